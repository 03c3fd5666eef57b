"""Where the memory of a step's CUDA graphs goes, and what would give it back to the KV cache (an experiment).

The engine sizes its KV cache from the memory free after the weights and captures its graphs afterwards. For the
Qwen3-30B-A3B shape on an 80 GB card the graphs took 6,168 MiB (236 graphs at 128 sequences and a 1,024-token
budget), more than the default fraction leaves (docs/GPU_NOTES.md). Each graph is instantiated five times: torch's
host executable, which only the start's probes replay, and the four device-launch copies the scheduler rotates;
a mixed graph past 256 tokens has about three times the kernels of a smaller one, since the expert sort past
``kernels.moe.ALIGN_KERNEL_PAIRS`` token-expert pairs takes torch's launches instead of one kernel. Measured here,
on the model shape with random bf16 weights, the engine's kernel plan and a small cache:

- ``parts``: for a decode graph and two mixed ones, the free memory taken by the capture (torch's pool), by torch's
  host executable, by the first device-launch executable and by the three more, and the graph's kernel nodes; the
  mixed ones again with the one-launch sort up to 8,192 pairs (``--align-pairs``);
- ``align``: mixed steps (``--decodes`` decode rows at ``--context`` tokens beside a prompt chunk) of 272-1,024
  tokens with the sort as it is and with the one-launch sort, each a host-replayed graph (CUDA events, median of
  ``--iters``), and whether the two give the same logits bit for bit;
- ``grid``: the engine's whole graph set (``serve_gpu.decode_buckets`` and ``graph_grid.mixed_buckets``) captured
  as the engine does, its memory and nodes, then destroyed (``GraphCache.close``) and the memory given back: what a
  start that captures once against a small cache, sizes the cache, then captures again would see; once per sort.

    python -m bench.graph_memory --out OUT/graph_memory.json          # on a CUDA host (Qwen3-30B-A3B shape)
    bash scripts/gpu_run.sh OUT graph_memory
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

MODELS = {"moe": "qwen3-30b-a3b-shape", "8b": "llama3-8b-shape"}
MAX_BATCH = 128   # the peer study's tuned128
BUDGET = 1024     # the default token budget
DECODES = 64      # decode rows beside the chunk of a timed mixed step
CONTEXT = 1024    # their context, about the peer workload's mean prompt
ALIGN_TOKENS = (272, 512, 768, 1024)  # mixed steps past 2,048 pairs at 8 experts a token
ITERS = 20


def hf_config(model: str, layers: int | None) -> dict[str, Any]:
    from bench.roofline import LLAMA3_8B, QWEN3_30B_A3B

    hf = dict(QWEN3_30B_A3B if model == "moe" else LLAMA3_8B)
    if layers:
        hf["num_hidden_layers"] = layers
    return hf


def probe_shapes(max_batch: int = MAX_BATCH, budget: int = BUDGET) -> list[tuple[bool, int, int]]:
    """(decode, rows, tokens): the largest decode graph, the largest mixed graph within 256 tokens, the largest."""
    return [(True, max_batch, max_batch), (False, max_batch // 4, 256), (False, max_batch, budget)]


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind of instantiation, MiB per kernel node over the probed graphs (None where nothing was counted)."""
    out: dict[str, Any] = {}
    for key in ("host_exec_mib", "device_exec_mib"):
        pairs = [(r[key], r["nodes"]) for r in rows if r.get("nodes") and r.get(key) is not None]
        out[f"{key.removesuffix('_mib')}_kib_per_node"] = (
            round(sum(m for m, _ in pairs) * 1024 / sum(n for _, n in pairs), 2) if pairs else None)
    return out


# ---- on the GPU ---------------------------------------------------------------------------------------------------
def free_mib() -> float:
    import torch

    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / 2**20


def node_count(raw_graph: int) -> int | None:
    """Kernel and other nodes of a `cudaGraph_t` (as int), through the runtime's cudaGraphGetNodes."""
    from gpu_engine.gpu.graph_cache import _cudart

    rt = _cudart()
    try:
        err, _nodes, n = rt.cudaGraphGetNodes(rt.cudaGraph_t(init_value=raw_graph), 0)
    except Exception:  # noqa: BLE001 - a bindings version with another signature: nodes not counted
        return None
    return int(n) if int(err) == 0 else None


