"""Batched paged attention on the CPU: every sequence of a step in one SDPA call, no loop per sequence.

The step's packed queries q [T, H, D] are laid out as a padded batch [B, Q, H, D] (Q: the longest
query run of the step; a decode step has Q = 1 and needs no copy), each sequence's context is
gathered from the paged cache through its block table into [B, L, Hkv, D] (L: the longest context,
rounded up to whole blocks), and one ``scaled_dot_product_attention`` call with a causal (optionally
sliding-window) mask per row computes all of them in float32, GQA included. Decode rows and prefill
rows are batched apart, so a long prompt does not pad the decode rows of the same step to its length.

Padded query rows see key 0 only (their output is dropped); padded keys are masked, so whatever a
padding block holds is never weighted (the cache is zero-initialised, so it is always finite).
``paged_attention_ref`` is the per-sequence loop it replaces, kept as the tests' reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_engine.kernels._checks import check


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                        scale: float, window: int | None = None) -> torch.Tensor:
    """Causal GQA attention of packed q [T, H, D] over each sequence's paged context; returns [T, H, D]."""
    _check_inputs(q, k_cache, v_cache, positions, cu_seqlens_q, context_lens, block_tables)
    qlens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    decode = qlens == 1
    if bool(decode.all()) or not bool(decode.any()):
        return _attend_group(q, k_cache, v_cache, positions, cu_seqlens_q, context_lens, block_tables,
                             scale, window)
    out = torch.empty_like(q)
    for rows in (decode.nonzero().flatten(), (~decode).nonzero().flatten()):
        starts, lens = cu_seqlens_q[rows], qlens[rows]
        tok = _token_index(starts, lens)
        cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(torch.int32)
        out[tok] = _attend_group(q[tok], k_cache, v_cache, positions[tok], cu, context_lens[rows],
                                 block_tables[rows], scale, window)
    return out


def _token_index(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Packed token indices of the sequences that start at ``starts`` with ``lens`` tokens, in order."""
    seq = torch.repeat_interleave(torch.arange(lens.numel()), lens.long())
    offsets = torch.arange(seq.numel()) - torch.repeat_interleave(lens.cumsum(0) - lens, lens.long())
    return starts.long()[seq] + offsets


def _attend_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                  cu: torch.Tensor, ctx: torch.Tensor, tables: torch.Tensor, scale: float,
                  window: int | None) -> torch.Tensor:
    t, heads, dim = q.shape
    b, block_size = ctx.numel(), k_cache.shape[1]
    nblocks = -(-int(ctx.max()) // block_size)
    idx = tables[:, :nblocks].clamp_min(0).long()
    k = k_cache[idx].flatten(1, 2).to(torch.float32).transpose(1, 2)  # [B, Hkv, L, D]
    v = v_cache[idx].flatten(1, 2).to(torch.float32).transpose(1, 2)
    if t == b:  # one query per sequence: the packed stream is already [B, 1, H, D]
        qb, qpos, seq, off = q.view(b, 1, heads, dim), positions.view(b, 1), None, None
    else:
        qlens = (cu[1:] - cu[:-1]).long()
        seq = torch.repeat_interleave(torch.arange(b), qlens)
        off = torch.arange(t) - cu[:-1].long()[seq]
        width = int(qlens.max())
        qb = q.new_zeros(b, width, heads, dim)
        qb[seq, off] = q
        qpos = positions.new_zeros(b, width)
        qpos[seq, off] = positions
    key_pos = torch.arange(k.shape[2])
    mask = key_pos <= qpos[..., None]  # [B, Q, L]; positions < ctx, so padded keys are excluded too
    if window is not None:
        mask &= key_pos > qpos[..., None] - window
    o = F.scaled_dot_product_attention(qb.to(torch.float32).transpose(1, 2), k, v, attn_mask=mask[:, None],
                                       scale=scale, enable_gqa=True).transpose(1, 2)  # [B, Q, H, D]
    o = o.to(q.dtype)
    return o.reshape(t, heads, dim) if seq is None else o[seq, off]


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                  cu: torch.Tensor, ctx: torch.Tensor, tables: torch.Tensor) -> None:
    check("q", q, shape=(None, None, None), last_contiguous=False)
    check("k_cache", k_cache, shape=(None, None, None, q.shape[2]))
    check("v_cache", v_cache, shape=tuple(k_cache.shape))
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q heads {q.shape[1]} not a multiple of KV heads {k_cache.shape[2]}")
    check("positions", positions, dtype=torch.int64, shape=(q.shape[0],))
    check("context_lens", ctx, shape=(None,))
    check("cu_seqlens_q", cu, shape=(ctx.numel() + 1,))
    check("block_tables", tables, shape=(ctx.numel(), None), last_contiguous=False)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                        scale: float, window: int | None = None) -> torch.Tensor:
    """The plain per-sequence loop, in float32 (the reference of ``paged_attention_cpu``)."""
    block_size, kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // kv_heads
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for b, ctx in enumerate(context_lens.tolist()):
        start, end = bounds[b], bounds[b + 1]
        blocks = block_tables[b, : -(-ctx // block_size)].long()
        k = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:ctx].to(torch.float32)
        v = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:ctx].to(torch.float32)
        qs = q[start:end].to(torch.float32).reshape(end - start, kv_heads, group, head_dim)
        scores = torch.einsum("nkgd,ckd->kgnc", qs, k) * scale
        key_pos = torch.arange(ctx, device=q.device)
        q_pos = positions[start:end, None]
        visible = key_pos[None, :] <= q_pos
        if window is not None:
            visible &= key_pos[None, :] > q_pos - window
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        o = torch.einsum("kgnc,ckd->nkgd", probs, v)
        out[start:end] = o.reshape(end - start, kv_heads * group, head_dim).to(q.dtype)
    return out
