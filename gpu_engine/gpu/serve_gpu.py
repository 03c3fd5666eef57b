"""GPU backends of ``blink engine``: host-driven (``--backend host``) and persistent
(``--backend persistent``). Both load the model in bf16 (a GGUF's Q8_0 linears kept as Q8_0 with
``--gpu-weights auto``: ``loader.load_gpu_weights``), size the paged KV cache from free memory, capture the
graph cache, and serve the same ring with the same policy.

Both bound every wait for the device (``BLINK_STEP_TIMEOUT_S``): a step that does not complete, a launch
that fails or a scheduler that stops raises a ``DeviceFailure`` (``gpu_engine/faults.py``), on which the
engine fails its requests with ENGINE_FAILURE and exits for a restart."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch

from gpu_engine.backend import Backend
from gpu_engine.faults import DeviceFailure, DeviceHang, Fault, FaultyRunner, LaunchFailure
from gpu_engine.gpu import sched_structs as SS
from gpu_engine.gpu.grammar_arena import GrammarArena
from gpu_engine.gpu.graph_cache import GraphCache, shape_label
from gpu_engine.gpu.graph_grid import mixed_buckets
from gpu_engine.gpu.host_runner import HostGraphRunner
from gpu_engine.gpu.kv_memory import GrowableKVCache
from gpu_engine.gpu.persistent import PersistentScheduler, SchedStats, coresidency_failures, library
from gpu_engine.gpu.runner import DeviceTables, GpuModelRunner, RunnerLimits
from gpu_engine.gpu.sm_share import reserve_sms
from gpu_engine.kernels.plan import resolve_plan
from gpu_engine.kv_cache import fp8_cache_runs_on
from gpu_engine.models.loader import default_model_path, load_gpu_weights
from gpu_engine.policy import Policy
from shared import env
from shared import ring_layout as L
from shared.config import EngineConfig
from shared.log import get_logger
from shared.ring import Liveness, Ring

log = get_logger("engine")
STALL_S = 5.0       # device heartbeat silence before the host looks at the scheduler's stream
QUERY_EVERY_S = 0.5  # while the heartbeat is silent: how often the host asks CUDA whether the kernel still runs
# How the persistent scheduler's exit reasons that are failures reach the engine.
FAILED_EXITS: dict[int, tuple[type[DeviceFailure], str]] = {
    SS.EXIT_LAUNCH_FAILED: (LaunchFailure, "a graph launch failed"),
    SS.EXIT_TAIL_LAUNCH_FAILED: (LaunchFailure, "the scheduler's tail launch failed"),
    SS.EXIT_STEP_TIMEOUT: (DeviceHang, "a step did not complete within the step timeout"),
    SS.EXIT_STATE_OVERWRITTEN: (DeviceFailure, "the scheduler's state was overwritten"),
}
DEVICE_FAULTS = {"hang": SS.FAULT_HANG, "launch": SS.FAULT_LAUNCH}
SCHEDULER_SMS = 1   # SMs left to the persistent scheduler's block
# The sampling fields the persistent scheduler applies on the device with the processors' tables
# (RingHeader.sampling_features); prompt log-probs with the score graph; grammars with the grammar arena
# (--grammar-cache-mb above 0).
PERSISTENT_FEATURES = L.SamplingFeatures.PENALTIES | L.SamplingFeatures.LOGIT_BIAS | L.SamplingFeatures.MIN_TOKENS
PROBE_TIMEOUT_S = 5.0
SCORE_ROWS = 256  # prompt positions the score graph scores per launch ([rows, vocab] float32 temporaries)


def decode_buckets(max_batch: int) -> list[int]:
    """The decode graphs' batch sizes up to ``max_batch`` (itself always): at most half apart from 8 rows, a
    third from 128, up to the 1,024 rows the persistent scheduler serves at most (sched_structs.MAX_BATCH)."""
    sizes = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 640, 768, 896, 1024]
    return sorted({b for b in sizes if b < max_batch} | {max_batch})


def prefill_buckets(max_batch: int, max_tokens: int) -> list[tuple[int, int]]:
    """Whole-prompt prefill graphs (no chunking): up to the context limit, batches of prompts."""
    tokens = [t for t in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384) if t < max_tokens] + [max_tokens]
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64) if b < max_batch] + [max_batch]
    # A prefill of b prompts averages at least 16 tokens each; larger batches use larger buckets.
    return [(b, t) for t in tokens for b in batches if b <= max(1, t // 16)]


def step_token_limit(max_context: int, budget: int | None, max_batch: int) -> int:
    """The runner's tokens in one step: a whole prompt up to the context limit, the chunked step's budget and a
    decode step of every row (a token each), whichever is largest. Without the last, a context limit under
    --max-num-seqs left the runner unable to hold a full decode step, and the engine refused to start."""
    return max(max_context, budget or 0, max_batch)


@dataclasses.dataclass(slots=True)
class GpuParts:
    runner: GpuModelRunner
    cache: GraphCache
    kv: GrowableKVCache
    limits: RunnerLimits
    eos_ids: tuple[int, ...]
    max_context: int
    vocab_size: int
    token_budget: int    # the policy's step budget (Policy.token_budget)
    chunked: bool


def build_parts(cfg: EngineConfig) -> GpuParts:
    """Load, size the cache, capture every graph (device-launchable for the persistent mode)."""
    dtype = getattr(torch, cfg.gpu_torch_dtype_name())
    path = Path(cfg.model) if cfg.model else default_model_path()
    if cfg.fp8_kv_cache:  # before the weights load: refused at once on a GPU without e4m3
        fp8_cache_runs_on(torch.cuda.get_device_capability())
    plan = resolve_plan(cfg.kernel_plan, torch.cuda.get_device_name())  # before the weights load
    log.info("kernel plan", gpu=torch.cuda.get_device_name(), **plan.summary())
    log.info("loading weights", model=str(path), dtype=str(dtype).removeprefix("torch."), device="cuda",
             gpu_weights=cfg.gpu_weights, quantization=cfg.quantization)
    loaded = load_gpu_weights(path, dtype=dtype, device="cuda", weights=cfg.gpu_weights,
                              random_weights=cfg.random_weights, seed=cfg.seed, quantization=cfg.quantization)
    model, mcfg = loaded.model, loaded.config
    log.info("weights loaded", **loaded.summary)
    max_context = cfg.context_limit(mcfg.max_position_embeddings, cap=cfg.context_cap)
    budget = cfg.token_budget(gpu=True)
    max_tokens = step_token_limit(max_context, budget, cfg.max_batch)
    kv_dtype = getattr(torch, cfg.gpu_kv_dtype_name())
    # The cache's ranges are reserved now (the graphs hold their addresses) and backed after the capture, sized by
    # what the graphs left (kv_memory).
    with memory_for("reserving the KV cache", cfg):
        kv = GrowableKVCache(mcfg, cfg.block_size, kv_dtype, torch.cuda.mem_get_info()[0])
    limits = runner_limits(cfg, max_context, max_tokens)
    with memory_for("allocating the step buffers", cfg):
        runner = GpuModelRunner(model, kv, limits, plan, quantized=loaded.quantized)
    # Both modes capture the same graphs: cuBLAS sized for every SM but the scheduler's.
    sms = reserve_sms(SCHEDULER_SMS)
    log.info("cuBLAS SM target", **sms)
    chunked = cfg.chunked_prefill
    mixed = mixed_buckets(cfg.max_batch, budget) if chunked and budget else None  # None: whole prompts
    buckets = mixed if mixed is not None else prefill_buckets(cfg.max_batch, max_tokens)
    cache = GraphCache(runner, decode_buckets(cfg.max_batch), buckets, device_launch=cfg.backend == "persistent",
                       prefill_variants=chunked)
    t0 = time.perf_counter()
    log.info("capturing graphs", count=len(cache.shapes), **graph_counts(cache))
    with memory_for("capturing the graphs", cfg):
        graphs = cache.capture(progress=False, on_graph=capture_progress)
    torch.cuda.empty_cache()
    log.info("graphs captured", count=len(graphs), seconds=round(time.perf_counter() - t0, 2),
             memory_mib=round(sum(g.memory_bytes for g in graphs) / 2**20, 1),
             gpu_free_mib=round(torch.cuda.mem_get_info()[0] / 2**20, 1),
             model=str(path), family=mcfg.family, chunked_prefill=chunked, token_budget=budget or max_tokens)
    blocks = size_cache(kv, cfg)
    log.info("KV cache", dtype=str(kv_dtype).removeprefix("torch."), blocks=blocks, block_size=cfg.block_size,
             tokens=blocks * cfg.block_size, gib=round(kv.backed_bytes / 2**30, 2),
             gpu_free_mib=round(torch.cuda.mem_get_info()[0] / 2**20, 1))
    return GpuParts(runner, cache, kv, limits, tuple(mcfg.eos_token_ids), max_context, mcfg.vocab_size,
                    budget or max_tokens, chunked)


def runner_limits(cfg: EngineConfig, max_context: int, max_tokens: int) -> RunnerLimits:
    """The step buffers' sizes for `cfg` (what every graph the engine captures holds)."""
    g = cfg.geometry
    # The logits processors: dense columns the host stages (host-driven), or the scheduler's device state
    # (persistent: a masked path in every graph, a row without processors costs one load; BLINK_DEVICE_PROCESSORS=0
    # leaves it out).
    device_procs = cfg.backend == "persistent" and env.env().device_processors
    tables = DeviceTables(g.num_slots, max_context, grammar_bytes=cfg.grammar_arena_bytes) \
        if device_procs else None
    # Prompt log-probs: the host-driven backend scores them in its step wait; the persistent one through the
    # score graph (BLINK_DEVICE_PROMPT_LOGPROBS=0 leaves it out), where the ring holds them.
    scored = cfg.backend == "persistent" and env.env().device_prompt_logprobs and g.prompt_logprob_rows > 0
    return RunnerLimits(max_batch=cfg.max_batch, max_tokens=max_tokens,
                        max_blocks_per_seq=-(-max_context // cfg.block_size),
                        num_top_logprobs=max(1, g.top_logprobs), processors=cfg.backend == "host",
                        device_tables=tables, score_rows=min(SCORE_ROWS, max_tokens) if scored else 0)


def size_cache(kv: GrowableKVCache, cfg: EngineConfig) -> int:
    """Back the cache's final blocks: --kv-blocks, else --gpu-memory-utilization of the memory the weights, the
    step buffers and the graphs left; ValueError (the start prints it and exits 2) when that is no block."""
    free = torch.cuda.mem_get_info()[0]
    blocks = cfg.kv_blocks or kv.blocks_for(cfg.kv_memory_fraction, free)
    room, gib = kv.blocks_for(1.0, free), (free + kv.backed_bytes) / 2**30
    if blocks > room:
        raise ValueError(f"--kv-blocks {blocks} does not fit: {gib:.2f} GiB is free after the weights, the step "
                         f"buffers and the graphs, {room} blocks of {kv.block_bytes} bytes: give a smaller one")
    if blocks <= 0:
        raise ValueError(f"the KV cache gets no block: {kv_setting(cfg)} of {gib:.2f} GiB holds none of "
                         f"{kv.block_bytes} bytes; give a larger --gpu-memory-utilization, or lower --max-num-seqs "
                         f"({cfg.max_batch}) or --max-num-batched-tokens")
    with memory_for("allocating the KV cache", cfg, blocks):
        kv.grow_to(blocks)
    return blocks


def kv_setting(cfg: EngineConfig) -> str:
    """The setting that sizes the KV cache, for messages."""
    return (f"--kv-blocks {cfg.kv_blocks}" if cfg.kv_blocks else
            f"--gpu-memory-utilization {cfg.kv_memory_fraction:g} of the memory free after the weights, the step "
            "buffers and the graphs")


@contextlib.contextmanager
def memory_for(what: str, cfg: EngineConfig, blocks: int | None = None) -> Iterator[None]:
    """The GPU running out of memory at a start (the KV cache, the step buffers, the graphs' pool) as a refused
    setting (ValueError: the start prints it and exits 2) that says which settings take the memory, instead of a
    traceback. `blocks`: the cache's size, once chosen (it is chosen after the graphs)."""
    try:
        yield
    except torch.cuda.OutOfMemoryError as exc:
        detail = (str(exc).splitlines() or ["no detail"])[0]
        cache = (f"the KV cache holds {blocks} blocks by {kv_setting(cfg)}: give a smaller one, or "
                 if blocks is not None else "the KV cache is sized after the graphs: ")
        raise ValueError(f"the GPU ran out of memory {what} ({detail}); {cache}lower --max-num-seqs "
                         f"({cfg.max_batch}) or --max-num-batched-tokens") from None


def graph_counts(cache: GraphCache) -> dict[str, int]:
    """The graphs of each kind, for the log."""
    decode = sum(1 for s in cache.shapes if s.decode)
    return {"decode_graphs": decode, "prefill_graphs": len(cache.shapes) - decode}


def capture_progress(k: int, n: int) -> None:
    """A log line at every tenth of the graphs captured, and at the last."""
    if k == n or k * 10 // n != (k - 1) * 10 // n:
        log.info("capturing graphs", done=f"{k}/{n}")


class PersistentEngine:
    """The engine host process of the persistent mode: launch once, then only sleep and watch."""

    def __init__(self, ring: Ring, parts: GpuParts, cfg: EngineConfig, fault: Fault | None = None,
                 prefix_caching: bool = False) -> None:
        self.ring, self.parts, self.cfg = ring, parts, cfg
        self.fault = (DEVICE_FAULTS[fault.kind], fault.at_step) if fault is not None else (0, 0)
        self.step_timeout_s = env.env().step_timeout_s
        self.prefix_caching = prefix_caching  # the Policy's decision, taken once in build_gpu_backend

    def flips_usable(self) -> bool:
        """Find new prompts through the header's flip bits: the ring's writer keeps them (minor >= 1), they
        cover every slot, and BLINK_SCHED_FULL_SCAN does not ask for the full scan."""
        return self.ring.flips_cover_slots() and not env.env().sched_full_scan

    def serve(self) -> None:
        p, ring = self.parts, self.ring
        size = ring.transport.size
        yielding = self.yielding_graphs()
        view = p.cache.scheduler_view()
        tables = p.limits.device_tables
        grammar = GrammarArena(p.runner.buffers.gram_arena, ring.name, p.vocab_size) \
            if tables is not None and tables.grammar_bytes else None
        if not self.score_graph_fits():
            view["score_exec_handles"] = []  # the scheduler then refuses prompt log-probs
        sched = PersistentScheduler(ring.transport.base, size, ring.geometry,  # type: ignore[attr-defined]
                                    view, p.kv, p.limits, p.eos_ids, self.cfg.max_batch,
                                    p.max_context, p.vocab_size, yield_graphs=yielding,
                                    claim_with_cas=not env.env().sched_plain_claim,
                                    scan_flips=self.flips_usable(), chunked=p.chunked,
                                    token_budget=p.token_budget, prefix_caching=self.prefix_caching,
                                    step_timeout_s=self.step_timeout_s,
                                    fault=self.fault, grammar=grammar)
        ring.header_store64("heartbeat_ns", time.time_ns())
        ring.header_store32("sampling_features", self.features(sched))  # the gateway refuses the rest with a 400
        ring.header_store64("grammar_arena_bytes", int(sched.config.gram_arena_bytes))
        if grammar is not None:
            grammar.start()
        ring.header_store32("engine_state", L.EngineState.READY)
        sched.start()
        cpu0 = time.process_time()
        try:
            watch_scheduler(sched, ring, self.step_timeout_s, self.graph_in_flight)
        finally:
            if grammar is not None:
                grammar.stop()
        st = sched.stats
        log.info("scheduler exited", host_cpu_s=round(time.process_time() - cpu0, 3), **st.counters(),
                 **st.step_times())
        overwritten = sched.guard_report()
        if overwritten:
            log.error("scheduler state overwritten by another kernel", ranges=overwritten)
        sched.close()

    def features(self, sched: PersistentScheduler) -> int:
        """The ``SamplingFeatures`` the scheduler serves: the processors with their tables, prompt log-probs
        with the score graph (given to it where the ring has the rows and the graph can run beside it)."""
        f = PERSISTENT_FEATURES if self.parts.limits.device_tables is not None else 0
        f |= L.SamplingFeatures.GRAMMAR if sched.config.grammar else 0
        return int(f | (L.SamplingFeatures.PROMPT_LOGPROBS if sched.config.score_rows else 0))

    def yielding_graphs(self) -> frozenset[int]:
        """Graphs during which the scheduler must leave its SM: those that cannot finish beside its
        block (checked here, once), or every graph with BLINK_SCHED_YIELD_ALL=1."""
        cache = self.parts.cache
        if env.env().sched_yield_all:
            return frozenset(i for i, g in enumerate(cache.graphs) if g is not None)
        graphs = [(i, cache.launcher(g)) for i, g in enumerate(cache.graphs) if g is not None]
        t0 = time.perf_counter()
        stuck = coresidency_failures(library(), graphs, PROBE_TIMEOUT_S)
        log.info("graphs checked beside the scheduler block", graphs=len(graphs), stuck=len(stuck),
                 seconds=round(time.perf_counter() - t0, 2))
        if stuck:
            log.warning("these graphs run with the scheduler off its SM (a tail launch per step)",
                        graphs=[shape_label(cache.shapes[i]) for i in stuck])
        return frozenset(stuck)

    def score_graph_fits(self) -> bool:
        """Whether there is a score graph and it finishes beside the scheduler's block (the scheduler keeps its
        SM while it runs, in every mode); checked once."""
        score = self.parts.cache.score
        if score is None:
            return False
        if coresidency_failures(library(), [(0, GraphCache.launcher(score))], PROBE_TIMEOUT_S):
            log.warning("the score graph does not finish beside the scheduler block: prompt log-probs refused")
            return False
        return True

    def graph_in_flight(self, sched: Watched) -> dict:
        """Log fields naming the graph in flight and how long it has run, if one is."""
        assert isinstance(sched, PersistentScheduler)
        flight = sched.stuck_graph()
        if flight is None:
            return {}
        return {"graph": shape_label(self.parts.cache.shapes[flight[0]]), "graph_running_s": round(flight[1], 3)}


class Watched(Protocol):
    """What ``watch_scheduler`` reads of a running scheduler."""

    @property
    def stats(self) -> SchedStats: ...
    def exited(self) -> bool: ...
    def query(self) -> int: ...
    def last_error(self) -> str: ...
    def wait(self) -> None: ...


def watch_scheduler(sched: Watched, ring: Ring, step_timeout_s: float,
                    where: Callable[[Watched], dict] = lambda _: {}, stall_s: float = STALL_S) -> None:
    """Sleep until the scheduler exits; ``DeviceFailure`` when it failed or hung.

    Steady state reads host memory only: the ring's beat counter, timed on this process's monotonic clock
    (``Liveness``: never against the device's clock), and the exit flag. Once the counter has been silent
    for ``stall_s`` the host asks CUDA whether the kernel still runs, every ``QUERY_EVERY_S``: a kernel that
    stopped without exiting is a ``DeviceFailure``; one still running but silent for ``stall_s`` plus twice
    the step timeout is a ``DeviceHang`` (hung where its own bounded poll cannot see it, e.g. yielded to a
    graph that never completes)."""
    live, next_query, warned = Liveness(), 0.0, False
    hang_s = stall_s + 2 * step_timeout_s if step_timeout_s > 0 else float("inf")
    while not sched.exited():
        time.sleep(0.02)
        silent = live.silent_s(ring.header_load64("heartbeat"))
        now = time.monotonic()
        if silent < stall_s:
            warned = False
            continue
        if now < next_query:
            continue
        next_query = now + QUERY_EVERY_S
        state = sched.query()  # 0: still running (a long step), else finished or failed
        if state != 0:
            raise DeviceFailure(f"the persistent scheduler stopped without exiting (query {state}): "
                                f"{sched.last_error()}")
        if silent >= hang_s:
            raise DeviceHang(f"the device made no progress for {silent:.1f} s")
        if not warned:
            log.warning("device heartbeat stalled", seconds=round(silent, 3), **where(sched),
                        counters=sched.stats.counters())
            warned = True
    check_exit(sched)


def check_exit(sched: Watched) -> None:
    """After the scheduler's exit flag: a failure exit raises its ``DeviceFailure`` (no CUDA call: the device
    may still hold a hung graph); a clean one waits for the kernel's end."""
    reason = int(sched.stats.exit_reason)
    if reason in FAILED_EXITS:
        cls, what = FAILED_EXITS[reason]
        log.error("persistent scheduler failed", what=what, counters=sched.stats.counters())
        raise cls(f"the persistent scheduler exited: {what} (exit reason {reason}, CUDA error "
                  f"{int(sched.stats.error)})")
    sched.wait()


def build_gpu_backend(cfg: EngineConfig, fault: Fault | None = None) -> Backend:
    parts = build_parts(cfg)
    persistent = cfg.backend == "persistent"
    policy = Policy(parts.kv.allocator, cfg.block_size, cfg.max_batch, parts.token_budget,
                    prefill_fits=lambda n, t: parts.cache.lookup(False, n, t)[1], chunked=parts.chunked,
                    prefix_caching=cfg.prefix_caching and (not persistent or env.env().device_prefix_cache))
    log.info("prefix caching", on=policy.prefix_caching, where="device" if persistent else "host",
             **({"why_off": "BLINK_DEVICE_PREFIX_CACHE=0"} if persistent and cfg.prefix_caching
                and not policy.prefix_caching else {}))
    if persistent:
        return Backend(None, policy, parts.eos_ids, parts.max_context, parts.vocab_size,
                       make_engine=lambda ring: PersistentEngine(ring, parts, cfg, fault, policy.prefix_caching),
                       prompt_logprobs=parts.limits.score_rows > 0)
    timeout_s = env.env().step_timeout_s
    runner = HostGraphRunner(parts.runner, parts.cache, timeout_s)
    served = runner if fault is None else FaultyRunner(runner, fault, timeout_s)
    return Backend(served, policy, parts.eos_ids, parts.max_context, parts.vocab_size)

