"""Kernels vs their plain-PyTorch references: tiny shapes on CPU (Triton interpreter), real sizes on GPU."""

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers.paged import paged_cache  # noqa: E402

from gpu_engine.kernels import activation, attention, kv_cache, moe, rmsnorm, rope  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _close(a, b, tol):
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 4e-2)])
def test_rmsnorm_residual(dtype, tol):
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(5, 48, generator=g).to(DEV, dtype) for _ in range(2))
    w = torch.randn(48, generator=g).to(DEV, dtype)
    want, want_r = rmsnorm.rms_norm_ref(x, w, 1e-6, r)
    res = r.clone()
    _close(rmsnorm.rms_norm(x, w, 1e-6, residual=res), want, tol)
    _close(res, want_r, tol)


def test_rmsnorm_per_head_in_place():
    qkv = torch.randn(3, 6 * 16, device=DEV)
    q = qkv[:, : 4 * 16].view(3, 4, 16)
    w = torch.randn(16, device=DEV)
    want = rmsnorm.rms_norm_ref(q.clone(), w, 1e-6)[0]
    rmsnorm.rms_norm(q, w, 1e-6, out=q)
    _close(qkv[:, : 4 * 16].view(3, 4, 16), want, 1e-5)


@pytest.mark.parametrize("rot,scaling", [(16, None), (8, None), (16, {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16})])
def test_rope(rot, scaling):
    qkv = torch.randn(5, 8 * 16, device=DEV)
    q, k = qkv[:, :64].view(5, 4, 16), qkv[:, 64:96].view(5, 2, 16)
    cache = rope.build_rope_cache(rot, 64, 10000.0, scaling, device=DEV)
    pos = torch.tensor([0, 3, 7, 1, 63], device=DEV)
    want_q, want_k = rope.rope_ref(q, pos, cache), rope.rope_ref(k, pos, cache)
    rope.apply_rope(q, k, pos, cache)
    _close(q, want_q, 1e-5)
    _close(k, want_k, 1e-5)


def test_rope_matches_model_module():
    from gpu_engine.models.rope import apply_rotary, base_inv_freq

    x = torch.randn(4, 2, 16, device=DEV)
    pos = torch.tensor([0, 5, 9, 2], device=DEV)
    inv = base_inv_freq(12, 500000.0).to(DEV)
    freqs = pos.float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], -1)
    cache = rope.cache_from_cos_sin(emb.cos(), emb.sin())
    want = apply_rotary(x, emb.cos(), emb.sin())
    got = x.clone()
    rope.apply_rope(got, torch.zeros(4, 1, 16, device=DEV), torch.arange(4, device=DEV), cache)
    _close(got, want, 1e-5)


def test_silu_and_mul():
    x = torch.randn(3, 2 * 200, device=DEV)
    _close(activation.silu_and_mul(x), activation.silu_and_mul_ref(x), 1e-5)


def test_write_kv_skips_padding():
    kc, vc = torch.zeros(4, 4, 2, 8, device=DEV), torch.zeros(4, 4, 2, 8, device=DEV)
    kv = torch.randn(3, 2, 2, 8, device=DEV)
    k, v = kv[:, 0], kv[:, 1]
    slots = torch.tensor([5, -1, 14], device=DEV)
    want_k, want_v = kc.clone(), vc.clone()
    kv_cache.write_kv_ref(k, v, want_k, want_v, slots)
    kv_cache.write_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    assert kc.abs().sum() > 0


def _paged(lens, hkv=2, d=16, bs=4, nblocks=40, dtype=torch.float32, seed=0):
    return paged_cache(lens, DEV, hkv=hkv, d=d, bs=bs, nblocks=nblocks, dtype=dtype, seed=seed)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 3e-3)])
def test_decode_attention(dtype, tol):
    kc, vc, bt, ctx = _paged([1, 37, 0, 70], dtype=dtype)
    q = torch.randn(4, 8, 16, device=DEV).to(dtype)
    want = attention.decode_attention_ref(q, kc, vc, bt, ctx, 0.25)
    got = attention.decode_attention(q, kc, vc, bt, ctx, 0.25, partition_size=32, block_n=16)
    _close(got, want, tol)


