"""bench/graph_memory.py's parts that need no GPU: the probed shapes, the per-node summary, the CLI's checks."""

from __future__ import annotations

import pytest

from bench import graph_memory as gm
from gpu_engine.gpu.graph_grid import mixed_buckets
from gpu_engine.kernels import moe


def test_the_probes_are_graphs_the_engine_captures() -> None:
    """A decode graph of the full batch, the largest mixed graph within 256 tokens, and the largest: every mixed step
    of the budget, the probed and the timed, sorts its experts in the engine's kernels, not torch's sort."""
    decode, small, large = gm.probe_shapes()
    assert decode == (True, gm.MAX_BATCH, gm.MAX_BATCH)
    captured = set(mixed_buckets(gm.MAX_BATCH, gm.BUDGET))
    assert (small[1], small[2]) in captured and (large[1], large[2]) in captured
    top_k = gm.hf_config("moe", None)["num_experts_per_tok"]
    assert large[2] == gm.BUDGET and max(tokens for _, tokens in captured) == gm.BUDGET
    assert all(t * top_k <= moe.ALIGN_KERNEL_PAIRS for t in (small[2], large[2], *gm.ALIGN_TOKENS))


def test_the_summary_divides_memory_by_nodes() -> None:
    rows = [{"nodes": 1000, "host_exec_mib": 4.0, "device_exec_mib": 3.0},
            {"nodes": 3000, "host_exec_mib": 12.0, "device_exec_mib": 9.0},
            {"nodes": None, "host_exec_mib": 50.0, "device_exec_mib": 50.0}]  # not counted: left out
    assert gm.summary(rows) == {"host_exec_kib_per_node": 4.1, "device_exec_kib_per_node": 3.07}
    assert gm.summary([]) == {"host_exec_kib_per_node": None, "device_exec_kib_per_node": None}


def test_fewer_layers_change_only_the_depth() -> None:
    full, cut = gm.hf_config("moe", None), gm.hf_config("moe", 4)
    assert cut["num_hidden_layers"] == 4 and full["num_hidden_layers"] == 48
    assert {k: v for k, v in cut.items() if k != "num_hidden_layers"} == \
        {k: v for k, v in full.items() if k != "num_hidden_layers"}


def test_unknown_parts_are_refused() -> None:
    with pytest.raises(SystemExit):
        gm.main(["--parts", "parts,nodes"])


def test_the_sort_limit_is_restored() -> None:
    was = moe.ALIGN_KERNEL_PAIRS
    with pytest.raises(RuntimeError), gm.align_pairs(0):
        assert moe.ALIGN_KERNEL_PAIRS == 0
        raise RuntimeError
    assert moe.ALIGN_KERNEL_PAIRS == was
