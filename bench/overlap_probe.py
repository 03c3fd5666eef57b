"""Can a decode graph and a prefill-chunk graph run at once? A probe on the 8B shape (random bf16 weights) of what
launching both in one scheduler round would give: the 128-row decode step at served contexts
(`bench.kernels.served_contexts`) and the chunk of one 896-token prompt, each captured in its own graph by its own
runner (`GpuModelRunner`: the two share the model's weights, which a runner only views, and the KV cache, whose
blocks the two steps' rows do not share; each has its own step buffers, tiled-linear scratch and counters, and
each graph its own memory pool, so neither writes what the other reads).

Modes, each the GPU time (CUDA events, median of `--reps` launches after two unmeasured ones) of the decode graph
alone, the prefill graph alone and both launched together:
- host: the graphs replayed from the host on two streams; beside them both one after the other on one stream
  (`sequential_ms`, the host modes' baseline);
- device: the device-launch executables launched from the device by a one-thread kernel of a device-launched
  parent graph (`blink_launch_pair`, bench/csrc/overlap_probe.cu), both fire-and-forget; the baseline the
  second as the parent's tail launch, which starts once the first finished (the device modes' baseline);
- beside (host): the decode graph 1, 2 and 3 times one after the other on its stream while the chunk's graph runs
  once on its own, when each was done; with each alone and the mixed step (the 128 decodes and the chunk in one
  graph, the mixed-step policy's round). What a decode row's tokens would take if decode steps went on while a
  chunk ran beside them, and what that costs the chunk;
- priority (host and device): the decode graph ahead of the chunk's, the device's most urgent launch priority
  against its least: replayed from the host on streams of those priorities (decode steps beside one chunk, as
  `beside`), and launched from the device as executables whose kernel nodes carry them (instantiated with
  cudaGraphInstantiateFlagUseNodePriority);
- cublas N (host and device): both graphs captured again with cuBLAS SM-count targets (`sm_share.reserve_sms`):
  N SMs for the decode graph's products, the rest but the scheduler's one for the prefill graph's (the Triton
  kernels still size their grids for the whole GPU);
- green N (host and device): the SMs split into two green contexts (the driver's split: N SMs, rounded up to the
  device's granularity, and the remainder, disjoint), each graph captured on its own context's stream with its
  cuBLAS target at its share; "unavailable" with the reason where the driver or the build has none.
`--splits` lists the N. Each partitioned mode is compared with the unpartitioned baseline of its launch form.

Overlap: one more launch of each pair traced under CUPTI (`torch.profiler`): where the kernels came on two streams,
the time kernels of both streams ran at once, else the time two kernels of any stream ran at once (a graph
captured from one stream runs its kernels one at a time), over the shorter graph's time alone. Each mode is
guarded (an exception or a refused device-side launch is recorded as its `error`, the rest still run); a launch
that does not finish within `--timeout` seconds ends the run, with what was measured written out.

    python -m bench.overlap_probe --out bench/results/overlap_probe.json       # on a CUDA host
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.trace import BUDGET, DECODES, union
from bench.trace import cuda_kernels as trace

CHUNK = BUDGET - DECODES  # the prompt chunk of a default 1,024-token step beside the 128 decodes (bench.trace's)
REPS = 8
WARM = 2
SPLITS = (32, 64)  # SMs for the decode graph
BESIDE = (1, 2, 3)  # decode steps one after another beside one chunk
TIMEOUT_S = 20.0
SPEEDUP_YES = 1.03  # a pair this much faster than sequential ran its graphs at once
OVERLAP_YES = 0.10  # or kernels of both graphs ran together this share of the shorter graph
LAUNCHERS = ("launch_pair", "launch_child")  # the parent graphs' one-thread kernels: not the steps' work


# ---- pure helpers -------------------------------------------------------------------------------------------------
def parse_splits(text: str, total: int | None = None) -> tuple[int, ...]:
    """The decode graph's SM counts of `--splits` ("32,64"), ascending; each must leave the prefill graph and the
    scheduler an SM where the device's `total` is known."""
    try:
        splits = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise ValueError(f"--splits {text!r}: comma-separated SM counts") from None
    if any(n <= 0 for n in splits):
        raise ValueError(f"--splits {text!r}: SM counts must be positive")
    if total is not None and any(n >= total - 1 for n in splits):
        raise ValueError(f"--splits {text!r}: each below {total - 1} (the device has {total} SMs)")
    return tuple(splits)