def test_decode_attention_forms_give_the_same_bits():
    """A row's splits computed by a program each and folded by a second launch, or by the last of them to finish
    (its counts left zero for the next launch): the same sums in the same order, so the outputs are equal bit for
    bit; within the reference's tolerance, empty rows zero (written: the outputs start poisoned)."""
    kc, vc, bt, ctx = _paged([1, 37, 0, 70, 129, 64], nblocks=100)
    q = torch.randn(6, 8, 16, device=DEV)
    split = attention.decode_attention(q, kc, vc, bt, ctx, 0.25, out=torch.full_like(q, float("nan")),
                                       partition_size=32, block_n=16)
    counters = torch.zeros(6 * 4, dtype=torch.int32, device=DEV)
    for _ in range(2):
        last = attention.decode_attention(q, kc, vc, bt, ctx, 0.25, out=torch.full_like(q, float("nan")),
                                          partition_size=32, block_n=16, form="last", counters=counters)
        assert torch.equal(last, split)
        assert not counters.any()
    unset = attention.decode_attention(q, kc, vc, bt, ctx, 0.25, partition_size=32, block_n=16, form="last")
    assert torch.equal(unset, split)  # counters allocated by the launcher
    with pytest.raises(ValueError, match="counters"):
        attention.decode_attention(q, kc, vc, bt, ctx, 0.25, form="last", counters=counters[:5])
    assert not split[2].any()
    _close(split, attention.decode_attention_ref(q, kc, vc, bt, ctx, 0.25), 1e-4)
    assert attention.DECODE_FORMS == ("split", "last")
    for gone in ("walk", "walked"):
        with pytest.raises(ValueError, match="form"):
            attention.decode_attention(q, kc, vc, bt, ctx, 0.25, form=gone)


def test_decode_attention_row_past_its_block_table_folds_the_table_s_splits_in_every_form():
    """A context longer than its block table holds (a caller's error: the runner sizes tables for its longest
    request) still gets one answer from the split and the "last" forms: the splits that have programs (the
    table's), folded; the fold reads no partial past them (before, it read the next head's and, for the last row,
    past the partials' end)."""
    kc, vc, bt, ctx = _paged([68, 64])  # 18 blocks of 4 a row (the last of row 0 unset: -1), 3 splits of 32
    bt[0, 17] = bt[1, 16] = 39  # any valid block, so that no token is read through a -1
    ctx[0] = 100  # 4 splits' worth: the 4th has no program; its tokens' table entries would be the next row's
    q = torch.randn(2, 8, 16, device=DEV)
    split = attention.decode_attention(q, kc, vc, bt, ctx, 0.25, out=torch.full_like(q, float("nan")),
                                       partition_size=32, block_n=16)
    counters = torch.zeros(2 * 2, dtype=torch.int32, device=DEV)
    for _ in range(2):
        got = attention.decode_attention(q, kc, vc, bt, ctx, 0.25, out=torch.full_like(q, float("nan")),
                                         partition_size=32, block_n=16, form="last", counters=counters)
        assert torch.equal(got, split)
        assert not counters.any()
    # what it is: the row's first 96 tokens (3 splits), whose last 24 took the next row's table entries
    wide = torch.cat([bt[0], bt[1, :6]])[None]
    first = attention.decode_attention(q[:1], kc, vc, wide, torch.tensor([96], dtype=torch.int32, device=DEV), 0.25,
                                       partition_size=32, block_n=16)
    assert torch.equal(split[:1], first)


def test_prefill_attention_varlen_with_prefix():
    lens_q = [5, 0, 19, 1]
    ctx_lens = [5, 3, 27, 9]
    kc, vc, bt, ctx = _paged(ctx_lens)
    cu = torch.tensor([0, 5, 5, 24, 25], dtype=torch.int32, device=DEV)
    q = torch.randn(sum(lens_q), 8, 16, device=DEV)
    want = attention.prefill_attention_ref(q, kc, vc, bt, ctx, cu, 0.3)
    got = attention.prefill_attention(q, kc, vc, bt, ctx, cu, 0.3, block_m=16, block_n=16)
    _close(got, want, 1e-4)


