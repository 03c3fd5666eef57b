"""Linear layer on FP8 weights: out[M, N] = x[M, K] @ W.T, both operands float8_e4m3fn (W8A8, as vLLM's fp8).

W is ``Fp8Weight``: FP8 values [N, K] and a float32 scale a row (``models.fp8_weight``). x is quantized at run
time: each row scaled so that its largest |value| maps to 448 (per token, the default), or the whole step by one
scale (``act_per_tensor``, or a checkpoint's static ``input_scale``). Then

    out[m, n] = sum_k xq[m, k] * wq[n, k]  * scale_a[m] * scale_b[n]

On CUDA the sum is ``torch._scaled_mm`` (Hopper's FP8 tensor cores, fp32 accumulation) with both scales applied
in its epilogue (``scale_a`` [M, 1], ``scale_b`` [1, N]: cuBLASLt's row-wise scaling; one scalar each where both
are per tensor), out in bf16. The activations' quantization is one Triton program a row (its largest |value|,
then the FP8 values and the row's scale), so a step is two launches a product and no host sync: the graphs
capture it. Elsewhere (the CPU tests), ``fp8_linear_ref``: the same quantization in torch, both operands
dequantized and multiplied in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_engine.kernels._checks import FLOAT_DTYPES, check
from gpu_engine.models.fp8_weight import FP8, FP8_MAX, MIN_SCALE, Fp8Weight

ALIGN = 16  # cuBLASLt's FP8 products take K and N in multiples of 16
QUANT_BLOCK = 1024  # x values a row's program reads at once


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, given_ptr, K, sx, BLOCK: tl.constexpr, GIVEN: tl.constexpr,
                       QMAX: tl.constexpr, FLOOR: tl.constexpr):
    """Program m: row m of x quantized to FP8 into q (contiguous [M, K]) and its scale into s[m]: its largest
    |value| / QMAX (at least FLOOR), or the one scale at given_ptr (GIVEN: static or per tensor)."""
    m = tl.program_id(0).to(tl.int64)
    if GIVEN:
        scale = tl.load(given_ptr)
    else:
        top = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            k = k0 + tl.arange(0, BLOCK)
            v = tl.load(x_ptr + m * sx + k, mask=k < K, other=0.0).to(tl.float32)
            top = tl.maximum(top, tl.abs(v))
        scale = tl.maximum(tl.max(top, axis=0) / QMAX, FLOOR)
    tl.store(s_ptr + m, scale)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + m * sx + k, mask=k < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(v / scale, -QMAX), QMAX)
        tl.store(q_ptr + m * K + k, q.to(q_ptr.dtype.element_ty), mask=k < K)


def _checked(x: torch.Tensor, w: Fp8Weight) -> tuple[int, int, int]:
    """(M, K, N) of an FP8 product's operands, checked: x [M, K] float (rows may be strided), W [N, K] on x's
    device; on CUDA, K and N multiples of 16 and x bf16 (the row-wise scaled product's output)."""
    check("x", x, dtype=FLOAT_DTYPES, shape=(None, None))
    M, K = x.shape
    check("weight", w.weight, shape=(None, K), device=x.device)
    N = w.weight.shape[0]
    if x.is_cuda:
        if K % ALIGN or N % ALIGN:
            raise ValueError(f"weight: [{N}, {K}] is not a multiple of {ALIGN} both ways (FP8 products on CUDA)")
        if x.dtype != torch.bfloat16:
            raise ValueError(f"x: dtype {x.dtype}; the FP8 product on CUDA takes and gives bfloat16")
    return M, K, N


def _act_scale(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor | None:
    """The one activation scale float32 [1] of a step where W asks for one (static, or dynamic per tensor),
    else None (a scale a row)."""
    if w.input_scale is not None:
        return w.input_scale
    if w.act_per_tensor:
        return (x.abs().amax().float() / FP8_MAX).clamp(min=MIN_SCALE).view(1)
    return None


def quantize_rows_ref(x: torch.Tensor, w: Fp8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """x as W's product quantizes it, in torch: (FP8 [M, K], float32 scales [M, 1])."""
    xf = x.float()
    given = _act_scale(x, w)
    if given is None:
        scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    else:
        scale = given.view(1, 1).expand(x.shape[0], 1).contiguous()
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_rows(x: torch.Tensor, w: Fp8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows_ref`` by the Triton program (one launch; a per-tensor dynamic scale adds torch's amax)."""
    M, K = x.shape
    q = torch.empty((M, K), dtype=FP8, device=x.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    given = _act_scale(x, w)
    if M:
        _quant_rows_kernel[(M,)](x, q, scale, scale if given is None else given, K, x.stride(0), BLOCK=QUANT_BLOCK,
                                 GIVEN=given is not None, QMAX=FP8_MAX, FLOOR=MIN_SCALE, num_warps=4)
    return q, scale


def fp8_linear_ref(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """The exact arithmetic: x quantized as the product does it, both operands dequantized to float32 and
    multiplied in float32, rounded to x's dtype once."""
    _checked(x, w)
    xq, scale = quantize_rows_ref(x, w)
    return (torch.mm(xq.float() * scale, w.dequantize().t())).to(x.dtype)


def fp8_linear(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """x [M, K] -> out [M, N] in x's dtype: ``torch._scaled_mm`` on CUDA (x bf16), ``fp8_linear_ref`` elsewhere."""
    M, K, N = _checked(x, w)
    if not x.is_cuda:
        return fp8_linear_ref(x, w)
    if M == 0 or K == 0:
        return torch.zeros((M, N), dtype=x.dtype, device=x.device)
    xq, scale_a = quantize_rows(x, w)
    if w.per_tensor and (w.input_scale is not None or w.act_per_tensor):  # one scale each: tensor-wise
        return torch._scaled_mm(xq, w.weight.t(), scale_a=scale_a[:1], scale_b=w.scale[:1].view(1, 1),
                                out_dtype=x.dtype)
    return torch._scaled_mm(xq, w.weight.t(), scale_a=scale_a, scale_b=w.scale.view(1, N), out_dtype=x.dtype)
