"""bench.kernels' decode-attention cases without a GPU: each variant it times, given as keywords by
`attention_variant`, runs in the Triton interpreter and gives the runner's form's result (the same bits where only
the launch differs: the last program's fold, the warps, the staging; within rounding where the split size or tile
differs), so that a broken case shows here, not in a GPU run."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import bench.kernels as bk  # noqa: E402
from gpu_engine.kernels.attention import DECODE_FORMS, decode_attention  # noqa: E402


def test_every_attention_variant_gives_the_runner_form_s_result():
    g = torch.Generator().manual_seed(0)
    lens, bs, hkv, d = [700, 1, 300, 0, 520], 16, 2, 16
    width = 48  # 768 tokens: 3 splits of 256 in the table, rows of 0-3 splits
    kc = torch.randn(100, bs, hkv, d, generator=g)  # the rows take 97 blocks
    vc = torch.randn(100, bs, hkv, d, generator=g)
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        nb = -(-n // bs)
        tables[b, :nb] = torch.arange(used, used + nb, dtype=torch.int32)
        used += nb
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), 8, d, generator=g)
    runner = bk.attention_variant(next(iter(bk.ATTENTION_VARIANTS)))
    assert runner == {"partition_size": 256, "block_n": 128, "form": "split", "num_warps": 4, "num_stages": None}
    want = decode_attention(q, kc, vc, tables, ctx, 0.25, **runner)
    assert not want.isnan().any() and not want[3].any()  # the empty row: zeros
    assert bk.attention_variant("p256_bn128_last")["form"] == "last"
    assert {bk.attention_variant(name)["form"] for name in bk.ATTENTION_VARIANTS} == set(DECODE_FORMS)
    for name in bk.ATTENTION_VARIANTS:
        how = bk.attention_variant(name)
        counters = torch.zeros(len(lens) * hkv, dtype=torch.int32) if how["form"] == "last" else None
        got = decode_attention(q, kc, vc, tables, ctx, 0.25, out=torch.full_like(q, float("nan")), counters=counters,
                               **how)
        if (how["partition_size"], how["block_n"]) == (256, 128):
            assert torch.equal(got, want), name
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert counters is None or not counters.any()


def test_every_prefill_variant_is_a_prefill_attention_setting() -> None:
    """The prefill rows' variants (the default grid by the step's sequences, `packed_grid` and `seq_grid` each
    grid) name keywords that `prefill_attention` takes, so none of them fails only on the GPU."""
    import inspect

    from bench.kernels import PREFILL_VARIANTS
    from gpu_engine.kernels.attention import prefill_attention

    params = inspect.signature(prefill_attention).parameters
    for name, kw in PREFILL_VARIANTS.items():
        assert set(kw) <= set(params), name
    assert PREFILL_VARIANTS["seq_grid"] == {"grid": "seq"} and PREFILL_VARIANTS["packed_grid"] == {"grid": "packed"}
    assert params["grid"].default == "auto" and PREFILL_VARIANTS["default"] == {}


def test_attn_stride_lanes_give_the_runner_s_bits():
    """bench/attn_stride.py's kernel (a few programs a (row, KV head), each striding over the row's splits) against
    the runner's decode attention: the same split sums folded in the same order, so every lane count, a lane per
    split included, gives the same bits; an empty row zero (the output starts poisoned)."""
    from bench.attn_stride import LANES, stride_attention

    g = torch.Generator().manual_seed(1)
    # 800 tokens a table: 7 splits of 128. The first row's context (950) runs past its table (a caller's error):
    # each form computes the table's 7 splits, whose last reads the next row's first entries, valid blocks.
    lens, bs, hkv, d = [950, 300, 17, 0, 700, 1, 129], 16, 2, 16
    width = 50
    blocks = [min(-(-n // bs), width) for n in lens]
    kc = torch.randn(sum(blocks) + 1, bs, hkv, d, generator=g)
    vc = torch.randn_like(kc)
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    used = 0
    for b, nb in enumerate(blocks):
        tables[b, :nb] = torch.arange(used, used + nb, dtype=torch.int32)
        used += nb
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), 8, d, generator=g)
    want = decode_attention(q, kc, vc, tables, ctx, 0.25, partition_size=128, block_n=64)
    for lanes in (1, 3, *LANES):
        got = stride_attention(q, kc, vc, tables, ctx, 0.25, torch.full_like(q, float("nan")), lanes,
                               partition_size=128, block_n=64)
        assert torch.equal(got, want), lanes
    assert not want[3].any()