@pytest.mark.parametrize("block_m", [16, 32])
def test_prefill_attention_packed_grid_gives_the_sequence_grids_bits(block_m):
    """A mixed step as the runner stages it: decode rows with no chunk rows (their queries are the decode
    kernel's), chunks over cached prefixes, a prompt whole, and padding rows past the last sequence up to T. The
    packed grid (a program per query tile of the step) writes every row the sequence grid writes with the same
    bits, zeros on the padding rows, and takes no more programs than cdiv(T, block_m) + B + 1 tiles."""
    lens_q = [0, 0, 37, 0, 5, 16, 1]
    ctx_lens = [9, 30, 40, 3, 5, 33, 21]
    kc, vc, bt, ctx = _paged(ctx_lens, nblocks=64, seed=3)
    cu = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    T = int(cu[-1]) + 11  # the captured graph's rows: 11 padding rows after the step's
    q = torch.randn(T, 8, 16, device=DEV)
    runs = {}
    for grid in ("seq", "packed"):
        out = torch.full_like(q, float("nan"))
        attention.prefill_attention(q, kc, vc, bt, ctx, cu, 0.3, out=out, block_m=block_m, block_n=16, grid=grid)
        runs[grid] = out
    assert torch.equal(runs["packed"], runs["seq"])
    assert not runs["packed"].isnan().any() and not runs["packed"][int(cu[-1]):].any()
    want = attention.prefill_attention_ref(q[: int(cu[-1])], kc, vc, bt, ctx, cu, 0.3)
    _close(runs["packed"][: int(cu[-1])], want, 1e-4)
    tiles = sum(-(-n // block_m) for n in lens_q) + -(-11 // block_m)
    assert tiles <= -(-T // block_m) + len(lens_q) + 1
    with pytest.raises(ValueError, match="grid must be"):
        attention.prefill_attention(q, kc, vc, bt, ctx, cu, 0.3, grid="flat")


def test_prefill_attention_picks_its_grid_by_the_steps_sequences(monkeypatch):
    """Left to choose, a step of few sequences (one prompt, a few) takes the sequence grid and a step with many
    (decode rows beside a chunk) the packed one, with the bits either gives."""
    assert [attention.prefill_grid(n) for n in (1, attention.SEQ_GRID_SEQS, attention.SEQ_GRID_SEQS + 1, 129)] == [
        "seq", "seq", "packed", "packed"]
    seen = []
    kernel = attention._prefill_kernel

    class Spy:
        def __getitem__(self, programs):
            seen.append(len(programs))  # the packed grid is 2-D, the sequence grid 3-D
            return kernel[programs]

    monkeypatch.setattr(attention, "_prefill_kernel", Spy())
    for lens_q in ([7], [0, 0, 0, 0, 0, 6]):
        kc, vc, bt, ctx = _paged([9] * len(lens_q), nblocks=16, seed=5)
        cu = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
        q = torch.randn(int(cu[-1]), 8, 16, device=DEV)
        auto = attention.prefill_attention(q, kc, vc, bt, ctx, cu, 0.3, block_m=16, block_n=16)
        grid = attention.prefill_grid(len(lens_q))
        assert torch.equal(auto, attention.prefill_attention(q, kc, vc, bt, ctx, cu, 0.3, block_m=16, block_n=16,
                                                             grid=grid))
    assert seen == [3, 3, 2, 2]


def _prefill_in_chunks(q, kc, vc, table, n, chunks, scale=0.3, **tiles):
    """One prompt of n tokens (its K/V already in the cache) prefilled chunk by chunk: each chunk's rows see
    the cache up to their own position, as the runner's steps do."""
    out, lo = torch.empty_like(q), 0
    for size in chunks:
        ctx = torch.tensor([lo + size], dtype=torch.int32, device=q.device)
        cu = torch.tensor([0, size], dtype=torch.int32, device=q.device)
        attention.prefill_attention(q[lo: lo + size], kc, vc, table, ctx, cu, scale, out=out[lo: lo + size], **tiles)
        lo += size
    assert lo == n
    return out


def test_prefill_attention_bits_do_not_depend_on_chunks_or_tile_height():
    """A prompt prefilled whole, in uneven chunks, with another query-tile height, or with the causal select on
    every tile: the same bits (a row sums its K/V tiles in order from token 0 whatever its chunk and its tile's
    other rows, and the select changes no bit of a tile it sees whole), so prefix caching and the chunk budget never
    change a prompt's logits."""
    n = 45
    kc, vc, bt, _ = _paged([n], nblocks=20)
    q = torch.randn(n, 8, 16, device=DEV)
    whole = _prefill_in_chunks(q, kc, vc, bt, n, [n], block_m=16, block_n=16)
    _close(whole, attention.prefill_attention_ref(q, kc, vc, bt, torch.tensor([n], dtype=torch.int32, device=DEV),
                                                  torch.tensor([0, n], dtype=torch.int32, device=DEV), 0.3), 1e-4)
    for chunks, tiles in (([17, 1, 27], {}), ([n], {"block_m": 32}), ([30, 15], {"block_m": 32}),
                          ([n], {"whole_tiles": False}), ([20, 25], {"whole_tiles": False})):
        got = _prefill_in_chunks(q, kc, vc, bt, n, chunks, **({"block_m": 16, "block_n": 16} | tiles))
        assert torch.equal(got, whole), (chunks, tiles)


def test_moe_route_matches_reference():
    logits = torch.randn(6, 10, device=DEV)
    for normalize in (False, True):
        w, ids = moe.moe_route(logits, 3, normalize)
        rw, rids = moe.route_ref(logits, 3, normalize)
        assert torch.equal(ids, rids)
        _close(w, rw, 1e-6)


def test_moe_align_groups_pairs_by_expert():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], device=DEV)
    sorted_pairs, block_expert = moe.moe_align(ids, 4, 4)
    flat = ids.reshape(-1).tolist()
    for blk, e in enumerate(block_expert.tolist()):
        pairs = [p for p in sorted_pairs[blk * 4: blk * 4 + 4].tolist() if p < 6]
        assert all(flat[p] == e for p in pairs)
    assert sorted(p for p in sorted_pairs.tolist() if p < 6) == list(range(6))


@pytest.mark.parametrize("T,k,E,bm,form", [(1, 8, 128, 16, None), (9, 8, 128, 16, None), (16, 8, 128, 16, "two"),
                                           (64, 8, 128, 16, None), (272, 8, 128, 16, None), (40, 8, 128, 64, "one"),
                                           (3, 2, 6, 4, None), (0, 2, 5, 4, None), (0, 2, 5, 4, "two"),
                                           (40, 4, 60, 64, None), (7, 1, 3, 1, "two"), (300, 8, 128, 64, 256),
                                           (130, 8, 256, 16, None)])
def test_moe_align_gives_the_sorted_arrays(T, k, E, bm, form):
    """The align's kernels against torch's stable sort (`moe_align_ref`): the same arrays, element for
    element, so the grouped GEMM sees the same blocks whichever ran; some experts unused, some crowded; the form the
    step size picks (None), or one launch, or two at the chunk the step size picks or at 256 pairs a chunk, with
    chunks that end inside the step and past it."""
    g = torch.Generator().manual_seed(T * 1000 + E)
    skew = torch.rand(E, generator=g) ** 4  # a few experts take most pairs
    ids = torch.multinomial(skew.expand(max(T, 1), E), k, generator=g)[:T].to(DEV)
    forced = {"one": {"one_launch": True}, "two": {"one_launch": False}, None: {}}.get(form, {"chunk": form,
                                                                                           "one_launch": False})
    got, want = moe.moe_align(ids, E, bm, **forced), moe.moe_align_ref(ids, E, bm)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("chunk", [0, 48, 512])
def test_moe_align_refuses_a_chunk_it_has_no_kernel_for(chunk):
    with pytest.raises(ValueError, match="chunk"):
        moe.moe_align(torch.zeros(4, 2, dtype=torch.int64, device=DEV), 4, 4, chunk=chunk)


@pytest.mark.parametrize("normalize", [False, True])
def test_fused_moe(normalize):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 32, generator=g).to(DEV)
    router = torch.randn(6, 32, generator=g).to(DEV)
    gate_up = (torch.randn(6, 2 * 24, 32, generator=g) * 0.2).to(DEV)
    down = (torch.randn(6, 32, 24, generator=g) * 0.2).to(DEV)
    want = moe.fused_moe_ref(x, router, gate_up, down, 2, normalize)
    _close(moe.fused_moe(x, router, gate_up, down, 2, normalize), want, 1e-4)  # 10 pairs: the sort-free path
    weights, ids = moe.moe_route(torch.nn.functional.linear(x, router), 2, normalize)
    _close(moe.moe_experts_sorted(x, gate_up, down, weights, ids, block_m=16), want, 1e-4)


