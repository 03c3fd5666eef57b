"""bench/trace: the arithmetic of a traced step (busy time as the union of kernel intervals, gaps, families), the
rows it stages, its tables and its figure, on made-up launches (the trace itself needs a CUDA device)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import trace

KERNELS = [("sm90_xmma_gemm_bf16", 0.0, 40.0), ("_decode_kernel", 50.0, 70.0), ("_fold_kernel", 65.0, 80.0),
           ("rmsnorm_kernel", 100.0, 105.0), ("sm90_xmma_gemm_bf16", 105.0, 145.0)]


def test_busy_time_is_the_union_of_intervals() -> None:
    assert trace.busy_us([]) == 0.0
    assert trace.busy_us([(0, 10), (5, 15), (20, 30), (22, 25)]) == 25.0
    assert trace.busy_us([(20, 30), (0, 10)]) == 20.0


def test_a_launch_summary_splits_span_into_kernels_and_gaps() -> None:
    got = trace.summarize(KERNELS)
    assert got["kernels"] == 5 and got["span_us"] == 145.0
    assert got["busy_us"] == 40 + 30 + 5 + 40  # the two attention kernels overlap by 5 µs
    assert got["gap_us"] == 145.0 - got["busy_us"]
    assert got["by_kernel"]["sm90_xmma_gemm_bf16"] == {"calls": 2, "us": 80.0, "family": "gemm"}
    assert got["by_family"] == {"gemm": 80.0, "decode attention": 35.0, "norm": 5.0}
    assert trace.summarize([])["span_us"] == 0.0


def test_kernel_families() -> None:
    assert trace.family("triton_poi_fused_silu_mul") == "activation"
    assert trace.family("_prefill_kernel") == "prefill attention"
    assert trace.family("_qkv_prep_kernel") == "qkv prep / rope / kv write"
    assert trace.family("nvjet_hsh_128x256") == "gemm" == trace.family("_tiled_heads_kernel")
    assert trace.family("something_new") == "other"


def test_the_median_launch_is_reported_with_every_span() -> None:
    launches = [trace.summarize(KERNELS[:n]) for n in (5, 2, 3)] + [trace.summarize([])]
    got = trace.median_launch(launches)
    assert got["span_us"] == 80.0 and sorted(got["spans_us"]) == [70.0, 80.0, 145.0]
    assert trace.median_launch([trace.summarize([])])["kernels"] == 0


def test_step_rows_are_decodes_then_the_prompt_chunk_on_disjoint_blocks() -> None:
    seqs = trace.step_seqs([17, 32, 1], 40, 16)
    assert [(c, n) for c, n, _ in seqs] == [(16, 1), (31, 1), (0, 1), (0, 40)]
    blocks = [b for _, _, table in seqs for b in table]
    assert blocks == list(range(len(blocks)))  # every row's blocks after the previous row's, none shared
    assert [len(t) for _, _, t in seqs] == [2, 2, 1, 3]
    assert trace.step_seqs([5], 0, 16) == [(4, 1, [0])]


def result_of(launch: dict) -> dict:
    empty = trace.summarize([])
    return {"device": "made-up", "plan": "cublas", "copy_gbps": 3000.0, "matmul_tflops": 700.0, "decodes": 2,
            "budget": 16, "context_mean": 20.0,
            "steps": {"decode": {"shape": [True, 2, 2], "chunk": 0, "floor_ms": 0.1, "device": launch,
                                 "host": empty}}}


def test_tables_and_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    launch = trace.median_launch([trace.summarize(KERNELS)])
    rows = trace.table_rows(launch)
    assert any(r.split()[:1] == ["gemm"] and "0.080" in r for r in rows)
    assert any(r.strip().startswith("gaps (no kernel running)") for r in rows)
    trace.print_tables(result_of(launch))
    out = capsys.readouterr().out
    assert "decode step, device-launched: span 0.145 ms (floor 0.100 ms, 1.45x)" in out
    assert "decode step, host-launched: CUPTI recorded no kernels" in out
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(result_of(launch)))
    trace.main(["--out", str(path), "--plot", str(tmp_path / "t.png"), "--plot-only"])
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_moe_kernels_have_their_own_families() -> None:
    """The expert kernels are not counted as activations or GEMMs, the routing and sort not as sampling."""
    assert trace.family("_gate_up_silu_kernel") == "moe experts" == trace.family("_moe_gemm_kernel")
    assert trace.family("_down_sum_kernel") == "moe experts"
    assert trace.family("_align_count_kernel") == trace.family("_align_place_kernel") == trace.family(
        "_align_one_kernel") == "moe routing / sort" == trace.family("_router_kernel")
    assert trace.family("_route_kernel") == "moe routing / sort"


def test_the_model_shapes_and_their_depth() -> None:
    moe = trace.model_config("moe", None)
    assert moe["architectures"] == ["Qwen3MoeForCausalLM"] and moe["num_hidden_layers"] == 48
    cut = trace.model_config("moe", 8)
    assert cut == {**moe, "num_hidden_layers": 8}
    assert trace.model_config("8b", None)["architectures"] == ["LlamaForCausalLM"]
    for bad in (0, 49):
        with pytest.raises(SystemExit, match="--layers"):
            trace.model_config("moe", bad)
    with pytest.raises(SystemExit, match="--layers"):  # refused before any CUDA work, on any host
        trace.main(["--model", "moe", "--layers", "99"])


def test_the_moe_floor_counts_only_the_routed_experts() -> None:
    """A token of Qwen3-30B-A3B is multiplied by about 2.7B of its 29.9B decoder parameters (8 of 128 experts):
    the floor's FLOPs count those, its bytes only the experts a step's tokens route to; the dense shape counts all."""
    torch = pytest.importorskip("torch")
    from bench.roofline import layer_params, weight_bytes
    from gpu_engine.models.config import ModelConfig
    from gpu_engine.models.loader import build_empty

    def meta_model(shape: str):
        return build_empty(ModelConfig.from_hf(trace.model_config(shape, None)), torch.bfloat16, "meta")

    moe, dense = meta_model("moe"), meta_model("8b")
    every = sum(p.numel() for n, p in moe.named_parameters() if n.startswith("layers."))
    assert 29e9 < every < 31e9 and 2.6e9 < layer_params(moe) < 2.9e9
    assert layer_params(dense) == sum(p.numel() for n, p in dense.named_parameters() if n.startswith("layers."))
    stored = 2 * sum(p.numel() for p in moe.parameters())  # bf16
    assert weight_bytes(moe, 1) < weight_bytes(moe, 128) < weight_bytes(moe, 1024) <= stored
    assert weight_bytes(dense, 1) == weight_bytes(dense, 1024)
    cfg = moe.config
    decode = trace.floor_ms(cfg, moe, [1000] * 4, 0, 3000.0, 700.0)
    mixed = trace.floor_ms(cfg, moe, [1000] * 4, 1020, 3000.0, 700.0)
    kv = 4 * 1000 * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    assert decode == pytest.approx((weight_bytes(moe, 4) + kv) / 3e12 * 1e3)
    assert mixed >= (weight_bytes(moe, 1024) + kv) / 3e12 * 1e3