@contextmanager
def align_pairs(pairs: int) -> Iterator[None]:
    """Steps of up to `pairs` token-expert pairs sort in one launch while inside."""
    from gpu_engine.kernels import moe

    was = moe.ALIGN_KERNEL_PAIRS
    moe.ALIGN_KERNEL_PAIRS = pairs
    try:
        yield
    finally:
        moe.ALIGN_KERNEL_PAIRS = was


def warm(run: Callable[[], None]) -> None:
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def parts(runner, shape: tuple[bool, int, int], pool) -> dict[str, Any]:
    """One graph captured as `GraphCache` captures it, the free memory each part took (MiB), then destroyed."""
    import torch

    from gpu_engine.gpu.graph_cache import _cudart, instantiate_for_device_launch

    decode, rows, tokens = shape
    run = lambda: runner.forward(rows, tokens, decode, False)  # noqa: E731
    warm(run)
    f0 = free_mib()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph, pool=pool):
        run()
    f1 = free_mib()
    raw = int(graph.raw_cuda_graph())
    nodes = node_count(raw)
    if hasattr(graph, "instantiate"):  # as GraphCache does; without it torch instantiates at its first replay
        graph.instantiate()
    f2 = free_mib()
    stream = torch.cuda.current_stream().cuda_stream
    handles = [instantiate_for_device_launch(raw, stream)]
    f3 = free_mib()
    handles += [instantiate_for_device_launch(raw, stream) for _ in range(3)]
    f4 = free_mib()
    rt = _cudart()
    for h in handles:
        rt.cudaGraphExecDestroy(rt.cudaGraphExec_t(init_value=h))
    del graph
    gc.collect()
    return {"shape": list(shape), "nodes": nodes, "capture_mib": round(f0 - f1, 1), "host_exec_mib": round(f1 - f2, 1),
            "device_exec_mib": round(f2 - f3, 1), "three_more_device_execs_mib": round(f3 - f4, 1)}


def timed_ms(graph, iters: int) -> float:
    import torch

    for _ in range(2):
        graph.replay()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def align_rows(runner, iters: int, pairs: int) -> list[dict[str, Any]]:
    """Mixed steps timed with the sort as it is and with the one-launch sort up to `pairs` pairs, same inputs."""
    import torch

    from bench.roofline import mixed_seqs, stage_seqs

    rows = []
    for t in ALIGN_TOKENS:
        stage_seqs(runner, mixed_seqs(DECODES, CONTEXT, t - DECODES))
        row: dict[str, Any] = {"tokens": t, "decodes": DECODES, "pairs": t * runner.config.num_experts_per_tok}
        logits = {}
        for name, limit in (("as_is", None), ("one_launch", pairs)):
            with align_pairs(limit) if limit else nullcontext():
                run = lambda t=t: runner.forward(DECODES + 1, t, False, False)  # noqa: E731
                warm(run)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run()
                row[f"{name}_ms"] = round(timed_ms(graph, iters), 3)
                logits[name] = runner.buffers.logits[: DECODES + 1].clone()
                del graph
                gc.collect()
                torch.cuda.empty_cache()
        row["same_logits"] = bool(torch.equal(logits["as_is"], logits["one_launch"]))
        rows.append(row)
    return rows


def grid(runner, max_batch: int, budget: int) -> dict[str, Any]:
    """The engine's graph set captured as the engine captures it, then destroyed: memory taken and given back."""
    import torch

    from gpu_engine.gpu.graph_cache import GraphCache
    from gpu_engine.gpu.graph_grid import mixed_buckets
    from gpu_engine.gpu.serve_gpu import decode_buckets

    f0 = free_mib()
    cache = GraphCache(runner, decode_buckets(max_batch), mixed_buckets(max_batch, budget), device_launch=True,
                       prefill_variants=True)
    t0 = time.perf_counter()
    graphs = cache.capture(progress=False)
    seconds = time.perf_counter() - t0
    f1 = free_mib()
    nodes = [node_count(int(g.graph.raw_cuda_graph())) for g in graphs]
    cache.close()
    del cache, graphs
    gc.collect()
    torch.cuda.empty_cache()
    f2 = free_mib()
    counted = [n for n in nodes if n is not None]
    return {"graphs": len(nodes), "capture_s": round(seconds, 1), "taken_mib": round(f0 - f1, 1),
            "given_back_mib": round(f2 - f1, 1), "nodes": sum(counted) if counted else None,
            "mib_per_node_instantiation": round((f0 - f1) / (5 * sum(counted)), 5) if counted else None}


