"""Matmul for decode steps of up to 128 rows: out = act(x) @ w.T, the weight read once, split over K.

A decode step of tens of rows still spends its matmul time reading the weight, and cuBLAS's kernels for
such steps leave bandwidth unused where the output is narrow: at 128 rows the Llama-3-8B o projection
(4,096 columns) ran at 1.64x its copy-rate floor on the H200 and down (14,336 deep) at 1.35x
(`bench/results/kernels.json`, `blas_*` rows). Here every program holds all the step's rows (padded to a
power of two, 16 to 128) for BLOCK_N columns, so the weight is read once, and the K range is cut in
`split_k` slices so that narrow outputs still give every SM a program. Each slice's fp32 partial goes
to a workspace; the last program of a tile to finish (an atomic count, which it resets for the next
launch) sums the slices in slice order and writes the tile, all in one launch. The sums therefore do
not depend on which program finishes last, and a row's output does not depend on the other rows of its
step among steps that pad to the same power of two (tested). `act="silu_mul"` takes x as the gate_up
output [M, 2K] and applies silu(gate) * up to each x tile as it is loaded. The reference is `tiled_ref`.

Measured beside cuBLAS by `bench/kernels.py --only tiled` (`TILED_CONFIGS`). A runner takes it only where its
`KernelPlan` (`kernels.plan`) names a configuration for the weight's shape and the step's rows. On the H200 the SiLU
fused here ran 1.4-8x slower than `activation.silu_and_mul` followed by the plain tiled linear (`tiled_down` rows,
NAME against NAME_apart), so the runner applies it apart.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from gpu_engine.kernels._checks import FLOAT_DTYPES, check
from gpu_engine.kernels._sync import last_to_finish
from gpu_engine.kernels.activation import silu_and_mul_ref
from gpu_engine.kernels.kv_cache import UNIT_SCALE, check_kv_scale, to_cache
from gpu_engine.kernels.qkv_prep import _check as _check_prep
from gpu_engine.kernels.qkv_prep import _norm_rotate_values, qkv_prep_ref
from gpu_engine.kernels.rmsnorm import rms_norm_ref

MAX_ROWS = 128
SHARED_BYTES = 227 * 1024  # shared memory a block may take on sm_90


@triton.jit
def _x_tile(x_ptr, sx, m, k, M, K, SILU: tl.constexpr):
    mask = (m[:, None] < M) & (k[None, :] < K)
    ptrs = x_ptr + m[:, None] * sx + k[None, :]
    if SILU:
        g = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
        return (g / (1.0 + tl.exp(-g)) * u).to(x_ptr.dtype.element_ty)
    return tl.load(ptrs, mask=mask, other=0.0)


def linear_ref(x: torch.Tensor, w: torch.Tensor, act: str | None = None) -> torch.Tensor:
    """Plain PyTorch: F.linear(act(x), w) in fp32, rounded to x's dtype."""
    xf = x.float()
    if act == "silu_mul":
        g, u = xf.chunk(2, dim=-1)
        xf = (torch.nn.functional.silu(g) * u).to(x.dtype).float()
    return (xf @ w.float().T).to(x.dtype)



def check_linear(x: torch.Tensor, w: torch.Tensor, act: str | None, out: torch.Tensor | None, max_rows: int,
                 what: str, acts: tuple[str, ...] = ("silu_mul",)) -> tuple[int, int, int, torch.Tensor]:
    """The launcher's checks: x [M, K] (or [M, 2K] with
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


@triton.jit
def _weighted(x, gram, nw_ptr, k, K, PREC: tl.constexpr):
    """An x tile times the RMSNorm weight (rounded to x's dtype, for the dot), and its Gram product x @ x.T added into
    `gram` ([BLOCK_M, BLOCK_M] fp32), whose diagonal is the rows' sums of squares (`_diagonal`, once after the loop):
    the 1 / RMS scales the product after the loop (`_rms_scale`), so no pass over the rows comes before the weight's
    first tile. The squares taken as a second small dot keep x among the dot's operands: squared and summed in
    registers every step they cost the H200 1.7-1.8x the product's time (`scripts/norm_probe.py`: gate_up at one row
    102 us with the squares against 58 plain), the weight's product alone nothing there."""
    nw = tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    return (x.to(tl.float32) * nw[None, :]).to(x.dtype), gram + tl.dot(x, tl.trans(x), input_precision=PREC)


@triton.jit
def _diagonal(gram, BLOCK_M: tl.constexpr):
    """The [BLOCK_M] diagonal of a [BLOCK_M, BLOCK_M] tile."""
    i = tl.arange(0, BLOCK_M)
    return tl.sum(tl.where(i[:, None] == i[None, :], gram, 0.0), axis=1)


