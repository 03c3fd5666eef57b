"""Log-probs of the raw logits, only for the rows that ask for them.

One program per row. A row whose `want` is 0 writes zeros and leaves: a decode step where no
request asked for log-probs costs one tiny launch instead of a [B, V] log-softmax and a top-k.
A row that wants them reads its logits K + 2 times (the max, the exp sum, then one pass per
top entry): the top entries come out in the order (log-prob descending, index ascending), each
pass taking the best token strictly after the previous one in that order, so ties never repeat.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_engine.kernels._checks import check


@triton.jit
def softmax_stats(row, V, min_p, BLOCK: tl.constexpr, CUT: tl.constexpr):
    """A row's max m, its softmax sum (of exp(x - m)) and, with CUT, the smallest x with exp(x - m) >= min_p.

    Two passes over the row: the max, then the sum. The log-sum-exp is m + log(sum); the sampler's
    filters (sampling_select) take the min-p cut from the second pass as well (without CUT it is +inf).
    """
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    for v0 in range(0, V, BLOCK):
        idx = v0 + tl.arange(0, BLOCK)
        top = tl.maximum(top, tl.load(row + idx, mask=idx < V, other=float("-inf")))
    m = tl.max(top, axis=0)
    z = tl.zeros([BLOCK], tl.float32)
    low = tl.full([BLOCK], float("inf"), tl.float32)
    for v0 in range(0, V, BLOCK):
        idx = v0 + tl.arange(0, BLOCK)
        x = tl.load(row + idx, mask=idx < V, other=float("-inf"))
        e = tl.exp(x - m)
        z += e
        if CUT:
            low = tl.where((e >= min_p) & (idx < V), tl.minimum(low, x), low)
    return m, tl.sum(z, axis=0), tl.min(low, axis=0)


@triton.jit
def _next_best(row, V, prev_val, prev_idx, BLOCK: tl.constexpr):
    """The best (value, lowest index) strictly after (prev_val, prev_idx) in descending order."""
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], 2147483647, tl.int32)
    for v0 in range(0, V, BLOCK):
        idx = v0 + tl.arange(0, BLOCK)
        x = tl.load(row + idx, mask=idx < V, other=float("-inf"))
        after = (x < prev_val) | ((x == prev_val) & (idx > prev_idx))
        ok = after & (idx < V)
        better = ok & ((x > best_val) | ((x == best_val) & (idx < best_idx)))
        best_val = tl.where(better, x, best_val)
        best_idx = tl.where(better, idx, best_idx)
    top = tl.max(best_val, axis=0)
    win = tl.min(tl.where(best_val == top, best_idx, 2147483647), axis=0)
    return top, win


@triton.jit
def _logprob_kernel(x_ptr, s_x, want_ptr, tok_ptr, lp_ptr, ids_ptr, tlp_ptr, V, K, s_top,
                    BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = x_ptr + b.to(tl.int64) * s_x
    if tl.load(want_ptr + b) != 0:
        m, z, _ = softmax_stats(row, V, 0.0, BLOCK, False)
        lse = m + tl.log(z)
        tl.store(lp_ptr + b, tl.load(row + tl.load(tok_ptr + b)) - lse)
        prev_val = tl.full([], float("inf"), tl.float32)
        prev_idx = tl.full([], -1, tl.int32)
        for j in range(K):
            prev_val, prev_idx = _next_best(row, V, prev_val, prev_idx, BLOCK)
            tl.store(ids_ptr + b * s_top + j, prev_idx.to(tl.int64))
            tl.store(tlp_ptr + b * s_top + j, prev_val - lse)
    else:
        tl.store(lp_ptr + b, 0.0)
        for j in range(K):
            tl.store(ids_ptr + b * s_top + j, 0)
            tl.store(tlp_ptr + b * s_top + j, 0.0)


def logprobs_ref(logits: torch.Tensor, want: torch.Tensor, tokens: torch.Tensor, k: int):
    """(token log-prob [B], top ids [B, k], top log-probs [B, k]); zeros on rows with want == 0."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    vals, ids = torch.topk(logp, k, dim=-1)
    on = want != 0
    lp = torch.where(on, logp.gather(-1, tokens[:, None]).squeeze(1), 0.0)
    return lp, torch.where(on[:, None], ids, 0), torch.where(on[:, None], vals, 0.0)


def token_logprobs(logits: torch.Tensor, want: torch.Tensor, tokens: torch.Tensor, out_logprobs: torch.Tensor,
                   out_top_ids: torch.Tensor, out_top_logprobs: torch.Tensor) -> None:
    """Write `logprobs_ref`'s three outputs in place, computing only the rows with want != 0.

    logits [B, V] f32; want [B] int32; tokens [B] int64 (the sampled ids); out_logprobs [B] f32;
    out_top_ids [B, K] int64 and out_top_logprobs [B, K] f32 with one row stride.
    """
    check("logits", logits, dtype=torch.float32, shape=(None, None))
    B, V = logits.shape
    dev = logits.device
    check("want", want, dtype=torch.int32, shape=(B,), device=dev)
    check("tokens", tokens, dtype=torch.int64, shape=(B,), device=dev)
    check("out_logprobs", out_logprobs, dtype=torch.float32, shape=(B,), device=dev)
    check("out_top_ids", out_top_ids, dtype=torch.int64, shape=(B, None), device=dev)
    K = out_top_ids.shape[1]
    check("out_top_logprobs", out_top_logprobs, dtype=torch.float32, shape=(B, K), device=dev)
    if B > 1 and out_top_ids.stride(0) != out_top_logprobs.stride(0):
        raise ValueError(f"out_top_ids and out_top_logprobs need one row stride, got "
                         f"{out_top_ids.stride(0)} and {out_top_logprobs.stride(0)}")
    if B == 0:
        return
    _logprob_kernel[(B,)](logits, logits.stride(0), want, tokens, out_logprobs, out_top_ids, out_top_logprobs,
                          V, K, out_top_ids.stride(0), BLOCK=1024, num_warps=4)