def guarded(result: dict[str, Any], key: str, fn: Callable[[], Any]) -> None:
    try:
        result[key] = fn()
    except Exception as exc:  # noqa: BLE001 - recorded; the other parts still run
        result[key] = {"error": repr(exc), "trace": traceback.format_exc(limit=4)}
        print(f"{key} failed: {exc!r}", flush=True)


def run(model: str, layers: int | None, iters: int, pairs: int, parts_: list[str]) -> dict[str, Any]:
    import torch

    from bench.roofline import BLOCK, bench_plan, build
    from gpu_engine.gpu.sm_share import reserve_sms

    hf = hf_config(model, layers)
    plan = bench_plan("auto", torch.cuda.get_device_name())
    free0 = free_mib()
    served = ([CONTEXT] * DECODES + [BUDGET],)
    # a cache for the timed steps' rows only (sized by `served`), to leave the graphs room beside the MoE's 57 GiB
    cfg, _model, runner = build(hf, 256, [MAX_BATCH], [BUDGET], plan, served=served)
    reserve_sms(1)  # the engine's cuBLAS target: every SM but the scheduler's
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "model": MODELS[model], "layers": cfg.num_layers,
        "plan": plan.summary(), "max_batch": MAX_BATCH, "budget": BUDGET, "align_pairs": pairs, "block": BLOCK,
        "weights_and_cache_mib": round(free0 - free_mib(), 1), "kv_blocks": runner.kv.num_blocks}
    print(f"{MODELS[model]}: {cfg.num_layers} layers, {result['weights_and_cache_mib']:.0f} MiB of weights and "
          f"cache, {result['kv_blocks']} blocks", flush=True)
    if "parts" in parts_:
        def probe() -> list[dict[str, Any]]:
            pool = torch.cuda.graph_pool_handle()
            rows = [{"sort": "as_is", **parts(runner, s, pool)} for s in probe_shapes()]
            if cfg.num_experts:
                with align_pairs(pairs):
                    rows += [{"sort": "one_launch", **parts(runner, s, pool)} for s in probe_shapes() if not s[0]]
            return rows
        guarded(result, "parts", probe)
        if isinstance(result["parts"], list):
            result["parts_summary"] = summary(result["parts"])
        print(json.dumps(result.get("parts_summary")), flush=True)
    if "align" in parts_ and cfg.num_experts:
        guarded(result, "align", lambda: align_rows(runner, iters, pairs))
        print(json.dumps(result["align"]), flush=True)
    if "grid" in parts_:
        guarded(result, "grid", lambda: grid(runner, MAX_BATCH, BUDGET))
        print(json.dumps(result["grid"]), flush=True)
        if cfg.num_experts:
            with align_pairs(pairs):
                guarded(result, "grid_one_launch", lambda: grid(runner, MAX_BATCH, BUDGET))
            print(json.dumps(result["grid_one_launch"]), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="moe")
    ap.add_argument("--layers", type=int, help="fewer decoder layers than the shape's (memory per node is per node)")
    ap.add_argument("--align-pairs", type=int, default=8192, help="the one-launch sort's limit to try")
    ap.add_argument("--parts", default="parts,align,grid", help="which measurements, comma-separated")
    ap.add_argument("--iters", type=int, default=ITERS)
    ap.add_argument("--out", type=Path, default=Path("bench/results/graph_memory.json"))
    args = ap.parse_args(argv)
    chosen = [p for p in args.parts.split(",") if p]
    unknown = set(chosen) - {"parts", "align", "grid"}
    if unknown:
        ap.error(f"--parts: unknown {sorted(unknown)} (parts, align, grid)")
    result = run(args.model, args.layers, args.iters, args.align_pairs, chosen)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
