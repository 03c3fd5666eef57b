"""Mixture of experts without a host sync: routing, then one of two expert paths. Pair p = token * top_k + slot.

Large steps: `moe_align` sorts the (token, slot) pairs by expert (one or two launches up to `ALIGN_KERNEL_PAIRS`
pairs, torch ops past it), in arrays whose sizes depend only on static shapes, padding each expert's run to a
multiple of `block_m`; the grouped GEMM then gives each block of `block_m` sorted pairs to one expert. Blocks
past the end read expert id E and exit.

Small steps (T * top_k <= SMALL_PAIRS, decode): no sort. A decode step reads a few experts' weights
for one row each, so its time is the weight read; the sorted path's grid there is mostly empty
blocks (one valid row in 16) and the 8 experts of a batch-1 step stream through a few hundred
programs. `moe_gate_up_silu` gives every (pair, column tile) a program that writes silu(gate) * up,
and `moe_down_sum` every (token, column tile) one that sums the token's top_k experts in registers,
so a step is four launches (router GEMM, routing, the two kernels) with thousands of programs, or three with
`moe_router`, which takes the router's product and the routing in one (a fused runner's, `fused_moe`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gpu_engine.kernels._checks import FLOAT_DTYPES, check, check_contiguous, next_pow2
from gpu_engine.kernels._sync import last_to_finish
from gpu_engine.kernels.activation import silu_and_mul
from gpu_engine.models.moe import route as route_ref

# Steps of at most this many (token, slot) pairs take the sort-free path. 64 = batch 8 of a top-8
# model: the Qwen3-30B-A3B decode up to there reads a distinct expert for most pairs, where the
# per-pair programs cost little; a first value, to be tuned on the GPU with `bench/kernels.py`.
SMALL_PAIRS = 64


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, E, s_t, TOPK: tl.constexpr, NORMALIZE: tl.constexpr,
                  BLOCK_E: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * s_t + offs, mask=offs < E, other=0.0).to(tl.float32)
    _route_row(x, w_ptr, ids_ptr, t, E, TOPK, NORMALIZE, BLOCK_E)


@triton.jit
def _route_row(x, w_ptr, ids_ptr, t, E, TOPK: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):
    """Token t's route from its router logits `x` (fp32 [BLOCK_E], E valid): softmax, the top-k (first index wins
    ties), optionally renormalised; its weights and expert ids stored."""
    offs = tl.arange(0, BLOCK_E)
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


@triton.jit
def _router_logits(x_ptr, rw_ptr, nw_ptr, logits_ptr, t, grp, E, K, s_x, s_r, eps, NORM: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr):
    """The router logits of experts grp * BLOCK_G.. for token t (with NORM, of the RMSNorm of x with the weight at
    `nw_ptr`, its 1 / RMS taken from the same x tiles and applied after the loop), rounded to x's dtype as the
    router's product is, stored."""
    e = grp * BLOCK_G + tl.arange(0, BLOCK_G)
    kk = tl.arange(0, BLOCK_K)
    rows = rw_ptr + e[:, None].to(tl.int64) * s_r
    acc = tl.zeros([BLOCK_G, BLOCK_K], tl.float32)
    sq = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        xk = tl.load(x_ptr + t.to(tl.int64) * s_x + k, mask=k < K, other=0.0).to(tl.float32)
        if NORM:
            sq += xk * xk
            xk = xk * tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        acc += tl.load(rows + k[None, :], mask=(e[:, None] < E) & (k[None, :] < K), other=0.0).to(tl.float32) \
            * xk[None, :]
    logit = tl.sum(acc, axis=1)
    if NORM:
        logit = logit * tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    logit = logit.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(logits_ptr + t * E + e, logit, mask=e < E)


@triton.jit
def _route_last(cnt_ptr, logits_ptr, w_ptr, ids_ptr, t, E, GROUPS, TOPK: tl.constexpr, NORMALIZE: tl.constexpr,
                BLOCK_E: tl.constexpr):
    """After a router program's logits: the last of token t's GROUPS programs to finish (an atomic count, reset for
    the next launch) routes the token (`_route_row`). Whether this program did."""
    last = last_to_finish(cnt_ptr + t, GROUPS)
    if last:
        offs = tl.arange(0, BLOCK_E)
        x = tl.load(logits_ptr + t * E + offs, mask=offs < E, other=0.0, cache_modifier=".cg")
        _route_row(x, w_ptr, ids_ptr, t, E, TOPK, NORMALIZE, BLOCK_E)
    return last