def both_us(a: Iterable[tuple[float, float]], b: Iterable[tuple[float, float]]) -> float:
    """The time some interval of `a` and some interval of `b` cover at once."""
    ua, ub, total, i, j = union(a), union(b), 0.0, 0, 0
    while i < len(ua) and j < len(ub):
        total += max(0.0, min(ua[i][1], ub[j][1]) - max(ua[i][0], ub[j][0]))
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return total


def concurrent_us(intervals: Iterable[tuple[float, float]]) -> float:
    """The time two or more of `intervals` run at once."""
    edges = sorted((t, d) for s, e in intervals if e > s for t, d in ((s, 1), (e, -1)))
    total, running, last = 0.0, 0, 0.0
    for t, d in edges:
        if running >= 2:
            total += t - last
        running, last = running + d, t
    return total


def overlap(kernels: Sequence[tuple[str, float, float, int]], shorter_us: float) -> dict[str, Any]:
    """Kernels (name, start µs, end µs, stream) of one launch of a pair: the time kernels of the two graphs ran at
    once (by stream where there are exactly two, else any two kernels at once) over the shorter graph's time."""
    work = [k for k in kernels if not any(name in k[0] for name in LAUNCHERS)]
    streams = sorted({k[3] for k in work})
    if len(streams) == 2:
        method = "streams"
        us = both_us([(k[1], k[2]) for k in work if k[3] == streams[0]],
                     [(k[1], k[2]) for k in work if k[3] == streams[1]])
    else:
        method, us = "any two kernels", concurrent_us((k[1], k[2]) for k in work)
    seen = bool(work) and shorter_us > 0
    return {"kernels": len(work), "streams": len(streams), "method": method, "overlap_us": us,
            "fraction": us / shorter_us if seen else None}


def verdict(pair_ms: float, sequential_ms: float, fraction: float | None) -> str:
    """Whether the pair ran at once (faster than sequential by `SPEEDUP_YES`, or kernels of both graphs together
    for `OVERLAP_YES` of the shorter one) and how much it gains over sequential."""
    speedup = sequential_ms / pair_ms
    yes = speedup >= SPEEDUP_YES or (fraction is not None and fraction >= OVERLAP_YES)
    kernels = "kernels not recorded" if fraction is None else f"both graphs' kernels together {fraction:.0%}"
    return (f"overlap {'yes' if yes else 'no'}: {speedup:.2f}x vs sequential ({pair_ms:.2f} vs "
            f"{sequential_ms:.2f} ms), {kernels}")


def judged(entry: dict[str, Any], sequential_ms: float | None) -> dict[str, Any]:
    """A mode's entry with its speedup and verdict against the sequential baseline (where one was measured)."""
    if "pair_ms" not in entry or not sequential_ms:
        return entry
    fraction = (entry.get("overlap") or {}).get("fraction")
    return {**entry, "baseline_ms": sequential_ms, "speedup": sequential_ms / entry["pair_ms"],
            "verdict": verdict(entry["pair_ms"], sequential_ms, fraction)}


def _ms(entry: dict[str, Any], key: str) -> str:
    value = entry.get(key)
    return f"{value:9.2f}" if isinstance(value, int | float) else f"{'-':>9}"


