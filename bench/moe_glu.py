"""An experiment: the sorted MoE path's gate_up GEMM with the SiLU-and-multiply in its epilogue.

The engine's sorted path (`gpu_engine.kernels.moe.moe_experts_sorted`) writes gate and up of every pair (`moe_gemm`,
[P, 2I] in the activations' dtype), then `silu_and_mul` reads them back and writes the activation [P, I]. Here one
grouped GEMM keeps both sums of a tile in fp32 and writes silu(gate) * up, so the products are not rounded before
the SiLU (as the sort-free path rounds them) and a launch and the [P, 2I] round trip are gone. It is timed by
`python -m bench.kernels --only moe_sorted` (the `glu` rows against `gate_up+silu`, `path glu` against `path`) and
enters the engine only if faster there.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from gpu_engine.kernels import moe
from gpu_engine.kernels._checks import FLOAT_DTYPES, check, check_contiguous


@triton.jit
def _glu_gemm_kernel(
    a_ptr, w_ptr, c_ptr, sorted_ptr, bexp_ptr,
    N, K, P, A_DIV, sa_m, sw_e, sw_n, sc_m, E,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
):
    """`moe._moe_gemm_kernel`'s tile over gate rows n and up rows N + n of the block's expert: silu(gate) * up."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp_ptr + pid_m)
    if e >= E:
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < P
    rows = (pairs // A_DIV).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    gate = w_ptr + e.to(tl.int64) * sw_e + n[None, :].to(tl.int64) * sw_n
    up = gate + N * sw_n
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + kk) < K
        wmask = kmask[:, None] & (n[None, :] < N)
        a = tl.load(a_ptr + rows[:, None] * sa_m + (k0 + kk)[None, :], mask=valid[:, None] & kmask[None, :],
                    other=0.0)
        acc_g += tl.dot(a, tl.load(gate + (k0 + kk)[:, None], mask=wmask, other=0.0), input_precision=PREC)
        acc_u += tl.dot(a, tl.load(up + (k0 + kk)[:, None], mask=wmask, other=0.0), input_precision=PREC)
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    c_ptrs = c_ptr + pairs[:, None].to(tl.int64) * sc_m + n[None, :]
    tl.store(c_ptrs, act.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (n[None, :] < N))


def glu_gemm(x, gate_up, out, sorted_pairs, block_expert, a_div: int, block_m: int, block_n: int = 64,
             block_k: int = 64, num_warps: int = 4, num_stages: int | None = None) -> torch.Tensor:
    """out[p] = silu(gate) * up of x[p // a_div] and the gate_up weights [E, 2N, K] of pair p's expert (`moe_align`'s
    arrays), from the two fp32 sums; the tile, warps and stages as `moe.moe_gemm`'s."""
    check("x", x, dtype=FLOAT_DTYPES, shape=(None, None))
    E, W, K = gate_up.shape
    if W % 2:
        raise ValueError(f"gate_up: an even row count, got {W}")
    N = W // 2
    if N * gate_up.stride(1) >= 2**31:  # the kernel's offset of the up rows is an int32 product
        raise ValueError(f"gate_up: {N} gate rows of {gate_up.stride(1)} elements is past int32 offsets")
    check("gate_up", gate_up, dtype=x.dtype, shape=(E, W, x.shape[1]), device=x.device)
    check_contiguous("gate_up", gate_up)
    check("out", out, dtype=x.dtype, shape=(None, N), device=x.device)
    if out.shape[0] == 0:
        return out
    launch: dict[str, Any] = {"num_warps": num_warps, **({} if num_stages is None else {"num_stages": num_stages})}
    _glu_gemm_kernel[(block_expert.numel(), triton.cdiv(N, block_n))](
        x, gate_up, out, sorted_pairs, block_expert, N, K, out.shape[0], a_div, x.stride(0), gate_up.stride(0),
        gate_up.stride(1), out.stride(0), E, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", **launch)
    return out


def sorted_path_glu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
    """`moe.moe_experts_sorted` with `glu_gemm` for its gate_up GEMM and SiLU-and-multiply (the same block height,
    align, down GEMM and sum over k)."""
    T, top_k = ids.shape
    E = gate_up.shape[0]
    bm = moe.sorted_block_m(T * top_k, E)
    sorted_pairs, block_expert = moe.moe_align(ids, E, bm)
    act = torch.empty((T * top_k, gate_up.shape[1] // 2), dtype=x.dtype, device=x.device)
    glu_gemm(x, gate_up, act, sorted_pairs, block_expert, a_div=top_k, block_m=bm)
    y = torch.empty((T * top_k, x.shape[1]), dtype=x.dtype, device=x.device)
    moe.moe_gemm(act, down, y, sorted_pairs, block_expert, weights.reshape(-1), a_div=1, block_m=bm)
    return y.view(T, top_k, x.shape[1]).sum(dim=1)
