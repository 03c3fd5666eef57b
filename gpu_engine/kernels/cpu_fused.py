"""A layer's small ops as one C call each on the CPU (``_cpu_quant``), for the packed serving form.

Torch spends a few microseconds of dispatch on each of the ~40 small ops of a layer (norms, RoPE, the cache
write, the gather, mask and SDPA of attention), which a 135M model's decode step notices over 30 layers:

- ``rms_norm``: ``w * (x / sqrt(mean(x^2) + eps))`` per row, fp32, as ``models.layers.RMSNorm`` computes it;
- ``rope_write_kv``: half-split RoPE of the q and k heads of a fused QKV output, in place, and the rotated k
  and the v heads stored at their cache slots as fp16 (round to nearest even, as ``Tensor.to`` does);
- ``attend_decode``: one query per sequence (a decode step) against its paged fp16 context, fp32 softmax and
  sums, GQA, optional sliding window: ``kernels.cpu_attention`` with Q = 1, without the gather and the mask.

Only the order of the fp32 sums differs from the torch forms (no FMA contraction where torch has none).
"""

from __future__ import annotations

import torch

from gpu_engine.kernels.cpu_linear import _cpu_quant


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