def table(result: dict[str, Any]) -> list[str]:
    """The printed table: a row a mode, its verdict (or error) under it."""
    lines = [f"{result.get('device', '?')}, plan {result.get('plan', '?')}, {result.get('sms', '?')} SMs: "
             f"{result.get('decodes')} decodes and a {result.get('chunk')}-token prompt chunk (ms, median)",
             f"{'mode':<18}{'SMs d/p':>10}{'decode':>9}{'prefill':>9}{'pair':>9}{'seq':>9}{'speedup':>9}"
             f"{'overlap':>9}"]
    for name, entry in result.get("modes", {}).items():
        sms = f"{entry.get('decode_sms') or '-'}/{entry.get('prefill_sms') or '-'}"
        fraction = (entry.get("overlap") or {}).get("fraction")
        lines.append(f"{name:<18}{sms:>10}{_ms(entry, 'decode_ms')}{_ms(entry, 'prefill_ms')}{_ms(entry, 'pair_ms')}"
                     f"{_ms(entry, 'baseline_ms')}"
                     + (f"{entry['speedup']:8.2f}x" if "speedup" in entry else f"{'-':>9}")
                     + (f"{fraction:9.0%}" if fraction is not None else f"{'-':>9}"))
        note = entry.get("error") or entry.get("verdict")
        if note:
            lines.append(f"    {'ERROR ' if entry.get('error') else ''}{note}")
        lines.extend(beside_lines(entry))
        done = entry.get("done_in_pair_ms")
        if done:
            lines.append(f"    in the pair, decode done at {done['decode']:.2f} ms, prefill at "
                         f"{done['prefill']:.2f} ms")
    return lines


def beside_lines(entry: dict[str, Any]) -> list[str]:
    """The lines of the decode steps beside one chunk: when each was done, each decode's own time, and the chunk's
    time against the mixed step's."""
    runs = entry.get("beside") or {}
    lines = [f"    mixed step alone {entry['mixed_ms']:.2f} ms"] if "mixed_ms" in entry else []
    for n, done in runs.items():
        decodes = [done[f"decode {i + 1}"] for i in range(int(n))]
        steps = ", ".join(f"{b - a:.2f}" for a, b in zip([0.0, *decodes[:-1]], decodes, strict=True))
        lines.append(f"    {n} decode(s) beside the chunk: each {steps} ms; chunk done at {done['chunk']:.2f} ms")
    return lines


def median_ms(samples: Sequence[float]) -> float:
    return float(statistics.median(samples))


# ---- the device ---------------------------------------------------------------------------------------------------
@dataclass
class Graph:
    """One captured step: torch's graph (host replay), its device-launch executable, the stream it was captured
    and is replayed on, and the green context it belongs to (an index of the split, or None)."""

    graph: Any
    exec_handle: int
    stream: Any
    green: int | None = None


@dataclass
class Pair:
    decode: Graph
    prefill: Graph
    split: Any = None  # the GreenSplit both were captured in, if any
    sms: tuple[int | None, int | None] = (None, None)


class Device:
    """The library's overlap diagnostics through ctypes: the pair launcher and the green-context split."""

    def __init__(self) -> None:
        self.lib = bind(probe_library())

    def pair(self, first: int, second: int, sequential: bool, reps: int, timeout_s: float) -> list[float]:
        """Milliseconds of `reps` launches of the parent graph that launches both from the device."""
        import ctypes as C

        ms, err = (C.c_float * reps)(), (C.c_int * 2)()
        rc = self.lib.lib.blink_launch_pair(first, second, int(sequential), reps, timeout_s, ms, err)
        message = self.lib.lib.blink_last_error().decode()
        if rc == -2:
            raise TimeoutError(message)
        if rc != 0:
            raise RuntimeError(f"blink_launch_pair failed ({rc}, device-side launch status {list(err)}): {message}")
        return list(ms)

    def priority_range(self) -> tuple[int, int]:
        """The device's launch priorities: (least urgent, most urgent)."""
        import ctypes as C

        least, greatest = C.c_int(), C.c_int()
        self.lib.check(self.lib.lib.blink_priority_range(C.byref(least), C.byref(greatest)), "priority range")
        return least.value, greatest.value

    def priority_exec(self, graph: Graph, priority: int) -> int:
        """A device-launch executable of `graph`'s captured step whose every kernel runs at `priority`."""
        import ctypes as C

        exec_, kernels = C.c_uint64(), C.c_int()
        self.lib.check(self.lib.lib.blink_priority_exec(int(graph.graph.raw_cuda_graph()), priority,
                                                        graph.stream.cuda_stream, C.byref(exec_), C.byref(kernels)),
                       "priority executable")
        if kernels.value == 0:
            raise RuntimeError("the captured step has no kernel node to give a priority")
        return int(exec_.value)


