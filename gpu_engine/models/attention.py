"""Paged attention over packed variable-length batches (reference implementation in torch).

A step's tokens from every sequence are packed into one [T] stream: prefill sequences contribute
many tokens, decode sequences one. Each new token's K/V is written into the paged cache at
``slot_mapping`` and then every query attends causally to its sequence's cached context, gathered
through the sequence's block table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from gpu_engine.kernels import cpu_fused
from gpu_engine.kernels.cpu_attention import paged_attention_cpu
from gpu_engine.models.config import ModelConfig
from gpu_engine.models.layers import RMSNorm
from gpu_engine.models.rope import apply_rotary

if TYPE_CHECKING:
    from gpu_engine.kv_cache import KVCache


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] int64, position of each packed token
    cu_seqlens_q: torch.Tensor  # [B+1] int32, packed token boundaries per sequence
    context_lens: torch.Tensor  # [B] int32, tokens in cache for each seq AFTER this step's tokens are written
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 padded
    slot_mapping: torch.Tensor  # [T] int64, flat cache index (block*block_size + offset) of each new token


class SeqStep(NamedTuple):
    """One sequence's part of a step: tokens already cached, tokens added now, and its blocks."""

    num_cached: int
    num_new: int
    block_table: Sequence[int]


def build_metadata(
    seqs: Sequence[SeqStep | tuple[int, int, Sequence[int]]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build the metadata for a packed step from per-sequence ``(num_cached, num_new, block_table)``.

    The new tokens of sequence b take positions ``num_cached .. num_cached + num_new - 1`` and
    are packed in the order given. Raises ``ValueError`` if a block table is too short.
    """
    positions: list[int] = []
    slots: list[int] = []
    cu = [0]
    for num_cached, num_new, table in seqs:
        total = num_cached + num_new
        if num_new <= 0 or num_cached < 0:
            raise ValueError(f"bad sequence step: num_cached={num_cached}, num_new={num_new}")
        if len(table) * block_size < total:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {total} tokens")
        for pos in range(num_cached, total):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        cu.append(cu[-1] + num_new)
    width = max((len(s[2]) for s in seqs), default=0)
    tables = [list(s[2]) + [-1] * (width - len(s[2])) for s in seqs]
    return AttentionMetadata(
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        context_lens=torch.tensor([s[0] + s[1] for s in seqs], dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device).reshape(len(seqs), width),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
    )


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys/values [T, kv_heads, head_dim] at their flat cache slots."""
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kv_heads, head_dim)[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, kv_heads, head_dim)[slot_mapping] = v.to(v_cache.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
    """Causal GQA attention of packed queries q [T, H, D] over each sequence's cached context.

    Query at position p sees cache positions 0..p of its own sequence, or only the last
    ``window`` of them (p - window < k <= p) with a sliding window. Computed in float32, every
    sequence of the step batched together (``kernels.cpu_attention``).
    """
    return paged_attention_cpu(q, k_cache, v_cache, meta.positions, meta.cu_seqlens_q, meta.context_lens,
                               meta.block_tables, scale, window)


class Attention(nn.Module):
    """Fused QKV projection, optional per-head QK RMSNorm, RoPE, paged cache write + attention, output."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.window = config.sliding_window
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv = nn.Linear(config.hidden_size, qkv_out, bias=False)
        self.o = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        # The CPU serving form (``cpu_pack`` sets it where it applies: no QK norm, RoPE over whole heads):
        # RoPE and the cache write in one C call, a decode step's attention in another.
        self.fused = False

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The attention output of x [T, hidden]; with ``residual`` (the CPU serving form's linears only)
        ``residual += output`` in place, returned."""
        k_cache, v_cache = kv_cache.k[self.layer_idx], kv_cache.v[self.layer_idx]
        if self.fused and k_cache.dtype == torch.float16:
            out = self._fused(x, cos, sin, meta, k_cache, v_cache)
            return self.o(out) if residual is None else self.o(out, out=residual)
        y = self._attend(x, cos, sin, meta, k_cache, v_cache)
        return y if residual is None else residual.add_(y)

    def _attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv(x)
        v = qkv[:, q_size + kv_size :].reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qkv[:, :q_size].reshape(t, self.num_heads, self.head_dim), qkv[:, q_size : q_size + kv_size]
            q, k = apply_rotary(self.q_norm(q), cos, sin), apply_rotary(self.k_norm(k.reshape(t, -1, self.head_dim)),
                                                                         cos, sin)
        else:  # one rotation for the query and key heads together
            qk = apply_rotary(qkv[:, : q_size + kv_size].reshape(t, -1, self.head_dim), cos, sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta, self.head_dim**-0.5, self.window)
        return self.o(out.reshape(t, q_size))

    def _fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
               k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        qkv = self.qkv(x)
        cpu_fused.rope_write_kv(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, h, self.num_kv_heads)
        if t == meta.context_lens.numel():  # one new token per sequence: a decode step
            return cpu_fused.attend_decode(qkv, k_cache, v_cache, meta.block_tables, meta.context_lens, h,
                                           d**-0.5, self.window)
        q = qkv[:, : h * d].reshape(t, h, d)
        return paged_attention(q, k_cache, v_cache, meta, d**-0.5, self.window).reshape(t, h * d)
