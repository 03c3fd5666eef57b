"""The one decoder-only transformer shared by every supported family.

Per-family differences are config flags, not subclasses: ``config.qk_norm`` (Qwen3) adds per-head
RMSNorm on queries and keys, ``config.is_moe_layer`` (Qwen3-MoE) swaps the dense MLP for experts,
``config.rotary_dim`` (Phi) limits RoPE to leading channels. Fused weight layouts (QKV, gate/up)
are the loaders' business: the modules always hold the fused form.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from gpu_engine.models.attention import Attention, AttentionMetadata
from gpu_engine.models.config import ModelConfig
from gpu_engine.models.layers import GatedMLP, RMSNorm
from gpu_engine.models.moe import MoEMLP
from gpu_engine.models.rope import RotaryEmbedding

if TYPE_CHECKING:
    from gpu_engine.kv_cache import KVCache


class StackRunner(Protocol):
    """A serving form's whole layer stack for the steps it ``runs`` (``cpu_pack.DecodeStack``)."""

    def runs(self, meta: AttentionMetadata, kv_cache: KVCache, tokens: int) -> bool: ...

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                 kv_cache: KVCache) -> torch.Tensor: ...


class HeadRunner(Protocol):
    """A serving form's greedy tail (``cpu_pack.GreedyHead``): the argmax token of each of ``rows`` of the last
    layer's output (None: every row), the same tokens as ``argmax(logits_at(hidden, rows))``."""

    def __call__(self, hidden: torch.Tensor, rows: list[int] | None) -> list[int]: ...


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module
        if config.is_moe_layer(layer_idx):
            self.mlp = MoEMLP(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                              config.num_experts_per_tok, config.norm_topk_prob)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        # The CPU serving form (``cpu_pack``): the output projections add into the residual stream in place.
        self.residual_in_place = False

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache) -> torch.Tensor:
        if self.residual_in_place:
            x = self.attn(self.attn_norm(x), cos, sin, meta, kv_cache, residual=x)
            return self.mlp(self.mlp_norm(x), residual=x)
        x = x + self.attn(self.attn_norm(x), cos, sin, meta, kv_cache)
        return x + self.mlp(self.mlp_norm(x))


class CausalLM(nn.Module):
    """``model(input_ids [T], meta, kv_cache)`` -> float32 logits [B, vocab] of each sequence's last token."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # given a weight, nn.Embedding skips its initialiser, whose first call imports torch._dynamo (seconds of
        # every engine start); build_empty makes this a meta tensor and the loader fills it
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size,
                                  _weight=torch.empty(config.vocab_size, config.hidden_size))
        with torch.device("cpu"):  # real tables even under build_empty's meta device: ops on meta tensors run
            self.rope = RotaryEmbedding(config)  # torch's Python reference kernels, which import torch._dynamo
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        # The CPU serving form's whole layer stack in one call for decode steps (``cpu_pack.DecodeStack``).
        self.decode_stack: StackRunner | None = None
        # The CPU serving form's final norm, LM head and argmax in one call for greedy rows (``cpu_pack.GreedyHead``).
        self.greedy_head: HeadRunner | None = None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        return self.logits_at(self.hidden_states(input_ids, meta, kv_cache), meta.cu_seqlens_q[1:].long() - 1)

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        """The last layer's output [T, hidden] of every token (before the final norm)."""
        x = self.embed(input_ids)
        cos, sin = self.rope.cos_sin(meta.positions)
        stack = self.decode_stack
        if stack is not None and stack.runs(meta, kv_cache, input_ids.numel()):
            return stack(x.contiguous(), cos, sin, meta, kv_cache)
        for layer in self.layers:
            x = layer(x, cos, sin, meta, kv_cache)
        return x

    @torch.inference_mode()
    def logits_at(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """float32 logits [len(rows), vocab] of the tokens ``rows`` of ``hidden_states``' output."""
        return self.lm_head(self.norm(hidden[rows])).to(torch.float32)

    @torch.inference_mode()
    def greedy_at(self, hidden: torch.Tensor, rows: list[int] | None) -> list[int]:
        """The argmax token of the logits of each of ``rows`` of ``hidden_states``' output (None: every row):
        ``logits_at`` and ``torch.argmax`` (the lowest index of the maximum), or the serving form's one call."""
        if self.greedy_head is not None:
            return self.greedy_head(hidden, rows)
        index = torch.arange(hidden.shape[0]) if rows is None else torch.tensor(rows, dtype=torch.int64)
        return torch.argmax(self.logits_at(hidden, index.to(hidden.device)), dim=-1).tolist()
