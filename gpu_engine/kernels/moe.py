"""Mixture of experts without a host sync: routing, token sort by expert, grouped expert GEMMs.

`moe_align` sorts the (token, slot) pairs by expert with torch ops whose output sizes depend only
on static shapes, padding each expert's run to a multiple of `block_m`; the grouped GEMM then
gives each block of `block_m` sorted pairs to one expert. Blocks past the end read expert id E and
exit. Pair p = token * top_k + slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gpu_engine.kernels._checks import FLOAT_DTYPES, check, check_contiguous, next_pow2
from gpu_engine.kernels.activation import silu_and_mul
from gpu_engine.models.moe import route as route_ref


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, E, s_t, TOPK: tl.constexpr, NORMALIZE: tl.constexpr,
                  BLOCK_E: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * s_t + offs, mask=offs < E, other=0.0).to(tl.float32)
    x = tl.where(tl.abs(x) < 3.0e38, x, 0.0)  # NaN/inf (padding rows) must still pick valid experts
    x = tl.where(offs < E, x, float("-inf"))
    x = tl.exp(x - tl.max(x, axis=0))
    p = x / tl.sum(x, axis=0)
    total = tl.zeros([], tl.float32)
    q = p
    for _ in tl.static_range(TOPK):
        best = tl.argmax(q, axis=0)
        total += tl.max(q, axis=0)
        q = tl.where(offs == best, -1.0, q)
    scale = tl.full([], 1.0, tl.float32)
    if NORMALIZE:
        scale = scale / total
    q = p
    for k in tl.static_range(TOPK):
        best = tl.argmax(q, axis=0)
        tl.store(w_ptr + t * TOPK + k, tl.max(q, axis=0) * scale)
        tl.store(ids_ptr + t * TOPK + k, best.to(tl.int64))
        q = tl.where(offs == best, -1.0, q)


def moe_route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts, top-k (first index wins ties), optional renormalisation.

    Returns (weights [T, k] fp32, expert ids [T, k] int64), like `gpu_engine.models.moe.route`.
    """
    check("router_logits", router_logits, dtype=FLOAT_DTYPES, shape=(None, None))
    T, E = router_logits.shape
    if not 0 < top_k <= E:
        raise ValueError(f"top_k {top_k} not in 1..{E}")
    weights = torch.empty((T, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=router_logits.device)
    if T:
        _route_kernel[(T,)](router_logits, weights, ids, E, router_logits.stride(0), TOPK=top_k,
                            NORMALIZE=bool(normalize), BLOCK_E=next_pow2(E), num_warps=1)
    return weights, ids


def moe_align(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort pairs by expert, no host sync.

    Returns sorted_pairs [P_max] int32 (value P marks padding) and block_expert [P_max // block_m]
    int32 (num_experts marks an unused block), with P = expert_ids.numel().
    """
    flat = expert_ids.reshape(-1)
    P, E, dev = flat.numel(), num_experts, flat.device
    p_max = triton.cdiv(P + E * (block_m - 1), block_m) * block_m
    counts = torch.zeros(E, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    rank = torch.arange(P, device=dev) - (counts.cumsum(0) - counts)[sorted_e]
    sorted_pairs = torch.full((p_max,), P, dtype=torch.int32, device=dev)
    sorted_pairs[(pad_end - padded)[sorted_e] + rank] = order.to(torch.int32)
    starts = torch.arange(0, p_max, block_m, device=dev)
    block_expert = torch.searchsorted(pad_end, starts, right=True).to(torch.int32)
    return sorted_pairs, block_expert


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, c_ptr, sorted_ptr, bexp_ptr, rw_ptr,
    N, K, P, A_DIV, sa_m, sw_e, sw_n, sc_m, E,
    MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREC: tl.constexpr,
):
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
    w_base = w_ptr + e.to(tl.int64) * sw_e + n[None, :].to(tl.int64) * sw_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + kk) < K
        a = tl.load(a_ptr + rows[:, None] * sa_m + (k0 + kk)[None, :], mask=valid[:, None] & kmask[None, :],
                    other=0.0)
        b = tl.load(w_base + (k0 + kk)[:, None], mask=kmask[:, None] & (n[None, :] < N), other=0.0)
        acc += tl.dot(a, b, input_precision=PREC)
    if MUL_WEIGHT:
        acc *= tl.load(rw_ptr + pairs, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs[:, None].to(tl.int64) * sc_m + n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (n[None, :] < N))


def moe_gemm(a, w, out, sorted_pairs, block_expert, route_weights, a_div: int, block_m: int,
             block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """out[p] = a[p // a_div] @ w[e(p)].T (* route_weights[p]) for every sorted pair p."""
    check("a", a, dtype=FLOAT_DTYPES, shape=(None, None))
    E, N, K = w.shape
    check("w", w, dtype=a.dtype, shape=(E, N, a.shape[1]), device=a.device)
    check_contiguous("w", w)
    check("out", out, dtype=a.dtype, shape=(None, N), device=a.device)
    check("route_weights", route_weights, dtype=torch.float32, shape=(out.shape[0],), device=a.device)
    if out.shape[0] == 0:
        return out
    grid = (block_expert.numel(), triton.cdiv(N, block_n))
    _moe_gemm_kernel[grid](
        a, w, out, sorted_pairs, block_expert, route_weights, N, K, out.shape[0], a_div, a.stride(0),
        w.stride(0), w.stride(1), out.stride(0), E, MUL_WEIGHT=a_div == 1, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, PREC="ieee" if a.dtype == torch.float32 else "tf32", num_warps=4,
    )
    return out


def fused_moe(x, router_w, gate_up, down, top_k: int, normalize: bool, block_m: int | None = None):
    """x [T, H] -> [T, H]: route, sort, gate_up GEMM, SiLU*mul, down GEMM (route-weighted), sum over k."""
    T, H = x.shape
    E = gate_up.shape[0]
    weights, ids = moe_route(F.linear(x, router_w), top_k, normalize)
    bm = block_m or (16 if T * top_k <= 4 * E else 64)
    sorted_pairs, block_expert = moe_align(ids, E, bm)
    inter = torch.empty((T * top_k, gate_up.shape[1]), dtype=x.dtype, device=x.device)
    flat_w = weights.reshape(-1)
    moe_gemm(x, gate_up, inter, sorted_pairs, block_expert, flat_w, a_div=top_k, block_m=bm)
    act = silu_and_mul(inter)
    y = torch.empty((T * top_k, H), dtype=x.dtype, device=x.device)
    moe_gemm(act, down, y, sorted_pairs, block_expert, flat_w, a_div=1, block_m=bm)
    return y.view(T, top_k, H).sum(dim=1)


def fused_moe_ref(x, router_w, gate_up, down, top_k: int, normalize: bool) -> torch.Tensor:
    """Plain PyTorch loop over tokens and slots."""
    weights, ids = route_ref(F.linear(x, router_w), top_k, normalize)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for k in range(top_k):
            e = int(ids[t, k])
            g, u = F.linear(x[t].float(), gate_up[e].float()).chunk(2)
            out[t] += weights[t, k] * F.linear(F.silu(g) * u, down[e].float())
    return out.to(x.dtype)