def probe_library():
    """The scheduler's library with the overlap diagnostics (bench/csrc/overlap_probe.cu; the engine's has none),
    built with nvcc (no GPU needed) and loaded as a `persistent.Library`."""
    from gpu_engine.gpu.persistent import Library, build_library

    return Library(build_library(source=Path(__file__).resolve().parent / "csrc" / "overlap_probe.cu"))


def bind(lib):
    """Argument types of the overlap diagnostics on a loaded `persistent.Library`; returns it."""
    import ctypes as C

    f = lib.lib
    f.blink_launch_pair.argtypes = [C.c_uint64, C.c_uint64, C.c_int, C.c_int, C.c_double, C.POINTER(C.c_float),
                                    C.POINTER(C.c_int)]
    f.blink_priority_range.argtypes = [C.POINTER(C.c_int), C.POINTER(C.c_int)]
    f.blink_priority_exec.argtypes = [C.c_uint64, C.c_int, C.c_uint64, C.POINTER(C.c_uint64), C.POINTER(C.c_int)]
    f.blink_green_split.argtypes = [C.c_int, C.c_uint, C.POINTER(C.c_void_p), C.POINTER(C.c_uint64),
                                    C.POINTER(C.c_uint)]
    f.blink_green_enter.argtypes = [C.c_void_p, C.c_int]
    f.blink_green_leave.argtypes = []
    f.blink_green_destroy.argtypes = [C.c_void_p]
    return lib


class GreenSplit:
    """The SMs split into two green contexts (decode: at least `sms` SMs; prefill: the rest), a stream each."""

    def __init__(self, device: Device, sms: int) -> None:
        import ctypes as C

        import torch

        self.f = device.lib.lib
        handle, streams, counts = C.c_void_p(), (C.c_uint64 * 2)(), (C.c_uint * 2)()
        rc = self.f.blink_green_split(torch.cuda.current_device(), sms, C.byref(handle), streams, counts)
        if rc != 0:
            raise RuntimeError(f"green contexts unavailable ({rc}): {self.f.blink_last_error().decode()}")
        self.handle, self.sms = handle, (int(counts[0]), int(counts[1]))
        self.streams = [torch.cuda.ExternalStream(int(s)) for s in streams]

    def enter(self, which: int | None) -> None:
        if which is not None and self.f.blink_green_enter(self.handle, which) != 0:
            raise RuntimeError(f"green context {which}: {self.f.blink_last_error().decode()}")

    def leave(self, which: int | None) -> None:
        if which is not None and self.f.blink_green_leave() != 0:
            raise RuntimeError(f"leaving green context {which}: {self.f.blink_last_error().decode()}")

    def close(self) -> None:
        self.f.blink_green_destroy(self.handle)


def capture(runner, decode: bool, stream=None, split: GreenSplit | None = None, which: int | None = None,
            shape: tuple[int, int] | None = None) -> Graph:
    """Warm up and capture one step of `runner` on `stream` (a new one where None), inside green context `which` of
    `split` where given, and instantiate it for device launch; `shape` (rows, tokens) of a step that is neither the
    decode step nor the chunk (the mixed step)."""
    import torch

    from gpu_engine.gpu.graph_cache import instantiate_for_device_launch

    batch, tokens = shape or ((DECODES, DECODES) if decode else (1, CHUNK))
    stream = stream or torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # before entering: the event is the current context's
    if split is not None:
        split.enter(which)
    try:
        with torch.cuda.stream(stream):
            runner.forward(batch, tokens, decode, filtered=False)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph, stream=stream):
            runner.forward(batch, tokens, decode, filtered=False)
        if hasattr(graph, "instantiate"):
            graph.instantiate()
        handle = instantiate_for_device_launch(int(graph.raw_cuda_graph()), stream.cuda_stream)
        stream.synchronize()
    finally:
        if split is not None:
            split.leave(which)
    return Graph(graph, handle, stream, which)


def destroy_graphs(graphs: Sequence[Graph]) -> None:
    import torch

    from gpu_engine.gpu.graph_cache import _cudart

    rt = _cudart()
    for g in graphs:
        rt.cudaGraphExecDestroy(rt.cudaGraphExec_t(init_value=g.exec_handle))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def destroy(pair: Pair) -> None:
    graphs = [pair.decode, pair.prefill]
    pair.decode = pair.prefill = None  # type: ignore[assignment]
    destroy_graphs(graphs)


