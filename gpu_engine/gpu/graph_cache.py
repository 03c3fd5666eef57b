"""The one owner of CUDA graphs: capture, shape lookup, device-launch executables and host replay.

Every graph runs `GpuModelRunner.forward` on the runner's single set of static buffers, sized for
the largest shape, then a tiny kernel that bumps the graph's completion counter
(`counters[graph_index]`, int64, release ordered). Graphs share one memory pool and the static
buffers, so at most one may run at a time. Each graph is captured with `keep_graph=True`; its
`cudaGraph_t` is instantiated `copies` times for device launch (`cudaGraphInstantiateFlagDeviceLaunch`
+ `cudaGraphUpload`) so a device scheduler can rotate copies, and a host replay (the start's probes, tests and
benchmarks) launches the first copy from the host: torch never instantiates its own executable, which would hold
as much memory as a copy. Without device launch, host replay uses torch's executable.

Each decode batch size is captured twice (`GraphShape.filtered`): the filtering variant samples
through the top-k / top-p / min-p filter (a sort of every row over the vocabulary), the unfiltered
one skips it and gives the same tokens when no row of the step uses those filters
(`gpu_engine.policy.needs_filter`). Prefill graphs come in both variants with `prefill_variants`
(chunked prefill: their steps carry the running decodes, whose sampling the sort would slow), else
in the filtering variant only. Every graph
of a runner built with `RunnerLimits.processors` also applies the logits processors' dense columns
(`StepBuffers.logit_add`, ...), which leave the logits unchanged until a step stages them.

Lookup is O(1): `decode_table[f, b]` (int32, shape (2, max_batch + 1); row 0 unfiltered, row 1
filtering, so a flat row-major read is `f * (max_batch + 1) + b`) is the index of the smallest
decode graph with batch >= b and filtered == bool(f); `prefill_table[f, b, ceil(t / TOKEN_GRAIN)]`
the cheapest prefill graph with batch >= b, tokens >= t and filtered == bool(f) (the filtering one
where no unfiltered prefill graph was captured). Shapes past the largest fall back to the
largest graph of their kind (whose padding rules then do not hold, so callers must split such
steps; `lookup` reports it).

A runner with `RunnerLimits.score_rows` also gets the score graph (`score`, outside the shape tables; its
counter is the last one): `GpuModelRunner.score_positions`, which the persistent scheduler launches after a
prefill step whose prompts asked for their log-probs.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from gpu_engine.gpu.runner import GpuModelRunner

TOKEN_GRAIN = 16


class GraphShape(NamedTuple):
    decode: bool
    batch: int
    tokens: int
    filtered: bool  # samples through the top-k / top-p / min-p filter (always True for prefill)


@dataclass
class CapturedGraph:
    shape: GraphShape
    index: int
    graph: torch.cuda.CUDAGraph
    exec_handles: list[int] = field(default_factory=list)
    capture_s: float = 0.0
    memory_bytes: int = 0


@triton.jit
def _bump_counter_kernel(counter_ptr):
    tl.atomic_add(counter_ptr, 1, sem="release")


def _cudart():
    from cuda.bindings import runtime

    return runtime


def _checked(result, what: str):
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")
    return rest[0] if len(rest) == 1 else rest


def warm_up(run: Callable[[], object]) -> None:
    """Run once on a side stream before a capture (compiles kernels, picks cuBLAS algorithms), then give its
    temporaries back to the device (torch.cuda.graph would on entering anyway, but then their release would count
    against the graph and its memory read negative)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def instantiate_for_device_launch(raw_graph: int, stream: int) -> int:
    """Instantiate a `cudaGraph_t` (as int) with the device-launch flag and upload it; returns the exec."""
    rt = _cudart()
    flag = rt.cudaGraphInstantiateFlags.cudaGraphInstantiateFlagDeviceLaunch
    graph = rt.cudaGraph_t(init_value=raw_graph)
    exec_ = _checked(rt.cudaGraphInstantiateWithFlags(graph, int(getattr(flag, "value", flag))),
                     "cudaGraphInstantiateWithFlags(DeviceLaunch)")
    _checked((rt.cudaGraphUpload(exec_, rt.cudaStream_t(init_value=stream))[0], None), "cudaGraphUpload")
    handle = int(exec_)
    if handle == 0:
        raise RuntimeError("device-launch instantiation returned a null executable")
    return handle


