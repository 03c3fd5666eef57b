"""Sort-free top-k / top-p / min-p: one boundary per row, found by bounded searches over the logits.

`filter_logits` keeps a prefix of each row in the order (value descending, index ascending): the
first n tokens, n the smallest of the top-k, top-p and min-p prefixes (at least 1). A prefix is
written as a boundary `(key, count)`: every token whose sortable key (`_key`, the float's bits
mapped to a monotone int32) is above `key`, plus the `count` lowest-indexed tokens whose key is
`key` (ties keep the lowest indices first, as the stable sort does). The sampler then masks each
token by that boundary while it scans the row in index order (a running tie count), so no
[B, V] mask, sort or scatter is ever made.

The kernel (one program per row) reads the row a bounded number of times: its max, the softmax
sum and the min-p cut, then for top-k a search over the key range for the k-th key (each pass
tests NC candidate keys at once, so about 11 passes for 32 bits), then for top-p the same search
on the mass above a key. Rows that sample greedily, or whose filters are all off, leave after one
load. The masses are summed in another order than the reference's cumulative sum, so a row whose
nucleus boundary lies within float rounding of `top_p` may cut one token apart; the tests draw
rows where it does not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_engine.kernels._checks import check
from gpu_engine.kernels.logprobs import softmax_stats

INT32_MIN = -(2**31)
IMIN: tl.constexpr = tl.constexpr(INT32_MIN)
IMAX: tl.constexpr = tl.constexpr(2**31 - 1)
NC = 8  # candidate keys tested per search pass: ~11 passes for 32 bits, ALU and memory about even on one SM


@triton.jit
def _key(x):
    """float32 -> int32, monotone, with -0.0 and +0.0 on one key."""
    x = tl.where(x == 0.0, 0.0, x)
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _unkey(k):
    b = tl.where(k < 0, k ^ 0x7FFFFFFF, k)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _above(row, V, cand, m, BLOCK: tl.constexpr, NCAND: tl.constexpr, MASS: tl.constexpr):
    """For each candidate key c: how many tokens have key >= c, or (MASS) the softmax mass of key > c.

    Sums stay per lane ([BLOCK, NCAND]) until the end: one cross-lane reduction per pass.
    """
    acc = tl.zeros([BLOCK, NCAND], tl.float32 if MASS else tl.int32)
    for v0 in range(0, V, BLOCK):
        idx = v0 + tl.arange(0, BLOCK)
        x = tl.load(row + idx, mask=idx < V, other=float("-inf"))
        k = _key(x)[:, None]
        if MASS:
            acc += tl.where(k > cand[None, :], tl.exp(x - m)[:, None], 0.0)
        else:
            acc += ((k >= cand[None, :]) & (idx < V)[:, None]).to(tl.int32)
    return tl.sum(acc, axis=0)


@triton.jit
def _candidates(lo, hi, NCAND: tl.constexpr):
    j = tl.arange(0, NCAND).to(tl.int64) + 1
    return (lo + ((hi - lo) * j) // (NCAND + 1)).to(tl.int32)


@triton.jit
def _kth_key(row, V, k, m, lo, hi, BLOCK: tl.constexpr, NCAND: tl.constexpr):
    """The largest key c with #(key >= c) >= k; #(key >= lo) >= k > #(key >= hi) on entry."""
    lo = lo.to(tl.int64)
    hi = hi.to(tl.int64)
    while hi - lo > 1:
        cand = _candidates(lo, hi, NCAND)
        count = _above(row, V, cand, m, BLOCK, NCAND, False)
        ok = count >= k
        lo = tl.maximum(lo, tl.max(tl.where(ok, cand, IMIN), axis=0).to(tl.int64))
        hi = tl.minimum(hi, tl.min(tl.where(ok, IMAX, cand), axis=0).to(tl.int64))
    return lo.to(tl.int32)


@triton.jit
def _nucleus_key(row, V, limit, m, lo, hi, BLOCK: tl.constexpr, NCAND: tl.constexpr):
    """The smallest key c with mass(key > c) < limit; false at lo, true at hi on entry."""
    lo = lo.to(tl.int64)
    hi = hi.to(tl.int64)
    while hi - lo > 1:
        cand = _candidates(lo, hi, NCAND)
        mass = _above(row, V, cand, m, BLOCK, NCAND, True)
        ok = mass < limit
        hi = tl.minimum(hi, tl.min(tl.where(ok, cand, IMAX), axis=0).to(tl.int64))
        lo = tl.maximum(lo, tl.max(tl.where(ok, IMIN, cand), axis=0).to(tl.int64))
    return hi.to(tl.int32)