def wait(event, timeout_s: float) -> None:
    """Until `event` completed; TimeoutError past `timeout_s` (the GPU is then taken for stuck)."""
    end = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > end:
            raise TimeoutError(f"host-launched graphs did not finish within {timeout_s:.1f} s")
        time.sleep(0.0002)


def host_launch(graphs: Sequence[Graph], split: GreenSplit | None = None, one_stream: bool = False,
                marks: list | None = None) -> None:
    """Replay `graphs` after the current stream's work, each on its own stream (or all on the first one's), inside
    its green context where it has one; the current stream then waits for them all. `marks`: each graph's
    completion event (timed) appended in order."""
    import torch

    main = torch.cuda.current_stream()
    ready = torch.cuda.Event()
    ready.record(main)
    for g in graphs:
        stream = graphs[0].stream if one_stream else g.stream
        if split is not None:
            split.enter(g.green)
        try:
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                g.graph.replay()
            done = torch.cuda.Event(enable_timing=marks is not None)
            done.record(stream)
            if marks is not None:
                marks.append(done)
        finally:
            if split is not None:
                split.leave(g.green)
        main.wait_event(done)


def beside_launch(decode: Graph, prefill: Graph, n: int, marks: list | None = None) -> None:
    """After the current stream's work: the decode graph `n` times one after the other on its stream and, beside
    them, the chunk's graph once on its own (the decode launched first, as a round would stage it); the current
    stream then waits for both. `marks`: each decode's completion event (timed) in order, then the chunk's."""
    import torch

    main = torch.cuda.current_stream()
    ready = torch.cuda.Event()
    ready.record(main)
    decode.stream.wait_event(ready)
    prefill.stream.wait_event(ready)
    done = []
    for i in range(n):
        with torch.cuda.stream(decode.stream):
            decode.graph.replay()
        done.append(torch.cuda.Event(enable_timing=marks is not None))
        done[-1].record(decode.stream)
        if i == 0:
            with torch.cuda.stream(prefill.stream):
                prefill.graph.replay()
            chunk = torch.cuda.Event(enable_timing=marks is not None)
            chunk.record(prefill.stream)
    if marks is not None:
        marks.extend([*done, chunk])
    main.wait_event(done[-1])
    main.wait_event(chunk)


def host_ms(launch: Callable[[], None], reps: int, timeout_s: float) -> list[float]:
    """GPU milliseconds of each of `reps` calls of `launch` (after `WARM` more), between events on the current
    stream."""
    import torch

    out = []
    for _ in range(reps + WARM):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        wait(end, timeout_s)
        out.append(start.elapsed_time(end))
    return out[WARM:]


def finish_ms(launch: Callable[[list], None], reps: int, timeout_s: float) -> list[list[float]]:
    """For each of `reps` calls of `launch(marks)` (after `WARM` more): the milliseconds from its start to each
    event it appended to `marks` (when each graph of a pair was done)."""
    import torch

    out = []
    for _ in range(reps + WARM):
        marks: list = []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch(marks)
        end.record()
        wait(end, timeout_s)
        out.append([start.elapsed_time(m) for m in marks])
    return out[WARM:]


def finished(samples: Sequence[Sequence[float]], names: Sequence[str]) -> dict[str, float]:
    """The median time at which each graph of a pair was done, by name."""
    return {name: median_ms([row[i] for row in samples]) for i, name in enumerate(names)}