class GraphCache:
    """Decode graphs over batch sizes and prefill graphs over (batch, tokens) buckets for one runner."""

    def __init__(self, runner: GpuModelRunner, decode_batches: list[int],
                 prefill_buckets: list[tuple[int, int]], copies: int = 2, device_launch: bool = True,
                 prefill_variants: bool = False) -> None:
        lim = runner.limits
        for b in decode_batches:
            if not 0 < b <= lim.max_batch:
                raise ValueError(f"decode batch {b} outside 1..{lim.max_batch}")
        for b, t in prefill_buckets:
            if not (0 < b <= lim.max_batch and b <= t <= lim.max_tokens):
                raise ValueError(f"prefill bucket ({b}, {t}) outside the runner limits {lim}")
        self.runner, self.copies, self.device_launch = runner, copies, device_launch
        shapes = [GraphShape(True, b, b, f) for f in (False, True) for b in sorted(set(decode_batches))]
        variants = (False, True) if prefill_variants else (True,)
        shapes += [GraphShape(False, b, t, f) for f in variants for b, t in sorted(set(prefill_buckets))]
        self.shapes = shapes
        self.graphs: list[CapturedGraph | None] = [None] * len(shapes)
        self.score: CapturedGraph | None = None  # the score graph, once captured (RunnerLimits.score_rows)
        self.counters = torch.zeros(len(shapes) + 1, dtype=torch.int64, device=runner.device)  # the last: score
        self.decode_table = self._decode_table(lim.max_batch)
        self.prefill_table = self._prefill_table(lim.max_batch, lim.max_tokens)
        self._pool: Any = None  # torch's graph pool handle, made at capture

    # ---- lookup -------------------------------------------------------------------------------
    def _decode_table(self, max_batch: int) -> np.ndarray:
        table = np.full((2, max_batch + 1), -1, dtype=np.int32)
        for f in (0, 1):
            dec = sorted((s.batch, i) for i, s in enumerate(self.shapes) if s.decode and s.filtered == bool(f))
            for b in range(max_batch + 1):
                fits = [i for size, i in dec if size >= b]
                table[f, b] = fits[0] if fits else (dec[-1][1] if dec else -1)
        return table

    def _prefill_table(self, max_batch: int, max_tokens: int) -> np.ndarray:
        n_t = triton.cdiv(max_tokens, TOKEN_GRAIN) + 1
        table = np.full((2, max_batch + 1, n_t), -1, dtype=np.int32)
        need = np.arange(n_t)[:, None] * TOKEN_GRAIN  # [n_t, 1] the tokens of each column
        for f in (1, 0):
            pre = sorted((s.tokens, s.batch, i) for i, s in enumerate(self.shapes)
                         if not s.decode and s.filtered == bool(f))
            if not pre:
                table[f] = table[1]  # no unfiltered prefill graphs: the filtering ones serve both
                continue
            tokens, batch, index = (np.array(c) for c in zip(*pre, strict=True))  # cheapest first
            for b in range(max_batch + 1):
                fits = (tokens[None, :] >= need) & (batch[None, :] >= b)  # [n_t, graphs]
                table[f, b] = np.where(fits.any(axis=1), index[fits.argmax(axis=1)], pre[-1][2])  # else the largest
        return table

    def lookup(self, decode: bool, batch: int, tokens: int, filtered: bool = True) -> tuple[int, bool]:
        """(graph index, fits) for a step; fits is False when the largest-shape fallback is too small.

        `filtered` picks the variant (a prefill without unfiltered graphs gets the filtering one).
        """
        if decode:
            idx = int(self.decode_table[int(bool(filtered)), min(batch, self.decode_table.shape[1] - 1)])
        else:
            b = min(batch, self.prefill_table.shape[1] - 1)
            g = min(triton.cdiv(tokens, TOKEN_GRAIN), self.prefill_table.shape[2] - 1)
            idx = int(self.prefill_table[int(bool(filtered)), b, g])
        if idx < 0:
            raise LookupError(f"no {'decode' if decode else 'prefill'} graph captured")
        s = self.shapes[idx]
        return idx, s.batch >= batch and s.tokens >= tokens

    def captured(self, decode: bool, batch: int, tokens: int, filtered: bool = True) -> int:
        """The index of the graph that runs a step; ValueError when the step is larger than every one."""
        idx, fits = self.lookup(decode, batch, tokens, filtered)
        if not fits:
            raise ValueError(f"step {(decode, batch, tokens)} is larger than every captured graph")
        return idx

    # ---- capture ------------------------------------------------------------------------------
    def capture(self, progress: bool = True,
                on_graph: Callable[[int, int], None] | None = None) -> list[CapturedGraph]:
        """Warm up and capture every shape, largest first (they share one pool); returns the graphs.
        ``on_graph(k, n)`` is called after the k-th of n graphs."""
        from tqdm import tqdm

        if not self.runner.device.type == "cuda":
            raise RuntimeError("graph capture needs a CUDA runner")
        self._pool = torch.cuda.graph_pool_handle()
        order = sorted(range(len(self.shapes)), key=lambda i: -self.shapes[i].tokens)
        bar = tqdm(order, desc="capturing graphs", disable=not progress, unit="graph")
        for k, i in enumerate(bar, 1):
            self.graphs[i] = self._capture_one(self.shapes[i], i, functools.partial(self._forward, self.shapes[i]))
            if on_graph is not None:
                on_graph(k, len(order))
            g = self.graphs[i]
            bar.set_postfix_str(f"{shape_label(g.shape)} {g.capture_s * 1e3:.0f} ms {g.memory_bytes / 2**20:.1f} MiB")
        rows = self.runner.limits.score_rows
        if rows:
            self.score = self._capture_one(GraphShape(False, 0, rows, False), len(self.shapes),
                                           self.runner.score_positions)
        torch.cuda.synchronize()
        return [g for g in self.graphs if g is not None]

    def _forward(self, s: GraphShape) -> None:
        self.runner.forward(s.batch, s.tokens, s.decode, s.filtered)

    def _capture_one(self, shape: GraphShape, index: int, run: Callable[[], None]) -> CapturedGraph:
        """Warm ``run`` up, then capture it followed by the bump of ``counters[index]``."""
        scratch = torch.zeros(1, dtype=torch.int64, device=self.runner.device)

        def warm() -> None:
            run()
            _bump_counter_kernel[(1,)](scratch)
        warm_up(warm)
        free_before = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph, pool=self._pool):
            run()
            _bump_counter_kernel[(1,)](self.counters[index:])
        cg = CapturedGraph(shape, index, graph)
        if not self.device_launch:
            graph.instantiate()
        else:
            raw = int(graph.raw_cuda_graph())
            cur = torch.cuda.current_stream().cuda_stream
            cg.exec_handles = [instantiate_for_device_launch(raw, cur) for _ in range(self.copies)]
        torch.cuda.synchronize()
        cg.capture_s = time.perf_counter() - t0
        cg.memory_bytes = free_before - torch.cuda.mem_get_info()[0]
        return cg

    # ---- use ----------------------------------------------------------------------------------
    def replay(self, shape: GraphShape | tuple[bool, int, int], filtered: bool = True) -> GraphShape:
        """Host-driven mode: replay the graph for (decode, batch, tokens) on the current stream.

        `filtered` picks the variant (`gpu_engine.policy.step_filters`); a prefill without unfiltered
        graphs runs the filtering one. A 4-field `GraphShape` must agree with `filtered` for decode.
        Buffers past the real step must hold padding (`GpuModelRunner.stage` writes it). Returns the
        captured shape that ran.
        """
        decode, batch, tokens = shape[:3]
        if decode and len(shape) > 3 and bool(shape[3]) != bool(filtered):
            raise ValueError(f"shape {tuple(shape)} disagrees with filtered={filtered}")
        idx = self.captured(decode, batch, tokens, filtered)
        g = self.graphs[idx]
        if g is None:
            raise RuntimeError("graphs not captured yet (call capture())")
        self.launcher(g)()
        return g.shape

    @staticmethod
    def launcher(g: CapturedGraph) -> Callable[[], None]:
        """A host launch of `g` on the current stream: its first device-launch copy, else torch's executable."""
        if not g.exec_handles:
            return g.graph.replay
        rt, handle = _cudart(), g.exec_handles[0]

        def launch() -> None:
            stream = rt.cudaStream_t(init_value=torch.cuda.current_stream().cuda_stream)
            _checked((rt.cudaGraphLaunch(rt.cudaGraphExec_t(init_value=handle), stream)[0], None), "cudaGraphLaunch")
        return launch

    def exec_handles(self, index: int) -> list[int]:
        """The device-launch `cudaGraphExec_t` copies (as ints) of graph `index`."""
        g = self.graphs[index]
        if g is None or not g.exec_handles:
            raise RuntimeError(f"graph {index} has no device-launch executables")
        return list(g.exec_handles)

    def scheduler_view(self) -> dict:
        """Everything a device scheduler needs: shapes, lookup tables, exec handles and buffer addresses."""
        return {
            "shapes": [tuple(s) for s in self.shapes],
            "exec_handles": [list(g.exec_handles) if g else [] for g in self.graphs],
            "decode_table": self.decode_table,  # (2, max_batch + 1) int32: row 0 unfiltered, row 1 filtering
            "prefill_table": self.prefill_table,  # (2, max_batch + 1, cols) int32: same rows as decode_table
            "token_grain": TOKEN_GRAIN,
            "counters_ptr": self.counters.data_ptr(),
            "buffers": self.runner.buffers.pointers(),
            # the score graph (none: prompt log-probs are not computed): its executables and counter
            "score_exec_handles": list(self.score.exec_handles) if self.score else [],
            "score_counter_ptr": self.counters[len(self.shapes):].data_ptr(),
        }

    def close(self) -> None:
        """Destroy the device-launch executables and drop the graphs."""
        every = [*self.graphs, self.score]
        rt = _cudart() if any(g and g.exec_handles for g in every) else None
        for g in every:
            if g is not None and rt is not None:
                for h in g.exec_handles:
                    rt.cudaGraphExecDestroy(rt.cudaGraphExec_t(init_value=h))
                g.exec_handles.clear()
        self.graphs = [None] * len(self.shapes)
        self.score = None


def shape_label(s: GraphShape) -> str:
    """A graph shape for logs: decode/prefill, batch, tokens and the sampling variant."""
    if s.decode:
        return f"decode b={s.batch} {'filtered' if s.filtered else 'unfiltered'}"
    if s.batch == 0:
        return f"score rows={s.tokens}"
    return f"prefill b={s.batch} t={s.tokens}{'' if s.filtered else ' unfiltered'}"
