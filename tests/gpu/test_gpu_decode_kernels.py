"""The decode-path kernels at real sizes (Llama-3-8B and Qwen3 shapes, bf16) against their references."""

import pytest
import torch

from gpu_engine.kernels import attention, rope
from gpu_engine.kernels.qkv_prep import qkv_prep, qkv_prep_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = "cuda"


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("T", [1, 128, 2048])
def test_gpu_qkv_prep_real_sizes(norm, T):
    hq, hk, d = 32, 8, 128
    qkv = torch.randn(T, (hq + 2 * hk) * d, device=DEV, dtype=torch.bfloat16)
    q, k = qkv[:, : hq * d].view(T, hq, d), qkv[:, hq * d: (hq + hk) * d].view(T, hk, d)
    v = qkv[:, (hq + hk) * d:].view(T, hk, d)
    cache = rope.build_rope_cache(d, 8192, 500000.0, device=DEV)
    pos = torch.randint(0, 8192, (T,), device=DEV)
    slots = torch.randperm(4096 * 16, device=DEV)[:T]
    slots[::7] = -1
    qn = kn = None
    if norm:
        qn, kn = (torch.rand(d, device=DEV) + 0.5).bfloat16(), (torch.rand(d, device=DEV) + 0.5).bfloat16()
    kc = torch.zeros(4096, 16, hk, d, device=DEV, dtype=torch.bfloat16)
    vc, want_kc, want_vc = torch.zeros_like(kc), torch.zeros_like(kc), torch.zeros_like(kc)
    want_q = qkv_prep_ref(q, k, v, pos, cache, want_kc, want_vc, slots, qn, kn, 1e-6)
    qkv_prep(q, k, v, pos, cache, kc, vc, slots, qn, kn, 1e-6)
    torch.testing.assert_close(q.float(), want_q.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(kc.float(), want_kc.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(vc, want_vc)


@pytest.mark.parametrize("batch", [1, 8, 64, 128])
def test_gpu_decode_attention_at_the_runner_split(batch):
    from tests.test_kernels import _paged

    lens = [int(x) for x in torch.randint(1, 4096, (batch,), generator=torch.Generator().manual_seed(batch))]
    kc, vc, bt, ctx = _paged(lens, hkv=8, d=128, bs=16, nblocks=sum(-(-n // 16) for n in lens) + 8,
                             dtype=torch.bfloat16)
    q = torch.randn(batch, 32, 128, device=DEV, dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    attention.decode_attention(q, kc, vc, bt, ctx, 128 ** -0.5, out=out,
                               partition_size=attention.decode_partition(batch, 8))
    want = attention.decode_attention_ref(q, kc, vc, bt, ctx, 128 ** -0.5)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("batch", [1, 8, 64, 128])
def test_gpu_decode_attention_forms_and_replay_give_the_same_bits(batch):
    """Each row's splits computed by a program each and folded by a second launch (the runner's form), or by the last
    of them to finish (a fused plan's at one row), with the tiles staged 1, 2 or the default 3 deep: the same bits; a
    captured launch replayed gives them again (the last form's counts back at zero each time), and follows new context
    lengths written into its buffer."""
    from tests.test_kernels import _paged

    lens = [int(x) for x in torch.randint(1, 3000, (batch,), generator=torch.Generator().manual_seed(7 + batch))]
    kc, vc, bt, ctx = _paged(lens, hkv=8, d=128, bs=16, nblocks=sum(-(-n // 16) for n in lens) + 8,
                             dtype=torch.bfloat16)
    bt = torch.cat([bt, torch.full((batch, 300), -1, dtype=torch.int32, device=DEV)], dim=1)  # a runner's wide table
    q = torch.randn(batch, 32, 128, device=DEV, dtype=torch.bfloat16)

    counters = torch.zeros(batch * 8, dtype=torch.int32, device=DEV)

    def run(form="split", out=None):
        return attention.decode_attention(q, kc, vc, bt, ctx, 128 ** -0.5, out=out, form=form,
                                          counters=counters if form == "last" else None)

    split = run()
    assert torch.equal(run("last"), split) and not counters.any()
    for stages in (1, 2):  # how deep the tiles are staged changes when they arrive, not the sums
        staged = attention.decode_attention(q, kc, vc, bt, ctx, 128 ** -0.5, num_stages=stages)
        assert torch.equal(staged, split), stages
    for form in attention.DECODE_FORMS:
        out = torch.full_like(q, float("nan"))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run(form, out=out)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(form, out=out)
        for _ in range(3):
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, split), form
            assert not counters.any(), form
        # the next step: other context lengths in the same buffer, as the runner replays its graphs
        full = ctx.clone()
        ctx.copy_(torch.where(torch.arange(batch, device=DEV) % 2 == 0, (full // 3).clamp(min=1), full))
        want = run()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ctx.copy_(full)
        assert torch.equal(out, want), form
    torch.testing.assert_close(split.float(), attention.decode_attention_ref(q, kc, vc, bt, ctx, 128 ** -0.5).float(),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tokens", [1, 9, 16, 17, 64, 128, 129, 256, 300, 1024, 2048, 2049, 8192, 8193])
def test_gpu_moe_align_equals_the_sort(tokens):
    """Qwen3-30B-A3B routing (128 experts, top 8) at decode and prompt-chunk sizes: the align's kernels and
    torch's stable sort give the same arrays (16 tokens is the one launch's bound, 128 pairs, then two launches of
    64, 128 and 256 pairs a chunk; 8,192 tokens is the kernels' bound, 65,536 pairs; 8,193 is past it: the sort
    itself)."""
    from gpu_engine.kernels import moe

    logits = torch.randn(tokens, 128, device=DEV, generator=torch.Generator(DEV).manual_seed(tokens))
    _, ids = moe.moe_route(logits, 8, True)
    for bm in (16, 64):
        got, want = moe.moe_align(ids, 128, bm), moe.moe_align_ref(ids, 128, bm)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("M", [1, 8, 16, 64, 128])
@pytest.mark.parametrize("shape", [(6144, 4096, None), (4096, 4096, None), (28672, 4096, None),
                                   (4096, 14336, "silu_mul")])
def test_gpu_tiled_linear_real_sizes(M, shape):
    """Every named configuration of the tiled linear at the Llama-3-8B projections, against the fp32 reference,
    into a poisoned output, through a shared scratch left zeroed."""
    from gpu_engine.kernels.tiled_linear import TILED_CONFIGS, linear_ref, tiled_linear, tiled_scratch

    N, K, act = shape
    x = torch.randn(M, 2 * K if act else K, device=DEV, dtype=torch.bfloat16)
    w = (torch.randn(N, K, device=DEV) * 0.02).bfloat16()
    want = linear_ref(x, w, act).float()
    for name, config in TILED_CONFIGS.items():
        scratch = tiled_scratch([(N, K)], [config], DEV)
        out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16)
        got = tiled_linear(x, w, act=act, out=out, **config._asdict(), scratch=scratch).float()
        assert float((got - want).norm() / want.norm()) < 1e-2, name
        assert int(scratch[1].abs().sum()) == 0, name


@pytest.mark.parametrize("M", [1, 8, 64])
def test_gpu_tiled_linear_fused_forms_real_sizes(M):
    """The fused forms at the Llama-3-8B sizes through the configurations the h200 plan gives them (`H200_LINEARS`):
    gate_up with its SiLU as output and with the RMSNorm on its x tiles; qkv with the norm, and with `qkv_prep` as
    its output (a program a head); o and down (split over K) added into a residual. Each against the unfused steps'
    fp32 reference; the glu output has the bits of the two halves' products followed by `silu_and_mul`, and the
    add's those of the product followed by `rms_norm`'s residual add, so turning the fusion on changes no bit
    there."""
    from gpu_engine.kernels.activation import silu_and_mul
    from gpu_engine.kernels.plan import H200_LINEARS
    from gpu_engine.kernels.rmsnorm import rms_norm
    from gpu_engine.kernels.tiled_linear import TILED_CONFIGS, Heads, tiled_linear, tiled_ref, tiled_scratch

    def close(got, want, what):
        assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2, what

    g = torch.Generator(device=DEV).manual_seed(M)
    nw = (torch.rand(4096, device=DEV, generator=g) + 0.5).bfloat16()
    x = (torch.randn(M, 4096, device=DEV, generator=g) * 4).bfloat16()
    for N, K, name in ((28672, 4096, "n128_k64_s4_w8"), (6144, 4096, "n64_k128_s4"), (4096, 4096, "n64_k128_s4_x2"),
                       (4096, 14336, "n64_k128_s4_x2")):
        assert name in {c for _, c in H200_LINEARS[N, K]}, (N, K, name)
        config = TILED_CONFIGS[name]
        w = (torch.randn(N, K, device=DEV, generator=g) * 0.02).bfloat16()
        scratch = tiled_scratch([(N, K)], [config, config._replace(block_n=128)], DEV)  # and head-wide tiles
        run = {**config._asdict(), "scratch": scratch}
        if N == 28672:
            half = {**run, "block_n": config.block_n // 2}
            apart = silu_and_mul(torch.cat([tiled_linear(x, h, **half) for h in w.chunk(2)], 1))
            assert torch.equal(tiled_linear(x, w, act="glu", **run), apart)
            close(tiled_linear(x, w, act="glu", norm=(nw, 1e-5), **run), tiled_ref(x, w, "glu", (nw, 1e-5)), name)
        elif N == 6144:
            close(tiled_linear(x, w, norm=(nw, 1e-5), **run), tiled_ref(x, w, None, (nw, 1e-5)), name)
            # with qkv_prep as the product's output (32 query and 8 KV heads of 128, Qwen3's QK norms): the rotated
            # queries and the caches at the rows' slots as the product followed by the reference preparation
            cache = rope.build_rope_cache(128, 4096, 500000.0, device=DEV)
            pos = torch.randint(0, 4096, (M,), device=DEV, generator=g)
            slots = torch.randperm(64 * 16, device=DEV, generator=g)[:M]
            qk = [(torch.rand(128, device=DEV, generator=g) + 0.5).bfloat16() for _ in range(2)]
            caches = [torch.zeros(64, 16, 8, 128, device=DEV, dtype=torch.bfloat16) for _ in range(4)]
            got = tiled_linear(x, w, norm=(nw, 1e-5), heads=Heads(32, 8, pos, cache, *caches[:2], slots, *qk), **run)
            want = tiled_ref(x, w, None, (nw, 1e-5), heads=Heads(32, 8, pos, cache, *caches[2:], slots, *qk))
            close(got[:, :4096], want[:, :4096], "heads q")
            close(caches[0], caches[2], "heads k")
            close(caches[1], caches[3], "heads v")
        else:
            a = (torch.randn(M, K, device=DEV, generator=g)).bfloat16()
            residual = torch.randn(M, N, device=DEV, generator=g).bfloat16()
            held, plain = residual.clone(), tiled_linear(a, w, **run)
            tiled_linear(a, w, residual=held, **run)
            want_res = residual.clone()
            rms_norm(plain, nw, 1e-5, residual=want_res)  # the sum it writes back is the unfused add
            assert torch.equal(held, want_res), name
        assert int(scratch[1].abs().sum()) == 0, name


def test_gpu_tiled_linear_bits_do_not_depend_on_the_step_within_a_size_nor_on_replay():
    """down (split over K) and gate_up (whole) at 65-128 rows: a row's bits are the same whichever of those sizes
    its step has, launch after launch, and replayed from a CUDA graph."""
    from gpu_engine.kernels.tiled_linear import TILED_CONFIGS, tiled_linear, tiled_scratch

    config = TILED_CONFIGS["n64_k128_s4"]
    for N, K, act in ((4096, 14336, "silu_mul"), (28672, 4096, None)):
        x = torch.randn(128, 2 * K if act else K, device=DEV, dtype=torch.bfloat16)
        w = (torch.randn(N, K, device=DEV) * 0.02).bfloat16()
        scratch = tiled_scratch([(N, K)], [config], DEV)
        full = tiled_linear(x, w, act=act, **config._asdict(), scratch=scratch)
        for M in (65, 100, 127):
            assert torch.equal(tiled_linear(x[:M], w, act=act, **config._asdict(), scratch=scratch), full[:M]), M
        out = torch.empty_like(full)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            tiled_linear(x, w, act=act, out=out, **config._asdict(), scratch=scratch)
        for _ in range(3):
            out.fill_(float("nan"))
            graph.replay()
            assert torch.equal(out, full)
