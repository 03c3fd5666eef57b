"""Where the memory of a step's CUDA graphs goes, and what would give it back to the KV cache (an experiment).

The engine sized its KV cache from the memory free after the weights and captured its graphs afterwards. For the
Qwen3-30B-A3B shape on an 80 GB card the graphs took 6,168 MiB (236 graphs at 128 sequences and a 1,024-token
budget), more than the default fraction left (docs/GPU_NOTES.md). Each graph was instantiated five times: torch's
host executable, which only the start's probes replayed, and four device-launch copies the scheduler rotated (the
engine now makes two copies and no torch executable, and sizes the cache after the graphs). A mixed graph whose
expert sort takes torch's launches (past ``kernels.moe.ALIGN_KERNEL_PAIRS`` token-expert pairs, 2,048 until the limit
became 8,192, then 65,536) has about three times the kernels of one whose sort is the engine's kernels. Measured
here, on the model shape with random bf16 weights, the engine's kernel plan and a small cache, with the engine's
sort ("as_is") and, to compare, the sort limit set to ``--align-pairs`` ("other"; 0, the default: torch's sort at
every size):

- ``parts``: for a decode graph and two mixed ones, the free memory taken by the capture (torch's pool), by torch's
  host executable, by the first device-launch executable and by the three more, and the graph's kernel nodes; the
  mixed ones again with the other sort;
- ``align``: mixed steps (``--decodes`` decode rows at ``--context`` tokens beside a prompt chunk) of 272-1,024
  tokens with each sort, each a host-replayed graph (CUDA events around
  ``--iters`` replays), and whether the two give the same logits bit for bit;
- ``grid``: the engine's whole graph set (``serve_gpu.decode_buckets`` and ``graph_grid.mixed_buckets``, the step
  buffers of ``serve_gpu.runner_limits`` for the peer study's tuned128 start) captured as the engine does, its
  memory, torch's pool within it and its nodes, then destroyed (``GraphCache.close``) and the memory given back; once
  per sort (``grid``, ``grid_other``). The file is written after each part.

    python -m bench.graph_memory --out OUT/graph_memory.json          # on a CUDA host (Qwen3-30B-A3B shape)
    bash scripts/gpu_run.sh OUT graph_memory
"""

from __future__ import annotations

import argparse
import gc
import json
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
ALIGN_TOKENS = (272, 512, 768, 1024)  # mixed steps of 2,176-8,192 pairs at 8 experts a token
ITERS = 20


def hf_config(model: str, layers: int | None) -> dict[str, Any]:
    from bench.roofline import shape_config

    return shape_config(model, layers)


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


def node_count(raw_graph: int) -> int:
    """Kernel and other nodes of a `cudaGraph_t` (as int), through the runtime's cudaGraphGetNodes."""
    from gpu_engine.gpu.graph_cache import _checked, _cudart

    rt = _cudart()
    return int(_checked(rt.cudaGraphGetNodes(rt.cudaGraph_t(init_value=raw_graph), 0), "cudaGraphGetNodes")[1])


def counted(raw_graph: int, into: dict[str, Any]) -> int | None:
    """`node_count`, or None with the reason in `into["nodes_error"]` (a bindings version with another signature)."""
    try:
        return node_count(raw_graph)
    except Exception as exc:  # noqa: BLE001 - recorded; the memory figures still stand
        into["nodes_error"] = repr(exc)
        return None


@contextmanager
def align_pairs(pairs: int) -> Iterator[None]:
    """Steps of up to `pairs` token-expert pairs sort in the engine's kernels while inside, larger ones by torch."""
    from gpu_engine.kernels import moe

    was = moe.ALIGN_KERNEL_PAIRS
    moe.ALIGN_KERNEL_PAIRS = pairs
    try:
        yield
    finally:
        moe.ALIGN_KERNEL_PAIRS = was


def parts(runner, shape: tuple[bool, int, int], pool) -> dict[str, Any]:
    """One graph captured as `GraphCache` captures it, the free memory each part took (MiB), then destroyed."""
    import torch

    from gpu_engine.gpu.graph_cache import _cudart, instantiate_for_device_launch, warm_up

    decode, rows, tokens = shape
    run = lambda: runner.forward(rows, tokens, decode, False)  # noqa: E731
    warm_up(run)
    f0 = free_mib()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph, pool=pool):
        run()
    f1 = free_mib()
    raw = int(graph.raw_cuda_graph())
    row: dict[str, Any] = {"shape": list(shape)}
    row["nodes"] = counted(raw, row)
    if hasattr(graph, "instantiate"):  # torch's own executable, as the engine made until 2026-12-07 (it no longer does)
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
    return {**row, "capture_mib": round(f0 - f1, 1), "host_exec_mib": round(f1 - f2, 1),
            "device_exec_mib": round(f2 - f3, 1), "three_more_device_execs_mib": round(f3 - f4, 1)}


