"""KV-cache write (reshape_and_cache): scatter the step's new K/V rows into the paged cache.

Cache layout per layer: [num_blocks, block_size, num_kv_heads, head_dim]; `slot_mapping[t]` is
block * block_size + offset, and a negative slot marks a padding token that writes nothing.

The cache holds the activations' dtype, or FP8 (`FP8_KV`, float8_e4m3fn: `--kv-cache-dtype fp8`) with one fp32
scale for the keys and one for the values of a layer (`kv_scale`): a value is stored as value / scale, saturated to
+-448 (e4m3's largest finite value), rounded to nearest even, and read back as code * scale. The scales are 1.0 unless
a caller gives others (the engine gives 1.0: `gpu_engine.kv_cache.KVCache`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_engine.kernels._checks import FLOAT_DTYPES, check, check_contiguous, next_pow2

FP8_KV = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value (torch.finfo(FP8_KV).max)
FP8_MAX_C = tl.constexpr(FP8_MAX)
UNIT_SCALE = (1.0, 1.0)  # (key scale, value scale) of a cache that is not FP8, or FP8 without calibration


@triton.jit
def to_cache(x, scale, dt: tl.constexpr):
    """Values of the activations' dtype -> the cache's element type `dt`: as they are, or for FP8 divided by
    `scale` in fp32 (correctly rounded, as torch divides), saturated to +-448 and rounded to nearest even."""
    if dt == tl.float8e4nv:
        return tl.clamp(tl.div_rn(x.to(tl.float32), scale), -FP8_MAX_C, FP8_MAX_C).to(dt)
    return x.to(dt)


def quantize_kv_ref(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """`to_cache` in torch: x as the cache stores it."""
    if dtype != FP8_KV:
        return x.to(dtype)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize_kv_ref(c: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache values as attention reads them: an FP8 code times its scale (fp32); any other dtype as it is."""
    return c.float() * scale if c.dtype == FP8_KV else c


def check_kv_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, act: torch.dtype, shape, device) -> None:
    """Paged key and value caches of one dtype, the activations' `act` or FP8, of one shape; contiguous."""
    check("k_cache", k_cache, dtype=(act, FP8_KV), shape=shape, device=device)
    check("v_cache", v_cache, dtype=k_cache.dtype, shape=tuple(k_cache.shape), device=device)
    check_contiguous("k_cache", k_cache)
    check_contiguous("v_cache", v_cache)


def check_kv_scale(kv_scale: tuple[float, float]) -> tuple[float, float]:
    """(key scale, value scale) as two positive finite floats."""
    ks, vs = (float(s) for s in kv_scale)
    if not (0.0 < ks < float("inf") and 0.0 < vs < float("inf")):
        raise ValueError(f"kv_scale: expected two positive finite scales, got {kv_scale}")
    return ks, vs


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, sk_t, sk_h, sv_t, sv_h, H, D, k_scale, v_scale,
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
        tl.store(kc_ptr + dst, to_cache(k, k_scale, kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + dst, to_cache(v, v_scale, vc_ptr.dtype.element_ty), mask=mask)


def write_kv_ref(k, v, k_cache, v_cache, slot_mapping, kv_scale: tuple[float, float] = UNIT_SCALE) -> None:
    """Plain PyTorch, in place."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    kc = k_cache.view(-1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:])
    kc[slots] = quantize_kv_ref(k[valid], kv_scale[0], kc.dtype)
    vc[slots] = quantize_kv_ref(v[valid], kv_scale[1], vc.dtype)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scale: tuple[float, float] = UNIT_SCALE,
) -> None:
    """k, v [T, Hkv, D] (row/head strides free) -> caches [num_blocks, block_size, Hkv, D] of k's dtype or FP8
    (`kv_scale`: the key and value scales an FP8 cache divides by)."""
    check("k", k, dtype=FLOAT_DTYPES)
    if k.dim() != 3:
        raise ValueError(f"k: expected [T, Hkv, D], got {tuple(k.shape)}")
    T, H, D = k.shape
    check("v", v, dtype=k.dtype, shape=(T, H, D), device=k.device)
    check_kv_caches(k_cache, v_cache, k.dtype, (None, None, H, D), k.device)
    check("slot_mapping", slot_mapping, dtype=torch.int64, shape=(T,), device=k.device)
    ks, vs = check_kv_scale(kv_scale)
    if T == 0:
        return
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1), H, D, ks, vs,
        BLOCK_H=next_pow2(H), BLOCK_D=next_pow2(D), num_warps=4,
    )