@pytest.mark.parametrize(("T", "E", "top_k", "group"), [(1, 128, 8, 4), (3, 6, 2, 4), (8, 60, 4, 16)])
@pytest.mark.parametrize("normalize", [False, True])
def test_moe_router_routes_in_one_launch(T, E, top_k, group, normalize):
    """The router's product and the routing in one launch (a program per token and group of experts, the last to
    finish routing): the experts and weights of the product then `moe_route`, its counts left zero (the last group
    of 60 experts half empty); with the RMSNorm taken in it, those of the normalised x; every expert a valid id."""
    from gpu_engine.kernels.rmsnorm import rms_norm_ref

    g = torch.Generator().manual_seed(T * 100 + E)
    x = (torch.randn(T, 64, generator=g) * 3).to(DEV)
    router = torch.randn(E, 64, generator=g).to(DEV)
    nw = (torch.rand(64, generator=g) + 0.5).to(DEV)
    counters = torch.zeros(16, dtype=torch.int32, device=DEV)
    for norm in (None, (nw, 1e-6)):
        src = x if norm is None else rms_norm_ref(x, nw, 1e-6)[0]
        want_w, want_ids = moe.moe_route(torch.nn.functional.linear(src, router), top_k, normalize)
        for _ in range(2):
            w, ids = moe.moe_router(x, router, top_k, normalize, counters, norm=norm, block_g=group, block_k=32)
            assert torch.equal(ids, want_ids) and not counters.any()
            _close(w, want_w, 1e-5)
    with pytest.raises(ValueError, match="counters"):
        moe.moe_router(x, router, top_k, normalize, counters[: T - 1] if T > 1 else counters[:0])


@pytest.mark.parametrize("T", [1, 4])
def test_fused_moe_takes_the_norm_and_the_residual_add_in_its_kernels(T):
    """A small step's MoE with the layer's RMSNorm in its router and gate_up kernels and its output added into the
    residual stream (the runner's fused MLP, x being the stream itself): the reference on the normalised x plus
    the stream, within fp32 rounding; refused for a step too large for the sort-free path."""
    from gpu_engine.kernels.rmsnorm import rms_norm_ref

    x, router, gate_up, down = _moe_weights(T, 6, 32, 24, torch.float32)
    nw = (torch.rand(32, generator=torch.Generator().manual_seed(4)) + 0.5).to(DEV)
    want = moe.fused_moe_ref(rms_norm_ref(x, nw, 1e-6)[0], router, gate_up, down, 2, True) + x
    stream = x.clone()
    counters = torch.zeros(8, dtype=torch.int32, device=DEV)
    got = moe.fused_moe(stream, router, gate_up, down, 2, True, residual=stream, counters=counters,
                        norm=(nw, 1e-6))
    assert got is stream and not counters.any()
    _close(stream, want, 1e-4)
    with pytest.raises(ValueError, match="norm: taken in the router"):
        moe.fused_moe(x, router, gate_up, down, 2, True, norm=(nw, 1e-6))


