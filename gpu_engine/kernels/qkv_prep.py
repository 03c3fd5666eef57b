"""One kernel between the QKV projection and attention: per-head QK RMSNorm (optional), RoPE, KV write.

It replaces up to four launches per layer (q norm, k norm, rotary, cache write) with one, one
program per token, and keeps their numerics: the norm rounds to the activation dtype before and
after its weight (as `rmsnorm`), the rotation runs in fp32 and rounds once (as `rope`). The
rotated queries are written back in place; the keys and values go only to the paged cache (a
negative slot writes nothing), which is where attention reads them. An FP8 cache takes them rounded to
the activation dtype first, then as `kernels.kv_cache.to_cache` stores them (scaled, saturated).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_engine.kernels._checks import FLOAT_DTYPES, check, check_contiguous, next_pow2
from gpu_engine.kernels.kv_cache import UNIT_SCALE, check_kv_caches, check_kv_scale, to_cache, write_kv_ref
from gpu_engine.kernels.rmsnorm import rms_norm_ref
from gpu_engine.kernels.rope import rope_ref


@triton.jit
def _norm_rotate(ptr, H, sh, w_ptr, eps, cos, sin, NORM: tl.constexpr, D: tl.constexpr, ROT_HALF: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    """Heads [H, D] at `ptr` (head stride `sh`) -> (rotated first half, second half, pass-through) fp32."""
    h = tl.arange(0, BLOCK_H)[:, None]
    r = tl.arange(0, BLOCK_R)[None, :]
    p = tl.arange(0, BLOCK_P)[None, :]
    rm = (h < H) & (r < ROT_HALF)
    pm = (h < H) & (p < D - 2 * ROT_HALF)
    x1 = tl.load(ptr + h * sh + r, mask=rm, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + h * sh + ROT_HALF + r, mask=rm, other=0.0).to(tl.float32)
    x3 = tl.load(ptr + h * sh + 2 * ROT_HALF + p, mask=pm, other=0.0).to(tl.float32)
    y1, y2, y3 = _norm_rotate_values(x1, x2, x3, w_ptr, eps, cos, sin, ptr.dtype.element_ty, NORM, D, ROT_HALF,
                                     BLOCK_R, BLOCK_P)
    return y1, y2, y3, rm, pm


@triton.jit
def _norm_rotate_values(x1, x2, x3, w_ptr, eps, cos, sin, dt: tl.constexpr, NORM: tl.constexpr, D: tl.constexpr,
                        ROT_HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    """Rows of heads as fp32 values of dtype `dt` (first rotary half, second, pass-through; one head a row) ->
    the same normalised (NORM: over each row, the weight at `w_ptr`) and rotated by `cos` / `sin` (a row each)."""
    r = tl.arange(0, BLOCK_R)[None, :]
    p = tl.arange(0, BLOCK_P)[None, :]
    if NORM:
        var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(x3 * x3, axis=1)) / D
        inv = tl.rsqrt(var + eps)[:, None]
        w1 = tl.load(w_ptr + r, mask=r < ROT_HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + ROT_HALF + r, mask=r < ROT_HALF, other=0.0).to(tl.float32)
        w3 = tl.load(w_ptr + 2 * ROT_HALF + p, mask=p < D - 2 * ROT_HALF, other=0.0).to(tl.float32)
        x1 = ((x1 * inv).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        x2 = ((x2 * inv).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
        x3 = ((x3 * inv).to(dt).to(tl.float32) * w3).to(dt).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin, x3


@triton.jit
def _store_heads(ptr, sh, y1, y2, y3, rm, pm, scale, ACT: tl.constexpr, ROT_HALF: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    """Heads rounded to the activation dtype ACT, stored as `ptr`'s element type takes them (`to_cache`)."""
    dt = ptr.dtype.element_ty
    h = tl.arange(0, BLOCK_H)[:, None]
    r = tl.arange(0, BLOCK_R)[None, :]
    p = tl.arange(0, BLOCK_P)[None, :]
    tl.store(ptr + h * sh + r, to_cache(y1.to(ACT), scale, dt), mask=rm)
    tl.store(ptr + h * sh + ROT_HALF + r, to_cache(y2.to(ACT), scale, dt), mask=rm)
    tl.store(ptr + h * sh + 2 * ROT_HALF + p, to_cache(y3.to(ACT), scale, dt), mask=pm)


