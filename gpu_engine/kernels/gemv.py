"""Skinny matmul for decode (M <= 16 rows): out = act(x) @ w.T, reading the weight once at full width.

A decode step multiplies a handful of rows by each weight, so its time is the weight read. Each
program owns BLOCK_N output columns for all M rows and streams its [BLOCK_N, K] slice of the
weight in [BLOCK_N, BLOCK_K] tiles (contiguous rows). Two forms (`form`): "dot", the rows of x padded
to 16 for a tensor-core dot of each tile (the tiles staged through shared memory, `num_stages` deep);
"fma", each tile multiplied in registers by the x rows broadcast over its columns, with no shared
memory and no padding: one row accumulates the products elementwise and sums them once at the end,
several rows sum each tile's products as they go.
`act="silu_mul"` takes x as the gate_up output [M, 2K] and applies silu(gate) * up to each x
tile as it is loaded, so the SiLU-and-multiply of the MLP costs no launch and no round trip.
Accumulation is fp32; fp32 inputs multiply at full precision (no TF32).

Measured beside cuBLAS by `bench/kernels.py` (`GEMV_CONFIGS`); the runner uses it only when given a `skinny`
configuration: the first form was slower than cuBLAS at M = 1-8 on the H200, and it sums in another order than
cuBLAS does for larger steps, so a request's last bits depend on how many rows its step carries (one of 5,000
fp32 greedy requests differed between two runs whose steps were batched otherwise), as they do between
cuBLAS's own kernels for different M.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gpu_engine.kernels._checks import FLOAT_DTYPES, check

MAX_ROWS = 16


@triton.jit
def _x_tile(x_ptr, sx, m, k, M, K, SILU: tl.constexpr):
    mask = (m[:, None] < M) & (k[None, :] < K)
    ptrs = x_ptr + m[:, None] * sx + k[None, :]
    if SILU:
        g = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
        return (g / (1.0 + tl.exp(-g)) * u).to(x_ptr.dtype.element_ty)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, sx, sw, so, SILU: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr, FMA: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # FMA with one row: the products, summed after the loop
    rows = w_ptr + n[:, None].to(tl.int64) * sw
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(rows + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        x = _x_tile(x_ptr, sx, m, k, M, K, SILU)
        if not FMA:
            acc += tl.dot(x, tl.trans(w), input_precision=PREC)
        elif BLOCK_M == 1:
            acc1 += w.to(tl.float32) * x.to(tl.float32)
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if FMA and BLOCK_M == 1:
        acc = tl.sum(acc1, axis=1)[None, :]
    mask = (m[:, None] < M) & (n[None, :] < N)
    tl.store(out_ptr + m[:, None] * so + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def gemv_ref(x: torch.Tensor, w: torch.Tensor, act: str | None = None) -> torch.Tensor:
    """Plain PyTorch: F.linear(act(x), w) in fp32, rounded to x's dtype."""
    xf = x.float()
    if act == "silu_mul":
        g, u = xf.chunk(2, dim=-1)
        xf = (torch.nn.functional.silu(g) * u).to(x.dtype).float()
    return (xf @ w.float().T).to(x.dtype)


GEMV_FORMS = ("dot", "fma")


def check_linear(x: torch.Tensor, w: torch.Tensor, act: str | None, out: torch.Tensor | None, max_rows: int,
                 what: str, acts: tuple[str, ...] = ("silu_mul",)) -> tuple[int, int, int, torch.Tensor]:
    """The checks this module's launcher and `kernels.tiled_linear`'s share: x [M, K] (or [M, 2K] with
    act="silu_mul") of at most `max_rows` rows, w [N, K] (or [2N, K], gate rows then up rows, with act="glu", where
    `acts` allows it) of x's dtype and device, `out` [M, N] (allocated when None); each with a contiguous last
    dimension. Returns (M, N, K, out)."""
    check("x", x, dtype=FLOAT_DTYPES, shape=(None, None))
    check("w", w, dtype=x.dtype, shape=(None, None), device=x.device)
    if act is not None and act not in acts:
        raise ValueError(f"act: {act!r} is not None or one of {acts}")
    if act == "silu_mul" and x.shape[1] % 2:
        raise ValueError(f"x: silu_mul needs [M, 2K], got {tuple(x.shape)}")
    if act == "glu" and w.shape[0] % 2:
        raise ValueError(f"w: glu needs [2N, K] (gate rows, then up rows), got {tuple(w.shape)}")
    M, K = x.shape[0], x.shape[1] // 2 if act == "silu_mul" else x.shape[1]
    if M > max_rows:
        raise ValueError(f"x: {M} rows, {what} takes at most {max_rows}")
    N = w.shape[0] // 2 if act == "glu" else w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"w: shape {tuple(w.shape)} does not match K = {K}")
    out = torch.empty((M, N), dtype=x.dtype, device=x.device) if out is None else out
    check("out", out, dtype=x.dtype, shape=(M, N), device=x.device)
    return M, N, K, out


class GemvConfig(NamedTuple):
    form: str
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Named configurations, measured by `bench/kernels.py --only gemv`; the first is the launcher's default up to 8,192
# columns (past that its default block_n is 32 or 64).
GEMV_CONFIGS = {
    "dot_n16_k128": GemvConfig("dot", 16, 128, 4, 4), "dot_n32_k256": GemvConfig("dot", 32, 256, 4, 3),
    "dot_n16_k512": GemvConfig("dot", 16, 512, 4, 3), "fma_n16_k256": GemvConfig("fma", 16, 256, 4, 1),
    "fma_n16_k256_s3": GemvConfig("fma", 16, 256, 4, 3), "fma_n8_k512": GemvConfig("fma", 8, 512, 4, 1),
    "fma_n32_k128": GemvConfig("fma", 32, 128, 4, 1), "fma_n16_k512_w8": GemvConfig("fma", 16, 512, 8, 1),
    "fma_n16_k512_s3": GemvConfig("fma", 16, 512, 4, 3), "dot_n16_k256_s6": GemvConfig("dot", 16, 256, 4, 6),
}
SKINNY_ROWS = 8  # a runner given a configuration multiplies steps of at most this many rows with it


def gemv(x: torch.Tensor, w: torch.Tensor, act: str | None = None, out: torch.Tensor | None = None,
         block_n: int | None = None, block_k: int = 128, form: str = "dot", num_warps: int = 4,
         num_stages: int = 4) -> torch.Tensor:
    """x [M, K] (or [M, 2K] with act="silu_mul"), w [N, K] -> out [M, N]; M <= MAX_ROWS.

    `block_n` (default by N: 16 up to 8192 columns, 32 up to 32768, else 64) keeps a few programs
    per SM for the Llama-3-8B projections (N 4096 .. 128256). `form` (the module's docstring): "dot" pads the
    rows to 16; "fma" to the next power of two (1, 2, 4, 8 or 16), so one row's output does not depend on how
    many rows its step has within those sizes."""
    if form not in GEMV_FORMS:
        raise ValueError(f"form must be one of {GEMV_FORMS}, got {form!r}")
    M, N, K, out = check_linear(x, w, act, out, MAX_ROWS, "the skinny matmul")
    if M == 0 or N == 0:
        return out
    if block_n is None:
        block_n = 16 if N <= 8192 else 32 if N <= 32768 else 64
    fma = form == "fma"
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0), SILU=act == "silu_mul",
        BLOCK_M=triton.next_power_of_2(M) if fma else 16, BLOCK_N=block_n, BLOCK_K=block_k,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", FMA=fma, num_warps=num_warps, num_stages=num_stages,
    )
    return out