def _moe_weights(T, E, H, I, dtype, seed=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(DEV, dtype)
    router = torch.randn(E, H, generator=g).to(DEV, dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.2).to(DEV, dtype)
    down = (torch.randn(E, H, I, generator=g) * 0.2).to(DEV, dtype)
    return x, router, gate_up, down


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("T,E,H,I,top_k,blocks", [
    (1, 6, 40, 22, 2, {}),  # non-power-of-two H and I: one masked tile each way
    (3, 8, 33, 24, 3, {"gate_up": (8, 16), "down": (4, 16)}),  # 3 slots padded to 4; K loops of 3 and 2 steps
    (5, 4, 64, 16, 4, {"gate_up": (16, 32), "down": (1, 32)}),  # more pairs than experts: shared experts
])
def test_moe_small_path(T, E, H, I, top_k, blocks, dtype, tol):
    """The sort-free kernels against the reference and against the sorted path on the same routing."""
    x, router, gate_up, down = _moe_weights(T, E, H, I, dtype)
    weights, ids = moe.moe_route(torch.nn.functional.linear(x, router), top_k, True)
    gn, gk = blocks.get("gate_up", (4, 512))
    dn, dk = blocks.get("down", (2, 256))
    act = moe.moe_gate_up_silu(x, gate_up, ids, block_n=gn, block_k=gk)
    got = moe.moe_down_sum(act, down, ids, weights, block_n=dn, block_k=dk)
    _close(got, moe.fused_moe_ref(x, router, gate_up, down, top_k, True), tol)
    if dtype == torch.float32 or DEV == "cuda":  # the interpreter's tl.dot (the sorted path's) is wrong on bf16
        _close(got, moe.moe_experts_sorted(x, gate_up, down, weights, ids, block_m=16), tol)
    assert torch.equal(moe.moe_down_sum(act, down, ids, weights, block_n=dn, block_k=dk), got)  # deterministic
    # added into a residual stream in place: the sum then `rms_norm`'s add (`kernels.rmsnorm`), the same bits
    residual = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).to(DEV, dtype)
    held = residual.clone()
    assert moe.moe_down_sum(act, down, ids, weights, block_n=dn, block_k=dk, residual=held) is held
    want = (got.float() + residual.float()).to(dtype)
    if dtype == torch.float32 or DEV == "cuda":  # the interpreter rounds to bf16 otherwise than torch
        assert torch.equal(held, want)
    _close(held, want, tol)


@pytest.mark.parametrize("extra", [0, 1])
def test_fused_moe_small_path_threshold(extra):
    """T * top_k at SMALL_PAIRS takes the sort-free path, one token more the sorted one; both match the reference."""
    top_k = 2
    T = moe.SMALL_PAIRS // top_k + extra
    x, router, gate_up, down = _moe_weights(T, 4, 16, 8, torch.float32)
    assert moe.small_path(T, top_k) == (extra == 0)
    got = moe.fused_moe(x, router, gate_up, down, top_k, False)
    weights, ids = moe.moe_route(torch.nn.functional.linear(x, router), top_k, False)
    path = moe.moe_experts_small if extra == 0 else moe.moe_experts_sorted
    assert torch.equal(got, path(x, gate_up, down, weights, ids))
    _close(got, moe.fused_moe_ref(x, router, gate_up, down, top_k, False), 1e-4)


def test_moe_small_launchers_reject_bad_inputs():
    x, _, gate_up, down = _moe_weights(2, 4, 16, 8, torch.float32)
    ids = torch.zeros(2, 2, dtype=torch.int64, device=DEV)
    weights = torch.full((2, 2), 0.5, device=DEV)
    act = moe.moe_gate_up_silu(x, gate_up, ids)
    with pytest.raises(ValueError, match="expert_ids"):
        moe.moe_gate_up_silu(x, gate_up, ids.int())
    with pytest.raises(ValueError, match="gate_up"):
        moe.moe_gate_up_silu(x, gate_up.transpose(1, 2), ids)
    with pytest.raises(ValueError, match="down"):
        moe.moe_down_sum(act, down.bfloat16(), ids, weights)
    with pytest.raises(ValueError, match="act"):
        moe.moe_down_sum(act[:3], down, ids, weights)
    with pytest.raises(ValueError, match="route_weights"):
        moe.moe_down_sum(act, down, ids, weights.t())
    with pytest.raises(ValueError, match="residual"):
        moe.moe_down_sum(act, down, ids, weights, residual=torch.zeros(3, 16, device=DEV))
    with pytest.raises(ValueError, match="writes into the residual"):
        moe.moe_down_sum(act, down, ids, weights, out=torch.zeros(2, 16, device=DEV),
                         residual=torch.zeros(2, 16, device=DEV))
    big = torch.zeros(moe.SMALL_PAIRS, 16, device=DEV)
    with pytest.raises(ValueError, match="residual, counters, norm: only for a step of at most"):
        moe.fused_moe(big, torch.zeros(4, 16, device=DEV), gate_up, down, 2, False, residual=big.clone())