@triton.jit
def _rms_scale(sq, K, eps):
    """The [M, 1] factor 1 / RMS of the rows from their sums of squares over all of K."""
    return tl.rsqrt(sq / K + eps)[:, None]


@triton.jit
def _slices_rms_scale(sq_ptr, m, M, K, eps, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr):
    """`_rms_scale` from the slices' sums of squares ([SPLIT_K, M] at `sq_ptr`), summed in slice order."""
    sq = tl.zeros([BLOCK_M], tl.float32)
    for i in tl.static_range(SPLIT_K):
        sq += tl.load(sq_ptr + i * M + m, mask=m < M, other=0.0, cache_modifier=".cg")
    return _rms_scale(sq, K, eps)


@triton.jit
def _finish(optrs, omask, acc, acc_u, GLU: tl.constexpr, ADD: tl.constexpr):
    """A tile's output from its fp32 sums: rounded to the output dtype; with GLU silu(gate) * up of the two rounded
    sums (`kernels.activation`'s formula); with ADD added to what `optrs` holds (the residual stream) and rounded
    again, as `kernels.rmsnorm`'s residual add does. So each equals the unfused kernels' result."""
    y = acc.to(optrs.dtype.element_ty)
    if GLU:
        g = y.to(tl.float32)
        y = (g / (1.0 + tl.exp(-g)) * acc_u.to(optrs.dtype.element_ty).to(tl.float32)).to(optrs.dtype.element_ty)
    if ADD:
        r = tl.load(optrs, mask=omask, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) + r).to(optrs.dtype.element_ty)
    tl.store(optrs, y, mask=omask)


@triton.jit
def _store_slice(ws_ptr, s, m, n, M, N, omask, acc, acc_u, GLU: tl.constexpr):
    """Slice s's fp32 sums of an [M, N] tile into the workspace: a slice's partials [M, N], or with GLU the gate's
    then the up's, [M, 2N]."""
    width = 2 * N if GLU else N
    at = ws_ptr + s.to(tl.int64) * M * width + m[:, None].to(tl.int64) * width + n[None, :]
    tl.store(at, acc, mask=omask)
    if GLU:
        tl.store(at + N, acc_u, mask=omask)


@triton.jit
def _slice_totals(ws_ptr, m, n, M, N, omask, GLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  SPLIT_K: tl.constexpr):
    """The tile's sums over the SPLIT_K slices `_store_slice` wrote, (total, up's total with GLU), added in slice order
    whichever program adds them; the loads bypass L1 (`.cg`): other SMs wrote them."""
    width = 2 * N if GLU else N
    part = m[:, None].to(tl.int64) * width + n[None, :]
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    total_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for i in tl.static_range(SPLIT_K):
        total += tl.load(ws_ptr + i * M * width + part, mask=omask, other=0.0, cache_modifier=".cg")
        if GLU:
            total_u += tl.load(ws_ptr + i * M * width + part + N, mask=omask, other=0.0, cache_modifier=".cg")
    return total, total_u


