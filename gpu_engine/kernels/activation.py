"""SiLU-and-multiply: out = silu(x[:, :I]) * x[:, I:] for the gated MLP."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_engine.kernels._checks import FLOAT_DTYPES, check


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, I, sx, so, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(x_ptr + t * sx + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * sx + I + offs, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + t * so + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    g, u = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).to(x.dtype)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2I] -> out [T, I]."""
    check("x", x, dtype=FLOAT_DTYPES)
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x: expected [T, 2I], got {tuple(x.shape)}")
    T, I2 = x.shape
    if out is None:
        out = torch.empty((T, I2 // 2), dtype=x.dtype, device=x.device)
    check("out", out, dtype=x.dtype, shape=(T, I2 // 2), device=x.device)
    if T == 0:
        return out
    block = 1024 if I2 // 2 >= 1024 else 128
    _silu_mul_kernel[(T, triton.cdiv(I2 // 2, block))](
        x, out, I2 // 2, x.stride(0), out.stride(0), BLOCK=block, num_warps=4
    )
    return out