def test_launchers_reject_bad_inputs():
    x = torch.randn(4, 8, device=DEV)
    with pytest.raises(ValueError, match="weight"):
        rmsnorm.rms_norm(x, torch.ones(7, device=DEV), 1e-6)
    with pytest.raises(ValueError, match="dtype"):
        activation.silu_and_mul(x.to(torch.int32))
    with pytest.raises(ValueError, match="slot_mapping"):
        kv_cache.write_kv(torch.zeros(2, 1, 8), torch.zeros(2, 1, 8), torch.zeros(2, 4, 1, 8),
                          torch.zeros(2, 4, 1, 8), torch.zeros(2, dtype=torch.int32))
    kc, vc, bt, ctx = _paged([3])
    with pytest.raises(ValueError, match="block_tables"):
        attention.decode_attention(torch.randn(1, 4, 16, device=DEV), kc, vc, bt.long(), ctx, 1.0)


def _sample_kernel(logits, specs, seeds, steps, filtered):
    """Run the sampling kernel on `specs` (SamplingSpec rows); returns its four outputs."""
    from gpu_engine.kernels.sampling import sample

    B, dev = logits.shape[0], logits.device

    def col(attr, dtype):
        return torch.tensor([getattr(s, attr) for s in specs], dtype=dtype, device=dev)

    out = (torch.full((B,), -1, device=dev), torch.full((B,), float("nan"), device=dev),
           torch.full((B, 3), -1, device=dev), torch.full((B, 3), float("nan"), device=dev))
    sample(logits, col("temperature", torch.float32), col("top_k", torch.int32), col("top_p", torch.float32),
           col("min_p", torch.float32), seeds, steps, *out, filtered=filtered)
    return out


def test_sampling_unfiltered_variant_is_identical_without_filters():
    from gpu_engine.policy import needs_filter
    from gpu_engine.sampling import SamplingSpec

    V = 1500  # two kernel blocks
    specs = [SamplingSpec(0.0, seed=1), SamplingSpec(0.0, top_p=0.5, top_k=5, min_p=0.1, seed=2),  # greedy
             SamplingSpec(1.0, seed=3), SamplingSpec(0.7, seed=-7), SamplingSpec(1.5, seed=2**40 + 1),
             SamplingSpec(2.0, top_p=1.5, top_k=-1, min_p=-0.1, seed=11)]  # filters explicitly off
    assert not any(needs_filter(s) for s in specs)
    g = torch.Generator().manual_seed(0)
    random_rows = torch.tensor([s.temperature > 0 for s in specs])
    seeds = torch.tensor([s.seed for s in specs], dtype=torch.int64, device=DEV)
    moved = False
    for step in range(3):
        logits = (torch.randn(len(specs), V, generator=g) * 2).to(DEV)
        steps = torch.arange(len(specs), device=DEV) * 100 + step
        want = _sample_kernel(logits, specs, seeds, steps, filtered=True)
        got = _sample_kernel(logits, specs, seeds, steps, filtered=False)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        argmax = logits.argmax(-1).cpu()
        assert torch.equal(got[0].cpu()[~random_rows], argmax[~random_rows])
        moved |= bool((got[0].cpu()[random_rows] != argmax[random_rows]).any())
    assert moved  # the temperature rows really drew, not argmax


def test_sampling_filtered_variant_applies_filters():
    from gpu_engine.sampling import SamplingSpec

    logits = (torch.randn(4, 300, generator=torch.Generator().manual_seed(1)) * 2).to(DEV)
    specs = [SamplingSpec(3.0, top_k=1, seed=i) for i in range(4)]  # top-1: argmax whatever the noise
    zeros = torch.zeros(4, dtype=torch.int64, device=DEV)
    tokens = _sample_kernel(logits, specs, torch.arange(4, device=DEV), zeros, filtered=True)[0]
    assert torch.equal(tokens, logits.argmax(-1))


# ---- real sizes on the GPU ------------------------------------------------------------------------
@gpu
@needs_cuda
def test_gpu_rmsnorm_rope_silu_real_sizes():
    x, r = torch.randn(64, 4096, device=DEV, dtype=torch.bfloat16), torch.randn(64, 4096, device=DEV,
                                                                               dtype=torch.bfloat16)
    w = torch.randn(4096, device=DEV, dtype=torch.bfloat16)
    want, want_r = rmsnorm.rms_norm_ref(x, w, 1e-5, r)
    res, out = r.clone(), torch.full_like(x, float("nan"))
    rmsnorm.rms_norm(x, w, 1e-5, residual=res, out=out)
    _close(out, want, 3e-2)
    _close(res, want_r, 1e-2)
    qkv = torch.randn(64, 48 * 128, device=DEV, dtype=torch.bfloat16)
    q, k = qkv[:, : 32 * 128].view(64, 32, 128), qkv[:, 32 * 128: 40 * 128].view(64, 8, 128)
    cache = rope.build_rope_cache(128, 8192, 500000.0, device=DEV)
    pos = torch.randint(0, 8192, (64,), device=DEV)
    wq, wk = rope.rope_ref(q, pos, cache), rope.rope_ref(k, pos, cache)
    rope.apply_rope(q, k, pos, cache)
    _close(q, wq, 2e-2)
    _close(k, wk, 2e-2)
    a = torch.randn(64, 2 * 14336, device=DEV, dtype=torch.bfloat16)
    _close(activation.silu_and_mul(a), activation.silu_and_mul_ref(a), 2e-2)