@triton.jit
def _router_kernel(x_ptr, rw_ptr, nw_ptr, logits_ptr, w_ptr, ids_ptr, cnt_ptr, E, K, s_x, s_r, eps,
                   TOPK: tl.constexpr, NORMALIZE: tl.constexpr, NORM: tl.constexpr, GROUPS: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr):
    """Program (token t, group g): `_router_logits` of experts g * BLOCK_G.., then `_route_last`."""
    t = tl.program_id(0)
    _router_logits(x_ptr, rw_ptr, nw_ptr, logits_ptr, t, tl.program_id(1), E, K, s_x, s_r, eps, NORM, BLOCK_G,
                   BLOCK_K)
    _route_last(cnt_ptr, logits_ptr, w_ptr, ids_ptr, t, E, GROUPS, TOPK, NORMALIZE, BLOCK_E)


ROUTER_GROUP = 4  # experts a router program takes: 32 programs a token for 128 experts


def _check_router(x: torch.Tensor, router_w: torch.Tensor, top_k: int) -> tuple[int, int, int]:
    """(tokens, hidden, experts) of a routed step's x [T, H] and router weight [E, H], checked."""
    check("x", x, dtype=FLOAT_DTYPES, shape=(None, None))
    T, H = x.shape
    check("router_w", router_w, dtype=x.dtype, shape=(None, H), device=x.device)
    check_contiguous("router_w", router_w)
    E = router_w.shape[0]
    if not 0 < top_k <= E:
        raise ValueError(f"top_k {top_k} not in 1..{E}")
    return T, H, E


