"""Linear layer on Q8_0 weights: out[M, N] = x[M, K] @ W.T.

W is llama.cpp's Q8_0 split into two tensors: ``codes`` int8 [N, K] and ``scales`` fp16 [N, K / 32], one
scale per 32 consecutive K values of a row (the file's own block scales, so no rounding on the way in):
W[n, k] = codes[n, k] * scales[n, k // 32], rounded to x's dtype (exactly what a model dequantized to that
dtype holds). Held that way the weight takes 8.5 bits against bf16's 16.

The product dequantizes the weight, ``CHUNK`` values (whole rows) at a time, into a scratch that cuBLAS
multiplies: the dense model's weights and product (the same bits where the weight is one chunk, as every
projection of an 8B Llama is; its LM head goes in four). Measured on the H200 (``bench/kernels.py --only q8``,
docs/benchmarks-history.md): a prefill chunk of 2,048 rows costs 1.07-1.21x cuBLAS on the bf16 weight, but a decode step
2.5-3.3x, since it reads the codes and writes and reads the bf16 scratch. Kernels that dequantized inside the
product (Triton ``tl.dot`` tiles, then the same split along K for decode steps) ran 9.6-19x slower than cuBLAS
at decode sizes and were dropped, and so was a matrix-vector kernel without the dot for steps of up to 8 rows
(each block of 32 codes summed against x, then scaled once): 0.84-0.98x this path's time at one row, 5x at
eight. The memory is what this path saves.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gpu_engine.kernels._checks import FLOAT_DTYPES, check
from gpu_engine.models.q8_weight import GROUP, q8_dequantize

# Triton's CPU interpreter truncates fp32 -> bf16 casts: there the dequantized values are rounded first as a
# GPU's cast rounds them (to nearest, ties to even).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CHUNK = 1 << 27     # weights dequantized at once (256 MiB of bf16)
DEQUANT_K = 1024    # values of a row each dequantizing program writes


@triton.jit
def _round_bf16(v):
    """fp32 rounded to the nearest bf16 (ties to even), kept in fp32: what a GPU's cast does, where the
    interpreter's cast truncates."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _q8_dequant_kernel(q_ptr, s_ptr, w_ptr, K, sq, ss, sw, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                       UPCAST: tl.constexpr):
    """Program (n, j): row n's values j * BLOCK_K.. dequantized into w (rounded to its dtype)."""
    n = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = k < K
    codes = tl.load(q_ptr + n * sq + k, mask=ok, other=0)
    scales = tl.load(s_ptr + n * ss + k // GROUP, mask=ok, other=0.0)
    w = codes.to(tl.float32) * scales.to(tl.float32)
    if UPCAST:
        w = _round_bf16(w)
    tl.store(w_ptr + n * sw + k, w.to(w_ptr.dtype.element_ty), mask=ok)


def _checked(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, dtypes) -> tuple[int, int, int]:
    """(M, K, N) of a Q8_0 product's operands, checked: x [M, K] of ``dtypes``, codes int8 [N, K], scales fp16
    [N, K / 32], K a multiple of 32."""
    check("x", x, dtype=dtypes, shape=(None, None))
    M, K = x.shape
    check("codes", codes, dtype=torch.int8, shape=(None, K), device=x.device)
    N = codes.shape[0]
    if K % GROUP:
        raise ValueError(f"codes: K = {K} is not a multiple of {GROUP} (Q8_0 blocks)")
    check("scales", scales, dtype=torch.float16, shape=(N, K // GROUP), device=x.device)
    return M, K, N


def q8_linear_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: the weight dequantized to x's dtype, then F.linear (fp32 accumulation for half inputs)."""
    w = q8_dequantize(codes, scales, x.dtype)
    return F.linear(x.float(), w.float()).to(x.dtype)


def _dequantized_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """F.linear on the weight dequantized to x's dtype, CHUNK weights (whole rows) at a time."""
    (M, K), N = x.shape, codes.shape[0]
    rows = max(1, min(N, CHUNK // K))
    w = torch.empty((rows, K), dtype=x.dtype, device=x.device)
    out = None if rows == N else torch.empty((M, N), dtype=x.dtype, device=x.device)
    for a in range(0, N, rows):
        b = min(N, a + rows)
        _q8_dequant_kernel[(b - a, triton.cdiv(K, DEQUANT_K))](
            codes[a:b], scales[a:b], w, K, codes.stride(0), scales.stride(0), w.stride(0), BLOCK_K=DEQUANT_K,
            GROUP=GROUP, UPCAST=x.dtype == torch.bfloat16 and INTERPRETED, num_warps=4)
        if out is None:
            return F.linear(x, w)
        out[:, a:b] = F.linear(x, w[: b - a])
    assert out is not None
    return out


def q8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (fp32 / fp16 / bf16, rows may be strided), codes int8 [N, K], scales fp16 [N, K / 32]
    (K a multiple of 32) -> out [M, N] in x's dtype."""
    M, K, N = _checked(x, codes, scales, FLOAT_DTYPES)
    if out is None and N and K:
        return _dequantized_linear(x, codes, scales)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device) if out is None else out
    check("out", out, dtype=x.dtype, shape=(M, N), device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    return out.copy_(_dequantized_linear(x, codes, scales))
