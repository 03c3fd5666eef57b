"""bench/roofline.py without a GPU: its plot from a result file (what `--plot-only` draws)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _row(model: str, batch: int, ctx: int, ms: float, floor: float) -> dict:
    return {"model": model, "phase": "decode", "batch": batch, "context": ctx, "tokens": batch, "ms": ms,
            "floor_ms": floor}


def test_plot_only_draws_the_decode_rows_of_a_result_file(tmp_path: Path) -> None:
    """The plot is made from the file alone (no CUDA), one panel per model, and a PNG comes out; prefill rows
    are not decode rows and are left out rather than breaking the panels."""
    pytest.importorskip("matplotlib")
    result = {"device": "test", "hbm_gbps_measured": 4000.0, "rows": [
        _row("llama3-8b-shape", 1, 512, 4.75, 3.53), _row("llama3-8b-shape", 64, 512, 6.27, 4.52),
        _row("llama3-8b-shape", 1, 2048, 4.86, 3.58), _row("qwen3-30b-a3b-shape", 64, 512, 18.4, 14.7),
        {"model": "llama3-8b-shape", "phase": "prefill", "batch": 1, "context": 512, "tokens": 512, "ms": 12.9,
         "floor_ms": 9.3}]}
    out = tmp_path / "roofline.json"
    out.write_text(json.dumps(result))
    png = tmp_path / "roofline.png"
    res = subprocess.run([sys.executable, "bench/roofline.py", "--out", str(out), "--plot", str(png), "--plot-only"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(out.read_text()) == result  # drawing leaves the file as it was


def test_the_saturated_rate_model_counts_chunk_steps_and_decode_steps() -> None:
    """`saturated_rate`: with 128 decodes a step, a request of 1,000 prompt and 512 output tokens needs 4 steps'
    share (512 / 128); a 640-token budget (512 a chunk) makes about 2 of them chunk steps and the rest decode
    steps; a 256-token budget (128 a chunk) would need 8 chunk steps, more than the 4: every step carries a chunk
    and the prompts bound the rate. Only the rows of the largest decode batch count."""
    sys.path.insert(0, str(ROOT))
    from bench.roofline import saturated_rate

    def mixed(decodes: int, tokens: int, ms: float, alone: float) -> dict:
        return {"phase": "mixed", "decodes": decodes, "tokens": tokens, "ms": ms, "decode_alone_ms": alone}

    rows = [mixed(128, 640, 20.0, 10.0), mixed(128, 256, 12.0, 10.0), mixed(32, 640, 1.0, 1.0),
            {"phase": "decode", "batch": 1, "ms": 5.0}]
    rates = saturated_rate(rows, prompt=1000.0, output=512.0)
    assert set(rates) == {640, 256}
    assert rates[640] == pytest.approx(1e3 / (1000 / 512 * 20.0 + (4 - 1000 / 512) * 10.0))
    assert rates[256] == pytest.approx(1e3 / (1000 / 128 * 12.0))
    assert saturated_rate([{"phase": "decode"}]) == {}


def test_a_run_of_some_batches_replaces_only_those_decode_rows() -> None:
    """`--batches 1,8 --models moe` measures the MoE decode rows of batches 1 and 8 again: those rows of the
    result file are replaced, and the other batches' rows, the dense model's and the prefill rows stay as the
    file has them (a run of a few rows must not wipe a full run's)."""
    sys.path.insert(0, str(ROOT))
    from bench.roofline import replaced

    moe, dense = "qwen3-30b-a3b-shape", "llama3-8b-shape"
    prefill = {"model": dense, "phase": "prefill", "batch": 1, "context": 512, "tokens": 512}
    assert replaced(_row(moe, 1, 512, 3.6, 1.4), ("moe",), (1, 8))
    assert replaced(_row(moe, 8, 2048, 10.3, 6.4), ("moe",), (1, 8))
    assert not replaced(_row(moe, 64, 512, 18.4, 14.7), ("moe",), (1, 8))
    assert not replaced(_row(dense, 1, 512, 4.5, 3.5), ("moe",), (1, 8))
    assert not replaced(prefill, ("dense",), (1,))
    assert replaced(prefill, ("dense",))  # a full run measures everything of its models again
    assert replaced(_row(moe, 64, 512, 18.4, 14.7), ("moe",))


def test_batches_that_no_model_runs_are_refused(tmp_path: Path) -> None:
    """A --batches list that names no decode batch of the models is refused before any GPU work (it would run
    nothing and rewrite the file)."""
    res = subprocess.run([sys.executable, "bench/roofline.py", "--models", "moe", "--batches", "32",
                          "--out", str(tmp_path / "r.json")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "--batches: none of [32]" in res.stderr


def test_a_run_of_large_batches_alone_sizes_its_tables_for_the_served_contexts() -> None:
    """`--batches 64,128` (no prefill rows, whose token counts used to widen the block tables) still stages the
    served steps' uneven contexts, rows of up to 6,144 tokens: the tables are as wide as the longest row and the
    cache holds every row's blocks; without served contexts the widths are the equal contexts' as before."""
    sys.path.insert(0, str(ROOT))
    from bench.kernels import served_contexts
    from bench.roofline import BLOCK, sizes

    served = tuple(served_contexts(b) for b in (64, 128))
    blocks, (batch, tokens, width) = sizes(2048, (64, 128), (), served)
    assert (batch, tokens) == (128, 128)
    assert width >= max(-(-n // BLOCK) for lens in served for n in lens) > 2048 // BLOCK + 1
    assert blocks >= max(sum(-(-n // BLOCK) for n in lens) for lens in served)
    assert blocks >= 128 * (2048 // BLOCK + 1)
    assert sizes(2048, (1, 8), ()) == (8 * 129, (8, 8, 129))
    assert sizes(2048, (1, 8), (8192,))[1] == (8, 8192, 512)


def test_the_plan_setting_names_a_plan_or_one_configuration_for_every_weight() -> None:
    """`--plan`: auto, the engine's plan for the GPU (`resolve_plan`: the H200's on an H200, cuBLAS on any other); a
    `PLANS` name, that plan whatever the GPU; a `TILED_CONFIGS` name, that configuration for every dense weight, with
    the fused forms after +fused; anything else refused, naming the choices."""
    sys.path.insert(0, str(ROOT))
    from bench.roofline import bench_plan
    from gpu_engine.kernels.plan import PLANS, KernelPlan

    assert bench_plan("auto", "NVIDIA H200") is PLANS["h200"]
    assert bench_plan("auto", "NVIDIA H100 80GB HBM3") is PLANS["h100"]
    assert bench_plan("auto", "NVIDIA L4") is PLANS["cublas"]
    assert bench_plan("h200", "NVIDIA H100 80GB HBM3") is PLANS["h200"]
    assert bench_plan("cublas", "NVIDIA H200") is PLANS["cublas"]
    assert bench_plan("n64_k128_s4", "NVIDIA H200") == KernelPlan.every_weight("n64_k128_s4")
    fused = bench_plan("n64_k128_s4+fused", "NVIDIA H200")
    assert fused == KernelPlan.every_weight("n64_k128_s4", fused=True) and fused.name == "n64_k128_s4+fused"
    for bad in ("fastest", "n64_k128_s4+fast", "n64_k128_s4+", "h200+fused", "off"):
        with pytest.raises(SystemExit, match="--plan"):
            bench_plan(bad, "NVIDIA H200")


def test_the_kv_dtype_setting_pairs_each_weight_form_with_each_cache() -> None:
    """`--kv-dtype bf16,fp8`: the dense model runs once per pairing of a `--weights` form and a cache, bf16 weights
    first, the MoE model once in bf16; an FP8 cache's rows are named with `-kvfp8` after the weights' suffix, a full
    dense run replaces them, and anything but bf16 and fp8 is refused naming the flag."""
    sys.path.insert(0, str(ROOT))
    from bench.roofline import KV_DTYPES, WEIGHTS, forms, label, parse_forms, replaced

    assert parse_forms("bf16,fp8", tuple(KV_DTYPES), "--kv-dtype") == ("bf16", "fp8")
    assert parse_forms("fp8-gemv", WEIGHTS, "--weights") == ("fp8-gemv",)
    for bad in ("", "fp16", "bf16,e5m2"):
        with pytest.raises(SystemExit, match="--kv-dtype: pick from bf16, fp8"):
            parse_forms(bad, tuple(KV_DTYPES), "--kv-dtype")
    assert forms("dense", ("bf16", "fp8"), ("bf16", "fp8")) == [("bf16", "bf16"), ("bf16", "fp8"), ("fp8", "bf16"),
                                                                ("fp8", "fp8")]
    assert forms("moe", ("bf16", "fp8"), ("fp8",)) == [("bf16", "bf16")]
    dense = "llama3-8b-shape"
    assert [label(dense, w, kv) for w, kv in forms("dense", ("bf16", "fp8-gemv"), ("bf16", "fp8"))] == [
        dense, f"{dense}-kvfp8", f"{dense}-fp8-gemv", f"{dense}-fp8-gemv-kvfp8"]
    assert replaced(_row(f"{dense}-fp8-kvfp8", 8, 512, 5.0, 2.5), ("dense",))
    assert replaced(_row(f"{dense}-kvfp8", 8, 512, 5.0, 2.5), ("dense",), (8,))
    assert not replaced(_row(f"{dense}-kvfp8", 8, 512, 5.0, 2.5), ("moe",))


def test_an_fp8_cache_counts_a_byte_an_element_and_tags_its_rows() -> None:
    """The decode floor's KV bytes a token (every layer's keys and values): two an element in bf16, one in FP8 (the
    Llama-3-8B shape: 128 KiB and 64 KiB); an FP8 cache's rows say so (`kv_dtype`), a bf16 one's carry no key."""
    sys.path.insert(0, str(ROOT))
    import torch

    from bench.roofline import KV_DTYPES, LLAMA3_8B, kv_token_bytes, tag_rows
    from gpu_engine.models.config import ModelConfig
    from gpu_engine.models.fp8_checkpoint import Fp8Scheme

    cfg = ModelConfig.from_hf(LLAMA3_8B)
    assert kv_token_bytes(cfg) == kv_token_bytes(cfg, KV_DTYPES["bf16"]) == 128 * 1024
    assert kv_token_bytes(cfg, KV_DTYPES["fp8"]) == 64 * 1024
    assert KV_DTYPES["fp8"] == torch.float8_e4m3fn
    rows = [{"model": "a"}, {"model": "b"}]
    tag_rows(rows, Fp8Scheme(), torch.float8_e4m3fn)
    assert rows == [{"model": m, "fp8": "channel/token", "kv_dtype": "float8_e4m3fn"} for m in "ab"]
    rows = [{"model": "a"}]
    tag_rows(rows, None, torch.bfloat16)
    assert rows == [{"model": "a"}]


def test_an_unknown_kv_dtype_is_refused_before_any_gpu_work(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "bench/roofline.py", "--kv-dtype", "fp8_e5m2", "--out",
                          str(tmp_path / "r.json")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "--kv-dtype: pick from bf16, fp8" in res.stderr
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("first", ["bench.roofline", "bench.kernels"])
def test_the_bench_modules_import_in_either_order(first: str) -> None:
    """bench.kernels imports nothing of bench.roofline (which takes `active_experts` from it): either module imports
    first in a fresh process, bench.kernels alone leaves bench.roofline unloaded, and `active_experts` is the
    expected count of distinct experts under uniform routing (top-8 of 128: 8 at one token)."""
    code = "\n".join((
        "import importlib, sys",
        "importlib.import_module(sys.argv[1])",
        "assert sys.argv[1] == 'bench.roofline' or 'bench.roofline' not in sys.modules",
        "import bench.roofline, bench.kernels as k",
        "cfg = type('C', (), {'num_experts': 128, 'num_experts_per_tok': 8})",
        "assert k.active_experts(cfg, 1) == 8 and 8 < k.active_experts(cfg, 8) < 64"))
    res = subprocess.run([sys.executable, "-c", code, first], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_decode_rows_whose_kv_cache_does_not_fit_are_skipped_and_the_others_keep_their_sizes() -> None:
    """`fit_rows`: the MoE shape's KV is 96 KiB a token; with the about 21.8 GiB an 80 GB card has free after its 61 GB
    of weights, less the 4 GiB margin, batch 128 at 2,048 tokens (24.2 GiB) is skipped and recorded with its bytes and
    the free bytes, every other row kept in the run's order; on an H200 (about 82 GiB free) every row is kept. The kept
    rows run as before: the same batches' graphs and runner limits, the cache the largest kept row's; with every row
    kept, the cache `sizes` gives (served rows too, whose record says context -1). A skip record is replaced by a
    run of its model and batch as a row is."""
    sys.path.insert(0, str(ROOT))
    from bench.kernels import served_contexts
    from bench.roofline import (
        BLOCK,
        CONTEXTS,
        DECODE_BATCHES,
        KV_MARGIN,
        MOE_BATCHES,
        QWEN3_30B_A3B,
        SERVED_BATCHES,
        fit_rows,
        fitted_sizes,
        kv_token_bytes,
        replaced,
        row_blocks,
        sizes,
    )
    from gpu_engine.models.config import ModelConfig

    token = kv_token_bytes(ModelConfig.from_hf(QWEN3_30B_A3B))
    assert token == 96 * 1024 and KV_MARGIN == 4 * 2**30
    rows = [(b, ctx) for ctx in CONTEXTS for b in MOE_BATCHES]
    free = int(21.8 * 2**30)
    kept, skipped = fit_rows(rows, token, free)
    assert kept == [r for r in rows if r != (128, 2048)]
    need = 128 * (2048 // BLOCK + 1) * BLOCK * token
    assert skipped == [{"phase": "decode", "batch": 128, "context": 2048, "kv_bytes": need, "free_bytes": free,
                        "margin_bytes": KV_MARGIN, "reason": skipped[0]["reason"]}]
    assert "24.19 GiB" in skipped[0]["reason"] and "21.80 GiB" in skipped[0]["reason"]
    assert fit_rows(rows, token, 82 * 2**30) == (rows, [])

    batches, blocks, limits = fitted_sizes(max(CONTEXTS), MOE_BATCHES, kept, ())
    full_blocks, full_limits = sizes(max(CONTEXTS), MOE_BATCHES, ())
    assert (batches, limits) == (list(MOE_BATCHES), full_limits)
    assert blocks == 64 * (2048 // BLOCK + 1) == row_blocks(64, 2048) < full_blocks
    assert fitted_sizes(max(CONTEXTS), MOE_BATCHES, rows, ()) == (list(MOE_BATCHES), full_blocks, full_limits)
    assert fitted_sizes(max(CONTEXTS), MOE_BATCHES, [(1, 512), (8, 512)], ())[0] == [1, 8]

    # a row fits up to the byte; the margin is what the caller passes
    edge = row_blocks(8, 512) * BLOCK * token
    assert fit_rows([(8, 512)], token, edge + KV_MARGIN)[0] == [(8, 512)]
    assert fit_rows([(8, 512)], token, edge + KV_MARGIN - 1)[0] == []
    assert fit_rows([(8, 512)], token, edge, margin=0)[0] == [(8, 512)]

    # the dense shape's rows with served contexts: all kept, the cache and limits are today's
    dense = [(b, ctx) for ctx in CONTEXTS for b in DECODE_BATCHES]
    served = [(b, served_contexts(b)) for b in SERVED_BATCHES]
    kept, skipped = fit_rows(dense + served, 128 * 1024, 64 * 2**30)
    assert (kept, skipped) == (dense + served, [])
    assert fitted_sizes(max(CONTEXTS), DECODE_BATCHES, kept, (512, 2048, 8192)) == (
        list(DECODE_BATCHES), *sizes(max(CONTEXTS), DECODE_BATCHES, (512, 2048, 8192), tuple(c for _, c in served)))
    assert row_blocks(128, served[-1][1]) == sum(n // BLOCK + 1 for n in served[-1][1])
    _, skipped = fit_rows(served[-1:], 128 * 1024, KV_MARGIN)
    assert [(s["batch"], s["context"]) for s in skipped] == [(128, -1)]

    record = {"model": "qwen3-30b-a3b-shape", **fit_rows(rows, token, free)[1][0]}
    assert replaced(record, ("moe",)) and replaced(record, ("moe",), (128,)) and not replaced(record, ("moe",), (64,))