@triton.jit
def _at_key(row, V, c, m, BLOCK: tl.constexpr):
    """#(key > c), #(key == c) and the softmax mass of key > c."""
    gt = tl.zeros([BLOCK], tl.int32)
    eq = tl.zeros([BLOCK], tl.int32)
    mass = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, V, BLOCK):
        idx = v0 + tl.arange(0, BLOCK)
        ok = idx < V
        x = tl.load(row + idx, mask=ok, other=float("-inf"))
        k = _key(x)
        gt += ((k > c) & ok).to(tl.int32)
        eq += ((k == c) & ok).to(tl.int32)
        mass += tl.where((k > c) & ok, tl.exp(x - m), 0.0)
    return tl.sum(gt, axis=0), tl.sum(eq, axis=0), tl.sum(mass, axis=0)


@triton.jit
def _tighter(key_a, cnt_a, key_b, cnt_b):
    """The smaller of two prefixes (boundary a or b)."""
    take_b = (key_b > key_a) | ((key_b == key_a) & (cnt_b < cnt_a))
    return tl.where(take_b, key_b, key_a), tl.where(take_b, cnt_b, cnt_a)


@triton.jit
def _threshold_kernel(x_ptr, s_x, temp_ptr, k_ptr, p_ptr, minp_ptr, key_ptr, cnt_ptr, V,
                      BLOCK: tl.constexpr, NCAND: tl.constexpr):
    b = tl.program_id(0)
    row = x_ptr + b.to(tl.int64) * s_x
    k = tl.load(k_ptr + b)
    p = tl.load(p_ptr + b)
    min_p = tl.load(minp_ptr + b)
    use_k = (k > 0) & (k < V)
    use_p = ~(p >= 1.0)  # NaN counts as on, as in filter_logits
    use_min = ~(min_p <= 0.0)
    out_key = tl.full([], IMIN, tl.int32)
    out_cnt = tl.full([], 0, tl.int32)
    if (tl.load(temp_ptr + b) > 0) & (use_k | use_p | use_min):
        m, z, low = softmax_stats(row, V, tl.where(use_min, min_p, 0.0), BLOCK, True)
        top = _key(m)
        if use_min:
            out_key, out_cnt = _tighter(out_key, out_cnt, tl.where(low <= m, _key(low), top),
                                        tl.where(low <= m, V, 1))
        lo_p = top * 0 + (IMIN + 1)  # the top-p search starts where the mass is all of z
        if use_k:
            ck = _kth_key(row, V, k, m, lo_p - 1, top + 1, BLOCK, NCAND)
            gt, _, mass = _at_key(row, V, ck, m, BLOCK)
            z = mass + (k - gt).to(tl.float32) * tl.exp(_unkey(ck) - m)
            out_key, out_cnt = _tighter(out_key, out_cnt, ck, k - gt)
            lo_p = ck
        if use_p:
            limit = p * z
            cp = top
            if p > 0:
                cp = _nucleus_key(row, V, limit, m, lo_p - 1, top, BLOCK, NCAND)
            gt, eq, mass = _at_key(row, V, cp, m, BLOCK)
            e = tl.exp(_unkey(cp) - m)
            ties = tl.where(e > 0, tl.ceil((limit - mass) / tl.where(e > 0, e, 1.0)), eq.to(tl.float32))
            ties = tl.minimum(tl.maximum(ties, 1.0), eq.to(tl.float32)).to(tl.int32)
            out_key, out_cnt = _tighter(out_key, out_cnt, cp, tl.where(p > 0, ties, 1))
    tl.store(key_ptr + b, out_key)
    tl.store(cnt_ptr + b, out_cnt)


def filter_boundary(scaled: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's kept prefix under `filter_logits(scaled, top_k, top_p, min_p)` as (key, count) [B] int32.

    Rows with temperature <= 0 or every filter off get (INT32_MIN, 0): every token is kept.
    """
    check("scaled", scaled, dtype=torch.float32, shape=(None, None))
    B, V = scaled.shape
    dev = scaled.device
    for name, t, dt in (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int32),
                        ("top_p", top_p, torch.float32), ("min_p", min_p, torch.float32)):
        check(name, t, dtype=dt, shape=(B,), device=dev)
    if V >= 2**31 - 1:
        raise ValueError(f"vocabulary of {V} does not fit int32 counts")
    keys = torch.empty(B, dtype=torch.int32, device=dev)
    counts = torch.empty(B, dtype=torch.int32, device=dev)
    if B:
        _threshold_kernel[(B,)](scaled, scaled.stride(0), temperature, top_k, top_p, min_p, keys, counts, V,
                                BLOCK=1024, NCAND=NC, num_warps=8)
    return keys, counts


def sortable_key(x: torch.Tensor) -> torch.Tensor:
    """The kernel's `_key` in torch (int32), for references and tests."""
    x = torch.where(x == 0, torch.zeros_like(x), x).contiguous()
    b = x.view(torch.int32)
    return torch.where(b < 0, b ^ 0x7FFFFFFF, b)


def boundary_mask(scaled: torch.Tensor, keys: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The [B, V] keep mask a boundary stands for (the sampler applies it without making it)."""
    k = sortable_key(scaled)
    eq = k == keys[:, None]
    rank = torch.cumsum(eq.to(torch.int64), dim=-1) - 1
    return (k > keys[:, None]) | (eq & (rank < counts[:, None].long()))
