"""A layer's small ops as one C call each on the CPU (``_cpu_quant``), for the packed serving form.

Torch spends a few microseconds of dispatch on each of the ~40 small ops of a layer (norms, RoPE, the cache
write, the gather, mask and SDPA of attention), which a 135M model's decode step notices over 30 layers:

- ``rms_norm``: ``w * (x / sqrt(mean(x^2) + eps))`` per row, fp32, as ``models.layers.RMSNorm`` computes it;
- ``rope_write_kv``: half-split RoPE of the q and k heads of a fused QKV output, in place, and the rotated k
  and the v heads stored at their cache slots as fp16 (round to nearest even, as ``Tensor.to`` does);
- ``attend_decode``: one query per sequence (a decode step) against its paged fp16 context, fp32 softmax and
  sums, GQA, optional sliding window: ``kernels.cpu_attention`` with Q = 1, without the gather and the mask;
- ``decode_stack``: a decode step's every layer in one call (the ops above, the Q4_1 products and SiLU-mul),
  for a stack whose linears are all ``Q4Linear`` (``models.cpu_pack.DecodeStack``): no Python between the
  layers;
- ``greedy_head``: a greedy step's tail, the final RMSNorm of the rows that sample, the tied Q8_0 LM head
  (``cpu_linear.Q8Head``'s product) and the argmax, for a step whose every sampled row is greedy and asks for
  nothing else (no log-probs, no logits processor): the same arithmetic as those three one after another, so
  the same tokens, with no torch op after the stack.

Only the order of the fp32 sums differs from the torch forms (no FMA contraction where torch has none), and
in ``decode_stack`` SiLU's exp (the C library's, within an ulp of torch's vectorised one).
"""

from __future__ import annotations

import dataclasses

import torch

from gpu_engine.kernels.cpu_linear import _cpu_quant

STACK_FIELDS = ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down", "k_cache", "v_cache")


