"""Linear layer on Q8_0 weights: out[M, N] = x[M, K] @ W.T.

W is llama.cpp's Q8_0 split into two tensors: ``codes`` int8 [N, K] and ``scales`` fp16 [N, K / 32], one
scale per 32 consecutive K values of a row (the file's own block scales, so no rounding on the way in):
W[n, k] = codes[n, k] * scales[n, k // 32], rounded to x's dtype (exactly what a model dequantized to that
dtype holds). That is 8.5 bits a weight against bf16's 16.

Two paths, by the step's rows:

* **Up to ``GEMV_ROWS`` rows** (decode steps, whose time is their weight read): a split-K kernel. Each
  program owns BLOCK_N output columns and one slice of K; it streams the codes and the matching scales of its
  slice, dequantizes each tile in its inner loop and accumulates ``tl.dot`` in fp32 against x's rows (padded
  to the dot's 16). Narrow layers are split along K so that every SM streams weights; the slices' partial
  sums are added in a fixed order afterwards (a deterministic sum, no atomics). fp32 inputs multiply at full
  precision (no TF32). Under Triton's CPU interpreter bf16 tiles go to the dot as fp32 (``INTERPRETED``), the
  same products.
* **More rows** (prefill chunks, compute bound): the weight dequantized to x's dtype, ``CHUNK`` weights (whole
  rows) at a time, into a scratch that cuBLAS multiplies: the dense model's weights and product (the same bits
  where the weight is one chunk: every projection of an 8B Llama; its LM head goes in four).
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
GEMV_ROWS = 64      # steps of at most this many rows take the split-K kernel
CHUNK = 1 << 27     # weights dequantized at once on the cuBLAS path (256 MiB of bf16)
BLOCK_K = 256       # the split-K kernel's K step
DEQUANT_K = 1024    # values of a row each dequantizing program writes
PROGRAMS = 264      # split-K target: about two programs per SM of an H100 / H200


@triton.jit
def _round_bf16(v):
    """fp32 rounded to the nearest bf16 (ties to even), kept in fp32: what a GPU's cast does, where the
    interpreter's cast truncates."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _q8_gemv_kernel(x_ptr, q_ptr, s_ptr, out_ptr, M, N, K, sx, sq, ss, so, sp, k_split,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                    PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Program (n, s): columns n * BLOCK_N.. of K slice s (k_split values, a multiple of BLOCK_K) into
    out + s * sp: the output itself with one slice, else that slice's fp32 partial sums."""
    m = tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = tl.program_id(1) * k_split
    x_rows = x_ptr + m[:, None].to(tl.int64) * sx
    q_rows = q_ptr + n[:, None].to(tl.int64) * sq
    s_rows = s_ptr + n[:, None].to(tl.int64) * ss
    m_ok, n_ok = m[:, None] < M, n[:, None] < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + k_split, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k[None, :] < K
        codes = tl.load(q_rows + k[None, :], mask=n_ok & k_ok, other=0)
        scales = tl.load(s_rows + (k // GROUP)[None, :], mask=n_ok & k_ok, other=0.0)
        x = tl.load(x_rows + k[None, :], mask=m_ok & k_ok, other=0.0)
        w = codes.to(tl.float32) * scales.to(tl.float32)
        if UPCAST:  # the same products (a bf16 product is exact in fp32) where bf16 dots are not available
            acc += tl.dot(x.to(tl.float32), tl.trans(_round_bf16(w)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PREC)
    if UPCAST:
        acc = _round_bf16(acc)
    dst = out_ptr + tl.program_id(1).to(tl.int64) * sp + m[:, None].to(tl.int64) * so + n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=m_ok & (n[None, :] < N))


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


def q8_linear_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: the weight dequantized to x's dtype, then F.linear (fp32 accumulation for half inputs)."""
    w = q8_dequantize(codes, scales, x.dtype)
    return F.linear(x.float(), w.float()).to(x.dtype)


def gemv_blocks(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, K values per slice, slices) of the split-K kernel for an [m, k] x [n, k] product."""
    bm = max(16, triton.next_power_of_2(m))
    bn = 64 if bm <= 32 else 32
    steps = triton.cdiv(k, BLOCK_K)
    slices = max(1, min(steps, triton.cdiv(PROGRAMS, triton.cdiv(n, bn))))
    per = triton.cdiv(steps, slices) * BLOCK_K
    return bm, bn, per, triton.cdiv(k, per)


def _gemv(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    (M, K), N = x.shape, codes.shape[0]
    bm, bn, per, slices = gemv_blocks(M, N, K)
    dst = out if slices == 1 else torch.empty((slices, M, N), dtype=torch.float32, device=x.device)
    _q8_gemv_kernel[(triton.cdiv(N, bn), slices)](
        x, codes, scales, dst, M, N, K, x.stride(0), codes.stride(0), scales.stride(0), dst.stride(-2),
        dst.stride(0) if slices > 1 else 0, per, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, GROUP=GROUP,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", UPCAST=x.dtype == torch.bfloat16 and INTERPRETED,
        num_warps=4, num_stages=3,
    )
    if slices > 1:
        out.copy_(dst.sum(0))  # the slices in index order: deterministic


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
    check("x", x, dtype=FLOAT_DTYPES, shape=(None, None))
    M, K = x.shape
    check("codes", codes, dtype=torch.int8, shape=(None, K), device=x.device)
    N = codes.shape[0]
    if K % GROUP:
        raise ValueError(f"codes: K = {K} is not a multiple of {GROUP} (Q8_0 blocks)")
    check("scales", scales, dtype=torch.float16, shape=(N, K // GROUP), device=x.device)
    if out is None and M > GEMV_ROWS and N and K:
        return _dequantized_linear(x, codes, scales)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device) if out is None else out
    check("out", out, dtype=x.dtype, shape=(M, N), device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    if M <= GEMV_ROWS:
        _gemv(x, codes, scales, out)
    else:
        out.copy_(_dequantized_linear(x, codes, scales))
    return out
