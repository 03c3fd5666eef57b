"""Linear layer on Q8_0 weights: out[M, N] = x[M, K] @ W.T, W dequantized tile by tile in the inner loop.

W is llama.cpp's Q8_0 split into two tensors: ``codes`` int8 [N, K] and ``scales`` fp16 [N, K / 32], one
scale per 32 consecutive K values of a row (the file's own block scales, so no rounding on the way in):
W[n, k] = codes[n, k] * scales[n, k // 32]. That is 8.5 bits a weight against bf16's 16, and a decode
step's time is its weight read.

Each program owns a [BLOCK_M, BLOCK_N] tile of ``out`` and walks K in BLOCK_K steps: it loads x's tile,
the codes' tile and the matching scales, dequantizes in fp32, rounds to x's dtype (exactly what a model
dequantized to that dtype holds) and accumulates ``tl.dot`` in fp32; fp32 inputs multiply at full
precision (no TF32). Under Triton's CPU interpreter bf16 tiles go to the dot as fp32 (``INTERPRETED``),
the same products. The blocks are chosen by M: 16 rows for decode-sized steps (the dot's smallest tile;
BLOCK_N shrinks for narrow layers so that every SM streams weights), 64 and 128 rows for prefill. BLOCK_K
is the same at every M so that the K sum runs in the same order whatever the step's size (not tuned on a
GPU yet).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gpu_engine.kernels._checks import FLOAT_DTYPES, check
from gpu_engine.models.q8_weight import GROUP, q8_dequantize

# Triton's CPU interpreter multiplies bf16 tiles as their raw uint16 bits and truncates fp32 -> bf16 casts:
# there the bf16 tiles go to the dot as fp32 rounded as a GPU rounds them (the same products and sums); a GPU
# build takes the bf16 dot.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_K = 128


@triton.jit
def _round_bf16(v):
    """fp32 rounded to the nearest bf16 (ties to even), kept in fp32: what a GPU's cast does, where the
    interpreter's cast truncates."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _q8_linear_kernel(x_ptr, q_ptr, s_ptr, out_ptr, M, N, K, sx, sq, ss, so, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, PREC: tl.constexpr,
                      UPCAST: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # programs along M share a weight tile (L2)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    x_rows = x_ptr + m[:, None].to(tl.int64) * sx
    q_rows = q_ptr + n[:, None].to(tl.int64) * sq
    s_rows = s_ptr + n[:, None].to(tl.int64) * ss
    m_ok, n_ok = m[:, None] < M, n[:, None] < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k[None, :] < K
        x = tl.load(x_rows + k[None, :], mask=m_ok & k_ok, other=0.0)
        codes = tl.load(q_rows + k[None, :], mask=n_ok & k_ok, other=0)
        scales = tl.load(s_rows + (k // GROUP)[None, :], mask=n_ok & k_ok, other=0.0)
        w = codes.to(tl.float32) * scales.to(tl.float32)
        if UPCAST:  # the same products (a bf16 product is exact in fp32) where bf16 dots are not available
            acc += tl.dot(x.to(tl.float32), tl.trans(_round_bf16(w)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PREC)
    if UPCAST:
        acc = _round_bf16(acc)
    tl.store(out_ptr + m[:, None].to(tl.int64) * so + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok & (n[None, :] < N))


def q8_linear_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: the weight dequantized to x's dtype, then F.linear (fp32 accumulation for half inputs)."""
    w = q8_dequantize(codes, scales, x.dtype)
    return F.linear(x.float(), w.float()).to(x.dtype)


def block_sizes(m: int, n: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for an [m, K] x [n, K] product (not tuned on a GPU yet)."""
    if m <= 16:
        return 16, 16 if n <= 8192 else 32 if n <= 32768 else 64, 4, 4
    if m <= 64 or dtype == torch.float32:
        return 64, 64, 4, 3
    return 128, 128, 8, 3


def q8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (fp32 / fp16 / bf16, rows may be strided), codes int8 [N, K], scales fp16 [N, K / 32]
    (K a multiple of 32) -> out [M, N] in x's dtype."""
    check("x", x, dtype=FLOAT_DTYPES, shape=(None, None))
    M, K = x.shape
    check("codes", codes, dtype=torch.int8, shape=(None, K), device=x.device)
    N = codes.shape[0]
    if K % GROUP:
        raise ValueError(f"codes: K = {K} is not a multiple of {GROUP} (Q8_0 blocks)")
    check("scales", scales, dtype=torch.float16, shape=(N, K // GROUP), device=x.device)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device) if out is None else out
    check("out", out, dtype=x.dtype, shape=(M, N), device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    bm, bn, warps, stages = block_sizes(M, N, x.dtype)
    _q8_linear_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        x, codes, scales, out, M, N, K, x.stride(0), codes.stride(0), scales.stride(0), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, GROUP=GROUP, PREC="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST=x.dtype == torch.bfloat16 and INTERPRETED,
        num_warps=warps, num_stages=stages,
    )
    return out

