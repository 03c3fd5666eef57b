"""Rotary position embedding (rotate-half layout) from a precomputed cos/sin cache, in place.

The cache is `[max_positions, rotary_dim]` fp32: cos in the first half of each row, sin in the
second. `rotary_dim <= head_dim`; the dims past it pass through (partial rotary).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_engine.kernels._checks import FLOAT_DTYPES, check, check_contiguous, next_pow2
from gpu_engine.models.rope import base_inv_freq, llama3_inv_freq


def build_rope_cache(
    rotary_dim: int, max_positions: int, theta: float, scaling: dict | None = None, device=None
) -> torch.Tensor:
    """cos/sin cache [max_positions, rotary_dim] fp32 (cos | sin), plain or llama3-scaled frequencies."""
    inv = base_inv_freq(rotary_dim, theta)
    if scaling is not None:
        if scaling.get("rope_type") != "llama3":
            raise ValueError(f"unsupported rope scaling {scaling.get('rope_type')!r}; use cache_from_cos_sin")
        inv = llama3_inv_freq(inv, scaling)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


def cache_from_cos_sin(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pack full-width tables (cos/sin [P, rotary_dim], halves repeated) into the kernel's cache layout."""
    half = cos.shape[-1] // 2
    return torch.cat([cos[:, :half], sin[:, :half]], dim=-1).float().contiguous()


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, pos_ptr, cache_ptr,
    sq_t, sq_h, sk_t, sk_h, HQ, HK,
    ROT_HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    r = tl.arange(0, BLOCK_R)
    rmask = r < ROT_HALF
    cos = tl.load(cache_ptr + pos * (2 * ROT_HALF) + r, mask=rmask, other=0.0)[None, :]
    sin = tl.load(cache_ptr + pos * (2 * ROT_HALF) + ROT_HALF + r, mask=rmask, other=0.0)[None, :]
    h = tl.arange(0, BLOCK_H)
    qp = q_ptr + t * sq_t + h[:, None] * sq_h + r[None, :]
    qm = (h[:, None] < HQ) & rmask[None, :]
    x1 = tl.load(qp, mask=qm, other=0.0).to(tl.float32)
    x2 = tl.load(qp + ROT_HALF, mask=qm, other=0.0).to(tl.float32)
    tl.store(qp, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=qm)
    tl.store(qp + ROT_HALF, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=qm)
    kp = k_ptr + t * sk_t + h[:, None] * sk_h + r[None, :]
    km = (h[:, None] < HK) & rmask[None, :]
    y1 = tl.load(kp, mask=km, other=0.0).to(tl.float32)
    y2 = tl.load(kp + ROT_HALF, mask=km, other=0.0).to(tl.float32)
    tl.store(kp, (y1 * cos - y2 * sin).to(k_ptr.dtype.element_ty), mask=km)
    tl.store(kp + ROT_HALF, (y2 * cos + y1 * sin).to(k_ptr.dtype.element_ty), mask=km)


def rope_ref(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: x [T, H, D] rotated over its first cache.shape[1] dims (returns a new tensor)."""
    rot = cache.shape[1]
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    xf = x.float()
    x1, x2 = xf[..., : rot // 2], xf[..., rot // 2 : rot]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([rotated, xf[..., rot:]], dim=-1).to(x.dtype)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place (any row/head strides, contiguous last dim)."""
    check("q", q, dtype=FLOAT_DTYPES)
    if q.dim() != 3:
        raise ValueError(f"q: expected [T, H, D], got {tuple(q.shape)}")
    T, HQ, D = q.shape
    check("k", k, dtype=q.dtype, shape=(T, None, D), device=q.device)
    check("positions", positions, dtype=torch.int64, shape=(T,), device=q.device)
    check("cache", cache, dtype=torch.float32, device=q.device)
    check_contiguous("cache", cache)
    rot = cache.shape[1]
    if cache.dim() != 2 or rot % 2 or rot > D:
        raise ValueError(f"cache: expected [max_pos, rotary_dim<=head_dim, even], got {tuple(cache.shape)}")
    if T == 0:
        return
    HK = k.shape[1]
    _rope_kernel[(T,)](
        q, k, positions, cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1), HQ, HK,
        ROT_HALF=rot // 2, BLOCK_H=next_pow2(max(HQ, HK)), BLOCK_R=next_pow2(rot // 2), num_warps=4,
    )