def moe_router(x: torch.Tensor, router_w: torch.Tensor, top_k: int, normalize: bool, counters: torch.Tensor,
               norm: tuple[torch.Tensor, float] | None = None, block_g: int = ROUTER_GROUP,
               block_k: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_route(F.linear(x, router_w), ...)` in one launch, for small steps: a program per (token, group of
    `block_g` experts) takes those logits, and the token's last program to finish routes it. `norm` (weight [H],
    eps): x is the residual stream and its RMSNorm is what is routed. `counters`: an int32 count per token, zero,
    which every launch leaves zero. The logits are summed in another order than cuBLAS's, so a near tie between
    two experts may go the other way."""
    T, H, E = _check_router(x, router_w, top_k)
    check("counters", counters, dtype=(torch.int32,), shape=(None,), device=x.device)
    if counters.numel() < T:
        raise ValueError(f"counters: {counters.numel()}, this launch needs {T} (one a token)")
    if norm is not None:
        check("norm weight", norm[0], dtype=x.dtype, shape=(H,), device=x.device)
    weights = torch.empty((T, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=x.device)
    logits = torch.empty((T, E), dtype=torch.float32, device=x.device)
    if T:
        groups = triton.cdiv(E, block_g)
        nw, eps = norm if norm is not None else (x, 0.0)
        _router_kernel[(T, groups)](
            x, router_w, nw, logits, weights, ids, counters, E, H, x.stride(0), router_w.stride(0), float(eps),
            TOPK=top_k, NORMALIZE=bool(normalize), NORM=norm is not None, GROUPS=groups, BLOCK_G=block_g,
            BLOCK_K=min(block_k, next_pow2(H)), BLOCK_E=next_pow2(E), num_warps=4,
        )
    return weights, ids


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


# The align's forms by step size (pairs = tokens * top_k), from `bench/kernels.py --only moe_align` on an H100
# (BENCHMARKS.md, "The expert sort in two launches"): up to ONE_LAUNCH_PAIRS one launch whose every program counts
# every pair (6.4 us at 128 pairs against 7.0 for two); up to ALIGN_KERNEL_PAIRS two, a count of each chunk of pairs
# and a placing from the counts (8.0 us at 1,024 pairs, 15.6 at 8,192 and 118.6 at 65,536, where the one launch
# took 19.4 and 133.9 and torch's stable sort 75.8, 124.4 and 132.9); past it torch's sort (about 25 launches).
# All give the same arrays.
ONE_LAUNCH_PAIRS = 128
ALIGN_KERNEL_PAIRS = 65536


def align_chunk(pairs: int) -> int:
    """The two-launch align's pairs a chunk at a step of `pairs`: the fastest of 64, 128 and 256 measured there."""
    return 64 if pairs <= 1024 else 128 if pairs <= 16384 else 256


def moe_align_ref(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_align` with torch ops (a stable sort): the reference, and the path for steps of many pairs."""
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
def _align_roles(ids_ptr, sorted_ptr, bexp_ptr, pid, e, counts, before, P, E, P_MAX, N_BLOCKS, PAIR_PROGS, SLOT_PROGS,
                 BM: tl.constexpr, CHUNK: tl.constexpr):
    """Program `pid`'s role, given the pairs per expert (`counts`) and, for a pair program, those ahead of its chunk
    (`before`): pair chunks (each pair to its slot), then slot chunks (padding slots get P), then block chunks (each
    block's expert). The roles need no order among them and write disjoint slots."""
    padded = (counts + BM - 1) // BM * BM
    pad_end = tl.cumsum(padded, axis=0)
    pad_start = pad_end - padded
    if pid < PAIR_PROGS:  # slot of pair p: its expert's first slot + pairs of that expert before it
        p = pid * CHUNK + tl.arange(0, CHUNK)
        f = tl.load(ids_ptr + p, mask=p < P, other=-1)
        onehot = (f[:, None] == e[None, :]).to(tl.int32)
        rank = tl.cumsum(onehot, axis=0) - onehot + (before + pad_start)[None, :]
        tl.store(sorted_ptr + tl.sum(onehot * rank, axis=1), p, mask=p < P)
    elif pid < PAIR_PROGS + SLOT_PROGS:  # slot s, of expert x (whose runs end by s): padding past x's pairs
        s = (pid - PAIR_PROGS) * CHUNK + tl.arange(0, CHUNK)
        x = tl.sum(((pad_end[None, :] <= s[:, None]) & (e[None, :] < E)).to(tl.int32), axis=1)
        sel = e[None, :] == x[:, None]
        first = tl.sum(tl.where(sel, pad_start[None, :], 0), axis=1)
        n = tl.sum(tl.where(sel, counts[None, :], 0), axis=1)
        tl.store(sorted_ptr + s, tl.zeros([CHUNK], tl.int32) + P, mask=(s < P_MAX) & ((x >= E) | (s - first >= n)))
    else:  # a block's expert: how many experts' runs end at or before its first slot (E: unused)
        j = (pid - PAIR_PROGS - SLOT_PROGS) * CHUNK + tl.arange(0, CHUNK)
        x = tl.sum(((pad_end[None, :] <= (j * BM)[:, None]) & (e[None, :] < E)).to(tl.int32), axis=1)
        tl.store(bexp_ptr + j, x, mask=j < N_BLOCKS)


@triton.jit
def _align_count_kernel(ids_ptr, hist_ptr, P, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """hist[c, x]: how many of pairs c * CHUNK .. c * CHUNK + CHUNK - 1 go to expert x (columns past E stay 0)."""
    c = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    p = c * CHUNK + tl.arange(0, CHUNK)
    f = tl.load(ids_ptr + p, mask=p < P, other=-1)
    tl.store(hist_ptr + c * BLOCK_E + e, tl.sum((f[:, None] == e[None, :]).to(tl.int32), axis=0))


@triton.jit
def _align_place_kernel(ids_ptr, hist_ptr, sorted_ptr, bexp_ptr, P, E, P_MAX, N_BLOCKS, N_CHUNKS, PAIR_PROGS,
                        SLOT_PROGS, BM: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
                        ROWS: tl.constexpr):
    """Every program sums the chunks' counts (`_align_count_kernel`) into the pairs per expert, and a pair program
    the chunks before its own, then takes its role (`_align_roles`)."""
    pid = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    before = tl.zeros([BLOCK_E], tl.int32)  # pairs of each expert ahead of a pair program's chunk
    for c0 in range(0, N_CHUNKS, ROWS):
        c = c0 + tl.arange(0, ROWS)
        h = tl.load(hist_ptr + c[:, None] * BLOCK_E + e[None, :], mask=(c < N_CHUNKS)[:, None], other=0)
        counts += tl.sum(h, axis=0)
        before += tl.sum(tl.where((c < pid)[:, None], h, 0), axis=0)
    _align_roles(ids_ptr, sorted_ptr, bexp_ptr, pid, e, counts, before, P, E, P_MAX, N_BLOCKS, PAIR_PROGS, SLOT_PROGS,
                 BM, CHUNK)


@triton.jit
def _align_one_kernel(ids_ptr, sorted_ptr, bexp_ptr, P, E, P_MAX, N_BLOCKS, PAIR_PROGS, SLOT_PROGS,
                      BM: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """Every program counts the pairs per expert itself (P is small), and a pair program those ahead of its chunk,
    then takes its role (`_align_roles`)."""
    pid = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    mine = pid * CHUNK  # a pair program's first pair
    counts = tl.zeros([BLOCK_E], tl.int32)
    before = tl.zeros([BLOCK_E], tl.int32)  # pairs of each expert ahead of this program's chunk
    for p0 in range(0, P, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        f = tl.load(ids_ptr + p, mask=p < P, other=-1)
        hits = tl.sum((f[:, None] == e[None, :]).to(tl.int32), axis=0)
        counts += hits
        before += tl.where(p0 < mine, hits, 0)
    _align_roles(ids_ptr, sorted_ptr, bexp_ptr, pid, e, counts, before, P, E, P_MAX, N_BLOCKS, PAIR_PROGS, SLOT_PROGS,
                 BM, CHUNK)


def moe_align(expert_ids: torch.Tensor, num_experts: int, block_m: int, chunk: int | None = None,
              one_launch: bool | None = None, limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort pairs by expert, no host sync.

    Returns sorted_pairs [P_max] int32 (value P marks padding) and block_expert [P_max // block_m]
    int32 (num_experts marks an unused block), with P = expert_ids.numel(). Each expert's pairs are in
    pair order (a stable sort). Up to `ONE_LAUNCH_PAIRS` pairs one launch, up to `ALIGN_KERNEL_PAIRS` (`limit`) two
    (each chunk of pairs counted per expert, then every slot placed from the counts; `align_chunk` pairs a chunk),
    past it `moe_align_ref`: all give the same arrays. `chunk` and `one_launch` force a form (the benchmark's).
    """
    check("expert_ids", expert_ids, dtype=torch.int64)
    check_contiguous("expert_ids", expert_ids)
    if chunk is not None and chunk not in (16, 32, 64, 128, 256):
        raise ValueError(f"chunk: 16, 32, 64, 128 or 256 pairs, got {chunk}")
    P, E = expert_ids.numel(), num_experts
    if P > (ALIGN_KERNEL_PAIRS if limit is None else limit):
        return moe_align_ref(expert_ids, num_experts, block_m)
    p_max = triton.cdiv(P + E * (block_m - 1), block_m) * block_m
    dev = expert_ids.device
    sorted_pairs = torch.empty((p_max,), dtype=torch.int32, device=dev)
    block_expert = torch.empty((p_max // block_m,), dtype=torch.int32, device=dev)
    if p_max == 0:  # no pairs and blocks of one
        return sorted_pairs, block_expert
    one = P <= ONE_LAUNCH_PAIRS if one_launch is None else one_launch
    chunk = chunk or (64 if one else align_chunk(P))
    progs = [triton.cdiv(n, chunk) for n in (P, p_max, p_max // block_m)]
    block_e = next_pow2(E)
    if one:
        _align_one_kernel[(sum(progs),)](expert_ids, sorted_pairs, block_expert, P, E, p_max, p_max // block_m,
                                         progs[0], progs[1], BM=block_m, BLOCK_E=block_e, CHUNK=chunk, num_warps=4)
        return sorted_pairs, block_expert
    chunks = max(progs[0], 1)
    hist = torch.empty((chunks, block_e), dtype=torch.int32, device=dev)
    _align_count_kernel[(chunks,)](expert_ids, hist, P, CHUNK=chunk, BLOCK_E=block_e, num_warps=4)
    _align_place_kernel[(sum(progs),)](expert_ids, hist, sorted_pairs, block_expert, P, E, p_max, p_max // block_m,
                                       chunks, progs[0], progs[1], BM=block_m, BLOCK_E=block_e, CHUNK=chunk,
                                       ROWS=min(16, next_pow2(chunks)), num_warps=4)
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
             block_n: int = 64, block_k: int = 64, num_warps: int = 4, num_stages: int | None = None) -> torch.Tensor:
    """out[p] = a[p // a_div] @ w[e(p)].T (* route_weights[p]) for every sorted pair p. The tile (`block_n`,
    `block_k`), warps and pipeline stages (None: Triton's default) change the speed, and `block_k` the order of
    the fp32 sums; `bench/kernels.py --only moe_sorted` times them."""
    check("a", a, dtype=FLOAT_DTYPES, shape=(None, None))
    E, N, K = w.shape
    check("w", w, dtype=a.dtype, shape=(E, N, a.shape[1]), device=a.device)
    check_contiguous("w", w)
    check("out", out, dtype=a.dtype, shape=(None, N), device=a.device)
    check("route_weights", route_weights, dtype=torch.float32, shape=(out.shape[0],), device=a.device)
    if out.shape[0] == 0:
        return out
    grid = (block_expert.numel(), triton.cdiv(N, block_n))
    launch: dict[str, Any] = {"num_warps": num_warps} if num_stages is None else {"num_warps": num_warps,
                                                                                   "num_stages": num_stages}
    _moe_gemm_kernel[grid](
        a, w, out, sorted_pairs, block_expert, route_weights, N, K, out.shape[0], a_div, a.stride(0),
        w.stride(0), w.stride(1), out.stride(0), E, MUL_WEIGHT=a_div == 1, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, PREC="ieee" if a.dtype == torch.float32 else "tf32", **launch,
    )
    return out


@triton.jit
def _gate_up_tile(x_ptr, w_ptr, ids_ptr, out_ptr, nw_ptr, p, nt, I, K, s_x, s_we, s_wn, s_o, eps,
                  TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr):
    """silu(gate) * up of pair p's expert, columns nt * BLOCK_N.., stored."""
    n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    kk = tl.arange(0, BLOCK_K)
    x_row = x_ptr + (p // TOPK).to(tl.int64) * s_x
    gate = w_ptr + tl.load(ids_ptr + p) * s_we + n[:, None].to(tl.int64) * s_wn  # ids are int64
    up = gate + I * s_wn  # I * H < 2^31: half of one expert's matrix
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    sq = tl.zeros([BLOCK_K], tl.float32)  # NORM: x's squares, summed after the loop
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        kmask = k < K
        xk = tl.load(x_row + k, mask=kmask, other=0.0).to(tl.float32)
        if NORM:  # RMSNorm(x) * weight: the weight here, 1 / RMS on the sums
            sq += xk * xk
            xk = xk * tl.load(nw_ptr + k, mask=kmask, other=0.0).to(tl.float32)
        wmask = nmask[:, None] & kmask[None, :]
        acc_g += tl.load(gate + k[None, :], mask=wmask, other=0.0).to(tl.float32) * xk[None, :]
        acc_u += tl.load(up + k[None, :], mask=wmask, other=0.0).to(tl.float32) * xk[None, :]
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    if NORM:
        rstd = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
        g, u = g * rstd, u * rstd
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + p.to(tl.int64) * s_o + n, y.to(out_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _gate_up_silu_kernel(x_ptr, w_ptr, ids_ptr, out_ptr, nw_ptr, I, K, s_x, s_we, s_wn, s_o, eps,
                         TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr):
    _gate_up_tile(x_ptr, w_ptr, ids_ptr, out_ptr, nw_ptr, tl.program_id(0), tl.program_id(1), I, K, s_x, s_we, s_wn,
                  s_o, eps, TOPK, BLOCK_N, BLOCK_K, NORM)


def _check_routing(ids: torch.Tensor, T: int | None, device: torch.device) -> None:
    check("expert_ids", ids, dtype=torch.int64, shape=(T, None), device=device)
    check_contiguous("expert_ids", ids)


def moe_gate_up_silu(x: torch.Tensor, gate_up: torch.Tensor, expert_ids: torch.Tensor, out: torch.Tensor | None = None,
                     block_n: int = 4, block_k: int = 512,
                     norm: tuple[torch.Tensor, float] | None = None, num_warps: int = 4) -> torch.Tensor:
    """x [T, H], gate_up [E, 2I, H] (gate rows first), expert_ids [T, k] -> out [T * k, I] =
    silu(x[t] @ gate.T) * (x[t] @ up.T) of expert ids[t, s] for each pair (t, s). `norm` (weight [H], eps): x is
    the residual stream and RMSNorm(x) * weight takes its place (the weight on the x tiles, 1 / RMS on the sums
    before the SiLU; no rounding of the normalised x).

    Grid (pair, I / block_n): the default 4 columns give 1,536 programs for the 8 pairs of a Qwen3-30B-A3B
    batch-1 step (I = 768), 2 columns 3,072: the time is the weight read, and what keeps HBM busy is how many
    loads are in flight. Measured on the H200 (`bench/kernels.py`, bf16): 2 columns 17.0 / 86.2 / 157.7 us at batch
    1 / 8 / 16, 4 columns 18.8 / 106.2 / 194.4, 16 columns 18.0 / 88.3 / 158.1 (in sequence with
    `moe_down_sum` the pair measured the same as with the earlier 4 and 2 columns). Each program streams its
    2 x block_n contiguous weight rows (gate and up) in block_k chunks, loaded at their
    own width, accumulated in fp32. Pairs vary fastest in the grid, so
    pairs that share an expert read its tile at about the same time (from L2 for all but the
    first). Expert ids must lie in [0, E) (`moe_route` guarantees it).
    """
    check("x", x, dtype=FLOAT_DTYPES, shape=(None, None))
    T, H = x.shape
    E, I2, _ = gate_up.shape
    check("gate_up", gate_up, dtype=x.dtype, shape=(E, I2, H), device=x.device)
    check_contiguous("gate_up", gate_up)
    if I2 % 2:
        raise ValueError(f"gate_up: expected [E, 2I, H], got {tuple(gate_up.shape)}")
    _check_routing(expert_ids, T, x.device)
    top_k, I = expert_ids.shape[1], I2 // 2
    if out is None:
        out = torch.empty((T * top_k, I), dtype=x.dtype, device=x.device)
    check("out", out, dtype=x.dtype, shape=(T * top_k, I), device=x.device)
    if norm is not None:
        check("norm weight", norm[0], dtype=x.dtype, shape=(H,), device=x.device)
    if out.shape[0] == 0:
        return out
    nw, eps = norm if norm is not None else (x, 0.0)
    _gate_up_silu_kernel[(T * top_k, triton.cdiv(I, block_n))](
        x, gate_up, expert_ids, out, nw, I, H, x.stride(0), gate_up.stride(0), gate_up.stride(1), out.stride(0),
        float(eps), TOPK=top_k, BLOCK_N=block_n, BLOCK_K=min(block_k, next_pow2(H)), NORM=norm is not None,
        num_warps=num_warps,
    )
    return out


@triton.jit
def _down_setup(a_ptr, w_ptr, ids_ptr, rw_ptr, t, nt, N, s_a, s_we, s_wn, TOPK: tl.constexpr, SLOTS: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Token t's route weights, and the pointers and masks of its top_k experts' down rows nt * BLOCK_N.. and
    activations."""
    n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    s = tl.arange(0, SLOTS)
    smask = s < TOPK
    pair = t.to(tl.int64) * TOPK + s
    rw = tl.load(rw_ptr + pair, mask=smask, other=0.0)
    e = tl.load(ids_ptr + pair, mask=smask, other=0)
    rows = w_ptr + e[:, None, None] * s_we + n[None, :, None].to(tl.int64) * s_wn  # [SLOTS, BLOCK_N, 1]
    acts = a_ptr + pair[:, None] * s_a  # [SLOTS, 1]
    rmask = smask[:, None, None] & nmask[None, :, None]
    return rw, rows, acts, rmask, smask, n, nmask


@triton.jit
def _down_steps(acc, rows, acts, rmask, smask, start, K, BLOCK_K: tl.constexpr):
    """`acc` plus the products of the K steps from `start` on, in order."""
    kk = tl.arange(0, BLOCK_K)
    for k0 in range(start, K, BLOCK_K):
        k = k0 + kk
        kmask = k < K
        a = tl.load(acts + k[None, :], mask=smask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        w = tl.load(rows + k[None, None, :], mask=rmask & kmask[None, None, :], other=0.0).to(tl.float32)
        acc += w * a[:, None, :]
    return acc


@triton.jit
def _down_store(out_ptr, acc, rw, t, n, nmask, s_o, ADD: tl.constexpr):
    """The route-weighted sum over the slots, stored as token t's columns `n` (ADD: added into what is there, the
    residual stream, rounded as `kernels.rmsnorm`'s residual add rounds)."""
    y = tl.sum(tl.sum(acc, axis=2) * rw[:, None], axis=0).to(out_ptr.dtype.element_ty)
    optrs = out_ptr + t.to(tl.int64) * s_o + n
    if ADD:
        y = (y.to(tl.float32) + tl.load(optrs, mask=nmask, other=0.0).to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(optrs, y, mask=nmask)


@triton.jit
def _down_sum_kernel(a_ptr, w_ptr, ids_ptr, rw_ptr, out_ptr, N, K, s_a, s_we, s_wn, s_o, TOPK: tl.constexpr,
                     SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ADD: tl.constexpr):
    t = tl.program_id(0)
    rw, rows, acts, rmask, smask, n, nmask = _down_setup(a_ptr, w_ptr, ids_ptr, rw_ptr, t, tl.program_id(1), N, s_a,
                                                         s_we, s_wn, TOPK, SLOTS, BLOCK_N)
    acc = tl.zeros([SLOTS, BLOCK_N, BLOCK_K], tl.float32)
    acc = _down_steps(acc, rows, acts, rmask, smask, 0, K, BLOCK_K)
    _down_store(out_ptr, acc, rw, t, n, nmask, s_o, ADD)


def moe_down_sum(act: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor, route_weights: torch.Tensor,
                 out: torch.Tensor | None = None, block_n: int = 2, block_k: int = 256,
                 residual: torch.Tensor | None = None, num_warps: int = 4) -> torch.Tensor:
    """act [T * k, I], down [E, H, I], expert_ids / route_weights [T, k] -> out [T, H] =
    sum over s of route_weights[t, s] * act[t * k + s] @ down[ids[t, s]].T, in registers: no
    [T * k, H] intermediate, no atomics (deterministic). `residual` [T, H]: the sum, rounded, is added into it
    (the residual stream; rounded again, as `kernels.rmsnorm`'s residual add does) and it is returned.

    Grid (token, H / block_n): the default 2 columns give 1,024 programs at batch 1 (H = 2048), 8 columns 256;
    each program loads all top_k experts' [block_n, block_k] tiles in one [slots, block_n, block_k] tile per step
    (slots = top_k rounded up to a power of two), so its loads in flight are top_k times a single
    expert's (8 KiB a step in bf16 at the defaults; 8 columns: 32 KiB, and 255 registers a thread with a spill
    for sm_90) and the loop is I / block_k steps long (3 at
    I = 768), not top_k times that. Measured on the H200 (`bench/kernels.py`, bf16): 8 columns 9.1 / 46.3 /
    80.7 us at batch 1 / 8 / 16, 2 columns 10.9 / 50.8 / 88.9, 1 column 9.4 / 46.6 / 83.8. Tokens vary fastest
    in the grid, as pairs do in `moe_gate_up_silu`.
    """
    check("act", act, dtype=FLOAT_DTYPES, shape=(None, None))
    E, H, I = down.shape
    check("down", down, dtype=act.dtype, shape=(E, H, act.shape[1]), device=act.device)
    check_contiguous("down", down)
    _check_routing(expert_ids, None, act.device)
    T, top_k = expert_ids.shape
    check("route_weights", route_weights, dtype=torch.float32, shape=(T, top_k), device=act.device)
    check_contiguous("route_weights", route_weights)
    if act.shape[0] != T * top_k:
        raise ValueError(f"act: {act.shape[0]} rows, expected T * top_k = {T * top_k}")
    if residual is not None:
        if out is not None:
            raise ValueError("out: a launch with a residual writes into the residual")
        out = residual
    if out is None:
        out = torch.empty((T, H), dtype=act.dtype, device=act.device)
    check("residual" if residual is not None else "out", out, dtype=act.dtype, shape=(T, H), device=act.device)
    if T == 0:
        return out
    _down_sum_kernel[(T, triton.cdiv(H, block_n))](
        act, down, expert_ids, route_weights, out, H, I, act.stride(0), down.stride(0), down.stride(1),
        out.stride(0), TOPK=top_k, SLOTS=next_pow2(top_k), BLOCK_N=block_n, BLOCK_K=min(block_k, next_pow2(I)),
        ADD=residual is not None, num_warps=num_warps,
    )
    return out


def small_path(tokens: int, top_k: int) -> bool:
    """Whether `fused_moe` takes the sort-free path for a step of `tokens` rows (a static shape, so
    a captured graph always holds one path)."""
    return tokens * top_k <= SMALL_PAIRS


def moe_experts_small(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, residual: torch.Tensor | None = None,
                      norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """The sort-free expert path: gate_up + SiLU-and-multiply per pair, then down + route-weighted sum
    per token. It rounds at fewer points than `moe_experts_sorted`: gate and up stay fp32 into the SiLU, each
    pair's activation is rounded once, each token's output once from its fp32 sum over k; the sorted path also
    rounds gate and up (its `inter`) and each pair's route-weighted down product (its `y`), and both sum in other
    fp32 orders (tests/helpers/moe_rounding.py bounds each). So an MoE request's greedy tokens may depend on
    whether its step was small, as
    cuBLAS's choice of kernel by GEMM size already makes them for the dense layers (docs/GPU_NOTES.md, batch
    invariance). `residual`: the output added into it (`moe_down_sum`); `norm`: x's RMSNorm taken in the gate_up
    kernel (`moe_gate_up_silu`)."""
    return moe_down_sum(moe_gate_up_silu(x, gate_up, ids, norm=norm), down, ids, weights,
                        residual=residual)


def sorted_block_m(pairs: int, experts: int) -> int:
    """The sorted path's block height at a step of `pairs` (token, slot) pairs: 16 where most experts hold a few
    pairs (at most 4 an expert on average), 64 past it."""
    return 16 if pairs <= 4 * experts else 64


def moe_experts_sorted(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                       ids: torch.Tensor, block_m: int | None = None) -> torch.Tensor:
    """The sorted expert path: align, gate_up GEMM, SiLU*mul, down GEMM (route-weighted), sum over k."""
    T, top_k = ids.shape
    E = gate_up.shape[0]
    bm = block_m or sorted_block_m(T * top_k, E)
    sorted_pairs, block_expert = moe_align(ids, E, bm)
    inter = torch.empty((T * top_k, gate_up.shape[1]), dtype=x.dtype, device=x.device)
    flat_w = weights.reshape(-1)
    moe_gemm(x, gate_up, inter, sorted_pairs, block_expert, flat_w, a_div=top_k, block_m=bm)
    act = silu_and_mul(inter)
    y = torch.empty((T * top_k, x.shape[1]), dtype=x.dtype, device=x.device)
    moe_gemm(act, down, y, sorted_pairs, block_expert, flat_w, a_div=1, block_m=bm)
    return y.view(T, top_k, x.shape[1]).sum(dim=1)


def fused_moe(x, router_w, gate_up, down, top_k: int, normalize: bool, block_m: int | None = None,
              residual: torch.Tensor | None = None, counters: torch.Tensor | None = None,
              norm: tuple[torch.Tensor, float] | None = None):
    """x [T, H] -> [T, H]: route, then the sort-free path for small steps (`small_path`), else the
    sorted one (`block_m` is the sorted path's). Small steps only:
    `residual`, the output added into it, which is returned (`moe_down_sum`); `counters` (one a token, zero), the
    router's product and the routing in one launch (`moe_router`); `norm` (with `counters`), x is the residual
    stream and its RMSNorm is taken in the router's and the gate_up kernels, so the layer's MLP is three launches
    and no norm."""
    small = small_path(x.shape[0], top_k)
    if not small and (residual is not None or counters is not None or norm is not None):
        raise ValueError(f"residual, counters, norm: only for a step of at most {SMALL_PAIRS} (token, expert) pairs")
    if norm is not None and counters is None:
        raise ValueError("norm: taken in the router's kernel, which needs counters")
    if counters is not None:
        weights, ids = moe_router(x, router_w, top_k, normalize, counters, norm=norm)
    else:
        weights, ids = moe_route(F.linear(x, router_w), top_k, normalize)
    if small:
        return moe_experts_small(x, gate_up, down, weights, ids, residual=residual, norm=norm)
    return moe_experts_sorted(x, gate_up, down, weights, ids, block_m)


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
