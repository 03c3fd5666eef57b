"""Where a served step's time goes: a per-kernel trace of a model shape's saturated mixed step and its 128-row decode
step, each launched from the device as the persistent scheduler launches it, beside the same executable launched
from the host. ``--model 8b`` (the default) is the Llama-3-8B shape, ``--model moe`` the Qwen3-30B-A3B shape
(``--layers`` cuts its depth where the card is short of memory; every layer is the same work).

The steps are the peer study's at saturation: 128 running rows at served (uneven) contexts
(`bench.kernels.served_contexts`), and, for the mixed step, those 128 decodes plus a prompt chunk that fills the
default 1,024-token budget (896 tokens), in the graph the engine captures for exactly that size. The kernel plan is
the one the engine takes on this GPU, and one SM is left to the scheduler, as served. Each launch is traced on its
own under CUPTI (`torch.profiler`): per kernel its calls and time, per step its span (first kernel start to last
kernel end), the time some kernel runs (the union of the kernels' intervals) and the rest (gaps between kernels:
launch latency inside the graph, dependency waits). The step's floor is the roofline's: bytes read at the copy
rate or the step's FLOPs at the matmul rate, whichever is longer (for the MoE, only the experts a step routes to:
their weights read, their FLOPs per token). CUPTI records no kernel of a graph launched
from the device (seen on an H100: the device rows say so), so the per-kernel table is the host launch's of the
same executable; `bench/overlap_probe.py` times both launches (the same within about 1%).

    python -m bench.trace --out bench/results/trace_h100.json          # on a CUDA host; prints the tables
    python -m bench.trace --model moe --out bench/results/trace_moe_h100.json
    python -m bench.trace --out bench/results/trace_h100.json --plot bench/results/trace_h100.png --plot-only
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

DECODES = 128
BUDGET = 1024  # the default token budget of a step (`--max-num-batched-tokens`)
LAUNCHES = 7  # traced launches of each step and mode; the median span's is reported
TOP = 25  # kernels a table lists, by time
LAUNCHER = "launch_child"  # the one-thread kernel that launches the step from the device: not the step's own work

MODELS = {"8b": "llama3-8b-shape", "moe": "qwen3-30b-a3b-shape"}

# Kernel families, first match wins: (family, substrings of the kernel's name, lower case)
FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("moe routing / sort", ("_route_kernel", "_router_kernel", "_align_", "radixsort", "searchsorted")),
    ("moe experts", ("_moe_gemm", "_gate_up_silu", "_down_sum")),
    ("decode attention", ("_decode_kernel", "_fold_kernel", "fold_splits", "finish_splits")),
    ("prefill attention", ("_prefill_kernel", "flash", "fmha")),
    ("qkv prep / rope / kv write", ("qkv_prep", "_prep_kernel", "rope", "write_kv")),
    ("norm", ("rmsnorm", "norm")),
    ("activation", ("silu", "act_", "activation")),
    ("sampling", ("sample", "argmax", "topk", "top_k", "softmax", "logprob", "penalt", "grammar", "processor")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90", "_tiled", "matmul", "_mm", "splitk", "cublas")),
    ("copy / fill", ("copy", "fill", "memcpy", "memset", "cat", "index", "gather", "scatter", "elementwise")),
)


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint sorted intervals covering the same time as `intervals`."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def busy_us(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals (µs): the time some kernel runs."""
    return sum(end - start for start, end in union(intervals))


def summarize(kernels: Sequence[tuple[str, float, float]]) -> dict[str, Any]:
    """One launch's kernels (name, start µs, end µs): its span, busy time, gaps, and per kernel and family time."""
    if not kernels:
        return {"kernels": 0, "span_us": 0.0, "busy_us": 0.0, "gap_us": 0.0, "by_kernel": {}, "by_family": {}}
    span = max(k[2] for k in kernels) - min(k[1] for k in kernels)
    busy = busy_us((k[1], k[2]) for k in kernels)
    by_kernel: dict[str, dict[str, float]] = {}
    by_family: dict[str, float] = {}
    for name, start, end in kernels:
        row = by_kernel.setdefault(name, {"calls": 0, "us": 0.0, "family": family(name)})  # type: ignore[dict-item]
        row["calls"] += 1
        row["us"] += end - start
        by_family[family(name)] = by_family.get(family(name), 0.0) + end - start
    return {"kernels": len(kernels), "span_us": span, "busy_us": busy, "gap_us": span - busy,
            "by_kernel": by_kernel, "by_family": by_family}