@triton.jit
def _prep_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cache_ptr, kc_ptr, vc_ptr, slot_ptr, qw_ptr, kw_ptr,
                 sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, HQ, HK, eps, k_scale, v_scale,
                 NORM: tl.constexpr, D: tl.constexpr, ROT_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
                 BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    r = tl.arange(0, BLOCK_R)[None, :]
    cos = tl.load(cache_ptr + pos * (2 * ROT_HALF) + r, mask=r < ROT_HALF, other=0.0)
    sin = tl.load(cache_ptr + pos * (2 * ROT_HALF) + ROT_HALF + r, mask=r < ROT_HALF, other=0.0)
    q = q_ptr + t * sq_t
    y1, y2, y3, rm, pm = _norm_rotate(q, HQ, sq_h, qw_ptr, eps, cos, sin, NORM, D, ROT_HALF, BLOCK_HQ, BLOCK_R,
                                      BLOCK_P)
    act = q_ptr.dtype.element_ty
    _store_heads(q, sq_h, y1, y2, y3, rm, pm, 1.0, act, ROT_HALF, BLOCK_HQ, BLOCK_R, BLOCK_P)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        # names of their own: a value defined before an `if` must keep its shape inside it (the key
        # heads' tiles are [BLOCK_HK, ...], the query heads' [BLOCK_HQ, ...])
        k1, k2, k3, krm, kpm = _norm_rotate(k_ptr + t * sk_t, HK, sk_h, kw_ptr, eps, cos, sin, NORM, D, ROT_HALF,
                                            BLOCK_HK, BLOCK_R, BLOCK_P)
        _store_heads(kc_ptr + slot * (HK * D), D, k1, k2, k3, krm, kpm, k_scale, act, ROT_HALF, BLOCK_HK, BLOCK_R,
                     BLOCK_P)
        h = tl.arange(0, BLOCK_HK)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        vm = (h < HK) & (d < D)
        v = tl.load(v_ptr + t * sv_t + h * sv_h + d, mask=vm)
        tl.store(vc_ptr + slot * (HK * D) + h * D + d, to_cache(v, v_scale, vc_ptr.dtype.element_ty), mask=vm)


def qkv_prep_ref(q, k, v, positions, cache, k_cache, v_cache, slot_mapping, q_norm=None, k_norm=None,
                 eps: float = 1e-6, kv_scale: tuple[float, float] = UNIT_SCALE) -> torch.Tensor:
    """Plain PyTorch: the unfused sequence (norms, rotation, cache write); returns the new q, caches in place."""
    if q_norm is not None and k_norm is not None:
        q, _ = rms_norm_ref(q, q_norm, eps)
        k, _ = rms_norm_ref(k, k_norm, eps)
    q, k = rope_ref(q, positions, cache), rope_ref(k, positions, cache)
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping, kv_scale)
    return q


def qkv_prep(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor,
             k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
             kv_scale: tuple[float, float] = UNIT_SCALE) -> None:
    """`qkv_prep_ref` in one launch: q [T, Hq, D] rotated in place, k/v [T, Hkv, D] into the caches.

    q, k, v may be views of one fused QKV output (row and head strides free, last dim contiguous).
    Caches [num_blocks, block_size, Hkv, D] contiguous, of q's dtype or FP8 (`kv_scale`: their key and value
    scales); cache [max_pos, rotary_dim] fp32 (cos | sin); q_norm / k_norm [D] both or neither.
    """
    _check(q, k, v, positions, cache, k_cache, v_cache, slot_mapping, q_norm, k_norm)
    ks, vs = check_kv_scale(kv_scale)
    T, HQ, D = q.shape
    HK, rot = k.shape[1], cache.shape[1]
    if T == 0:
        return
    norm = q_norm is not None
    _prep_kernel[(T,)](
        q, k, v, positions, cache, k_cache, v_cache, slot_mapping, q_norm if norm else q, k_norm if norm else k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), HQ, HK, float(eps), ks, vs,
        NORM=norm, D=D, ROT_HALF=rot // 2, BLOCK_HQ=next_pow2(HQ), BLOCK_HK=next_pow2(HK),
        BLOCK_R=next_pow2(max(rot // 2, 1)), BLOCK_P=next_pow2(max(D - rot, 1)), BLOCK_D=next_pow2(D),
        num_warps=4 if HQ * D <= 4096 else 8,
    )


def _check(q, k, v, positions, cache, k_cache, v_cache, slot_mapping, q_norm, k_norm) -> None:
    check("q", q, dtype=FLOAT_DTYPES)
    if q.dim() != 3:
        raise ValueError(f"q: expected [T, Hq, D], got {tuple(q.shape)}")
    T, HQ, D = q.shape
    check("k", k, dtype=q.dtype, shape=(T, None, D), device=q.device)
    HK = k.shape[1]
    if HK == 0 or HQ % HK:
        raise ValueError(f"q heads {HQ} not a multiple of KV heads {HK}")
    check("v", v, dtype=q.dtype, shape=(T, HK, D), device=q.device)
    check("positions", positions, dtype=torch.int64, shape=(T,), device=q.device)
    check("cache", cache, dtype=torch.float32, shape=(None, None), device=q.device)
    check_contiguous("cache", cache)
    if cache.shape[1] % 2 or cache.shape[1] > D:
        raise ValueError(f"cache: rotary dim {cache.shape[1]} must be even and <= head_dim {D}")
    check_kv_caches(k_cache, v_cache, q.dtype, (None, None, HK, D), q.device)
    check("slot_mapping", slot_mapping, dtype=torch.int64, shape=(T,), device=q.device)
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm go together")
    if q_norm is not None:
        check("q_norm", q_norm, shape=(D,), device=q.device)
        check("k_norm", k_norm, shape=(D,), device=q.device)