def align_rows(runner, iters: int, pairs: int) -> list[dict[str, Any]]:
    """Mixed steps timed with the engine's sort and with the sort limit at `pairs` pairs, same inputs."""
    import torch

    from bench.kernels import eager_ms
    from bench.roofline import mixed_seqs, stage_seqs
    from gpu_engine.gpu.graph_cache import warm_up

    rows = []
    for t in ALIGN_TOKENS:
        stage_seqs(runner, mixed_seqs(DECODES, CONTEXT, t - DECODES))
        row: dict[str, Any] = {"tokens": t, "decodes": DECODES, "pairs": t * runner.config.num_experts_per_tok}
        logits = {}
        for name, limit in (("as_is", None), ("other", pairs)):
            with align_pairs(limit) if limit is not None else nullcontext():
                run = lambda t=t: runner.forward(DECODES + 1, t, False, False)  # noqa: E731
                warm_up(run)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run()
                row[f"{name}_ms"] = round(eager_ms(graph.replay, iters), 3)
                logits[name] = runner.buffers.logits[: DECODES + 1].clone()
                del graph
                gc.collect()
                torch.cuda.empty_cache()
        row["same_logits"] = bool(torch.equal(logits["as_is"], logits["other"]))
        rows.append(row)
    return rows


def grid(runner, max_batch: int, budget: int) -> dict[str, Any]:
    """The engine's graph set captured as the engine captures it (its buckets, the score graph where the runner
    scores), then destroyed: memory taken, torch's pool within it, nodes, and what came back."""
    import torch

    from gpu_engine.gpu.graph_cache import GraphCache
    from gpu_engine.gpu.graph_grid import mixed_buckets
    from gpu_engine.gpu.serve_gpu import decode_buckets

    f0, r0 = free_mib(), torch.cuda.memory_reserved() / 2**20
    cache = GraphCache(runner, decode_buckets(max_batch), mixed_buckets(max_batch, budget), device_launch=True,
                       prefill_variants=True)
    t0 = time.perf_counter()
    graphs = cache.capture(progress=False)
    seconds = time.perf_counter() - t0
    f1, r1 = free_mib(), torch.cuda.memory_reserved() / 2**20
    out: dict[str, Any] = {"graphs": len(graphs), "score_graph": cache.score is not None,
                           "capture_s": round(seconds, 1), "taken_mib": round(f0 - f1, 1),
                           "pool_mib": round(r1 - r0, 1)}
    nodes = [counted(int(g.graph.raw_cuda_graph()), out) for g in graphs]
    per = cache.copies  # the engine's instantiations a graph: its device-launch copies (no torch executable)
    cache.close()
    del cache, graphs
    gc.collect()
    torch.cuda.empty_cache()
    out["given_back_mib"] = round(free_mib() - f1, 1)
    known = [n for n in nodes if n is not None]
    out["nodes"] = sum(known) if len(known) == len(nodes) else None
    if out["nodes"]:
        out["kib_per_node_instantiation"] = round((out["taken_mib"] - out["pool_mib"]) * 1024 / (per * out["nodes"]), 3)
    return out


def guarded(result: dict[str, Any], key: str, fn: Callable[[], Any]) -> None:
    try:
        result[key] = fn()
    except Exception as exc:  # noqa: BLE001 - recorded; the other parts still run
        result[key] = {"error": repr(exc), "trace": traceback.format_exc(limit=4)}
        print(f"{key} failed: {exc!r}", flush=True)


def engine_config():
    """The engine's config as the peer study's tuned128 serves Blink (persistent, 128 sequences, prompts up to
    4,096 tokens and outputs up to 2,048)."""
    from bench.peers.load import MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS
    from blink.cli import build_parser
    from shared.config import EngineConfig

    argv = ["serve", "--backend", "persistent", "--max-batch", str(MAX_BATCH), "--max-prompt-tokens",
            str(MAX_PROMPT_TOKENS), "--max-output-tokens", str(MAX_OUTPUT_TOKENS), "--random-weights"]
    return EngineConfig.from_namespace(build_parser().parse_args(argv))


