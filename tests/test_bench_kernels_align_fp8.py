"""bench.kernels' MoE align rows and FP8-cache attention rows (decode and prefill) without a GPU: every case they
would time runs on small shapes in the Triton interpreter, and each gives what its row says (the sort's arrays; the
attention of its cache and product form), so that a broken case shows here, not in a GPU run."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import bench.kernels as bk  # noqa: E402
from gpu_engine.kernels import moe  # noqa: E402


def _once(monkeypatch) -> list:
    """graph_ms replaced by one call of the step, its result kept."""
    calls: list = []

    def once(fn, *args, **kwargs):
        calls.append(fn())
        return 1e-3

    monkeypatch.setattr(bk, "graph_ms", once)
    return calls


def test_align_rows_time_every_form_and_each_gives_the_sorted_arrays(monkeypatch) -> None:
    calls = _once(monkeypatch)
    monkeypatch.setitem(bk.MOE_SHAPE, "experts", 16)  # a smaller one-hot for the interpreter; the top 8 as served
    tokens = (2, 20, 80)  # 16, 160 and 640 pairs: the one launch, then two (every form at every size, forced)
    rows = bk.moe_align_rows(1000.0, layers=2, tokens=tokens, device="cpu")
    cases = {"torch_sort", "served", "one_launch c64"} | {f"two_launch c{c}" for c in bk.ALIGN_CHUNKS}
    assert [r["batch"] for r in rows] == [t for t in tokens for _ in cases]
    assert {r["case"] for r in rows} == cases and len(rows) == len(calls)
    assert all(r["same_arrays"] for r in rows), [r for r in rows if not r["same_arrays"]]
    heights = {t: {r["block_m"] for r in rows if r["batch"] == t} for t in tokens}
    assert heights == {2: {16}, 20: {64}, 80: {64}}
    for r, (sorted_pairs, block_expert) in zip(rows, calls, strict=True):  # the call timed is the row's form
        assert sorted_pairs.numel() % r["block_m"] == 0 and block_expert.numel() == sorted_pairs.numel() // r["block_m"]
    assert moe.ONE_LAUNCH_PAIRS < 160 <= moe.ALIGN_KERNEL_PAIRS


def test_fp8_attention_rows_time_three_forms_each_with_its_cache_and_queries(monkeypatch) -> None:
    """Decode and prefill rows, each call given its row's cache and queries (recorded from the launchers: `fp8_f16`'s
    in fp16). With fp16 queries already (the interpreter's bf16 products overflow) the two FP8 forms give the same
    bits; the bf16 cache's output (here fp16) near the FP8 ones; each row's bytes its cache's; the prefill rows'
    FLOPs the causal pairs'."""
    from gpu_engine.kernels import attention

    calls = _once(monkeypatch)
    seen: list[tuple[str, torch.dtype, torch.dtype]] = []
    def spying(name: str):
        fn = getattr(attention, name)

        def spy(*args, **kwargs):
            seen.append((name, args[1].dtype, args[0].dtype))
            return fn(*args, **kwargs)
        return spy

    for launcher in ("decode_attention", "prefill_attention"):
        monkeypatch.setattr(attention, launcher, spying(launcher))
    prefill = {"prompt_20": [(20, 20)], "mixed_2_8": [(1, 5), (1, 40), (8, 8)]}
    rows = bk.attention_fp8_rows(1000.0, width=4, contexts=[[5, 40], [16, 16]], device="cpu", dtype=torch.float16,
                                 prefill=prefill)
    assert [r["case"] for r in rows] == ["bf16_cache", "fp8_query", "fp8_f16"] * 4
    assert [r["kernel"] for r in rows] == ["decode_attention_fp8"] * 6 + ["prefill_attention_fp8"] * 6
    fp8 = torch.float8_e4m3fn
    half = torch.float16
    assert seen == [(f"{k}_attention", dt, half) for k in ("decode", "decode", "prefill", "prefill")
                    for dt in (half, fp8, fp8)]
    assert [r["context"] for r in rows[:6]] == [-1] * 3 + [16] * 3
    assert [(r["shape"], r["tokens"], r["flops"]) for r in rows[6::3]] == [
        ("prompt_20", 20, 4 * 32 * 128 * 210), ("mixed_2_8", 10, 4 * 32 * 128 * 36)]
    for i in (0, 3, 6, 9):
        cache, query, f16 = calls[i: i + 3]
        assert torch.equal(query, f16) and rows[i + 2]["max_abs_diff_vs_fp8_query"] == 0.0
        assert "max_abs_diff_vs_fp8_query" not in rows[i + 1] and "max_abs_diff_vs_bf16_cache" not in rows[i]
        assert rows[i + 1]["max_abs_diff_vs_bf16_cache"] == rows[i + 2]["max_abs_diff_vs_bf16_cache"] > 0
        torch.testing.assert_close(query.float(), cache.float(), rtol=0.15, atol=0.15)
        assert rows[i]["bytes"] > rows[i + 1]["bytes"] == rows[i + 2]["bytes"]
    q, kc = torch.zeros(2, 4, 8, dtype=torch.bfloat16), torch.zeros(3, 16, 1, 8, dtype=torch.bfloat16)
    forms = bk._fp8_forms(q, kc, kc)  # bf16 queries, as on a GPU: the experiment's in fp16, the others as they are
    assert [(f[0].dtype, f[1].dtype) for f in forms.values()] == [
        (torch.bfloat16, torch.bfloat16), (torch.bfloat16, fp8), (torch.float16, fp8)]
