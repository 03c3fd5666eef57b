"""Host side of the persistent scheduler: build the CUDA library, describe the graphs and the
ring to it, start it once, then only supervise.

After ``start`` the host makes no CUDA call until shutdown: it reads the scheduler's counters
from host-mapped memory and sleeps.
"""

from __future__ import annotations

import contextlib
import ctypes as C
import functools
import hashlib
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt

from gpu_engine.backend import find_nvcc
from gpu_engine.gpu import sched_structs
from gpu_engine.gpu.grammar_arena import GrammarArena
from gpu_engine.gpu.sched_structs import MAX_EOS, SAMPLES, SchedConfig
from shared.env import env
from shared.token_dfa import device_row_bytes

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SCHEMA_CPP = CSRC.parent.parent / "schema" / "cpp"
# Every source of the library (scheduler.cu includes the headers): the build cache's digest covers them all.
SOURCES = tuple(sorted(p.name for p in CSRC.iterdir() if p.suffix in (".cu", ".cuh", ".h")))
PHASE_CLOCKS_FLAG = "-DBLINK_SCHED_PHASE_CLOCKS"

P = C.c_void_p
i64 = C.c_int64


class SchedStats(sched_structs.SchedStats):
    """blink_sched_stats (mirror generated from schema/sched_structs.py) and what the host reads of it."""

    def samples(self, name: str) -> np.ndarray:
        n = min(int(getattr(self, f"n_{name}_samples")), SAMPLES)
        return np.frombuffer(getattr(self, f"{name}_ns"), dtype=np.uint32)[:n].astype(np.float64)

    def step_times(self) -> dict[str, float | None]:
        """``step_ms_p50`` / ``step_ms_p99``: graph launch to completion seen, over the last samples; ``gap_us``:
        the mean time the GPU waited on the scheduler between two steps launched back to back (None without any)."""
        steps = self.samples("step")
        pct = {q: (round(float(np.percentile(steps, q)) / 1e6, 3) if steps.size else None) for q in (50, 99)}
        gap = round(self.gap_ns / self.gap_steps / 1e3, 1) if self.gap_steps else None
        return {"step_ms_p50": pct[50], "step_ms_p99": pct[99], "gap_us": gap}

    def counters(self) -> dict[str, int | list[int]]:
        names = [f[0] for f in self._fields_]
        out: dict[str, int | list[int]] = {}
        for n in names[: names.index("current_graph")]:
            v = getattr(self, n)
            out[n] = int(v) if isinstance(v, int) else [int(x) for x in v]
        return out


class SchedulerError(RuntimeError):
    pass


def _digest(source: Path | None = None) -> str:
    h = hashlib.sha256()
    for name in SOURCES:
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    h.update((SCHEMA_CPP / "blink_ring.h").read_bytes())
    if source is not None:
        h.update(source.read_bytes())
    return h.hexdigest()[:16]


def library_path(arch: str = "sm_90a", phase_clocks: bool = False, source: Path | None = None) -> Path:
    """Where ``build_library`` puts (and finds) the library for these sources and options."""
    out_dir = env().cuda_build_dir or CSRC / "build"
    clocks = "-clocks" if phase_clocks else ""
    name = "blink_sched" if source is None else source.stem
    return out_dir / f"lib{name}-{_digest(source)}-{arch}{clocks}.so"