def build_runner(hf: dict[str, Any]):
    """The model (random bf16 weights), a cache for the timed steps' rows only, and a runner with the limits and
    kernel plan the engine would give it: (model config, engine config, token budget, runner)."""
    import torch

    from bench.roofline import BLOCK, bench_plan, random_model
    from gpu_engine.gpu.runner import GpuModelRunner
    from gpu_engine.gpu.serve_gpu import runner_limits, step_token_limit
    from gpu_engine.kv_cache import KVCache

    ecfg = engine_config()
    mcfg, model = random_model(hf)
    max_context = ecfg.context_limit(mcfg.max_position_embeddings, cap=ecfg.context_cap)
    budget = ecfg.token_budget(gpu=True)
    limits = runner_limits(ecfg, max_context, step_token_limit(max_context, budget, ecfg.max_batch))
    blocks = DECODES * -(-CONTEXT // BLOCK) + -(-budget // BLOCK) + 1  # the timed steps' rows, one after another
    kv = KVCache(mcfg, blocks, BLOCK, dtype=torch.bfloat16, device="cuda")
    plan = bench_plan("auto", torch.cuda.get_device_name())
    return mcfg, ecfg, budget, GpuModelRunner(model, kv, limits, plan=plan)


def run(model: str, layers: int | None, iters: int, pairs: int, parts_: list[str], out: Path) -> dict[str, Any]:
    import torch

    from gpu_engine.gpu.sm_share import reserve_sms

    free0 = free_mib()
    cfg, ecfg, budget, runner = build_runner(hf_config(model, layers))
    reserve_sms(1)  # the engine's cuBLAS target: every SM but the scheduler's
    lim = runner.limits
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "model": MODELS[model], "layers": cfg.num_layers,
        "plan": runner.plan.summary(), "max_batch": ecfg.max_batch, "budget": budget, "align_pairs": pairs,
        "limits": {"max_tokens": lim.max_tokens, "max_blocks_per_seq": lim.max_blocks_per_seq,
                   "device_tables": lim.device_tables is not None, "score_rows": lim.score_rows},
        "weights_and_cache_mib": round(free0 - free_mib(), 1), "kv_blocks": runner.kv.num_blocks}
    print(f"{MODELS[model]}: {cfg.num_layers} layers, {result['weights_and_cache_mib']:.0f} MiB of weights, cache and "
          f"buffers, {result['kv_blocks']} blocks, limits {result['limits']}", flush=True)

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")

    def part(key: str, fn: Callable[[], Any], shown: str | None = None) -> None:
        """One measurement into `result` (its failure recorded), printed, and the file written."""
        guarded(result, key, fn)
        if key == "parts" and isinstance(result["parts"], list):
            result["parts_summary"] = summary(result["parts"])
        print(json.dumps(result.get(shown or key)), flush=True)
        save()

    save()
    if "parts" in parts_:
        shapes = probe_shapes(ecfg.max_batch, budget)

        def probe() -> list[dict[str, Any]]:
            pool = torch.cuda.graph_pool_handle()
            rows = [{"sort": "as_is", **parts(runner, s, pool)} for s in shapes]
            if cfg.num_experts:
                with align_pairs(pairs):
                    rows += [{"sort": "other", **parts(runner, s, pool)} for s in shapes if not s[0]]
            return rows
        part("parts", probe, shown="parts_summary")
    if "align" in parts_ and cfg.num_experts:
        part("align", lambda: align_rows(runner, iters, pairs))
    if "grid" in parts_:
        part("grid", lambda: grid(runner, ecfg.max_batch, budget))
        if cfg.num_experts:
            with align_pairs(pairs):
                part("grid_other", lambda: grid(runner, ecfg.max_batch, budget))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="moe")
    ap.add_argument("--layers", type=int, help="fewer decoder layers than the shape's (memory per node is per node)")
    ap.add_argument("--align-pairs", type=int, default=0,
                    help="the sort limit to compare the engine's with (token-expert pairs; 0: torch's sort throughout)")
    ap.add_argument("--parts", default="parts,align,grid", help="which measurements, comma-separated")
    ap.add_argument("--iters", type=int, default=ITERS)
    ap.add_argument("--out", type=Path, default=Path("bench/results/graph_memory.json"))
    args = ap.parse_args(argv)
    chosen = [p for p in args.parts.split(",") if p]
    unknown = set(chosen) - {"parts", "align", "grid"}
    if unknown:
        ap.error(f"--parts: unknown {sorted(unknown)} (parts, align, grid)")
    run(args.model, args.layers, args.iters, args.align_pairs, chosen, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