@triton.jit
def _tiled_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, cnt_ptr, nw_ptr, M, N, K, sx, sw, so, k_split, eps,
                  SILU: tl.constexpr, GLU: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                  PREC: tl.constexpr):
    """Program (column tile pn, slice s of K)."""
    pn, s = tl.program_id(0), tl.program_id(1)
    n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    rows = w_ptr + n[:, None].to(tl.int64) * sw
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # GLU: the up half's sums (rows N.. of w)
    gram = tl.zeros([BLOCK_M, BLOCK_M], tl.float32)  # NORM: x @ x.T over this slice of K, the squares its diagonal
    k_lo = s * k_split  # k_split is a multiple of BLOCK_K: a tile never straddles two slices
    for k0 in range(k_lo, tl.minimum(k_lo + k_split, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        wmask = (n[:, None] < N) & (k[None, :] < K)
        w = tl.load(rows + k[None, :], mask=wmask, other=0.0)
        x = _x_tile(x_ptr, sx, m, k, M, K, SILU)
        if NORM:
            x, gram = _weighted(x, gram, nw_ptr, k, K, PREC)
        acc += tl.dot(x, tl.trans(w), input_precision=PREC)
        if GLU:
            w_u = tl.load(rows + N * sw + k[None, :], mask=wmask, other=0.0)
            acc_u += tl.dot(x, tl.trans(w_u), input_precision=PREC)
    omask = (m[:, None] < M) & (n[None, :] < N)
    optrs = out_ptr + m[:, None] * so + n[None, :]
    sq_rows = _diagonal(gram, BLOCK_M)
    if SPLIT_K == 1:
        if NORM:
            scale = _rms_scale(sq_rows, K, eps)
            acc, acc_u = acc * scale, acc_u * scale
        _finish(optrs, omask, acc, acc_u, GLU, ADD)
    else:
        sq_at = ws_ptr + SPLIT_K * M * (2 * N if GLU else N)  # NORM: the slices' [M] sums after their partials
        _store_slice(ws_ptr, s, m, n, M, N, omask, acc, acc_u, GLU)
        if NORM:
            tl.store(sq_at + s * M + m, sq_rows, mask=m < M)
        if last_to_finish(cnt_ptr + pn, SPLIT_K):
            total, total_u = _slice_totals(ws_ptr, m, n, M, N, omask, GLU, BLOCK_M, BLOCK_N, SPLIT_K)
            if NORM:
                scale = _slices_rms_scale(sq_at, m, M, K, eps, BLOCK_M, SPLIT_K)
                total, total_u = total * scale, total_u * scale
            _finish(optrs, omask, total, total_u, GLU, ADD)


@triton.jit
def _heads_finish(a1, a2, a3, head, m, M, out_ptr, so, pos_ptr, cache_ptr, kc_ptr, vc_ptr, slot_ptr, qw_ptr, kw_ptr,
                  HQ, HK, qk_eps, k_scale, v_scale, QK_NORM: tl.constexpr, D: tl.constexpr, ROT_HALF: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    """One head's columns of a qkv product (fp32 sums: first rotary half, second, pass-through; a row a token) as
    `qkv_prep` takes them after the product is rounded: a query head normalised (QK_NORM), rotated and stored into
    `out`'s row; a key head the same into the key cache at the row's slot; a value head as it is into the value
    cache (a negative slot writes nothing; an FP8 cache takes them as `to_cache` stores them, with `k_scale` /
    `v_scale`). Each branch stores through its own pointer: an FP8 cache's pointers are not `out`'s type."""
    dt = out_ptr.dtype.element_ty
    x1, x2, x3 = a1.to(dt).to(tl.float32), a2.to(dt).to(tl.float32), a3.to(dt).to(tl.float32)
    r = tl.arange(0, BLOCK_R)[None, :]
    p = tl.arange(0, BLOCK_P)[None, :]
    row = (m < M)[:, None]
    rm, pm = row & (r < ROT_HALF), row & (p < D - 2 * ROT_HALF)
    pos = tl.load(pos_ptr + m, mask=m < M, other=0)[:, None]
    cos = tl.load(cache_ptr + pos * (2 * ROT_HALF) + r, mask=rm, other=0.0)
    sin = tl.load(cache_ptr + pos * (2 * ROT_HALF) + ROT_HALF + r, mask=rm, other=0.0)
    if head < HQ:
        y1, y2, y3 = _norm_rotate_values(x1, x2, x3, qw_ptr, qk_eps, cos, sin, dt, QK_NORM, D, ROT_HALF, BLOCK_R,
                                         BLOCK_P)
        _store_head(out_ptr + m[:, None].to(tl.int64) * so + head * D, r, p, y1, y2, y3, rm, pm, 1.0, dt, ROT_HALF)
    else:
        slot = tl.load(slot_ptr + m, mask=m < M, other=-1)[:, None]
        rm, pm = rm & (slot >= 0), pm & (slot >= 0)
        if head < HQ + HK:
            y1, y2, y3 = _norm_rotate_values(x1, x2, x3, kw_ptr, qk_eps, cos, sin, dt, QK_NORM, D, ROT_HALF,
                                             BLOCK_R, BLOCK_P)
            _store_head(kc_ptr + slot * (HK * D) + (head - HQ) * D, r, p, y1, y2, y3, rm, pm, k_scale, dt, ROT_HALF)
        else:
            _store_head(vc_ptr + slot * (HK * D) + (head - HQ - HK) * D, r, p, x1, x2, x3, rm, pm, v_scale, dt,
                        ROT_HALF)


@triton.jit
def _store_head(dst, r, p, y1, y2, y3, rm, pm, scale, ACT: tl.constexpr, ROT_HALF: tl.constexpr):
    """A head's rotary halves and pass-through (fp32) rounded to the activation dtype ACT, stored as `dst`'s element
    type takes them (`to_cache`)."""
    dt = dst.dtype.element_ty
    tl.store(dst + r, to_cache(y1.to(ACT), scale, dt), mask=rm)
    tl.store(dst + ROT_HALF + r, to_cache(y2.to(ACT), scale, dt), mask=rm)
    tl.store(dst + 2 * ROT_HALF + p, to_cache(y3.to(ACT), scale, dt), mask=pm)


@triton.jit
def _tiled_heads_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, cnt_ptr, nw_ptr, pos_ptr, cache_ptr, kc_ptr, vc_ptr, slot_ptr,
                        qw_ptr, kw_ptr, M, K, HQ, HK, sx, sw, so, k_split, eps, qk_eps, k_scale, v_scale,
                        NORM: tl.constexpr, QK_NORM: tl.constexpr, D: tl.constexpr, ROT_HALF: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, PASS: tl.constexpr,
                        BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PREC: tl.constexpr):
    """The qkv product with `qkv_prep` as its output: program (head, slice) takes one head's D weight rows in three
    tiles (the rotary halves and the pass-through, PASS: whether the head has one, D > 2 x ROT_HALF), so the rotation
    pairs lie in one program; the sums of the slices of K meet as in `_tiled_kernel` (the workspace's columns are
    the product's)."""
    head, s = tl.program_id(0), tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    n1, n2, n3 = head * D + r, head * D + ROT_HALF + r, head * D + 2 * ROT_HALF + p
    rmask, pmask = r < ROT_HALF, p < D - 2 * ROT_HALF
    a1 = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    a2 = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    a3 = tl.zeros([BLOCK_M, BLOCK_P], tl.float32)
    gram = tl.zeros([BLOCK_M, BLOCK_M], tl.float32)
    k_lo = s * k_split
    for k0 in range(k_lo, tl.minimum(k_lo + k_split, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = _x_tile(x_ptr, sx, m, k, M, K, False)
        if NORM:
            x, gram = _weighted(x, gram, nw_ptr, k, K, PREC)
        kin = k[None, :] < K
        w1 = tl.load(w_ptr + n1[:, None].to(tl.int64) * sw + k[None, :], mask=rmask[:, None] & kin, other=0.0)
        w2 = tl.load(w_ptr + n2[:, None].to(tl.int64) * sw + k[None, :], mask=rmask[:, None] & kin, other=0.0)
        a1 += tl.dot(x, tl.trans(w1), input_precision=PREC)
        a2 += tl.dot(x, tl.trans(w2), input_precision=PREC)
        if PASS:  # a full rotary head has no pass-through columns: no load, no product
            w3 = tl.load(w_ptr + n3[:, None].to(tl.int64) * sw + k[None, :], mask=pmask[:, None] & kin, other=0.0)
            a3 += tl.dot(x, tl.trans(w3), input_precision=PREC)
    if SPLIT_K > 1:
        N = (HQ + 2 * HK) * D
        rows = m[:, None].to(tl.int64) * N
        rm, pm = (m[:, None] < M) & rmask[None, :], (m[:, None] < M) & pmask[None, :]
        at = ws_ptr + s.to(tl.int64) * M * N + rows
        tl.store(at + n1[None, :], a1, mask=rm)
        tl.store(at + n2[None, :], a2, mask=rm)
        if PASS:
            tl.store(at + n3[None, :], a3, mask=pm)
        if NORM:
            tl.store(ws_ptr + SPLIT_K * M * N + s * M + m, _diagonal(gram, BLOCK_M), mask=m < M)
        if last_to_finish(cnt_ptr + head, SPLIT_K):
            a1 = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
            a2 = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
            a3 = tl.zeros([BLOCK_M, BLOCK_P], tl.float32)
            for i in tl.static_range(SPLIT_K):  # slice order whichever program sums
                at = ws_ptr + i * M * N + rows
                a1 += tl.load(at + n1[None, :], mask=rm, other=0.0, cache_modifier=".cg")
                a2 += tl.load(at + n2[None, :], mask=rm, other=0.0, cache_modifier=".cg")
                if PASS:
                    a3 += tl.load(at + n3[None, :], mask=pm, other=0.0, cache_modifier=".cg")
            if NORM:
                scale = _slices_rms_scale(ws_ptr + SPLIT_K * M * N, m, M, K, eps, BLOCK_M, SPLIT_K)
                a1, a2, a3 = a1 * scale, a2 * scale, a3 * scale
            _heads_finish(a1, a2, a3, head, m, M, out_ptr, so, pos_ptr, cache_ptr, kc_ptr, vc_ptr, slot_ptr, qw_ptr,
                          kw_ptr, HQ, HK, qk_eps, k_scale, v_scale, QK_NORM, D, ROT_HALF, BLOCK_R, BLOCK_P)
    else:
        if NORM:
            scale = _rms_scale(_diagonal(gram, BLOCK_M), K, eps)
            a1, a2, a3 = a1 * scale, a2 * scale, a3 * scale
        _heads_finish(a1, a2, a3, head, m, M, out_ptr, so, pos_ptr, cache_ptr, kc_ptr, vc_ptr, slot_ptr, qw_ptr,
                      kw_ptr, HQ, HK, qk_eps, k_scale, v_scale, QK_NORM, D, ROT_HALF, BLOCK_R, BLOCK_P)


class Heads(NamedTuple):
    """Where a qkv product goes when `tiled_linear` applies `qkv_prep` as its output (`heads=`): the query heads,
    normalised (with `q_norm` and `k_norm`) and rotated, into the product's first num_heads x head_dim columns;
    the key and value heads into the paged caches at each row's slot, which is where attention reads them (caches of
    the product's dtype, or FP8 with `kv_scale`, their key and value scales)."""

    num_heads: int
    num_kv_heads: int
    positions: torch.Tensor
    cache: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    eps: float = 1e-6
    kv_scale: tuple[float, float] = UNIT_SCALE


class TiledConfig(NamedTuple):
    block_n: int
    block_k: int
    per_sm: int  # programs an SM runs at once, as `tiled_split` counts them when it splits K
    num_warps: int
    num_stages: int


# Named configurations, measured by `bench/kernels.py --only tiled`. Shared memory at 128 rows:
# num_stages x (128 + block_n) x block_k x 2 bytes, at most 196 KiB here (the H200 gives a block 227;
# `tiled_stages` takes fewer where the SiLU's tiles would not fit). Each program reads x whole from L2: M / block_n
# times the weight's bytes in all, so the wider tiles are for the larger steps.
TILED_CONFIGS = {
    "n64_k128_s4": TiledConfig(64, 128, 1, 4, 4), "n64_k128_s4_w8": TiledConfig(64, 128, 1, 8, 4),
    "n128_k64_s4_w8": TiledConfig(128, 64, 1, 8, 4), "n128_k128_s3_w8": TiledConfig(128, 128, 1, 8, 3),
    "n64_k64_s6": TiledConfig(64, 64, 1, 4, 6), "n64_k128_s4_x2": TiledConfig(64, 128, 2, 4, 4),
    "n32_k128_s4": TiledConfig(32, 128, 1, 4, 4), "n128_k64_s4_w8_x2": TiledConfig(128, 64, 2, 8, 4),
    "n256_k64_s4_w8": TiledConfig(256, 64, 1, 8, 4),
    # for 64-128 rows (not measured yet): stages and K tiles small enough that two programs share an SM (by the
    # formula above, 96 KB at 64 rows for the first, 96 KB at 128 for the other two), where those above hold one
    # from 64 rows and cuBLAS measured faster at 128
    "n64_k128_s3_x2": TiledConfig(64, 128, 2, 4, 3), "n64_k64_s4_x2": TiledConfig(64, 64, 2, 4, 4),
    "n128_k64_s3_w8_x2": TiledConfig(128, 64, 2, 8, 3),
}
MAX_SPLIT = 8


def tiled_split(N: int, K: int, block_n: int, block_k: int, per_sm: int, sms: int) -> tuple[int, int]:
    """(slices, slice width in K), the width a multiple of block_k. One slice where the column tiles alone fill
    the `per_sm` programs an SM runs at once (a split costs its partials' traffic); otherwise, of 1 to MAX_SPLIT
    slices, the one whose programs finish soonest (waves of tiles x slices programs, each 1 / slices of a tile's
    work), the fewest among equals. Depends on the shape and the device, never on M. E.g. on 132 SMs with
    64-column tiles: o and down (64 tiles) 2 slices, qkv (96) 4, gate_up (448) and lm_head 1."""
    tiles, slots = triton.cdiv(N, block_n), max(1, per_sm * sms)
    most = max(1, min(MAX_SPLIT, triton.cdiv(K, block_k))) if tiles < slots else 1
    want = min(range(1, most + 1), key=lambda n: (triton.cdiv(tiles * n, slots) / n, n))
    width = triton.cdiv(triton.cdiv(K, want), block_k) * block_k
    return triton.cdiv(K, width), width


def tiled_scratch(shapes, configs, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(workspace, counters) for launches of at most MAX_ROWS rows with any of `configs` (`TiledConfig`s) over
    weights of `shapes` ((N, K) pairs): fp32 partials for the widest split launch, and one zeroed int32 count a
    column tile, which every launch leaves zero. A runner allocates them once for all its launches, which run
    one after another, so that none needs a memset before it. A glu launch over a gate_up weight of shape (N, K) takes
    the same as a plain one: half the columns in tiles of half the width."""
    device = torch.device(device)
    parts, tiles = 1, 1
    for config in configs:
        for N, K in shapes:
            split, _ = tiled_split(N, K, config.block_n, config.block_k, config.per_sm, _sms(device))
            parts = max(parts, split * MAX_ROWS * (N + 1) if split > 1 else 1)  # + a fused norm's sums of squares
            tiles = max(tiles, triton.cdiv(N, config.block_n))
    return (torch.empty(parts, dtype=torch.float32, device=device),
            torch.zeros(tiles, dtype=torch.int32, device=device))


def tiled_stages(num_stages: int, block_m: int, block_n: int, block_k: int, silu: bool, itemsize: int,
                 budget: int = SHARED_BYTES) -> int:
    """`num_stages`, or fewer where that many stages of the x and w tiles (the gate and up tiles apart with the
    SiLU) would not fit in `budget` bytes of shared memory (a block's, by default). The depth changes no sum, only
    how many loads are in flight."""
    per_stage = (block_m * block_k * (2 if silu else 1) + block_n * block_k) * itemsize
    return max(1, min(num_stages, budget // per_stage))


def heads_stages(num_stages: int, block_m: int, block_r: int, block_p: int, block_k: int, itemsize: int) -> int:
    """The heads kernel's stages (`_tiled_heads`): its x tile and the head's rotary halves and pass-through (block_p
    0 for a full rotary head), within half a block's shared memory, for two programs an SM, unless that leaves
    fewer than two (128 rows): then within a block's, one program an SM with its loads still staged."""
    block_n = 2 * block_r + block_p
    two = tiled_stages(num_stages, block_m, block_n, block_k, False, itemsize, SHARED_BYTES // 2)
    return two if two >= 2 else tiled_stages(num_stages, block_m, block_n, block_k, False, itemsize)


def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _split_scratch(scratch: tuple[torch.Tensor, torch.Tensor] | None, split: int, parts: int, tiles: int,
                   out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(workspace, counters) for a launch of `split` slices that needs `parts` fp32 partials and `tiles` counts: the
    given `scratch`, checked, or (with None) its own; for a launch that does not split, `out` twice (unread)."""
    if split == 1:
        return out, out
    if scratch is None:
        return (torch.empty(parts, dtype=torch.float32, device=out.device),
                torch.zeros(tiles, dtype=torch.int32, device=out.device))
    ws, cnt = scratch
    check("workspace", ws, dtype=(torch.float32,), shape=(None,), device=out.device)
    check("counters", cnt, dtype=(torch.int32,), shape=(None,), device=out.device)
    if ws.numel() < parts or cnt.numel() < tiles:
        raise ValueError(f"scratch: {ws.numel()} partials and {cnt.numel()} counters, this launch needs {parts} and "
                         f"{tiles}")
    return ws, cnt


def tiled_linear(x: torch.Tensor, w: torch.Tensor, act: str | None = None, out: torch.Tensor | None = None,
                 block_n: int = 64, block_k: int = 128, per_sm: int = 1, num_warps: int = 4, num_stages: int = 4,
                 scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
                 norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None,
                 heads: Heads | None = None) -> torch.Tensor:
    """x [M, K] (or [M, 2K] with act="silu_mul") and w [N, K] (or [2N, K] with act="glu") -> out [M, N];
    M <= MAX_ROWS. The fused forms, each giving what the unfused kernels give (`tiled_ref`; the norm to rounding):

    - act="silu_mul": silu(x[:, :K]) * x[:, K:] taken as x, applied to each x tile as it is loaded.
    - act="glu": w is a gate_up weight, gate rows then up rows; out = silu(x @ gate.T) * (x @ up.T). Each program
      reads block_n / 2 gate rows and the matching up rows (the same tile as block_n plain rows), so the
      SiLU-and-multiply costs no launch and the [M, 2N] product is never written.
    - `norm` (weight [K], eps; x bf16 or fp32): x is the residual stream, and RMSNorm(x) * weight is what is
      multiplied, normalised tile by tile: each x tile times the norm's weight goes into the dot, the rows' sums
      of squares are taken from the same tiles (as the diagonal of x @ x.T, a second small dot: `_weighted`), and
      the product is scaled by 1 / RMS after the loop (by the last
      program, from the slices' sums, where K is split). So no pass over x comes before the weight's first tile;
      the result differs from the unfused kernels' by the rounding of the normalised x they make (within an ulp of
      the product's terms).
    - `residual` [M, N]: the output is added into it (rounded as `kernels.rmsnorm`'s residual add rounds) and it is
      returned; `out` is then unused.
    - `heads` (`Heads`): w is a qkv weight and the product goes through `qkv_prep` (QK norms, RoPE, the KV cache
      write) in the same launch; each program takes one head's rows (whatever block_n), and only the query columns
      of `out` are written.

    `scratch`: (workspace, counters) from `tiled_scratch`, large enough for N; without it a launch that splits K
    allocates its own (and zeroes its counters: a memset more)."""
    if block_n < 16 or block_k < 16 or block_n & (block_n - 1) or block_k & (block_k - 1):
        raise ValueError(f"block_n {block_n} and block_k {block_k} must be powers of two >= 16")
    glu = act == "glu"
    if residual is not None:
        if out is not None:
            raise ValueError("out: a launch with a residual writes into the residual")
        out = residual
    M, N, K, out = check_linear(x, w, act, out, MAX_ROWS, "the tiled linear", acts=("silu_mul", "glu"))
    if norm is not None:
        if act == "silu_mul":
            raise ValueError("norm: the fused RMSNorm takes a plain x, not silu_mul")
        if x.dtype == torch.float16:  # x * weight is rounded before 1 / RMS scales it: a large x passes 65,504
            raise ValueError("norm: the fused RMSNorm takes bf16 or fp32 (fp16 would overflow before the scale)")
        check("norm weight", norm[0], dtype=x.dtype, shape=(K,), device=x.device)
    if residual is not None and (residual.data_ptr() == x.data_ptr() or residual.data_ptr() == w.data_ptr()):
        raise ValueError("residual: must not alias x or w (it is written while they are read)")
    if M == 0 or N == 0:
        return out
    if heads is not None:
        if act is not None or residual is not None:
            raise ValueError("heads: the qkv_prep output takes a plain product, without act or residual")
        _tiled_heads(x, w, out, heads, norm, block_k, per_sm, num_warps, num_stages, scratch)
        return out
    silu = act == "silu_mul"
    grid = tiled_grid(M, N, K, TiledConfig(block_n, block_k, per_sm, num_warps, num_stages), x, glu, silu,
                      norm is not None)
    ws, cnt = _split_scratch(scratch, grid.split, grid.parts, grid.tiles, out)
    nw, eps = norm if norm is not None else (out, 0.0)
    _tiled_kernel[(grid.tiles, grid.split)](
        x, w, out, ws, cnt, nw, M, N, K, x.stride(0), w.stride(0), out.stride(0), grid.width, float(eps), SILU=silu,
        GLU=glu, NORM=norm is not None, ADD=residual is not None, BLOCK_M=grid.block_m, BLOCK_N=grid.tile_n,
        BLOCK_K=block_k, SPLIT_K=grid.split, PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=num_warps,
        num_stages=grid.stages,
    )
    return out


class TiledGrid(NamedTuple):
    """How a tiled launch of an [M, K] x [N, K] product is cut (`tiled_grid`)."""

    tile_n: int  # output columns a program takes
    split: int  # slices of K
    width: int  # a slice's width
    tiles: int  # column tiles
    parts: int  # fp32 partials of a split launch (the norm's sums of squares included)
    block_m: int
    stages: int


def tiled_grid(M: int, N: int, K: int, config: TiledConfig, x: torch.Tensor, glu: bool = False, silu: bool = False,
               norm: bool = False) -> TiledGrid:
    """The cut of `tiled_linear`'s launch with `config` (N output columns: half the weight's rows with glu)."""
    tile_n = config.block_n // 2 if glu else config.block_n  # glu: half its weight rows a program
    split, width = tiled_split(N, K, tile_n, config.block_k, config.per_sm, _sms(x.device))
    block_m = max(16, triton.next_power_of_2(M))
    return TiledGrid(tile_n, split, width, triton.cdiv(N, tile_n), split * M * (N * (2 if glu else 1) + int(norm)),
                     block_m, tiled_stages(config.num_stages, block_m, config.block_n, config.block_k, silu,
                                           x.element_size()))


class HeadsGrid(NamedTuple):
    """How a tiled launch of a qkv product with its heads out is cut (`heads_grid`)."""

    D: int
    split: int
    width: int
    parts: int
    rot_half: int
    block_m: int
    block_r: int
    block_p: int
    passing: bool  # whether a head has pass-through columns (a partial rotary)
    stages: int
    warps: int


def heads_warps(rows: int, config: TiledConfig) -> int:
    """The heads kernel's warps for a step of `rows` rows: 8 from 64 padded rows (33 rows and more), where its
    three accumulators and the rotation would spill at 4, else the configuration's."""
    return max(config.num_warps, 8) if max(16, triton.next_power_of_2(rows)) >= 64 else config.num_warps


def heads_grid(x: torch.Tensor, w: torch.Tensor, heads: Heads, norm: bool, config: TiledConfig) -> HeadsGrid:
    """The cut of `tiled_linear`'s launch with `heads` and `config` (checked: the heads divide the product)."""
    (M, K), N = x.shape, w.shape[0]
    HQ, HK = heads.num_heads, heads.num_kv_heads
    D = N // max(1, HQ + 2 * HK)
    if HQ <= 0 or HK <= 0 or (HQ + 2 * HK) * D != N:
        raise ValueError(f"heads: {HQ} query and {HK} KV heads do not divide the product's {N} columns")
    split, width = tiled_split(N, K, D, config.block_k, config.per_sm, _sms(x.device))
    rot_half = heads.cache.shape[1] // 2
    block_m = max(16, triton.next_power_of_2(M))
    block_r, block_p = max(16, triton.next_power_of_2(rot_half)), max(16, triton.next_power_of_2(D - 2 * rot_half))
    passing = D > 2 * rot_half
    # Its three accumulators and the rotation take about 250 registers a thread at 4 warps (`heads_warps`). Shared
    # memory for two programs an SM where that leaves two stages (`heads_stages`): at one row the launch is 48 heads
    # x 8 slices on the H200, which one program an SM would run in three waves.
    return HeadsGrid(D, split, width, split * M * (N + int(norm)), rot_half, block_m, block_r, block_p, passing,
                     heads_stages(config.num_stages, block_m, block_r, block_p if passing else 0, config.block_k,
                                  x.element_size()), heads_warps(M, config))


def _tiled_heads(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, heads: Heads,
                 norm: tuple[torch.Tensor, float] | None, block_k: int, per_sm: int, num_warps: int, num_stages: int,
                 scratch: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """`tiled_linear` with `heads`: checks, then `_tiled_heads_kernel` (a program a head and slice of K)."""
    M = x.shape[0]
    HQ, HK = heads.num_heads, heads.num_kv_heads
    g = heads_grid(x, w, heads, norm is not None, TiledConfig(0, block_k, per_sm, num_warps, num_stages))
    D = g.D
    q = out[:, : HQ * D].view(M, HQ, D)
    _check_prep(q, out[:, HQ * D: (HQ + HK) * D].view(M, HK, D), out[:, (HQ + HK) * D:].view(M, HK, D),
                heads.positions, heads.cache, heads.k_cache, heads.v_cache, heads.slot_mapping, heads.q_norm,
                heads.k_norm)
    ks, vs = check_kv_scale(heads.kv_scale)
    ws, cnt = _split_scratch(scratch, g.split, g.parts, HQ + 2 * HK, out)
    nw, eps = norm if norm is not None else (out, 0.0)
    qk = heads.q_norm is not None
    _tiled_heads_kernel[(HQ + 2 * HK, g.split)](
        x, w, out, ws, cnt, nw, heads.positions, heads.cache, heads.k_cache, heads.v_cache, heads.slot_mapping,
        heads.q_norm if qk else out, heads.k_norm if qk else out, M, x.shape[1], HQ, HK, x.stride(0), w.stride(0),
        out.stride(0), g.width, float(eps), float(heads.eps), ks, vs, NORM=norm is not None, QK_NORM=qk, D=D,
        ROT_HALF=g.rot_half, BLOCK_M=g.block_m, BLOCK_R=g.block_r, BLOCK_P=g.block_p, PASS=g.passing,
        BLOCK_K=block_k, SPLIT_K=g.split, PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=g.warps,
        num_stages=g.stages,
    )


def tiled_ref(x: torch.Tensor, w: torch.Tensor, act: str | None = None, norm: tuple[torch.Tensor, float] | None = None,
              residual: torch.Tensor | None = None, heads: Heads | None = None) -> torch.Tensor:
    """Plain PyTorch for every form of `tiled_linear`: the unfused steps in turn, each rounded to x's dtype (a new
    tensor: `residual` is not written). With `heads`, the product with its query heads as `qkv_prep_ref` leaves
    them (the caches written as it writes them)."""
    if norm is not None:
        x = rms_norm_ref(x, norm[0], norm[1])[0]
    y = linear_ref(x, w, act if act == "silu_mul" else None)
    if act == "glu":
        y = silu_and_mul_ref(y)
    if residual is not None:
        y = (y.float() + residual.float()).to(y.dtype)
    if heads is not None:
        HQ, HK = heads.num_heads, heads.num_kv_heads
        D, M = y.shape[1] // (HQ + 2 * HK), y.shape[0]
        q, k, v = y[:, : HQ * D].view(M, HQ, D), y[:, HQ * D: (HQ + HK) * D].view(M, HK, D), y[:, (HQ + HK) * D:]
        y[:, : HQ * D] = qkv_prep_ref(q, k, v.reshape(M, HK, D), heads.positions, heads.cache, heads.k_cache,
                                      heads.v_cache, heads.slot_mapping, heads.q_norm, heads.k_norm,
                                      heads.eps, heads.kv_scale).reshape(M, HQ * D)
    return y
