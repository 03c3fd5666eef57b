"""Rotary position embeddings: plain, Llama-3 scaled, explicit factors, Phi-3 "longrope"; partial rotary."""

from __future__ import annotations

import math

import torch
from torch import nn

from gpu_engine.models.config import ModelConfig


def base_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """``1 / theta^(2i/d)`` for i in [0, d/2), float32."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (theta**exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama-3.1 frequency scaling: slow down low frequencies, keep high ones, blend in between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin tables per position and rotates the leading ``rotary_dim`` channels of each head.

    For ``longrope`` the short factors apply to positions below ``original_max_position_embeddings``
    and the long factors from there on (decided per token so cached keys never change).
    """

    inv_freq: torch.Tensor
    long_inv_freq: torch.Tensor
    inv_freq_twice: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim = config.rotary_dim
        inv_freq = base_inv_freq(dim, config.rope_theta)
        long_inv_freq = inv_freq
        self.attention_factor = 1.0
        self.switch_position = -1
        scaling = config.rope_scaling
        if scaling is not None and scaling["rope_type"] == "llama3":
            inv_freq = long_inv_freq = llama3_inv_freq(inv_freq, scaling)
        elif scaling is not None and scaling["rope_type"] == "factors":
            inv_freq = long_inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
        elif scaling is not None and scaling["rope_type"] == "longrope":
            long_inv_freq = inv_freq / torch.tensor(scaling["long_factor"], dtype=torch.float32)
            inv_freq = inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float32)
            self.attention_factor = scaling["attention_factor"]
            self.switch_position = scaling["original_max_position_embeddings"]
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("long_inv_freq", long_inv_freq, persistent=False)
        # [1, rotary_dim]: the frequencies twice over, as cos_sin's cat lays them (the plain case's one product)
        self.register_buffer("inv_freq_twice", torch.cat([inv_freq, inv_freq])[None, :], persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``cos``/``sin`` of shape [T, rotary_dim] for int64 ``positions`` [T]."""
        pos = positions.to(torch.float32)[:, None]
        if self.switch_position < 0 and self.attention_factor == 1.0:  # the same values in three ops fewer
            emb = pos * self.inv_freq_twice
            return emb.cos(), emb.sin()
        freqs = pos * self.inv_freq[None, :]
        if self.switch_position >= 0:
            long = pos * self.long_inv_freq[None, :]
            freqs = torch.where(positions[:, None] >= self.switch_position, long, freqs)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, head_dim] with half-split (NeoX) pairing; extra channels pass through."""
    dim = cos.shape[-1]
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    rot, rest = x[..., :dim], x[..., dim:]
    first, second = rot[..., : dim // 2], rot[..., dim // 2 :]
    rotated = torch.cat([-second, first], dim=-1)
    out = rot * cos + rotated * sin
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out