@dataclasses.dataclass(frozen=True)
class StackShape:
    """The dimensions ``decode_stack`` needs beside its plan."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    window: int  # 0: none
    eps: float


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x float32 [T, N] contiguous -> a new [T, N]."""
    out = torch.empty_like(x)
    _cpu_quant.rms_norm(out.data_ptr(), x.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps)
    return out


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, heads: int, kv_heads: int) -> None:
    """qkv float32 [T, (heads + 2 kv_heads) * D] contiguous, cos/sin float32 [T, D], the caches fp16
    [blocks, block_size, kv_heads, D], slot_mapping int64 [T]."""
    if k_cache.dtype != torch.float16 or not (qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("rope_write_kv: needs contiguous float32 qkv, cos, sin and an fp16 cache")
    dim = k_cache.shape[3]
    _cpu_quant.rope_write_kv(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                             slot_mapping.data_ptr(), qkv.shape[0], heads, kv_heads, dim, qkv.shape[1])


def attend_decode(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, heads: int, scale: float, window: int | None) -> torch.Tensor:
    """The query heads leading each row of qkv [B, row] (one per sequence, at position context_len - 1, which
    is >= 1 as ``build_metadata`` makes it) over the sequence's cache; returns float32 [B, heads * D]."""
    tables, ctx = block_tables.contiguous(), context_lens.contiguous()
    if tables.dtype != torch.int32 or ctx.dtype != torch.int32 or k_cache.dtype != torch.float16:
        raise ValueError("attend_decode: needs int32 block tables and context lengths and an fp16 cache")
    b, block_size, kv_heads, dim = qkv.shape[0], k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    out = torch.empty(b, heads * dim)
    _cpu_quant.attend_decode(out.data_ptr(), qkv.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                             ctx.data_ptr(), b, heads, kv_heads, dim, block_size, tables.shape[1], qkv.shape[1],
                             window or 0, scale)
    return out


def decode_stack(x: torch.Tensor, plan: torch.Tensor, shape: StackShape, cos: torch.Tensor, sin: torch.Tensor,
                 slots: torch.Tensor, tables: torch.Tensor, ctx: torch.Tensor, threads: int, int8_x: bool) -> None:
    """A decode step's whole layer stack in one C call: x float32 [B, H] (the residual stream) updated in place.
    ``plan`` int64 [L, 8]: per layer the pointers of the attention norm's weight, the qkv and o Q4_1 blocks, the
    MLP norm's weight, the gate_up and down Q4_1 blocks, the fp16 K and V caches (``STACK_FIELDS``)."""
    b = x.shape[0]
    if not (x.is_contiguous() and x.dtype == torch.float32 and x.shape == (b, shape.hidden)):
        raise ValueError(f"decode_stack: x must be contiguous float32 [B, {shape.hidden}]")
    if plan.dtype != torch.int64 or plan.shape[1] != len(STACK_FIELDS) or not plan.is_contiguous():
        raise ValueError("decode_stack: plan must be contiguous int64 [layers, 8]")
    _cpu_quant.decode_stack(x.data_ptr(), plan.data_ptr(), plan.shape[0], b, shape.hidden, shape.intermediate,
                            shape.heads, shape.kv_heads, shape.head_dim, cos.data_ptr(), sin.data_ptr(),
                            slots.data_ptr(), tables.data_ptr(), ctx.data_ptr(), tables.shape[1], shape.block_size,
                            shape.window, threads, int8_x, shape.eps, shape.head_dim**-0.5)


def greedy_head(x: torch.Tensor, rows: torch.Tensor | None, norm_weight: torch.Tensor, codes: torch.Tensor,
                scales: torch.Tensor, eps: float, threads: int, int8_x: bool,
                logits: torch.Tensor | None = None) -> torch.Tensor:
    """The argmax token (int64 [R]) of ``lm_head(rms_norm(x[rows]))`` for a tied Q8_0 head: x float32 [T, H]
    contiguous, rows int64 [R] of indices into x (None: every row), the table's int8 codes [V, H] and float32
    scales [V, H / 32]; ``logits`` a float32 scratch of at least R * V values (made when None)."""
    hidden = x.shape[-1]
    if not (x.is_contiguous() and x.dtype == torch.float32 and x.dim() == 2):
        raise ValueError("greedy_head: x must be contiguous float32 [T, H]")
    if rows is not None and not (rows.dtype == torch.int64 and rows.dim() == 1 and rows.is_contiguous()):
        raise ValueError("greedy_head: rows must be contiguous int64 [R]")
    n = x.shape[0] if rows is None else rows.numel()
    if rows is not None and n and not (0 <= int(rows.min()) and int(rows.max()) < x.shape[0]):
        raise ValueError(f"greedy_head: a row index outside x's {x.shape[0]} rows")
    vocab = codes.shape[0]
    if not (codes.dtype == torch.int8 and codes.shape == (vocab, hidden) and codes.is_contiguous()
            and scales.dtype == torch.float32 and scales.shape == (vocab, hidden // 32) and scales.is_contiguous()):
        raise ValueError(f"greedy_head: needs int8 codes [V, {hidden}] and float32 scales [V, {hidden // 32}]")
    if not (norm_weight.dtype == torch.float32 and norm_weight.shape == (hidden,) and norm_weight.is_contiguous()):
        raise ValueError(f"greedy_head: the norm's weight must be contiguous float32 [{hidden}]")
    if logits is None:
        logits = torch.empty(n, vocab)
    if not (logits.dtype == torch.float32 and logits.is_contiguous() and logits.numel() >= n * vocab):
        raise ValueError(f"greedy_head: the logits scratch must be contiguous float32 of >= {n * vocab} values")
    tokens = torch.empty(n, dtype=torch.int64)
    if n:
        _cpu_quant.greedy_head(tokens.data_ptr(), x.data_ptr(), 0 if rows is None else rows.data_ptr(), n,
                               norm_weight.data_ptr(), codes.data_ptr(), scales.data_ptr(), vocab, hidden, eps,
                               threads, int8_x, logits.data_ptr())
    return tokens
