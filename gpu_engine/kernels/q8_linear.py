"""Linear layer on Q8_0 weights: out[M, N] = x[M, K] @ W.T.

W is llama.cpp's Q8_0 split into two tensors: ``codes`` int8 [N, K] and ``scales`` fp16 [N, K / 32], one
scale per 32 consecutive K values of a row (the file's own block scales, so no rounding on the way in):
W[n, k] = codes[n, k] * scales[n, k // 32], rounded to x's dtype (exactly what a model dequantized to that
dtype holds). Held that way the weight takes 8.5 bits against bf16's 16.

The product dequantizes the weight, ``CHUNK`` values (whole rows) at a time, into a scratch that cuBLAS
multiplies: the dense model's weights and product (the same bits where the weight is one chunk, as every
projection of an 8B Llama is; its LM head goes in four). Measured on the H200 (``bench/kernels.py --only q8``,
BENCHMARKS.md): a prefill chunk of 2,048 rows costs 1.07-1.21x cuBLAS on the bf16 weight, but a decode step
2.5-3.3x, since it reads the codes and writes and reads the bf16 scratch. Kernels that dequantized inside the
product (Triton ``tl.dot`` tiles, then the same split along K for decode steps) ran 9.6-19x slower than cuBLAS
at decode sizes and were dropped; the memory is what this path saves. ``q8_gemv`` is the next candidate for
decode steps of up to 8 rows, not taken until it is measured: a matrix-vector kernel without the dot, each
block of 32 codes summed against x and then scaled once.
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
GEMV_PROGRAMS = 528  # the matrix-vector kernel splits K until about this many programs run (4 an H200 SM)


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


@triton.jit
def _q8_gemv_kernel(x_ptr, q_ptr, s_ptr, out_ptr, M, N, K, sx, sq, ss, so, sp, groups_per_slice,
                    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, GROUP: tl.constexpr):
    """Program (n, s): columns n * BLOCK_N.. of K slice s (groups_per_slice blocks of 32) for x's first
    ROWS rows, into out + s * sp (fp32 partial sums where K is split). Each block of 32 codes is summed
    against x in fp32 and then scaled once: sum_j x[j] * code[j] * scale, no weight rounded to x's dtype."""
    r = tl.arange(0, ROWS)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    gi, j = tl.arange(0, BLOCK_G), tl.arange(0, GROUP)
    n_ok, r_ok = n < N, r < M
    g_lo = tl.program_id(1) * groups_per_slice
    g_hi = tl.minimum(g_lo + groups_per_slice, K // GROUP)
    q_rows = q_ptr + n.to(tl.int64)[:, None, None] * sq
    s_rows = s_ptr + n.to(tl.int64)[:, None] * ss
    x_rows = x_ptr + r.to(tl.int64)[:, None, None] * sx
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for g0 in range(g_lo, g_hi, BLOCK_G):
        g = g0 + gi
        g_ok = g < g_hi
        k = g[:, None] * GROUP + j[None, :]  # [BLOCK_G, GROUP]
        codes = tl.load(q_rows + k[None, :, :], mask=n_ok[:, None, None] & g_ok[None, :, None], other=0)
        scales = tl.load(s_rows + g[None, :], mask=n_ok[:, None] & g_ok[None, :], other=0.0)
        x = tl.load(x_rows + k[None, :, :], mask=r_ok[:, None, None] & g_ok[None, :, None], other=0.0)
        part = tl.sum(x.to(tl.float32)[:, None, :, :] * codes.to(tl.float32)[None, :, :, :], axis=3)
        acc += tl.sum(part * scales.to(tl.float32)[None, :, :], axis=2)
    dst = out_ptr + tl.program_id(1).to(tl.int64) * sp + r.to(tl.int64)[:, None] * so + n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])


def gemv_blocks(m: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(ROWS, BLOCK_N, BLOCK_G, groups per slice, slices) of the matrix-vector kernel for an [m, k] x [n, k]
    product: a product tile of about 8,192 values a program, K split so that about GEMV_PROGRAMS run."""
    rows = triton.next_power_of_2(m)
    block_n, block_g = {1: (16, 16), 2: (16, 8), 4: (8, 8), 8: (8, 4)}[rows]
    groups = k // GROUP
    steps = triton.cdiv(groups, block_g)
    slices = max(1, min(steps, triton.cdiv(GEMV_PROGRAMS, triton.cdiv(n, block_n))))
    per = triton.cdiv(steps, slices) * block_g
    return rows, block_n, block_g, per, triton.cdiv(groups, per)


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


def q8_gemv(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The Q8_0 product of a step of at most 8 rows by a matrix-vector kernel (a candidate: not yet measured
    on a GPU, so ``q8_linear`` does not take it; ``bench/kernels.py --only q8`` times it). Half inputs only:
    its sums are not the dense fp32 model's."""
    M, K, N = _checked(x, codes, scales, (torch.float16, torch.bfloat16))
    if not 0 < M <= 8 or K == 0:
        raise ValueError(f"x: {M} rows of {K}; the matrix-vector kernel takes 1 to 8 rows, K > 0")
    rows, bn, bg, per, slices = gemv_blocks(M, N, K)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    dst = out if slices == 1 else torch.empty((slices, M, N), dtype=torch.float32, device=x.device)
    _q8_gemv_kernel[(triton.cdiv(N, bn), slices)](
        x, codes, scales, dst, M, N, K, x.stride(0), codes.stride(0), scales.stride(0), dst.stride(-2),
        dst.stride(0) if slices > 1 else 0, per, ROWS=rows, BLOCK_N=bn, BLOCK_G=bg, GROUP=GROUP, num_warps=4)
    return out if slices == 1 else out.copy_(dst.sum(0))  # the slices in index order: deterministic


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
