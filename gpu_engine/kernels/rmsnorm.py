"""RMSNorm, optionally fused with the residual add that precedes it.

Numerics follow the Hugging Face modules: the residual sum is rounded to the activation dtype, the
normalisation runs in fp32, the normalised value is rounded before the weight multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_engine.kernels._checks import FLOAT_DTYPES, check, next_pow2


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr,
    n_inner, sx_m, sx_n, sr_m, so_m, so_n, D, eps,
    HAS_RES: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    m = row // n_inner
    n = row % n_inner
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + m * sx_m + n * sx_n + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + m * sr_m + offs, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + m * sr_m + offs, x, mask=mask)
        x = x.to(tl.float32)
    var = tl.sum(x * x, axis=0) / D
    y = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * so_m + n * so_n + offs, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain PyTorch: returns (normed, new_residual); new_residual is None without a residual."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = (weight.float() * h.to(x.dtype).float()).to(x.dtype)
    return out, (x if residual is not None else None)


def _as3d(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows, inner, stride_rows, stride_inner) for a 2D [M, D] or 3D [M, N, D] tensor."""
    if t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    return t.shape[0], t.shape[1], t.stride(0), t.stride(1)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out = RMSNorm(x [+ residual]) * weight over the last dim of a 2D or 3D `x`.

    With `residual` ([M, D], contiguous rows) the sum x + residual is written back into `residual`
    (the next layer's residual). `out` may alias `x` (used in place for per-head QK-norm).
    """
    check("x", x, dtype=FLOAT_DTYPES)
    if x.dim() not in (2, 3):
        raise ValueError(f"x: expected 2 or 3 dims, got shape {tuple(x.shape)}")
    D = x.shape[-1]
    check("weight", weight, shape=(D,), device=x.device)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    check("out", out, dtype=x.dtype, shape=tuple(x.shape), device=x.device)
    if residual is not None:
        if x.dim() != 2:
            raise ValueError("residual add needs a 2D x")
        check("residual", residual, dtype=x.dtype, shape=tuple(x.shape), device=x.device)
    M, N, sx_m, sx_n = _as3d(x)
    _, _, so_m, so_n = _as3d(out)
    if M * N == 0:
        return out
    res = residual if residual is not None else x
    _rmsnorm_kernel[(M * N,)](
        x, res, weight, out, N, sx_m, sx_n, res.stride(0), so_m, so_n, D, float(eps),
        HAS_RES=residual is not None, BLOCK_D=next_pow2(D), num_warps=4 if D <= 4096 else 8,
    )
    return out