@gpu
@needs_cuda
@pytest.mark.parametrize("lens", [[1, 700, 2900, 0, 33], [4000] * 3])
def test_gpu_decode_attention_real_sizes(lens):
    kc, vc, bt, ctx = _paged(lens, hkv=8, d=128, bs=16, nblocks=1200, dtype=torch.bfloat16)
    q = torch.randn(len(lens), 32, 128, device=DEV, dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    attention.decode_attention(q, kc, vc, bt, ctx, 128 ** -0.5, out=out)
    _close(out, attention.decode_attention_ref(q, kc, vc, bt, ctx, 128 ** -0.5), 2e-2)


@gpu
@needs_cuda
def test_gpu_prefill_attention_real_sizes():
    ctx_lens = [700, 50, 1000]  # query lengths 700, 1, 300
    kc, vc, bt, ctx = _paged(ctx_lens, hkv=8, d=128, bs=16, nblocks=200, dtype=torch.bfloat16)
    cu = torch.tensor([0, 700, 701, 1001], dtype=torch.int32, device=DEV)
    q = torch.randn(1010, 32, 128, device=DEV, dtype=torch.bfloat16)  # 9 padding rows at the end
    out = torch.full_like(q, float("nan"))
    attention.prefill_attention(q, kc, vc, bt, ctx, cu, 128 ** -0.5, out=out, grid="packed")
    _close(out[:1001], attention.prefill_attention_ref(q, kc, vc, bt, ctx, cu, 128 ** -0.5)[:1001], 2e-2)
    assert torch.equal(out[1001:], torch.zeros_like(out[1001:]))
    seq = torch.full_like(q, float("nan"))
    attention.prefill_attention(q, kc, vc, bt, ctx, cu, 128 ** -0.5, out=seq, grid="seq")
    assert torch.equal(out, seq)  # the packed grid and the sequence grid: the same bits


@gpu
@needs_cuda
def test_gpu_prefill_attention_bits_do_not_depend_on_chunks_or_tile_height():
    """Real sizes, bf16: a 3,000-token prompt whole, in the chunks a 2,048-token budget makes, in chunks of
    1,000 / 1 / 1,999 (the 1-row chunk takes 16-row tiles), with 128-row tiles, and with the causal select on
    every tile: the same bits."""
    n = 3000
    kc, vc, bt, ctx = _paged([n], hkv=8, d=128, bs=16, nblocks=200, dtype=torch.bfloat16)
    q = torch.randn(n, 32, 128, device=DEV, dtype=torch.bfloat16)
    scale = 128 ** -0.5
    whole = _prefill_in_chunks(q, kc, vc, bt, n, [n], scale=scale)
    cu = torch.tensor([0, n], dtype=torch.int32, device=DEV)
    _close(whole, attention.prefill_attention_ref(q, kc, vc, bt, ctx, cu, scale), 2e-2)
    differ = []
    for chunks, tiles in (([2048, 952], {}), ([1000, 1, 1999], {}), ([n], {"block_m": 128, "num_stages": 3}),
                          ([2048, 952], {"block_m": 128}), ([n], {"whole_tiles": False})):
        got = _prefill_in_chunks(q, kc, vc, bt, n, chunks, scale=scale, **tiles)
        if not torch.equal(got, whole):
            bad = (got != whole).any(-1).any(-1).nonzero().flatten()
            differ.append((chunks, tiles, f"{bad.numel()} tokens differ, first {bad[:5].tolist()}",
                           float((got.float() - whole.float()).abs().max())))
    assert not differ, differ


@gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 8, 9, 96])  # 8 and 9: at and past SMALL_PAIRS (top-8)
def test_gpu_fused_moe_real_sizes(tokens):
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(tokens, 2048, device=DEV, generator=g).bfloat16()
    router = (torch.randn(128, 2048, device=DEV, generator=g) * 0.02).bfloat16()
    gate_up = (torch.randn(128, 1536, 2048, device=DEV, generator=g) * 0.02).bfloat16()
    down = (torch.randn(128, 2048, 768, device=DEV, generator=g) * 0.02).bfloat16()
    got = moe.fused_moe(x, router, gate_up, down, 8, True)
    want = moe.fused_moe_ref(x, router, gate_up, down, 8, True)
    assert ((got.float() - want.float()).norm() / want.float().norm()) < 1e-2
    weights, ids = moe.moe_route(torch.nn.functional.linear(x, router), 8, True)
    small = moe.moe_experts_small(x, gate_up, down, weights, ids)
    assert ((small.float() - want.float()).norm() / want.float().norm()) < 1e-2
    if not moe.small_path(tokens, 8):
        return
    # the fused MLP of a small step (the runner's +fused): the norm in the router's and gate_up kernels, the
    # routing in the router's launch, the output added into the stream. Its routing sums the normalised x unrounded,
    # so a near tie may pick another expert than a reference on the rounded x would: the routing is checked against
    # fp32 logits up to such ties (its weights against theirs rounded as the kernel rounds them), and the experts'
    # output against the reference experts on the routing it chose.
    from gpu_engine.kernels.rmsnorm import rms_norm_ref

    nw = (torch.rand(2048, device=DEV, generator=g) + 0.5).bfloat16()
    counters = torch.zeros(8, dtype=torch.int32, device=DEV)
    w_f, ids_f = moe.moe_router(x, router, 8, True, counters, norm=(nw, 1e-6))
    xn32 = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * nw.float()
    logits = xn32 @ router.float().T  # the kernel rounds its logits to bf16 (as cuBLAS's product is), then routes
    chosen = logits.gather(1, ids_f)
    unchosen = logits.scatter(1, ids_f, float("-inf")).max(-1).values
    assert (chosen.min(-1).values >= unchosen - 2e-2).all() and not counters.any()  # within a bf16 step of a tie
    probs = logits.bfloat16().float().softmax(-1).gather(1, ids_f)
    torch.testing.assert_close(w_f, probs / probs.sum(-1, keepdim=True), rtol=1e-2, atol=2e-3)
    xn = rms_norm_ref(x, nw, 1e-6)[0].float()
    ref = x.float().clone()
    for t in range(tokens):
        for s_, e in enumerate(ids_f[t].tolist()):
            gate, up = (xn[t] @ gate_up[e].float().T).chunk(2)
            ref[t] += w_f[t, s_] * ((torch.nn.functional.silu(gate) * up) @ down[e].float().T)
    stream = x.clone()
    moe.fused_moe(stream, router, gate_up, down, 8, True, residual=stream, counters=counters, norm=(nw, 1e-6))
    assert ((stream.float() - ref).norm() / ref.norm()) < 1e-2 and not counters.any()
    # the router kernel alone, fp32 so that no rounding tie decides: the experts and weights of `moe_route`
    w32, ids32 = moe.moe_router(x.float(), router.float(), 8, True, counters)
    want_w, want_ids = moe.moe_route(torch.nn.functional.linear(x.float(), router.float()), 8, True)
    assert torch.equal(ids32, want_ids)
    torch.testing.assert_close(w32, want_w, rtol=1e-4, atol=1e-5)