def build_library(arch: str = "sm_90a", phase_clocks: bool = False, source: Path | None = None) -> Path:
    """Compile libblink_sched.so (cached by source digest) with relocatable device code.

    ``phase_clocks`` builds the scan's phase clocks in (stats.scan_phase_ns; the scheduler
    micro-benchmark asks for them): a few more global-timer reads per scan, so off by default.
    ``source``: another translation unit built the same way with the scheduler's headers on its include path
    (a benchmark's, e.g. bench/csrc/overlap_probe.cu, which includes the scheduler's and adds entry points).
    """
    lib = library_path(arch, phase_clocks, source)
    if lib.exists():
        return lib
    nvcc = find_nvcc() or "nvcc"  # the one lookup --backend auto also uses
    lib.parent.mkdir(parents=True, exist_ok=True)
    compute = arch.replace("sm_", "compute_")
    flags = [PHASE_CLOCKS_FLAG] if phase_clocks else []
    cmd = [nvcc, "-O2", "-std=c++17", f"-gencode=arch={compute},code={arch}", "-rdc=true", "-shared",
           "-Xcompiler", "-fPIC", "-cudart", "shared", f"-I{SCHEMA_CPP}", f"-I{CSRC}", *flags,
           str(source or CSRC / "scheduler.cu"),
           "-o", str(lib), "-lcudadevrt"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SchedulerError(f"nvcc failed:\n{res.stderr[-4000:]}")
    return lib


class Library:
    """ctypes binding of the scheduler's extern "C" API."""

    def __init__(self, path: Path) -> None:
        self.lib = C.CDLL(str(path))
        lib = self.lib
        lib.blink_last_error.restype = C.c_char_p
        lib.blink_register_host.argtypes = [P, C.c_size_t, C.POINTER(P)]
        lib.blink_unregister_host.argtypes = [P]
        lib.blink_clock_offset.argtypes = [C.POINTER(i64)]
        lib.blink_sched_create.argtypes = [C.POINTER(SchedConfig), C.POINTER(P), C.POINTER(C.POINTER(SchedStats))]
        for fn in ("blink_sched_start", "blink_sched_query", "blink_sched_wait", "blink_sched_destroy",
                   "blink_probe_release"):
            getattr(lib, fn).argtypes = [P]
        lib.blink_probe_hold.argtypes = [C.POINTER(P)]
        lib.blink_sched_guard_report.argtypes = [P, C.c_char_p, C.c_size_t]
        lib.blink_launch_once.argtypes = [C.c_uint64, C.c_int, C.POINTER(C.c_int)]
        if lib.blink_sched_config_size() != C.sizeof(SchedConfig):
            raise SchedulerError(f"SchedConfig mirror is {C.sizeof(SchedConfig)} bytes, "
                                 f"library says {lib.blink_sched_config_size()}")
        if lib.blink_sched_stats_size() != C.sizeof(SchedStats):
            raise SchedulerError("SchedStats mirror does not match the library")

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise SchedulerError(f"{what} failed ({rc}): {self.lib.blink_last_error().decode()}")

    def launch_once(self, exec_handle: int, device: bool) -> int:
        """Launch a device-launch executable once, from the host or (``device``) as the scheduler does, from a
        kernel of a device-launched parent graph, and wait for it (diagnostics, benchmarks and tests); the
        device-side ``cudaGraphLaunch``'s status (0: launched). A host-side failure raises."""
        err = C.c_int(0)
        self.check(self.lib.blink_launch_once(exec_handle, int(device), C.byref(err)),
                   "device launch" if device else "host launch")
        return err.value

    def register_host(self, addr: int, size: int) -> int:
        dev = P()
        self.check(self.lib.blink_register_host(P(addr), size, C.byref(dev)), "cudaHostRegister of the ring")
        return int(dev.value or 0)

    @contextlib.contextmanager
    def scheduler_footprint(self) -> Iterator[None]:
        """Hold one SM the way the scheduler does (its block size and shared memory) meanwhile."""
        probe = P()
        self.check(self.lib.blink_probe_hold(C.byref(probe)), "probe block")
        try:
            yield
        finally:
            self.check(self.lib.blink_probe_release(probe), "probe release")

    def clock_offset(self) -> int:
        off = i64()
        self.check(self.lib.blink_clock_offset(C.byref(off)), "clock offset")
        return int(off.value)


@functools.cache
def library(phase_clocks: bool = False) -> Library:
    """The scheduler library of this process: built (or found in the cache) and loaded once."""
    return Library(build_library(phase_clocks=phase_clocks))


def _dev_array(values: np.ndarray | list[int], dtype: npt.DTypeLike) -> object:
    import torch

    return torch.from_numpy(np.ascontiguousarray(np.asarray(values, dtype=dtype))).cuda()


def coresidency_failures(lib: Library, graphs: list[tuple[int, Callable[[], None]]],
                         timeout_s: float = 5.0) -> list[int]:
    """Run each graph while a block shaped like the scheduler holds one SM; the keys of those that
    did not finish within ``timeout_s`` (beside the scheduler they would never finish).

    Each ``run`` launches its graph on the current stream. A graph that hangs finishes once the
    probe block is released, so the check itself never hangs.
    """
    import torch

    stuck = []
    for key, run in graphs:
        done = torch.cuda.Event()
        with lib.scheduler_footprint():
            run()
            done.record()
            end = time.monotonic() + timeout_s
            while not done.query() and time.monotonic() < end:
                time.sleep(0.0005)
            finished = done.query()
        done.synchronize()
        if not finished:
            stuck.append(key)
    return stuck


class PersistentScheduler:
    """Owns the scheduler's device state; started once, then supervised through host memory."""

    def __init__(self, ring_addr: int, ring_size: int, geometry: object, view: dict, kv_cache: object,
                 limits: object, eos_ids: tuple[int, ...], max_batch: int, max_context: int, vocab_size: int,
                 claim_with_cas: bool = True, scan_flips: bool = True, heartbeat_ms: float = 5.0,
                 drain_s: float = 5.0,
                 yield_graphs: frozenset[int] = frozenset(), phase_clocks: bool = False,
                 chunked: bool = False, token_budget: int | None = None, prefix_caching: bool = False,
                 step_timeout_s: float = 0.0, fault: tuple[int, int] = (0, 0),
                 grammar: GrammarArena | None = None) -> None:
        self.lib = library(phase_clocks)
        self.ring_addr = ring_addr
        self.ring_dev = self.lib.register_host(ring_addr, ring_size)
        self.mail_addr = 0
        self._keep: list[object] = []
        cfg = self._config(geometry, view, kv_cache, limits, eos_ids, max_batch, max_context, vocab_size)
        if grammar is not None:
            self._grammar(cfg, grammar, view["buffers"], vocab_size)
        cfg.graph_yield = self._arr([int(i in yield_graphs) for i in range(cfg.num_graphs)], np.uint32)
        cfg.claim_with_cas = int(claim_with_cas)
        # the policy's token budget (Policy.token_budget): the largest prefill graph without chunking
        cfg.chunked = int(chunked)
        cfg.prefix_caching = int(prefix_caching and chunked)  # a cached prefix is a prefill starting after it
        cfg.max_prefill_tokens = token_budget or limits.max_tokens  # type: ignore[attr-defined]
        if chunked and cfg.max_prefill_tokens < max_batch:
            raise SchedulerError(f"token budget {cfg.max_prefill_tokens} < max batch {max_batch}")
        if cfg.score_rows:  # a step's tokens: the budget with chunking, else up to the largest prefill graph
            step_tokens = cfg.max_prefill_tokens if chunked else limits.max_tokens  # type: ignore[attr-defined]
            cfg.score_max_pieces = -(-step_tokens // cfg.score_rows)
        cfg.scan_flips = int(scan_flips)
        cfg.heartbeat_ns = int(heartbeat_ms * 1e6)
        cfg.drain_ns = int(drain_s * 1e9)
        cfg.clock_offset_ns = self.lib.clock_offset()
        cfg.step_timeout_ns = int(step_timeout_s * 1e9)  # 0: the completion poll is unbounded
        cfg.fault, cfg.fault_at = fault  # (BLINK_FAULT_*, step from 1) injected for fault runs; (0, 0): none
        self.config = cfg
        self.handle = P()
        self.stats_ptr = C.POINTER(SchedStats)()
        self.lib.check(self.lib.lib.blink_sched_create(C.byref(cfg), C.byref(self.handle), C.byref(self.stats_ptr)),
                       "scheduler create")

    def _arr(self, values: np.ndarray | list[int], dtype: npt.DTypeLike) -> int:
        t = _dev_array(values, dtype)
        self._keep.append(t)
        return int(t.data_ptr())  # type: ignore[attr-defined]

    def _config(self, g: object, view: dict, kv: object, limits: object, eos_ids: tuple[int, ...],
                max_batch: int, max_context: int, vocab_size: int) -> SchedConfig:
        c = SchedConfig()
        c.ring = self.ring_dev
        c.num_slots, c.max_prompt, c.max_output = g.num_slots, g.max_prompt_tokens, g.max_output_tokens  # type: ignore[attr-defined]
        c.ring_top_k = g.top_logprobs  # type: ignore[attr-defined]
        c.slots_off, c.prompt_off, c.output_off = g.slots_offset, g.prompt_arena_offset, g.output_arena_offset  # type: ignore[attr-defined]
        c.logprob_off, c.top_logprob_off = g.logprob_arena_offset, g.top_logprob_arena_offset  # type: ignore[attr-defined]
        c.max_batch, c.block_size, c.num_blocks = max_batch, kv.block_size, kv.num_blocks  # type: ignore[attr-defined]
        c.max_blocks_per_seq = c.max_graph_blocks = limits.max_blocks_per_seq  # type: ignore[attr-defined]
        c.max_context, c.max_tokens = max_context, limits.max_tokens  # type: ignore[attr-defined]
        eos = list(eos_ids)[:MAX_EOS]
        c.num_eos = len(eos)
        for k, e in enumerate(eos):
            c.eos_ids[k] = e
        shapes = view["shapes"]
        copies = min(len(h) for h in view["exec_handles"])
        c.num_graphs, c.copies, c.token_grain = len(shapes), copies, view["token_grain"]
        prefill_table = np.asarray(view["prefill_table"], dtype=np.int32)
        if prefill_table.ndim != 3 or prefill_table.shape[:2] != (2, max_batch + 1):
            raise SchedulerError(f"prefill table is {prefill_table.shape}, expected (2, {max_batch + 1}, cols)")
        c.prefill_cols = prefill_table.shape[2]
        c.exec_handles = self._arr([h[k] for h in view["exec_handles"] for k in range(copies)], np.uint64)
        c.graph_batch = self._arr([s[1] for s in shapes], np.int32)
        c.graph_tokens = self._arr([s[2] for s in shapes], np.int32)
        decode_table = np.asarray(view["decode_table"], dtype=np.int32)
        if decode_table.shape != (2, max_batch + 1):
            raise SchedulerError(f"decode table is {decode_table.shape}, expected (2, {max_batch + 1}): "
                                 "one row per sampling variant (without, with filtering)")
        c.decode_table = self._arr(decode_table.reshape(-1), np.int32)
        c.prefill_table = self._arr(prefill_table.reshape(-1), np.int32)
        c.counters = view["counters_ptr"]
        b = view["buffers"]
        for name, ours in (("input_ids", "input_ids"), ("positions", "positions"), ("slot_mapping", "slot_mapping"),
                           ("cu_seqlens_q", "cu_seqlens"), ("context_lens", "context_lens"),
                           ("decode_ctx", "decode_ctx"), ("cu_chunks", "cu_chunks"),
                           ("want_logprobs", "want_logprobs"),
                           ("block_tables", "block_tables"), ("temperature", "temperature"), ("top_p", "top_p"),
                           ("min_p", "min_p"), ("top_k", "top_k"), ("seeds", "seeds"),
                           ("sample_index", "sample_index"), ("next_tokens", "next_tokens"),
                           ("token_logprobs", "token_logprobs"), ("top_ids", "top_ids"),
                           ("top_logprobs", "top_logprobs")):
            setattr(c, ours, b[name])
        c.num_top_out = max(1, limits.num_top_logprobs)  # type: ignore[attr-defined]
        c.vocab_size = vocab_size
        self._processor_tables(c, limits.device_tables, b)  # type: ignore[attr-defined]
        self._score_graph(c, g, view, limits)
        return c

    def _score_graph(self, c: SchedConfig, g: object, view: dict, limits: object) -> None:
        """The prompt log-probs' score graph (graph_cache.GraphCache.score), where one was captured and the ring
        has prompt-logprob rows; without it the scheduler refuses a request that asks for them."""
        handles, rows = view["score_exec_handles"], g.prompt_logprob_rows  # type: ignore[attr-defined]
        if not handles or not rows:
            return
        if len(handles) < c.copies:
            raise SchedulerError(f"the score graph has {len(handles)} executables, the others {c.copies}")
        c.score_exec = self._arr(handles[: c.copies], np.uint64)
        c.score_counter = view["score_counter_ptr"]
        c.score_rows, c.score_top = limits.score_rows, max(1, limits.num_top_logprobs)  # type: ignore[attr-defined]
        c.prompt_logprob_rows = rows
        c.prompt_logprob_off = g.prompt_logprob_arena_offset  # type: ignore[attr-defined]
        c.prompt_top_logprob_off = g.prompt_top_logprob_arena_offset  # type: ignore[attr-defined]
        b = view["buffers"]
        for name in ("score_index", "score_targets", "score_logprobs", "score_ranks", "score_top_ids",
                     "score_top_logprobs"):
            setattr(c, name, b[name])

    @staticmethod
    def _processor_tables(c: SchedConfig, tables: object, buffers: dict) -> None:
        """The logits processors' tables (runner.DeviceTables) when the graphs apply them: the scheduler keeps
        its token history in the graphs' table, copies each request's bias table at admission and stages each
        row's processors; without them it refuses a request that uses one."""
        if tables is None:
            return
        if (tables.num_slots, tables.max_context) != (c.num_slots, c.max_context):  # type: ignore[attr-defined]
            raise SchedulerError(f"processor tables {tables} do not match {c.num_slots} slots of "
                                 f"{c.max_context} tokens")
        c.processors, c.max_bias = 1, tables.max_bias  # type: ignore[attr-defined]
        for name in ("history", "bias_tokens", "bias_values", "proc_rows", "proc_penalties"):
            setattr(c, name, buffers[name])

    def _grammar(self, c: SchedConfig, arena: GrammarArena, buffers: dict, vocab_size: int) -> None:
        """The grammar arena (grammar_arena.GrammarArena, its tensor the graphs' `gram_arena`): the scheduler
        loads grammars into it through the mailbox and stages each constrained row's mask; without it the
        scheduler refuses a request with a grammar."""
        if not len(arena.arena) or int(arena.arena.data_ptr()) != buffers["gram_arena"]:
            raise SchedulerError("the grammar arena must be the graphs' gram_arena buffer")
        c.grammar, c.gram_row_bytes = 1, device_row_bytes(vocab_size)
        c.gram_arena_bytes = len(arena.arena)
        c.gram_arena = buffers["gram_arena"]
        c.gram_bits, c.gram_ends = buffers["gram_bits"], buffers["gram_ends"]
        c.gram_mail = self.lib.register_host(arena.address, arena.size)
        self.mail_addr = arena.address

    def guard_report(self) -> str:
        """After a stop: byte ranges (offsets from the state's start) of the guard bands and of the
        configuration that were overwritten, with their first bytes; empty when intact."""
        buf = C.create_string_buffer(4096)
        n = self.lib.lib.blink_sched_guard_report(self.handle, buf, len(buf))
        if n and not buf.value:  # a CUDA error code (positive, like a range count, but nothing written)
            return f"unreadable: {self.last_error()}"
        return buf.value.decode() if n else ""

    def stuck_graph(self) -> tuple[int, float] | None:
        """(graph index, seconds since its launch) of the graph in flight, or None between steps."""
        st = self.stats
        g, since = int(st.current_graph), int(st.current_since_ns)
        if g == 0:
            return None
        return g - 1, (time.time_ns() - (since + int(self.config.clock_offset_ns))) / 1e9

    @property
    def stats(self) -> SchedStats:
        return self.stats_ptr.contents

    def start(self) -> None:
        self.lib.check(self.lib.lib.blink_sched_start(self.handle), "scheduler start")

    def exited(self) -> bool:
        return bool(self.stats.exited)

    def query(self) -> int:
        """0 while the scheduler runs, 1 once it finished, a CUDA error code if it failed."""
        return int(self.lib.lib.blink_sched_query(self.handle))

    def last_error(self) -> str:
        return str(self.lib.lib.blink_last_error().decode())

    def wait(self) -> None:
        self.lib.check(self.lib.lib.blink_sched_wait(self.handle), "scheduler wait")

    def close(self) -> None:
        if self.handle:
            self.lib.lib.blink_sched_destroy(self.handle)
            self.handle = P()
        if self.ring_dev:
            self.lib.lib.blink_unregister_host(P(self.ring_addr))
            self.ring_dev = 0
        if self.mail_addr:
            self.lib.lib.blink_unregister_host(P(self.mail_addr))
            self.mail_addr = 0