class Probe:
    """The model, the two runners with their steps staged, and the measurements of each mode."""

    def __init__(self, plan, reps: int, timeout_s: float) -> None:
        import torch

        from bench.kernels import served_contexts
        from bench.roofline import BLOCK, LLAMA3_8B, build, stage_seqs
        from bench.trace import step_seqs
        from gpu_engine.gpu.runner import GpuModelRunner

        contexts = served_contexts(DECODES)
        # the cache holds the served contexts' blocks and the prompt's, no more (max_ctx sizes only the RoPE table)
        # the limits hold the mixed step too (every decode row and the chunk in one step: the baseline)
        _, self.model, self.decoder = build(LLAMA3_8B, CHUNK, [DECODES + 1], [BUDGET], plan,
                                            served=(contexts + [CHUNK],))
        self.prefiller = GpuModelRunner(self.model, self.decoder.kv, self.decoder.limits, plan=plan)
        self.mixer = GpuModelRunner(self.model, self.decoder.kv, self.decoder.limits, plan=plan)
        rows = step_seqs(contexts, CHUNK, BLOCK)
        stage_seqs(self.decoder, rows[:-1])
        stage_seqs(self.prefiller, rows[-1:])
        stage_seqs(self.mixer, rows)
        torch.cuda.synchronize()
        self.device, self.reps, self.timeout_s = Device(), reps, timeout_s
        self.sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        self.context_mean = sum(contexts) / len(contexts)

    def pair(self, decode_sms: int | None = None, split: GreenSplit | None = None) -> Pair:
        """Both steps captured: with cuBLAS at every SM but the scheduler's (None), at `decode_sms` for the decode
        graph and the rest but one for the prefill graph, or in the two contexts of a green `split`."""
        from gpu_engine.gpu.sm_share import reserve_sms

        if split is not None:
            shares = split.sms
        elif decode_sms is not None:
            shares = (decode_sms, self.sms - 1 - decode_sms)
        else:
            shares = (None, None)
        try:
            reserve_sms(self.sms - shares[0] if shares[0] else 1)
            decode = capture(self.decoder, True, split.streams[0] if split else None, split, 0 if split else None)
            reserve_sms(self.sms - shares[1] if shares[1] else 1)
            prefill = capture(self.prefiller, False, split.streams[1] if split else None, split,
                              1 if split else None)
        finally:
            reserve_sms(1)
        return Pair(decode, prefill, split, shares)

    def host(self, pair: Pair, sequential: bool = False) -> dict[str, Any]:
        """Each graph alone, the two on two streams (and one after the other on one, with `sequential`), host
        replays; then one traced launch of the pair."""
        both = [pair.decode, pair.prefill]

        def timed(graphs: list[Graph], one_stream: bool = False) -> list[float]:
            return host_ms(lambda: host_launch(graphs, pair.split, one_stream), self.reps, self.timeout_s)

        entry = {"launch": "host", "decode_ms": median_ms(timed([pair.decode])),
                 "prefill_ms": median_ms(timed([pair.prefill]))}
        pairs = timed(both)
        entry.update(pair_ms=median_ms(pairs), pair_all_ms=pairs, alone_sum_ms=entry["decode_ms"] + entry["prefill_ms"])
        if sequential:
            entry["sequential_ms"] = median_ms(timed(both, one_stream=True))
        # when each graph of the pair is done: the decode rows' share of a round, what their TPOT would see
        done = finish_ms(lambda marks: host_launch(both, pair.split, marks=marks), self.reps, self.timeout_s)
        entry["done_in_pair_ms"] = finished(done, ("decode", "prefill"))
        shorter = min(entry["decode_ms"], entry["prefill_ms"]) * 1e3
        entry["overlap"] = overlap(trace(lambda: host_launch(both, pair.split)), shorter)
        return entry

    def beside(self, pair: Pair, counts: Sequence[int] = BESIDE, mixed: bool = True) -> dict[str, Any]:
        """Decode steps one after another beside one chunk (host replays, two streams), for each count in `counts`:
        when each decode and the chunk were done; beside them each graph alone and, with `mixed`, the mixed step
        that does one decode's and the chunk's work in one graph (the mixed-step policy's round)."""
        entry: dict[str, Any] = {
            "launch": "host", "partition": "none",
            "decode_ms": median_ms(host_ms(lambda: host_launch([pair.decode]), self.reps, self.timeout_s)),
            "prefill_ms": median_ms(host_ms(lambda: host_launch([pair.prefill]), self.reps, self.timeout_s))}
        if mixed:
            graph = capture(self.mixer, False, shape=(DECODES + 1, BUDGET))
            try:
                entry["mixed_ms"] = median_ms(host_ms(lambda: host_launch([graph]), self.reps, self.timeout_s))
            finally:
                destroy_graphs([graph])
        entry["beside"] = {}
        for n in counts:
            done = finish_ms(lambda marks, n=n: beside_launch(pair.decode, pair.prefill, n, marks), self.reps,
                             self.timeout_s)
            names = [f"decode {i + 1}" for i in range(n)] + ["chunk"]
            entry["beside"][str(n)] = finished(done, names)
        return entry

    def prioritized(self) -> list[dict[str, Any]]:
        """The decode graph ahead of the chunk's: replayed from the host on a stream of the device's most urgent
        priority beside the chunk's on a least urgent one (decode steps beside one chunk, as `beside`), and both
        launched from the device as executables whose kernel nodes carry those priorities."""
        import torch

        least, greatest = self.device.priority_range()
        streams = torch.cuda.Stream(priority=greatest), torch.cuda.Stream(priority=least)
        pair = Pair(capture(self.decoder, True, streams[0]), capture(self.prefiller, False, streams[1]))
        execs: list[int] = []
        try:
            # torch may clamp a stream's priority to its own range: the host mode records what the streams got
            host = {**attempt("host", lambda: self.beside(pair, mixed=False)), "partition": "priority",
                    "priorities": {"decode": streams[0].priority, "prefill": streams[1].priority}}

            def device() -> dict[str, Any]:
                execs.append(self.device.priority_exec(pair.decode, greatest))
                execs.append(self.device.priority_exec(pair.prefill, least))
                return self.device_launch(Pair(Graph(None, execs[0], pair.decode.stream),
                                               Graph(None, execs[1], pair.prefill.stream)), trace_it=False)

            return [host, {**attempt("device", device), "partition": "priority",
                           "priorities": {"decode": greatest, "prefill": least}}]
        finally:
            destroy_graphs([Graph(None, e, None) for e in execs])
            destroy(pair)

    def device_launch(self, pair: Pair, sequential: bool = False, trace_it: bool = True) -> dict[str, Any]:
        """The same from the device: each executable alone, both fire-and-forget (and the second as a tail launch,
        with `sequential`), then one traced launch of the pair."""
        d, p = pair.decode.exec_handle, pair.prefill.exec_handle

        def timed(first: int, second: int, tail: bool = False) -> list[float]:
            return self.device.pair(first, second, tail, self.reps + WARM, self.timeout_s)[WARM:]

        entry = {"launch": "device", "decode_ms": median_ms(timed(d, 0)), "prefill_ms": median_ms(timed(p, 0))}
        pairs = timed(d, p)
        entry.update(pair_ms=median_ms(pairs), pair_all_ms=pairs, alone_sum_ms=entry["decode_ms"] + entry["prefill_ms"])
        if sequential:
            entry["sequential_ms"] = median_ms(timed(d, p, tail=True))
        if trace_it:
            shorter = min(entry["decode_ms"], entry["prefill_ms"]) * 1e3
            entry["overlap"] = overlap(trace(lambda: self.device.pair(d, p, False, 1, self.timeout_s)), shorter)
        return entry