def median_launch(launches: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The launch of median span among those that recorded kernels (an empty summary if none did)."""
    seen = sorted((x for x in launches if x["kernels"]), key=lambda x: x["span_us"])
    if not seen:
        return summarize([])
    pick = dict(seen[(len(seen) - 1) // 2])
    pick["spans_us"] = [x["span_us"] for x in seen]
    return pick


def cuda_kernels(launch: Callable[[], None]) -> list[tuple[str, float, float, int]]:
    """The CUDA kernels (name, start µs, end µs, stream) CUPTI records during one `launch`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        launch()
        torch.cuda.synchronize()
    return [(e.name, float(e.time_range.start), float(e.time_range.end), int(getattr(e, "device_resource_id", 0) or 0))
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]


def trace_once(launch: Callable[[], None]) -> list[tuple[str, float, float]]:
    """The step's own kernels (name, start µs, end µs) during one `launch` (which returns once the step is done)."""
    return [(name, start, end) for name, start, end, _ in cuda_kernels(launch) if LAUNCHER not in name]


def step_seqs(contexts: Sequence[int], chunk: int, block: int) -> list[tuple[int, int, list[int]]]:
    """Rows (cached, new, block table) of a step: one decode per context (`contexts[b]` tokens after the step), then
    a prompt chunk of `chunk` new tokens (none when 0); every row's blocks after the previous row's."""
    seqs, first = [], 0
    for n in contexts:
        blocks = -(-n // block)
        seqs.append((n - 1, 1, list(range(first, first + blocks))))
        first += blocks
    if chunk:
        seqs.append((0, chunk, list(range(first, first + -(-chunk // block)))))
    return seqs


def floor_ms(cfg, model, contexts: Sequence[int], chunk: int, gbps: float, tflops: float) -> float:
    from bench.roofline import kv_token_bytes, layer_params, prefill_flops, weight_bytes

    tokens = len(contexts) + chunk
    read = weight_bytes(model, tokens) + sum(contexts) * kv_token_bytes(cfg)
    flops = (prefill_flops(cfg, model, chunk) if chunk else 0.0) + 2.0 * len(contexts) * layer_params(model)
    return max(read / (gbps * 1e9), flops / (tflops * 1e12)) * 1e3


def launchers(graphs, shape: tuple[bool, int, int]) -> dict[str, Callable[[], None]]:
    """'device': the device-launch executable launched by a one-thread kernel of a device-launched parent graph (as
    the scheduler does; `blink_launch_once` waits for it); 'host': the same executable launched from the host."""

    import torch

    from gpu_engine.gpu.persistent import library

    lib = library()
    handle = graphs.exec_handles(graphs.captured(*shape, filtered=False))[0]

    def make(device: int) -> Callable[[], None]:
        def go() -> None:
            torch.cuda.synchronize()
            err = lib.launch_once(handle, bool(device))
            if err:
                raise RuntimeError(f"device-side cudaGraphLaunch returned {err}")
        return go

    return {"device": make(1), "host": make(0)}


def model_config(model: str, layers: int | None) -> dict:
    """The Hugging Face config of a `MODELS` shape, cut to `layers` decoder layers where given."""
    from bench.roofline import shape_config

    return shape_config(model, layers)


def build_steps(plan_name: str, hf: dict):
    """The model of `hf`, its runner and graphs for the two steps; returns (cfg, model, runner, graphs, steps,
    contexts, plan) where steps maps a step's name to (its rows, its graph shape, its chunk)."""
    import torch

    from bench.kernels import served_contexts
    from bench.roofline import BLOCK, bench_plan, build
    from gpu_engine.gpu.graph_cache import GraphCache
    from gpu_engine.gpu.sm_share import reserve_sms

    contexts = served_contexts(DECODES)
    chunk = BUDGET - DECODES
    plan = bench_plan(plan_name, torch.cuda.get_device_name())
    # the cache holds the served rows' blocks and the chunk's, no more (a `max_ctx` of one block: sized by `served`;
    # every row at the longest context would not fit an 80 GB card)
    cfg, model, runner = build(hf, BLOCK, [DECODES + 1], [BUDGET], plan, served=(contexts + [chunk],))
    reserve_sms(1)
    graphs = GraphCache(runner, [DECODES], [(DECODES + 1, BUDGET)], copies=1, device_launch=True,
                        prefill_variants=True)
    graphs.capture(progress=False)
    steps = {"decode": (step_seqs(contexts, 0, BLOCK), (True, DECODES, DECODES), 0),
             "mixed": (step_seqs(contexts, chunk, BLOCK), (False, DECODES + 1, BUDGET), chunk)}
    return cfg, model, runner, graphs, steps, contexts, plan


def run(plan_name: str, launches: int, model_name: str = "8b", layers: int | None = None) -> dict[str, Any]:
    import torch

    from bench.roofline import measure_ceilings, stage_seqs

    hf = model_config(model_name, layers)
    gbps, tflops = measure_ceilings()
    cfg, model, runner, graphs, steps, contexts, plan = build_steps(plan_name, hf)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "model": MODELS[model_name],
                              "layers": cfg.num_layers, "plan": plan.summary(), "copy_gbps": gbps,
                              "matmul_tflops": tflops, "decodes": DECODES, "budget": BUDGET,
                              "context_mean": sum(contexts) / len(contexts), "steps": {}}
    for name, (seqs, shape, chunk) in steps.items():
        stage_seqs(runner, seqs)
        entry: dict[str, Any] = {"shape": list(shape), "chunk": chunk,
                                 "floor_ms": floor_ms(cfg, model, contexts, chunk, gbps, tflops)}
        for mode, go in launchers(graphs, shape).items():
            for _ in range(3):
                go()
            entry[mode] = median_launch([summarize(trace_once(go)) for _ in range(launches)])
        result["steps"][name] = entry
    graphs.close()
    return result


def table_rows(launch: dict[str, Any], top: int = TOP) -> list[str]:
    span = launch["span_us"] or 1.0
    lines = [f"  {'family':<28}{'ms':>8}{'share':>8}"]
    for fam, us in sorted(launch["by_family"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {fam:<28}{us / 1e3:>8.3f}{us / span:>8.1%}")
    lines.append(f"  {'gaps (no kernel running)':<28}{launch['gap_us'] / 1e3:>8.3f}{launch['gap_us'] / span:>8.1%}")
    lines.append(f"  {'kernel':<72}{'calls':>6}{'ms':>8}{'share':>8}")
    ranked = sorted(launch["by_kernel"].items(), key=lambda kv: -kv[1]["us"])[:top]
    for name, row in ranked:
        lines.append(f"  {name[:71]:<72}{row['calls']:>6}{row['us'] / 1e3:>8.3f}{row['us'] / span:>8.1%}")
    return lines


def print_tables(result: dict[str, Any]) -> None:
    print(f"{result['device']}, plan {result['plan']}, copy {result['copy_gbps']:.0f} GB/s, matmul "
          f"{result['matmul_tflops']:.0f} TFLOP/s, {result['decodes']} rows at mean context "
          f"{result['context_mean']:.0f}")
    for name, entry in result["steps"].items():
        for mode in ("device", "host"):
            launch = entry[mode]
            if not launch["kernels"]:
                print(f"\n{name} step, {mode}-launched: CUPTI recorded no kernels")
                continue
            print(f"\n{name} step, {mode}-launched: span {launch['span_us'] / 1e3:.3f} ms (floor "
                  f"{entry['floor_ms']:.3f} ms, {launch['span_us'] / 1e3 / entry['floor_ms']:.2f}x), "
                  f"{launch['kernels']} kernels, busy {launch['busy_us'] / 1e3:.3f} ms")
            print("\n".join(table_rows(launch)))


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(f"{name}\n{mode}", entry[mode]) for name, entry in result["steps"].items()
            for mode in ("device", "host") if entry[mode]["kernels"]]
    fams = sorted({f for _, launch in bars for f in launch["by_family"]}) + ["gaps"]
    fig, ax = plt.subplots(figsize=(11, 1.6 + 0.7 * len(bars)))
    for i, (_, launch) in enumerate(bars):
        left = 0.0
        for j, fam in enumerate(fams):
            ms = (launch["gap_us"] if fam == "gaps" else launch["by_family"].get(fam, 0.0)) / 1e3
            ax.barh(i, ms, left=left, color=plt.cm.tab20(j), label=fam if i == 0 else None)
            left += ms
    ax.set_yticks(range(len(bars)), [label for label, _ in bars])
    ax.set_xlabel("ms (kernel time by family, then gaps; overlapping kernels count each)")
    shape = result.get("model", MODELS["8b"])
    ax.set_title(f"{shape}, {result['decodes']} rows: where a step's time goes ({result['device']})")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/trace.json"))
    parser.add_argument("--plot", type=Path, help="a PNG of each step's time by kernel family")
    parser.add_argument("--plot-only", action="store_true", help="draw --plot from --out as it is (no GPU)")
    parser.add_argument("--plan", default="auto", help="the kernel plan (bench/roofline.py --plan)")
    parser.add_argument("--launches", type=int, default=LAUNCHES, help="traced launches of each step and mode")
    parser.add_argument("--model", choices=sorted(MODELS), default="8b", help="the model shape (random bf16 weights)")
    parser.add_argument("--layers", type=int, help="fewer decoder layers than the shape's")
    args = parser.parse_args(argv)
    if args.plot_only:
        plot(json.loads(args.out.read_text()), args.plot or args.out.with_suffix(".png"))
        return
    model_config(args.model, args.layers)  # refuses a bad --layers before any GPU work
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench.trace needs a CUDA device")
    result = run(args.plan, max(1, args.launches), args.model, args.layers)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print_tables(result)
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
