"""Paged attention: decode (one query per sequence, split over the context) and packed varlen prefill.

Both read K/V from the paged cache [num_blocks, block_size, Hkv, D] through block tables
[B, max_blocks] (int32, -1 padded); `context_lens[B]` counts the tokens in the cache after this
step (the new tokens included, already written). GQA: query head h reads KV head h // (Hq // Hkv).
Softmax runs in the exp2 domain in fp32.

An FP8 cache (`kernels.kv_cache.FP8_KV`) is read as its codes widened to the queries' dtype (exact), its scales
applied outside the products: the key scale to the scores (folded into the softmax scale), the value scale to each
output sum (`_v_scaled`). A cache of the queries' dtype runs the same code as before the FP8 form.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from gpu_engine.kernels._checks import FLOAT_DTYPES, check, next_pow2
from gpu_engine.kernels._sync import last_to_finish
from gpu_engine.kernels.kv_cache import UNIT_SCALE, check_kv_caches, check_kv_scale, dequantize_kv_ref

LOG2E = 1.4426950408889634
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _load_kv_tile(c_ptr, bt_ptr, n, valid, kvh, d, HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr):
    """Gather [BLOCK_N, BLOCK_D] rows of one KV head for logical token indices `n` (in the cache's dtype)."""
    blk = tl.load(bt_ptr + n // BS, mask=valid, other=0).to(tl.int64)
    row = (blk * BS + n % BS) * (HKV * D) + kvh * D
    return tl.load(c_ptr + row[:, None] + d[None, :], mask=valid[:, None] & (d[None, :] < D), other=0.0)


@triton.jit
def _online_step(q, kc_ptr, vc_ptr, bt_row, n, valid, vis, kvh, d, acc, m, lsum, scale_log2, HKV: tl.constexpr,
                 D: tl.constexpr, BS: tl.constexpr, PREC: tl.constexpr, MASK: tl.constexpr):
    """One K/V tile (tokens `n`) folded into a running online softmax (exp2 domain, fp32), scores masked to `vis`
    where MASK. A tile every row sees whole skips the mask, and gives the same bits as with it: the mask only picks
    which scores enter the max and zeroes the masked terms after the exp2, whose argument is one explicit fma either
    way (left to the compiler, a multiply and a subtract are contracted or not depending on what lies between them;
    they then differ in the last bit)."""
    k = _load_kv_tile(kc_ptr, bt_row, n, valid, kvh, d, HKV, D, BS).to(q.dtype)  # FP8: exact; else no-op
    qk = tl.dot(q, tl.trans(k), input_precision=PREC)
    sc = qk * scale_log2
    if MASK:
        sc = tl.where(vis, sc, float("-inf"))
    m_new = tl.maximum(m, tl.max(sc, axis=1))
    p = tl.exp2(tl.fma(qk, scale_log2, -m_new[:, None]))
    if MASK:
        p = tl.where(vis, p, 0.0)
    alpha = tl.exp2(m - m_new)
    v = _load_kv_tile(vc_ptr, bt_row, n, valid, kvh, d, HKV, D, BS).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return acc, m_new, lsum * alpha + tl.sum(p, axis=1)


@triton.jit
def _v_scaled(acc, v_scale, vc_ptr):
    """An unnormalised output sum of an FP8 cache's value codes times the value scale; any other cache's as it is
    (the same code as without FP8)."""
    if vc_ptr.dtype.element_ty == tl.float8e4nv:
        acc = acc * v_scale
    return acc


@triton.jit
def _merge_step(acc, m, lsum, acc_s, m_s, l_s):
    """Fold split s's (unnormalised output, max, sum) into the running ones: the one merge formula, whether the
    splits come from the fold kernel or from the last program of a row."""
    m_new = tl.maximum(m, m_s)
    a = tl.exp2(m - m_new)
    b = tl.exp2(m_s - m_new)
    return acc * a[:, None] + acc_s * b[:, None], m_new, lsum * a + l_s * b


@triton.jit
def _store_folded(out_ptr, b, so_b, so_h, heads, d, omask, run_acc, run_l):
    """The folded output of a row's G heads, normalised (a row that folded nothing gets zeros)."""
    o_ptrs = out_ptr + b * so_b + heads[:, None] * so_h + d[None, :]
    tl.store(o_ptrs, (run_acc / tl.maximum(run_l, 1e-30)[:, None]).to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _fold_splits(po_ptr, pm_ptr, pl_ptr, base, n_active, d, gmask, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """The (unnormalised output, sum) of a row's first `n_active` split partials folded in split order by
    `_merge_step`. Loads bypass L1 (`.cg`): other SMs wrote the partials."""
    run_acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    run_m = tl.full([BLOCK_G], NEG_BIG, tl.float32)
    run_l = tl.zeros([BLOCK_G], tl.float32)
    for s in range(0, n_active):
        acc = tl.load(po_ptr + (base + s)[:, None] * BLOCK_D + d[None, :], mask=gmask[:, None], other=0.0,
                      cache_modifier=".cg")
        m = tl.load(pm_ptr + base + s, mask=gmask, other=NEG_BIG, cache_modifier=".cg")
        lsum = tl.load(pl_ptr + base + s, mask=gmask, other=0.0, cache_modifier=".cg")
        run_acc, run_m, run_l = _merge_step(run_acc, run_m, run_l, acc, m, lsum)
    return run_acc, run_l


@triton.jit
def _split_sums(q, kc_ptr, vc_ptr, bt_row, s, n_ctx, kvh, d, scale_log2, v_scale, HKV: tl.constexpr,
                D: tl.constexpr,
                BS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, PART: tl.constexpr,
                BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    """Split s's online softmax of the G query heads over its tokens (exp2 domain, fp32): (unnormalised output,
    max, sum); an FP8 cache's output times `v_scale`."""
    start = s * PART
    end = tl.minimum(start + PART, n_ctx)
    m = tl.full([BLOCK_G], NEG_BIG, tl.float32)
    lsum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < end
        acc, m, lsum = _online_step(q, kc_ptr, vc_ptr, bt_row, n, valid, valid[None, :], kvh, d, acc, m, lsum,
                                    scale_log2, HKV, D, BS, PREC, True)
    return _v_scaled(acc, v_scale, vc_ptr), m, lsum


@triton.jit
def _store_partial(po_ptr, pm_ptr, pl_ptr, b, heads, s, d, gmask, acc, m, lsum, NSPLIT, HKV: tl.constexpr,
                   G: tl.constexpr, BLOCK_D: tl.constexpr):
    """Split s's (unnormalised output, max, sum) of a row's G heads, for the fold."""
    at = (b * (HKV * G) + heads) * NSPLIT + s
    tl.store(po_ptr + at[:, None] * BLOCK_D + d[None, :], acc, mask=gmask[:, None])
    tl.store(pm_ptr + at, m, mask=gmask)
    tl.store(pl_ptr + at, lsum, mask=gmask)


@triton.jit
def _finish_splits(po_ptr, pm_ptr, pl_ptr, out_ptr, cnt_ptr, b, kvh, s, n_ctx, so_b, so_h, NSPLIT, heads, d, gmask,
                   omask, run_acc, run_l, HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_D: tl.constexpr, PART: tl.constexpr, FORM: tl.constexpr):
    """After split s's program: "last", the last of the (row, KV head)'s programs that computed a split to finish
    folds the row's partials and stores its output; "split" leaves them to `_fold_kernel`."""
    if FORM == "last":
        # the splits that have a program (a context past the block table's would leave a count never reset)
        n_active = tl.minimum(tl.cdiv(n_ctx, PART), NSPLIT)
        if s < n_active:
            if last_to_finish(cnt_ptr + b * HKV + kvh, n_active):
                base = (b * (HKV * G) + heads) * NSPLIT
                run_acc, run_l = _fold_splits(po_ptr, pm_ptr, pl_ptr, base, n_active, d, gmask, BLOCK_G, BLOCK_D)
                _store_folded(out_ptr, b, so_b, so_h, heads, d, omask, run_acc, run_l)
        elif s == 0:  # an empty row (padding): zeros, as the fold of nothing gives
            _store_folded(out_ptr, b, so_b, so_h, heads, d, omask, run_acc, run_l)


@triton.jit
def _decode_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, po_ptr, pm_ptr, pl_ptr, out_ptr, cnt_ptr,
    sq_b, sq_h, sbt_b, so_b, so_h, scale_log2, v_scale, NSPLIT,
    HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, G: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, PART: tl.constexpr, BLOCK_N: tl.constexpr,
    FORM: tl.constexpr, PREC: tl.constexpr,
):
    """Program (row b, KV head kvh, split s) computes split s and writes its partial. By FORM: "split", for
    `_fold_kernel`; "last", and the last of a (row, KV head)'s programs to finish (an atomic count a pair, which it
    resets for the next launch) folds the partials as `_fold_kernel` does, in one launch."""
    b, kvh, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * G + g
    gmask = g < G
    omask = gmask[:, None] & (d[None, :] < D)
    n_ctx = tl.load(ctx_ptr + b)
    run_acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    run_l = tl.zeros([BLOCK_G], tl.float32)
    q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=omask, other=0.0)
    bt_row = bt_ptr + b.to(tl.int64) * sbt_b
    if s < tl.cdiv(n_ctx, PART):  # a split past the row's context has nothing to compute
        acc, m, lsum = _split_sums(q, kc_ptr, vc_ptr, bt_row, s, n_ctx, kvh, d, scale_log2, v_scale, HKV, D, BS,
                                   BLOCK_G, BLOCK_D, PART, BLOCK_N, PREC)
        _store_partial(po_ptr, pm_ptr, pl_ptr, b, heads, s, d, gmask, acc, m, lsum, NSPLIT, HKV, G, BLOCK_D)
    _finish_splits(po_ptr, pm_ptr, pl_ptr, out_ptr, cnt_ptr, b, kvh, s, n_ctx, so_b, so_h, NSPLIT, heads, d, gmask,
                   omask, run_acc, run_l, HKV, G, BLOCK_G, BLOCK_D, PART, FORM)


@triton.jit
def _fold_row(po_ptr, pm_ptr, pl_ptr, out_ptr, b, kvh, n_active, so_b, so_h, NSPLIT, HKV: tl.constexpr,
              D: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """The output of a row's G heads from its first `n_active` split partials."""
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * G + g
    gmask = g < G
    base = (b * (HKV * G) + heads) * NSPLIT
    run_acc, run_l = _fold_splits(po_ptr, pm_ptr, pl_ptr, base, n_active, d, gmask, BLOCK_G, BLOCK_D)
    _store_folded(out_ptr, b, so_b, so_h, heads, d, gmask[:, None] & (d[None, :] < D), run_acc, run_l)


@triton.jit
def _fold_kernel(po_ptr, pm_ptr, pl_ptr, ctx_ptr, out_ptr, so_b, so_h, NSPLIT, HKV: tl.constexpr, D: tl.constexpr,
                 G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, PART: tl.constexpr):
    """Program (row b, KV head): the row's split partials folded in split order by `_merge_step`, as the "last" form
    folds them, so the output has the same bits in both forms."""
    b = tl.program_id(0)
    # the splits that have partials: a context past the block table's (NSPLIT splits) has none beyond them, as the
    # "last" form counts them
    n_active = tl.minimum(tl.cdiv(tl.load(ctx_ptr + b), PART), NSPLIT)
    _fold_row(po_ptr, pm_ptr, pl_ptr, out_ptr, b, tl.program_id(1), n_active, so_b, so_h, NSPLIT, HKV, D, G, BLOCK_G,
              BLOCK_D)


def _gather_kv(k_cache, v_cache, block_table, n_tokens, kv_scale):
    bs = k_cache.shape[1]
    idx = torch.arange(n_tokens, device=k_cache.device)
    blocks = block_table[idx // bs].long()
    k, v = k_cache[blocks, idx % bs], v_cache[blocks, idx % bs]
    return dequantize_kv_ref(k, kv_scale[0]), dequantize_kv_ref(v, kv_scale[1])


def _attend_ref(q, k, v, scale, q_pos):
    """q [M, H, D], k/v [N, Hkv, D]; query i sees keys 0..q_pos[i]. fp32 result [M, H, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("mhd,nhd->hmn", q.float(), k) * scale
    causal = torch.arange(k.shape[0], device=q.device)[None, :] > q_pos[:, None]
    s = s.masked_fill(causal[None], float("-inf"))
    return torch.einsum("hmn,nhd->mhd", s.softmax(-1), v)


def decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale,
                         kv_scale: tuple[float, float] = UNIT_SCALE) -> torch.Tensor:
    """Plain PyTorch: q [B, H, D] -> [B, H, D]; an FP8 cache read as its codes times `kv_scale` (fp32)."""
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        if n == 0:
            continue
        k, v = _gather_kv(k_cache, v_cache, block_tables[b], n, kv_scale)
        pos = torch.tensor([n - 1], device=q.device)
        out[b] = _attend_ref(q[b : b + 1], k, v, scale, pos)[0].to(q.dtype)
    return out


def prefill_attention_ref(q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, scale,
                          kv_scale: tuple[float, float] = UNIT_SCALE):
    """Plain PyTorch: packed q [T, H, D] -> [T, H, D], causal, cached prefix included; an FP8 cache as in
    `decode_attention_ref`."""
    out = torch.zeros_like(q)
    for b in range(block_tables.shape[0]):
        lo, hi = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        n = int(context_lens[b])
        if hi == lo:
            continue
        k, v = _gather_kv(k_cache, v_cache, block_tables[b], n, kv_scale)
        pos = torch.arange(n - (hi - lo), n, device=q.device)
        out[lo:hi] = _attend_ref(q[lo:hi], k, v, scale, pos).to(q.dtype)
    return out


@triton.jit
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, cu_ptr, out_ptr,
    sq_t, sq_h, so_t, so_h, sbt_b, scale_log2, v_scale, NB, T,
    HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WHOLE: tl.constexpr, PREC: tl.constexpr,
    PACKED: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """Program (query tile mt, query head h, sequence b). WHOLE: the K/V tiles every row of the query tile sees
    whole skip the causal select (the same bits, `_online_step`). PACKED: the grid is (the step's query tiles
    packed one sequence after another, heads), and each program finds its sequence and tile from the step's
    `cu` (a prefix sum of the sequences' tile counts); otherwise (tile, head, sequence), where every sequence gets
    the longest one's tiles and those past its own rows return at once. Sequence NB is the padding rows past the
    last sequence, up to T. A tile's rows and their sums are the same either way, so are the bits."""
    if PACKED:
        p = tl.program_id(0)
        h = tl.program_id(1)
        i = tl.arange(0, BLOCK_B)
        lo = tl.load(cu_ptr + i, mask=i <= NB, other=0)
        hi = tl.load(cu_ptr + i + 1, mask=i < NB, other=T)
        tiles = tl.where(i <= NB, (hi - lo + BLOCK_M - 1) // BLOCK_M, 0)
        ends = tl.cumsum(tiles, 0)
        b = tl.sum((ends <= p).to(tl.int32))
        if b > NB:  # past the step's last tile: the grid is sized for the most tiles a step of T rows can have
            return
        mt = p - tl.sum(tl.where(i == b, ends - tiles, 0))
    else:
        mt = tl.program_id(0)
        h = tl.program_id(1)
        b = tl.program_id(2)
    d = tl.arange(0, BLOCK_D)
    tok = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    if b == NB:  # rows past the last sequence (padding) get zeros, never stale memory
        rows = tl.load(cu_ptr + NB) + tok
        zeros = tl.zeros([BLOCK_M, BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * so_t + h * so_h + d[None, :], zeros,
                 mask=(rows[:, None] < T) & (d[None, :] < D))
        return
    q_lo = tl.load(cu_ptr + b)
    qlen = tl.load(cu_ptr + b + 1) - q_lo
    if mt * BLOCK_M >= qlen:
        return
    ctx = tl.load(ctx_ptr + b)
    qpos = ctx - qlen + tok
    rows = (q_lo + tok).to(tl.int64)
    rmask = (tok[:, None] < qlen) & (d[None, :] < D)
    q = tl.load(q_ptr + rows[:, None] * sq_t + h * sq_h + d[None, :], mask=rmask, other=0.0)
    kvh = h // G
    bt_row = bt_ptr + b.to(tl.int64) * sbt_b
    m = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    lsum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(ctx, ctx - qlen + (mt + 1) * BLOCK_M)
    # tiles wholly at or before the tile's first query position: every row sees all of them, no causal select
    whole = 0
    if WHOLE:
        whole = (ctx - qlen + mt * BLOCK_M + 1) // BLOCK_N * BLOCK_N
    for n0 in range(0, whole, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        acc, m, lsum = _online_step(q, kc_ptr, vc_ptr, bt_row, n, n < hi, None, kvh, d, acc, m, lsum, scale_log2,
                                    HKV, D, BS, PREC, False)
    for n0 in range(whole, hi, BLOCK_N):  # the diagonal: each row sees the tokens up to its own position
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < hi
        acc, m, lsum = _online_step(q, kc_ptr, vc_ptr, bt_row, n, valid, (n[None, :] <= qpos[:, None]) & valid[None, :],
                                    kvh, d, acc, m, lsum, scale_log2, HKV, D, BS, PREC, True)
    out = _v_scaled(acc, v_scale, vc_ptr) / tl.maximum(lsum, 1e-30)[:, None]
    o_ptrs = out_ptr + rows[:, None] * so_t + h * so_h + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=rmask)


def _check_paged(q, k_cache, v_cache, block_tables, context_lens, n_seqs: int):
    check("q", q, dtype=FLOAT_DTYPES)
    if q.dim() != 3:
        raise ValueError(f"q: expected 3 dims, got {tuple(q.shape)}")
    D = q.shape[2]
    check_kv_caches(k_cache, v_cache, q.dtype, (None, None, None, D), q.device)
    hkv = k_cache.shape[2]
    if q.shape[1] % hkv:
        raise ValueError(f"q heads {q.shape[1]} not a multiple of KV heads {hkv}")
    check("block_tables", block_tables, dtype=torch.int32, shape=(n_seqs, None), device=q.device)
    check("context_lens", context_lens, dtype=torch.int32, shape=(n_seqs,), device=q.device)


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_partition(batch: int, kv_heads: int) -> int:
    """Context tokens per split for a decode graph of `batch` rows: one size for every batch. A row's split
    (so its fp32 sums) must not depend on the batch it runs in, or a request's greedy tokens would depend on its
    neighbours."""
    del batch, kv_heads
    return 256


DECODE_FORMS = ("split", "last")
# Decode steps of at most this many rows fold their splits in the split launch ("last") when the runner fuses
# (`KernelPlan.fused`); larger ones keep the fold's own launch. An earlier one-launch fold measured level with
# two launches at batch 1 and up to 25% slower at batches 8-64 on the H200 (a serial merge after the last split,
# and its registers in every program).
LAST_FOLD_ROWS = 1


def decode_partials(q: torch.Tensor, hkv: int, table_tokens: int,
                    partition_size: int) -> tuple[int, tuple[torch.Tensor, ...], dict[str, Any]]:
    """(splits of a block table of `table_tokens` tokens, the split partials (output, max, sum), the decode kernel's
    shape constants) for queries `q` [B, H, D] over `hkv` KV heads."""
    B, H, D = q.shape
    nsplit, bd = triton.cdiv(table_tokens, partition_size), next_pow2(D)
    po = torch.empty((B, H, nsplit, bd), dtype=torch.float32, device=q.device)
    pm = torch.empty((B, H, nsplit), dtype=torch.float32, device=q.device)
    consts = {"HKV": hkv, "D": D, "G": H // hkv, "BLOCK_G": max(16, next_pow2(H // hkv)), "BLOCK_D": bd,
              "PART": partition_size}
    return nsplit, (po, pm, torch.empty_like(pm)), consts


def decode_attention(
    q, k_cache, v_cache, block_tables, context_lens, scale: float,
    out: torch.Tensor | None = None, partition_size: int = 256, block_n: int = 128, form: str = "split",
    num_warps: int = 4, num_stages: int | None = None, counters: torch.Tensor | None = None,
    kv_scale: tuple[float, float] = UNIT_SCALE,
) -> torch.Tensor:
    """q [B, H, D] -> out [B, H, D]; the context is split in `partition_size` chunks, each reduced by an online
    softmax over `block_n`-token tiles, then the splits are folded in order (`_merge_step`). `num_warps` and
    `num_stages` (Triton's default where None) are the split kernel's, for the benchmark's sweep: its K and V tiles
    are staged in shared memory `num_stages` deep, which bounds how many programs an SM holds.

    Each program computes all the query heads of one KV head (GQA), so each K/V tile is read once. `form`
    (`_decode_kernel`): "split", a program per (row, KV head, split) writes partials and a second launch folds them;
    "last", the same programs, the last of each (row, KV head) to finish folding them, in one launch (`counters`: an
    int32 count per (row, KV head), zero, which every launch leaves zero; allocated when None, a memset more). Both
    give the same bits; only the split size and the tile size change a sum, and they are the same for every batch.
    Of 32-, 64- and 128-token tiles, 128 measured fastest in 8 of 10 cells (batches 1-128, contexts 512 and 2,048, 8
    and 4 KV heads) and within 3% in the other two on the H200 (`bench/kernels.py`, bf16). "last" measured level
    with "split" at batch 1 (7.5 against 7.7 us a layer at context 512). The caches are q's dtype or FP8 (`kv_scale`:
    their key and value scales)."""
    B = q.shape[0] if q.dim() == 3 else -1
    _check_paged(q, k_cache, v_cache, block_tables, context_lens, B)
    H, D = q.shape[1], q.shape[2]
    out = torch.empty_like(q) if out is None else out
    check("out", out, dtype=q.dtype, shape=(B, H, D), device=q.device)
    if partition_size % block_n:
        raise ValueError("partition_size must be a multiple of block_n")
    if form not in DECODE_FORMS:
        raise ValueError(f"form must be one of {DECODE_FORMS}, got {form!r}")
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    ks, vs = check_kv_scale(kv_scale)
    nsplit, (po, pm, pl), consts = decode_partials(q, hkv, block_tables.shape[1] * bs, partition_size)
    if form == "last":
        if counters is None:
            counters = torch.zeros(max(B, 1) * hkv, dtype=torch.int32, device=q.device)
        check("counters", counters, dtype=(torch.int32,), shape=(None,), device=q.device)
        if counters.numel() < B * hkv:
            raise ValueError(f"counters: {counters.numel()}, this launch needs {B * hkv} (rows x KV heads)")
    if B == 0:
        return out
    _decode_kernel[(B, hkv, nsplit)](
        q, k_cache, v_cache, block_tables, context_lens, po, pm, pl, out, out if counters is None else counters,
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1), scale * LOG2E * ks, vs,
        nsplit,
        BS=bs, BLOCK_N=block_n, FORM=form, PREC=_prec(q.dtype), num_warps=num_warps, **consts,
        **({} if num_stages is None else {"num_stages": num_stages}),
    )
    if form == "split":
        _fold_kernel[(B, hkv)](po, pm, pl, context_lens, out, out.stride(0), out.stride(1), nsplit, num_warps=4,
                               **consts)
    return out


def prefill_block_m(tokens: int) -> int:
    """Query rows a prefill program takes for a step of `tokens` rows: 64 (16 for a short chunk), over 64-token K/V
    tiles and 2 stages, for every dtype. On the H200 (`bench/kernels.py --only prefill`, bf16, BENCHMARKS.md)
    128-row tiles were 15-22% slower over 64-token K/V tiles and level to 13% slower over 128-token ones, 3 stages
    level, 64-row tiles over 128-token K/V tiles 28-58% slower. A row's result depends on the K/V tile size only
    (its tiles are summed in order from token 0), not on which rows share its tile, so chunk size and tile height
    do not change its bits."""
    return 16 if tokens < 64 else 64


# Steps of at most this many sequences take the sequence grid, more the packed one (`prefill_grid`).
SEQ_GRID_SEQS = 4


def prefill_grid(sequences: int) -> str:
    """The prefill attention's grid for a step of `sequences` sequences (its block tables' rows, decode rows
    included): "seq" up to `SEQ_GRID_SEQS`, else "packed". Both give the same bits, so a step's size may choose.
    Measured on an H100 (`bench/kernels.py --only prefill`, BENCHMARKS.md): one sequence of 2,048 or 8,192 tokens
    and a 2,048-token chunk took 11-13% less time on the sequence grid, four prompts of 512 5% less; a mixed step's
    896-token chunk beside 128 decode rows 54% less on the packed grid (46.7 against 101.5 us a layer)."""
    return "seq" if sequences <= SEQ_GRID_SEQS else "packed"


def prefill_attention(
    q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, scale: float,
    out: torch.Tensor | None = None, max_seqlen_q: int | None = None, block_m: int | None = None,
    block_n: int = 64, num_warps: int | None = None, num_stages: int = 2, whole_tiles: bool = True,
    kv_scale: tuple[float, float] = UNIT_SCALE,
    grid: str = "auto",
) -> torch.Tensor:
    """Packed q [T, H, D] (sequence b owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1]) -> out [T, H, D].

    `max_seqlen_q` bounds one sequence's query length (default T); it sizes the "seq" grid, so no host
    sync is needed and the launch can be captured in a graph (the "packed" one is sized by T and B alone).
    `block_m` left None: `prefill_block_m`.
    `whole_tiles`: each program walks first the K/V tiles every row of its query tile sees whole (no causal
    select), then the diagonal ones; off, every tile takes the select (the former form, kept to be measured
    against). It does not change a bit of the output. The caches are q's dtype or FP8 (`kv_scale`: their key and
    value scales).

    `grid`: "packed" (a program per query tile of the step, tiles of one sequence after another, and head; at
    most cdiv(T, block_m) + B + 1 tiles) or "seq" (a program per (tile, head, sequence), every sequence given
    cdiv(max_seqlen_q, block_m) tiles: in a mixed step of 128 decode rows and a chunk, over 130 times the
    programs with work, the rest returning at once). Both give the same bits. "auto": `prefill_grid(B)`.
    """
    B = block_tables.shape[0]
    _check_paged(q, k_cache, v_cache, block_tables, context_lens, B)
    T, H, D = q.shape
    check("cu_seqlens_q", cu_seqlens_q, dtype=torch.int32, shape=(B + 1,), device=q.device)
    out = torch.empty_like(q) if out is None else out
    check("out", out, dtype=q.dtype, shape=(T, H, D), device=q.device)
    if T == 0 or B == 0:
        return out
    block_m = block_m or prefill_block_m(T)
    num_warps = num_warps or (4 if block_m <= 64 else 8)
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    ks, vs = check_kv_scale(kv_scale)
    grid = prefill_grid(B) if grid == "auto" else grid
    if grid == "packed":
        programs: tuple[int, ...] = (triton.cdiv(T, block_m) + B + 1, H)
    elif grid == "seq":
        programs = (triton.cdiv(max_seqlen_q or T, block_m), H, B + 1)
    else:
        raise ValueError(f"grid must be 'packed' or 'seq', got {grid!r}")
    _prefill_kernel[programs](
        q, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), scale * LOG2E * ks, vs, B, T,
        HKV=hkv, D=D, BS=bs, G=H // hkv, BLOCK_D=next_pow2(D), BLOCK_M=block_m, BLOCK_N=block_n, WHOLE=whole_tiles,
        PREC=_prec(q.dtype), PACKED=grid == "packed", BLOCK_B=next_pow2(B + 1), num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