@gpu
@needs_cuda
def test_gpu_sampling_matches_reference():
    from gpu_engine import sampling as ref
    from gpu_engine.kernels.sampling import sample

    B, V = 8, 128256
    logits = torch.randn(B, V, device=DEV) * 4
    specs = [ref.SamplingSpec(0.0), ref.SamplingSpec(1.0), ref.SamplingSpec(0.7, top_k=40),
             ref.SamplingSpec(1.0, top_p=0.9), ref.SamplingSpec(0.8, min_p=0.05),
             ref.SamplingSpec(1.1, top_k=100, top_p=0.95, min_p=0.01), ref.SamplingSpec(2.0),
             ref.SamplingSpec(0.5, top_p=0.5)]
    specs = [dataclasses.replace(s, num_top_logprobs=5) for s in specs]
    seeds = torch.tensor([3, -7, 2**40 + 1, 11, 12, 13, 14, 15], device=DEV)
    steps = torch.arange(B, device=DEV) * 1000
    want = ref.sample(logits, specs, steps, seeds)

    def col(attr, dtype):
        return torch.tensor([getattr(s, attr) for s in specs], dtype=dtype, device=DEV)

    toks, lp = torch.full((B,), -1, device=DEV), torch.full((B,), float("nan"), device=DEV)
    ids, tlp = torch.full((B, 5), -1, device=DEV), torch.full((B, 5), float("nan"), device=DEV)
    sample(logits, col("temperature", torch.float32), col("top_k", torch.int32), col("top_p", torch.float32),
           col("min_p", torch.float32), seeds, steps, toks, lp, ids, tlp)
    assert torch.equal(toks, want.tokens)
    _close(lp, want.logprobs, 1e-5)
    assert torch.equal(ids, want.top_ids)
    # the sort-free variant on the rows that filter nothing: the same outputs, bit for bit
    plain = torch.tensor([0, 1, 6], device=DEV)
    sub = [specs[i] for i in plain.tolist()]
    got = _sample_kernel(logits[plain], sub, seeds[plain], steps[plain], filtered=False)
    full = _sample_kernel(logits[plain], sub, seeds[plain], steps[plain], filtered=True)
    assert all(torch.equal(a, b) for a, b in zip(got, full, strict=True))
    assert torch.equal(got[0], want.tokens[plain])