# ---- the run ------------------------------------------------------------------------------------------------------
def attempt(launch: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`measure()`, or its error as the entry of a `launch` mode (a timeout goes on: it ends the run)."""
    try:
        return measure()
    except TimeoutError:
        raise
    except Exception as exc:  # noqa: BLE001  (recorded; the other modes still run)
        return {"launch": launch, "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(limit=6).splitlines()[-8:]}


def guarded(result: dict[str, Any], names: Sequence[str], measure: Callable[[], list[dict[str, Any]]],
            save: Callable[[], None]) -> None:
    """Record the entries `measure` returns under `names` (a host mode, then a device one), or its error under each;
    a timeout ends the run (the GPU may still be running the graphs) once the file is written."""
    t0 = time.perf_counter()
    try:
        entries = measure()
    except TimeoutError as exc:
        for name in names:
            result["modes"][name] = {"error": f"timeout: {exc}"}
        result["aborted"] = f"{names[0]}: {exc}"
        save()
        print("\n".join(table(result)), flush=True)
        os._exit(3)
    except Exception as exc:  # noqa: BLE001  (a capture failed: recorded for each mode)
        entries = [attempt(launch, lambda exc=exc: _raise(exc)) for launch in ("host", "device")[:len(names)]]
    baselines = result.get("baseline", {})
    for name, entry in zip(names, entries, strict=True):
        baseline = baselines.get(entry.get("launch", "")) or baselines.get("host")
        result["modes"][name] = judged({**entry, "seconds": time.perf_counter() - t0}, baseline)
    save()
    print(f"{', '.join(names)}: done in {time.perf_counter() - t0:.1f} s", flush=True)


def _raise(exc: BaseException) -> dict[str, Any]:
    raise exc


def unpartitioned(probe: Probe, result: dict[str, Any]) -> list[dict[str, Any]]:
    """Host and device entries of the graphs as served (cuBLAS at every SM but the scheduler's); their sequential
    times become the baselines."""
    pair = probe.pair()
    try:
        entries = [attempt("host", lambda: probe.host(pair, sequential=True)),
                   attempt("device", lambda: probe.device_launch(pair, sequential=True))]
    finally:
        destroy(pair)
    for entry in entries:
        entry["partition"] = "none"
        if "sequential_ms" in entry:
            result.setdefault("baseline", {})[entry["launch"]] = entry["sequential_ms"]
    return entries


def besides(probe: Probe) -> list[dict[str, Any]]:
    """The entry of decode steps beside one chunk (`Probe.beside`), the graphs as served (a failed capture is the
    entry's error)."""
    def measure() -> dict[str, Any]:
        pair = probe.pair()
        try:
            return probe.beside(pair)
        finally:
            destroy(pair)

    return [attempt("host", measure)]


def partitioned(probe: Probe, kind: str, sms: int) -> list[dict[str, Any]]:
    """Host and device entries of one split: cuBLAS targets ("cublas") or green contexts ("green")."""
    split = GreenSplit(probe.device, sms) if kind == "green" else None
    try:
        pair = probe.pair(decode_sms=sms, split=split)
        try:
            shares = {"partition": kind, "decode_sms": pair.sms[0], "prefill_sms": pair.sms[1]}
            return [{**attempt("host", lambda: probe.host(pair)), **shares},
                    {**attempt("device", lambda: probe.device_launch(pair)), **shares}]
        finally:
            destroy(pair)
    finally:
        if split is not None:
            split.close()


def torch_green() -> str:
    try:
        from torch.cuda import green_contexts
    except ImportError:
        return "no torch.cuda.green_contexts"
    return f"torch.cuda.green_contexts.SUPPORTED={getattr(green_contexts, 'SUPPORTED', '?')}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from bench.roofline import bench_plan

    plan = bench_plan(args.plan, torch.cuda.get_device_name())
    t0 = time.perf_counter()
    probe = Probe(plan, args.reps, args.timeout)
    splits = parse_splits(args.splits, probe.sms)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "plan": plan.summary(), "sms": probe.sms,
                              "decodes": DECODES, "chunk": CHUNK, "context_mean": probe.context_mean,
                              "reps": args.reps, "splits": list(splits), "torch_green": torch_green(),
                              "build_s": time.perf_counter() - t0, "modes": {}}

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")

    guarded(result, ["host", "device"], lambda: unpartitioned(probe, result), save)
    guarded(result, ["beside"], lambda: besides(probe), save)
    guarded(result, ["priority/host", "priority/device"], probe.prioritized, save)
    for kind in ("cublas", "green"):
        for n in splits:
            guarded(result, [f"{kind} {n}/host", f"{kind} {n}/device"], lambda k=kind, n=n: partitioned(probe, k, n),
                    save)
    result["seconds"] = time.perf_counter() - t0
    save()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/overlap_probe.json"))
    parser.add_argument("--splits", default=",".join(map(str, SPLITS)), help="the decode graph's SMs, e.g. 32,64")
    parser.add_argument("--reps", type=int, default=REPS, help="timed launches of each measurement")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds a launch may take")
    parser.add_argument("--plan", default="auto", help="the kernel plan (bench/roofline.py --plan)")
    parser.add_argument("--table-only", action="store_true", help="print the table of --out as it is (no GPU)")
    args = parser.parse_args(argv)
    try:
        parse_splits(args.splits)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if args.table_only:
        print("\n".join(table(json.loads(args.out.read_text()))))
        return
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench.overlap_probe needs a CUDA device")
    args.reps = max(1, args.reps)
    result = run(args)
    print("\n".join(table(result)))


if __name__ == "__main__":
    main()
