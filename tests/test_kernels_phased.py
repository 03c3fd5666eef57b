"""A decode step's attention half as phases of one launch (`kernels.phased`) against the same kernels launched one
after another. Tiny shapes (interpreter on the CPU)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gpu_engine.kernels import rope  # noqa: E402
from gpu_engine.kernels.attention import decode_attention  # noqa: E402
from gpu_engine.kernels.phased import (  # noqa: E402
    LAYER_COUNTERS,
    attention_half_one_launch,
    layer_one_launch,
    mlp_half_one_launch,
    one_launch_parts,
)
from gpu_engine.kernels.tiled_linear import Heads, TiledConfig, tiled_linear, tiled_scratch  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HQ, HK, D, H, BS = 4, 2, 16, 32, 4


def _case(ctx: list[int], rot: int, qk_norm: bool, dtype, seed: int = 0):
    """A stream, weights, caches holding earlier tokens, and the step's tables, positions and slots: row b has
    ctx[b] tokens after this step, its blocks after the previous row's, its new token at the last position."""
    g = torch.Generator().manual_seed(seed)
    M, N = len(ctx), (HQ + 2 * HK) * D
    stream = torch.randn(M, H, generator=g).to(DEV, dtype)
    w_qkv = (torch.randn(N, H, generator=g) * 0.3).to(DEV, dtype)
    w_o = (torch.randn(H, HQ * D, generator=g) * 0.3).to(DEV, dtype)
    nw = (torch.rand(H, generator=g) + 0.5).to(DEV, dtype)
    qn = kn = None
    if qk_norm:
        qn, kn = (torch.rand(D, generator=g) + 0.5).to(DEV, dtype), (torch.rand(D, generator=g) + 0.5).to(DEV, dtype)
    blocks = [-(-n // BS) for n in ctx]
    width = max(blocks)
    tables = torch.full((M, width), -1, dtype=torch.int32)
    first = 0
    for b, nb in enumerate(blocks):
        tables[b, :nb] = torch.arange(first, first + nb)
        first += nb
    kc = torch.randn(first + 2, BS, HK, D, generator=g).to(DEV, dtype)
    vc = torch.randn(first + 2, BS, HK, D, generator=g).to(DEV, dtype)
    pos = torch.tensor([n - 1 for n in ctx], device=DEV)
    slots = torch.tensor([int(tables[b, (n - 1) // BS]) * BS + (n - 1) % BS for b, n in enumerate(ctx)], device=DEV)
    cache = rope.build_rope_cache(rot, 64, 10000.0, device=DEV)
    return stream, w_qkv, w_o, nw, (qn, kn), kc, vc, tables.to(DEV), torch.tensor(ctx, dtype=torch.int32,
                                                                                    device=DEV), pos, slots, cache


@pytest.mark.parametrize(("ctx", "rot", "qk_norm", "per_sm"), [
    ([37], 16, True, 1),  # one row: attention's last program folds (form "last"), 3 splits of 16 tokens
    ([5, 40, 17], 8, False, 1),  # three rows: the fold phase; partial rotary
    ([9, 64, 1, 23], 16, True, 8),  # more programs an SM: K split in more slices
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_attention_half_in_one_launch_gives_the_bits_of_its_kernels_one_after_another(ctx, rot, qk_norm,
                                                                                         per_sm, dtype):
    """qkv with the RMSNorm and q/k/v preparation, decode attention (a program a split, folded by the last one at
    one row, by a fold phase at more), and o added into the stream, as one launch: the stream and both caches have
    the bits of `tiled_linear(heads=)`, `decode_attention` and `tiled_linear(residual=)` in turn, twice over the
    same counts, which it leaves zero. The stream is both the qkv product's x (with its norm) and the o product's
    residual, as the fused runner passes it."""
    stream, w_qkv, w_o, nw, (qn, kn), kc, vc, tables, ctx_t, pos, slots, cache = _case(ctx, rot, qk_norm, dtype)
    M = len(ctx)
    qc, oc = TiledConfig(32, 16, per_sm, 4, 2), TiledConfig(16, 32, per_sm, 4, 3)
    scratch = tiled_scratch([(w_qkv.shape[0], H), (H, HQ * D)], [qc, oc, qc._replace(block_n=D)], DEV)
    attn_counters = torch.zeros(M * HK, dtype=torch.int32, device=DEV) if M == 1 else None
    how = {"partition_size": 16, "block_n": 8}

    def heads(k_cache, v_cache):
        return Heads(HQ, HK, pos, cache, k_cache, v_cache, slots, qn, kn, 1e-6)

    want, want_k, want_v = stream.clone(), kc.clone(), vc.clone()
    qkv = tiled_linear(want, w_qkv, block_n=qc.block_n, block_k=qc.block_k, per_sm=per_sm, num_stages=qc.num_stages,
                       scratch=scratch, norm=(nw, 1e-5), heads=heads(want_k, want_v))
    att = decode_attention(qkv[:, : HQ * D].view(M, HQ, D), want_k, want_v, tables, ctx_t, D ** -0.5,
                           form="split" if attn_counters is None else "last", counters=attn_counters, **how)
    tiled_linear(att.view(M, HQ * D), w_o, block_n=oc.block_n, block_k=oc.block_k, per_sm=per_sm,
                 num_stages=oc.num_stages, scratch=scratch, residual=want)
    counters = torch.zeros(LAYER_COUNTERS, dtype=torch.int32, device=DEV)
    for _ in range(2):
        got, got_k, got_v = stream.clone(), kc.clone(), vc.clone()
        out = attention_half_one_launch(got, w_qkv, heads(got_k, got_v), (nw, 1e-5), qc, tables, ctx_t, D ** -0.5,
                                        w_o, got, oc, scratch, counters, attn_counters=attn_counters, **how)
        assert out is got
        assert torch.equal(got, want) and torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        assert not counters.any() and not scratch[1].any()
        assert attn_counters is None or not attn_counters.any()
    assert not torch.equal(want, stream)  # the o product was added


def test_the_attention_half_in_one_launch_refuses_what_it_cannot_take():
    stream, w_qkv, w_o, nw, (qn, kn), kc, vc, tables, ctx_t, pos, slots, cache = _case([7], 16, False,
                                                                                         torch.float32)
    qc, oc = TiledConfig(32, 16, 1, 4, 2), TiledConfig(16, 32, 1, 4, 3)
    scratch = tiled_scratch([(w_qkv.shape[0], H), (H, HQ * D)], [qc, oc, qc._replace(block_n=D)], DEV)
    heads = Heads(HQ, HK, pos, cache, kc, vc, slots)
    counters = torch.zeros(LAYER_COUNTERS, dtype=torch.int32, device=DEV)
    args = (stream, w_qkv, heads, (nw, 1e-5), qc, tables, ctx_t, 0.25, w_o, stream, oc, scratch)
    with pytest.raises(ValueError, match="4 warps|be the attention's 4"):
        attention_half_one_launch(*args[:10], oc._replace(num_warps=8), scratch, counters)
    with pytest.raises(ValueError, match="counters"):
        attention_half_one_launch(*args, counters[:5])
    with pytest.raises(ValueError, match="heads: 3 query"):
        attention_half_one_launch(stream, w_qkv, heads._replace(num_heads=3), *args[3:], counters)
    with pytest.raises(ValueError, match="residual"):
        attention_half_one_launch(*args[:9], stream[:, :16], oc, scratch, counters)
    assert one_launch_parts("") == frozenset() and one_launch_parts("all") == {"attention", "mlp", "layer", "moe"}
    assert one_launch_parts("moe, attention") == {"attention", "moe"}
    assert one_launch_parts("attention,all") == one_launch_parts("all")
    with pytest.raises(ValueError, match="one launch"):
        one_launch_parts("attention,norm")
    with pytest.raises(ValueError, match="scratch"):
        attention_half_one_launch(*args[:11], None, counters)


@pytest.mark.parametrize(("M", "per_sm", "norm"), [(1, 1, True), (5, 8, True), (3, 2, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mlp_half_in_one_launch_gives_the_bits_of_its_kernels_one_after_another(M, per_sm, norm, dtype):
    """gate_up with the RMSNorm and the SiLU-and-multiply, then down added into the stream, as one launch: the
    stream has the bits of `tiled_linear(act="glu", norm=)` then `tiled_linear(residual=)` (K split in more slices
    with more programs an SM), twice over the same counts, which it leaves zero."""
    g = torch.Generator().manual_seed(M + per_sm)
    I = 48
    stream = torch.randn(M, H, generator=g).to(DEV, dtype)
    w_gu = (torch.randn(2 * I, H, generator=g) * 0.3).to(DEV, dtype)
    w_d = (torch.randn(H, I, generator=g) * 0.3).to(DEV, dtype)
    nw = (torch.rand(H, generator=g) + 0.5).to(DEV, dtype)
    how = (nw, 1e-5) if norm else None
    gc, dc = TiledConfig(32, 16, per_sm, 4, 2), TiledConfig(16, 16, per_sm, 4, 3)
    scratch = tiled_scratch([(2 * I, H), (H, I)], [gc, dc], DEV)
    want = stream.clone()
    act = tiled_linear(want, w_gu, act="glu", block_n=gc.block_n, block_k=gc.block_k, per_sm=per_sm,
                       num_stages=gc.num_stages, scratch=scratch, norm=how)
    tiled_linear(act, w_d, block_n=dc.block_n, block_k=dc.block_k, per_sm=per_sm, num_stages=dc.num_stages,
                 scratch=scratch, residual=want)
    counters = torch.zeros(LAYER_COUNTERS, dtype=torch.int32, device=DEV)
    for _ in range(2):
        got = stream.clone()
        assert mlp_half_one_launch(got, w_gu, how, gc, w_d, got, dc, scratch, counters) is got
        assert torch.equal(got, want) and not counters.any() and not scratch[1].any()
    assert not torch.equal(want, stream)
    with pytest.raises(ValueError, match="warps"):
        mlp_half_one_launch(got, w_gu, how, gc, w_d, got, dc._replace(num_warps=8), scratch, counters)
    with pytest.raises(ValueError, match="counters"):
        mlp_half_one_launch(got, w_gu, how, gc, w_d, got, dc, scratch, counters[:5])
    with pytest.raises(ValueError, match="w_down"):
        mlp_half_one_launch(got, w_gu, how, gc, w_d[:, :8], got, dc, scratch, counters)


@pytest.mark.parametrize(("ctx", "per_sm"), [([37], 1), ([5, 40, 17], 8)])
def test_a_layer_in_one_launch_gives_the_bits_of_its_halves_in_turn(ctx, per_sm):
    """Both halves as phases of one launch (gate_up's programs waiting for o's): the stream and caches of
    `attention_half_one_launch` then `mlp_half_one_launch` (each the bits of its kernels in turn, above), the
    counts left zero."""
    dtype = torch.bfloat16
    stream, w_qkv, w_o, nw, (qn, kn), kc, vc, tables, ctx_t, pos, slots, cache = _case(ctx, 16, True, dtype, seed=3)
    M, I = len(ctx), 48
    g = torch.Generator().manual_seed(5)
    w_gu = (torch.randn(2 * I, H, generator=g) * 0.3).to(DEV, dtype)
    w_d = (torch.randn(H, I, generator=g) * 0.3).to(DEV, dtype)
    mw = (torch.rand(H, generator=g) + 0.5).to(DEV, dtype)
    qc, oc = TiledConfig(32, 16, per_sm, 4, 2), TiledConfig(16, 32, per_sm, 4, 3)
    gc, dc = TiledConfig(32, 16, per_sm, 4, 2), TiledConfig(16, 16, per_sm, 4, 3)
    scratch = tiled_scratch([(w_qkv.shape[0], H), (H, HQ * D), (2 * I, H), (H, I)],
                            [qc, oc, gc, dc, qc._replace(block_n=D)], DEV)
    attn_counters = torch.zeros(M * HK, dtype=torch.int32, device=DEV) if M == 1 else None
    counters = torch.zeros(LAYER_COUNTERS, dtype=torch.int32, device=DEV)
    how = {"partition_size": 16, "block_n": 8}

    def heads(k_cache, v_cache):
        return Heads(HQ, HK, pos, cache, k_cache, v_cache, slots, qn, kn, 1e-6)

    want, want_k, want_v = stream.clone(), kc.clone(), vc.clone()
    attention_half_one_launch(want, w_qkv, heads(want_k, want_v), (nw, 1e-5), qc, tables, ctx_t, D ** -0.5, w_o,
                              want, oc, scratch, counters, attn_counters=attn_counters, **how)
    mlp_half_one_launch(want, w_gu, (mw, 1e-5), gc, w_d, want, dc, scratch, counters)
    for _ in range(2):
        got, got_k, got_v = stream.clone(), kc.clone(), vc.clone()
        assert layer_one_launch(got, w_qkv, heads(got_k, got_v), (nw, 1e-5), qc, tables, ctx_t, D ** -0.5, w_o, oc,
                                w_gu, (mw, 1e-5), gc, w_d, dc, scratch, counters, attn_counters=attn_counters,
                                **how) is got
        assert torch.equal(got, want) and torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        assert not counters.any() and not scratch[1].any()
    with pytest.raises(ValueError, match="warps"):
        layer_one_launch(got, w_qkv, heads(got_k, got_v), (nw, 1e-5), qc, tables, ctx_t, D ** -0.5, w_o, oc, w_gu,
                         (mw, 1e-5), gc._replace(num_warps=8), w_d, dc._replace(num_warps=8), scratch, counters,
                         attn_counters=attn_counters, **how)
