"""KV-cache write (reshape_and_cache): scatter the step's new K/V rows into the paged cache.

Cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim]; `slot_mapping[t]` is
block * block_size + offset, and a negative slot marks a padding token that writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_engine.kernels._checks import FLOAT_DTYPES, check, check_contiguous, next_pow2


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, sk_t, sk_h, sv_t, sv_h, H, D,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < H) & (d < D)
        dst = slot * H * D + h * D + d
        k = tl.load(k_ptr + t * sk_t + h * sk_h + d, mask=mask)
        v = tl.load(v_ptr + t * sv_t + h * sv_h + d, mask=mask)
        tl.store(kc_ptr + dst, k, mask=mask)
        tl.store(vc_ptr + dst, v, mask=mask)


def write_kv_ref(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Plain PyTorch, in place."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    kc = k_cache.view(-1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:])
    kc[slots] = k[valid]
    vc[slots] = v[valid]


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v [T, Hkv, D] (row/head strides free) -> caches [num_blocks, block_size, Hkv, D]."""
    check("k", k, dtype=FLOAT_DTYPES)
    if k.dim() != 3:
        raise ValueError(f"k: expected [T, Hkv, D], got {tuple(k.shape)}")
    T, H, D = k.shape
    check("v", v, dtype=k.dtype, shape=(T, H, D), device=k.device)
    check("k_cache", k_cache, dtype=k.dtype, shape=(None, None, H, D), device=k.device)
    check("v_cache", v_cache, dtype=k.dtype, shape=tuple(k_cache.shape), device=k.device)
    check_contiguous("k_cache", k_cache)
    check_contiguous("v_cache", v_cache)
    check("slot_mapping", slot_mapping, dtype=torch.int64, shape=(T,), device=k.device)
    if T == 0:
        return
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1), H, D,
        BLOCK_H=next_pow2(H), BLOCK_D=next_pow2(D), num_warps=4,
    )
