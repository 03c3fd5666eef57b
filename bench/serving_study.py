"""The paper's serving evaluation (Tables 6-7): persistent vs host-driven, isolated vs CPU interference.

For each mode, one ``blink serve`` on a Llama-3-8B-shaped model with random weights (bf16 on the GPU) and the
real Llama-3 tokenizer; a warm-up; a Poisson rate sweep of the ``paper`` workload (log-normal 1019 / 463
tokens) with the host otherwise idle; the same sweep (same requests, same arrival times) with CPU co-tenants
(``bench/interfere.py``: compression and cache thrashing) on every allowed core but the first ``--free-cores``;
then the server stops. The load generator runs in this process, pinned to the free cores; the server is not
pinned. Each run records vLLM-style latencies (``bench/serve_bench.py``) and the CPU time the engine host
process (and every other server process) spent per minute of the run.

    python -m bench.serving_study --modes persistent --tokenizer-assets .whl/tokenizer-assets
    python -m bench.serving_study --modes host --tokenizer-assets .whl/tokenizer-assets

Results merge into ``--out`` (default ``bench/results/serving.json``): the runs of the modes just run replace
those modes' old runs and every other mode's runs are kept, so one invocation per mode builds the whole file.
The plots (``PREFIX_latency.png``, ``PREFIX_throughput.png``) and the Markdown table (``--table``, default the
``--out`` path with ``.md``) are redrawn from the merged file every time.

Peers: ``python -m bench.peers`` (``bench/peers/``) serves the same workload to Blink's modes and to peers started
from a command line (vLLM first) in steady state (a warm-up, then a measurement window of arrivals), under three
co-tenant levels, with the plateau found by bisection; it builds on this module's model description, serve flags
and device names.

Time: ``--time-budget-s`` bounds the invocation. A rate starts only when its worst case (sending
``--duration-s``, then at most ``--drain-s`` for the requests still in flight, which are then cut and counted as
``unfinished``) still fits, together with the interference replays of the rates run so far and the time to stop.
Rates left out are listed under ``skipped``. With several modes in one invocation each gets an equal share of
what is left when it starts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench import serve_bench as sb
from bench.interfere import KINDS as INTERFERE_KINDS
from bench.interfere import Interference
from bench.workloads import WORKLOADS, Limits, RequestSpec, Workload, build_requests, summary
from harness.models import MODEL_CONFIGS, build_model_folder, model_config
from harness.serve_proc import CpuMeter, ServeProc, cpu_name, http_get, parse_metrics

MODES = ("persistent", "host")
EMBEDDED = "embedded"  # the engine's embedded default model and its own tokenizer (CI without tokenizer assets)
RESERVE_S = 30.0  # stopping the co-tenants and the server, writing the results and plots
SETTLE_S = 15.0  # longest wait for the server to be idle again between two runs
SETTLE_TYPICAL_S = 5.0  # what the budget counts for it (the reserve covers the rest)
TICK_S = 10.0
REPLAY_FACTOR = 1.2  # an interference run's wall time over its isolated run's, for the budget


def say(text: str) -> None:
    print(text, flush=True)


def rate_text(rate: float | str | None) -> str:
    return "inf" if rate in ("inf", None) or math.isinf(float(rate)) else f"{float(rate):g}"  # type: ignore[arg-type]


def model_description(name: str) -> str:
    if name == EMBEDDED:
        return "embedded default model (SmolLM2-135M-Instruct, real weights)"
    c = model_config(name)
    if "num_experts" in c:
        return (f"Qwen3 MoE shape '{name}': hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, heads "
                f"{c['num_attention_heads']}/{c['num_key_value_heads']}, {c['num_experts']} experts of FFN "
                f"{c['moe_intermediate_size']} ({c['num_experts_per_tok']} a token), vocab {c['vocab_size']}; "
                "random weights; Qwen3 tokenizer")
    return (f"Llama-3 shape '{name}': hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, heads "
            f"{c['num_attention_heads']}/{c['num_key_value_heads']}, FFN {c['intermediate_size']}, vocab "
            f"{c['vocab_size']}; random weights; Llama-3 tokenizer")


# ---------------------------------------------------------------------- the host
def device_name(backend: str) -> str:
    if backend != "cpu":
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=20, check=True).stdout.strip().splitlines()
            if out:
                return out[0].strip() + (f" (x{len(out)} on the host)" if len(out) > 1 else "")
        return "cuda device (nvidia-smi unavailable)"
    return f"cpu: {cpu_name()}, {os.cpu_count()} cores"


def server_cpu(serve: ServeProc | None) -> CpuMeter:
    """The server's processes (by role; none for an external server) and this generator."""
    return CpuMeter(lambda: serve.pids() if serve is not None and serve.proc is not None else {})


def cpu_report(meter: CpuMeter) -> dict[str, Any]:
    per_min, own = meter.end()
    return {"engine_cpu_s_per_min": per_min.get("engine"), "cpu_s_per_min": per_min, "generator_cpu_s_per_min": own}


@contextlib.contextmanager
def pinned(cores: list[int]) -> Iterator[None]:
    """Every thread of this process on ``cores`` (threads started meanwhile inherit it); restored afterwards."""
    before = os.sched_getaffinity(0)

    def apply(mask: set[int]) -> None:
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), mask)

    apply(set(cores))
    try:
        yield
    finally:
        apply(before)


def split_cores(free: int) -> tuple[list[int], list[int]]:
    """(cores of the load generator, cores of the co-tenants): the first ``free`` allowed cores and the rest."""
    allowed = sorted(os.sched_getaffinity(0))
    if free < 1 or free >= len(allowed):
        raise ValueError(f"--free-cores {free} must leave at least one of the {len(allowed)} allowed cores "
                         f"{allowed} to the co-tenants and take at least one")
    return allowed[:free], allowed[free:]


# ---------------------------------------------------------------------- the time budget
@dataclass
class Budget:
    """Deadlines in ``time.monotonic`` seconds, and the worst case of one run."""

    end: float
    run_worst_s: float

    def left(self) -> float:
        return self.end - time.monotonic()

    def share(self, parts: int) -> Budget:
        """A budget ending after an equal share of what is left."""
        return Budget(time.monotonic() + max(0.0, self.left()) / max(1, parts), self.run_worst_s)


# ---------------------------------------------------------------------- one run
@dataclass
class Plan:
    """What every run of the invocation shares."""

    workload: Workload
    limits: Limits
    rates: list[float]
    duration_s: float
    drain_s: float
    seed: int
    warmup: int
    max_concurrency: int | None
    tokenizer: Any
    specs: dict[int, tuple[list[float], list[RequestSpec]]] = field(default_factory=dict)

    def fit(self, max_model_len: int | None) -> None:
        """Shrink the context limit to what the server reports, before any request is drawn."""
        if max_model_len and max_model_len < self.limits.max_context and not self.specs:
            self.limits = Limits(min(self.limits.max_prompt, max_model_len), min(self.limits.max_output,
                                                                                 max_model_len), max_model_len)

    def requests(self, k: int) -> tuple[list[float], list[RequestSpec]]:
        """Arrival offsets and requests of the ``k``-th rate: the same in every mode and condition."""
        if k not in self.specs:
            rate = self.rates[k]
            offsets = sb.arrival_offsets(rate, np.random.default_rng(self.seed + k), None, self.duration_s)
            specs = build_requests(self.workload, max(1, len(offsets)), self.tokenizer, self.limits, self.seed + k)
            self.specs[k] = (offsets, specs)
        return self.specs[k]


async def send_bounded(session: aiohttp.ClientSession, target: sb.Target, specs: list[RequestSpec],
                       offsets: list[float], drain_s: float, label: str) -> tuple[list[sb.RequestResult], float]:
    """Send ``specs`` at ``offsets``; requests still open ``drain_s`` after the last send are cut. Returns every
    request's result (cut ones: error ``drain_limit``) and the run's wall time, first send to last answer."""
    results = [sb.RequestResult(prompt_len=s.prompt_len) for s in specs[:len(offsets)]]
    sem = asyncio.Semaphore(target.max_concurrency) if target.max_concurrency else None
    start = time.perf_counter()
    hard_end = start + (offsets[-1] if offsets else 0.0) + drain_s
    tasks: list[asyncio.Task[sb.RequestResult]] = []

    async def one(i: int) -> sb.RequestResult:
        try:
            return await sb.send_one(session, target.url, sb.make_payload(target.model, specs[i]), target.headers,
                                     results[i])
        finally:
            if sem is not None:
                sem.release()

    async def ticker() -> None:
        while True:
            await asyncio.sleep(TICK_S)
            done = sum(t.done() for t in tasks)
            bad = sum(1 for t, r in zip(tasks, results, strict=False) if t.done() and not r.ok)
            say(f"  {label}: {time.perf_counter() - start:5.0f} s, sent {len(tasks)}/{len(offsets)}, "
                f"done {done}, failed {bad}")

    tick = asyncio.create_task(ticker())
    try:
        for i, offset in enumerate(offsets):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is not None:
                try:
                    await asyncio.wait_for(sem.acquire(), max(0.01, hard_end - time.perf_counter()))
                except TimeoutError:
                    break
            tasks.append(asyncio.create_task(one(i)))
        pending: set[asyncio.Task[sb.RequestResult]] = set()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, hard_end - time.perf_counter()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    finally:
        tick.cancel()
    wall = time.perf_counter() - start
    for res in results[len(tasks):]:
        res.error = "not_sent"
    for task, res in zip(tasks, results, strict=False):
        if not res.ok and (task.cancelled() or not res.error):
            res.ok, res.error, res.detail = False, "drain_limit", f"still open {drain_s:g} s after the last send"
    return results, wall


def tokens_while_sending(results: list[sb.RequestResult], send_s: float) -> float:
    """Output tokens per second that reached the client while requests were still being sent.

    vLLM's ``out_tok_per_s`` divides the tokens of completed requests by the time until the last one
    finished, which for short runs mostly measures the drain; this counts every token streamed during the
    sending window, requests cut later included (a chunk counts as the completed requests' mean tokens per
    chunk), so it is the generation rate the server kept up at that load."""
    sent = [r.sent for r in results if r.sent]
    if not sent or send_s <= 0:
        return 0.0
    t0 = min(sent)
    done = [r for r in results if r.ok and r.chunk_times]
    per_chunk = (sum(r.output_tokens for r in done) / sum(len(r.chunk_times) for r in done)) if done else 1.0
    chunks = sum(1 for r in results for t in r.chunk_times if t < t0 + send_s)
    return per_chunk * chunks / send_s


def run_record(rate: float, results: list[sb.RequestResult], wall: float, plan: Plan) -> dict[str, Any]:
    """serve_bench's summary of a run, with requests cut by the drain limit counted as ``unfinished``."""
    run = sb.summarize(rate, results, wall)
    run["out_tok_per_s_sending"] = tokens_while_sending(results, plan.duration_s)
    unfinished = run["failures"].pop("drain_limit", 0) + run["failures"].pop("not_sent", 0)
    run["failure_samples"].pop("drain_limit", None)
    run["failure_samples"].pop("not_sent", None)
    run["failed"] -= unfinished
    run.update(unfinished=unfinished, sent=len(results), send_s=plan.duration_s, drain_limit_s=plan.drain_s)
    return run


async def settle(serve: ServeProc | None, timeout_s: float) -> None:
    """Wait until the server holds no request (slots, running), at most ``timeout_s``."""
    if serve is not None:
        await asyncio.to_thread(serve.wait_gauges, {"slots_in_use": 0.0, "num_requests_running": 0.0}, timeout_s)


# ---------------------------------------------------------------------- one mode
@dataclass
class ModeResult:
    runs: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


async def warm_up(session: aiohttp.ClientSession, target: sb.Target, plan: Plan, timeout_s: float) -> dict[str, Any]:
    """``plan.warmup`` short requests at once; raises when none completes within ``timeout_s`` (an engine that
    does not serve should not be swept for minutes)."""
    specs = [RequestSpec(s.prompt, s.prompt_len, min(s.output_len, 16))
             for s in build_requests(plan.workload, plan.warmup, plan.tokenizer, plan.limits, plan.seed + 999)]
    t0 = time.perf_counter()
    results, _ = await send_bounded(session, target, specs, [0.0] * len(specs), timeout_s, "warm-up")
    ok = sum(r.ok for r in results)
    errors = sorted({r.error for r in results if not r.ok})
    if specs and not ok:
        raise RuntimeError(f"no warm-up request completed within {timeout_s:.0f} s ({', '.join(errors)}): "
                           "the engine is not serving")
    return {"requests": len(specs), "completed": ok, "errors": errors, "wall_s": round(time.perf_counter() - t0, 2)}


def stuck(run: dict[str, Any]) -> bool:
    return bool(run["sent"]) and not run["completed"]


async def sweep(serve: ServeProc | None, url: str, plan: Plan, mode: str, backend: str, budget: Budget,
                interference: bool, replay_s: list[float] | None, warmup_s: float, out: ModeResult) -> None:
    """Every rate of the plan under one condition, appending runs and skips to ``out``. ``replay_s``: the wall
    times of the isolated runs, which the interference sweep replays (None when it will not run)."""
    tag = "interference" if interference else "isolated"
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=None)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        model, max_len = await sb.discover(session, url, {}, None)
        plan.fit(max_len)
        target = sb.Target(f"{url}/v1/completions", model, {}, plan.max_concurrency)
        if plan.warmup and "warmup" not in out.info:
            say(f"[{mode}] warm-up: {plan.warmup} requests")
            out.info["warmup"] = await warm_up(session, target, plan, warmup_s)
            say(f"[{mode}] warm-up: {out.info['warmup']['completed']}/{plan.warmup} done in "
                f"{out.info['warmup']['wall_s']} s")
        stop_reason = None
        meter = server_cpu(serve)
        for k, rate in enumerate(plan.rates):
            rate_s = rate_text(rate)
            if interference or replay_s is None:
                need = budget.run_worst_s
            else:  # this run, then the interference replays of every run so far and of this one
                need = 2 * budget.run_worst_s + sum(min(budget.run_worst_s, REPLAY_FACTOR * s) for s in replay_s)
            if stop_reason is None and need + RESERVE_S > budget.left():
                stop_reason = (f"time budget: {budget.left():.0f} s left, the run may need {need:.0f} s and "
                               f"stopping {RESERVE_S:.0f} s")
            if stop_reason is None and interference and replay_s is not None and k >= len(replay_s):
                stop_reason = "not run isolated"
            if stop_reason is not None:
                out.skipped.append({"mode": mode, "interference": interference, "rate": rate_s,
                                    "reason": stop_reason})
                say(f"[{mode} {tag}] rate {rate_s}: skipped ({stop_reason})")
                continue
            offsets, specs = plan.requests(k)
            say(f"[{mode} {tag}] rate {rate_s} req/s: {len(offsets)} requests over {plan.duration_s:g} s "
                f"(drain limit {plan.drain_s:g} s)")
            await settle(serve, SETTLE_S)
            meter.begin()
            started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            results, wall = await send_bounded(session, target, specs, offsets, plan.drain_s,
                                               f"{mode} {tag} {rate_s}")
            run = {"mode": mode, "interference": interference, **run_record(rate, results, wall, plan),
                   **cpu_report(meter), "backend": backend, "started": started, "workload": summary(specs)}
            out.runs.append(run)
            if not interference and replay_s is not None:
                replay_s.append(wall)
            cpu = run["engine_cpu_s_per_min"]
            say(f"[{mode} {tag}] rate {rate_s}: done {run['completed']}, failed {run['failed']}, unfinished "
                f"{run['unfinished']} in {wall:.1f} s | {run['req_per_s']:.2f} req/s, {run['out_tok_per_s']:.0f} "
                f"tok/s | TTFT p50/p99 {fmt(run['ttft_p50_ms'])}/{fmt(run['ttft_p99_ms'])} ms | TPOT p50/p99 "
                f"{fmt(run['tpot_p50_ms'])}/{fmt(run['tpot_p99_ms'])} ms | engine CPU {fmt(cpu)} s/min")
            if stuck(run):
                raise RuntimeError(f"{tag} rate {rate_s}: no request of {run['sent']} completed "
                                   f"({run['failures'] or 'all cut by the drain limit'}): the engine is not serving")
        await settle(serve, SETTLE_S)


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def step_padding(url: str) -> dict[str, float | None]:
    """The engine's step tokens and the tokens its graphs computed past them, over the server's whole life
    (warm-up included; ``blink:step_tokens_total``, ``blink:padded_tokens_total``), and padding's share."""
    status, body = http_get(url + "/metrics")
    values = parse_metrics(body.decode(errors="replace")) if status == 200 else {}
    real, pad = values.get("blink:step_tokens_total"), values.get("blink:padded_tokens_total")
    share = round(pad / real, 4) if real and pad is not None else None
    return {"step_tokens": real, "padded_tokens": pad, "padded_share": share}


def serve_args(args: argparse.Namespace, backend: str, model: Path | None) -> tuple[str, ...]:
    out = ["--backend", backend, "--max-batch", str(args.max_batch), "--max-prompt-tokens",
           str(args.max_prompt_tokens), "--max-output-tokens", str(args.max_output_tokens), "--drain-timeout", "5"]
    if model is not None:
        out += ["--model", str(model), "--random-weights", "--served-model-name", model.name]
    return (*out, *extra_serve_args(args))


def extra_serve_args(args: argparse.Namespace) -> list[str]:
    """--serve-args, given once as one string or repeated (each value split as a shell would)."""
    given = args.serve_args
    return [w for part in ([given] if isinstance(given, str) else given) for w in shlex.split(part)]


def run_mode(mode: str, args: argparse.Namespace, plan: Plan, model: Path | None, budget: Budget, work: Path,
             out: ModeResult) -> None:
    """Start the server, sweep isolated then under interference, stop everything (also on errors and
    interrupts); ``out`` collects what was measured as it is measured."""
    backend = args.backend_override or mode
    flags = serve_args(args, backend, model)
    env = {"BLINK_HEARTBEAT_TIMEOUT_S": os.environ.get("BLINK_HEARTBEAT_TIMEOUT_S", "10")} if backend == "cpu" else {}
    gen_cores, co_cores = split_cores(args.free_cores)
    out.info.update(backend=backend, device=device_name(backend), dtype="float32" if backend == "cpu" else "bfloat16",
                    serve_args=list(flags), max_batch=args.max_batch, host=platform.node(),
                    started=time.strftime("%Y-%m-%dT%H:%M:%S%z"), python=platform.python_version(),
                    generator_cores=gen_cores, interference_cores=co_cores)
    serve = ServeProc(flags, work / mode, env=env)
    say(f"[{mode}] starting blink serve (backend {backend}): {' '.join(flags)}")
    t0 = time.monotonic()
    try:
        serve.start(timeout_s=max(30.0, min(args.startup_timeout_s, budget.left() - RESERVE_S)))
        out.info["startup_s"] = round(time.monotonic() - t0, 1)
        say(f"[{mode}] ready in {out.info['startup_s']} s on {serve.url}; processes {serve.children()}")
        replay_s: list[float] | None = [] if args.conditions == [False, True] else None
        for interference in args.conditions:
            co = None
            if interference:
                co = Interference(cores=co_cores, kinds=tuple(args.interfere_kinds.split(",")))
                say(f"[{mode}] interference: {len(co.kinds)} kind(s) x {len(co_cores)} core(s) {co_cores}")
            try:
                with pinned(gen_cores):
                    if co is not None:
                        co.start()
                    asyncio.run(sweep(serve, serve.url, plan, mode, backend, budget, interference, replay_s,
                                      args.warmup_timeout_s, out))
            finally:
                if co is not None:
                    report = co.stop()
                    out.info["interference"] = report
                    say(f"[{mode}] interference stopped: {report['reported']}/{report['workers']} workers reported, "
                        f"{fmt(report['compress_mb_per_s'])} MB/s compressed, "
                        f"{fmt(report['thrash_accesses_per_s'], '.3g')} random accesses/s")
        out.info["step_padding"] = step_padding(serve.url)
        say(f"[{mode}] step tokens and padding: {out.info['step_padding']}")
    except Exception as exc:  # a failed mode is reported, the other modes still run
        out.error = f"{type(exc).__name__}: {exc}"
        say(f"[{mode}] FAILED: {out.error}")
        tail = serve.log_tail(3000)
        if tail and tail not in str(exc):
            say(f"[{mode}] server log (tail):\n{tail}")
    finally:
        code = serve.stop(timeout_s=45)
        out.info.update(exit_code=code, finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        say(f"[{mode}] blink serve stopped (exit code {code})")


# ---------------------------------------------------------------------- the results file
RUN_ORDER = {m: i for i, m in enumerate(MODES)}


def run_key(run: dict[str, Any]) -> tuple:
    rate = run.get("rate")
    return (RUN_ORDER.get(run["mode"], 99), run["mode"], bool(run["interference"]),
            math.inf if rate in ("inf", None) else float(rate))


def merge(old: dict[str, Any] | None, new: dict[str, Any], modes_run: list[str]) -> dict[str, Any]:
    """``new``'s runs, skips and mode records for ``modes_run`` replace the old ones; other modes' are kept.
    A mode that produced no run keeps its old runs (its failure is recorded)."""
    if old is None:
        return {**new, "runs": sorted(new["runs"], key=run_key)}
    produced = {r["mode"] for r in new["runs"]}
    replaced = [m for m in modes_run if m in produced]
    doc = {**old, **{k: v for k, v in new.items() if k not in ("runs", "skipped", "modes", "errors")}}
    doc["runs"] = sorted([r for r in old.get("runs", []) if r["mode"] not in replaced] + new["runs"], key=run_key)
    doc["skipped"] = [s for s in old.get("skipped", []) if s["mode"] not in modes_run] + new.get("skipped", [])
    doc["modes"] = {**old.get("modes", {}), **new.get("modes", {})}
    doc["errors"] = {**{m: e for m, e in old.get("errors", {}).items() if m not in modes_run},
                     **new.get("errors", {})}
    return doc


def compatible(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """Why ``old``'s runs cannot be shown next to ``new``'s (None when they can)."""
    for key in ("model", "workload"):
        if old.get(key) != new.get(key):
            return f"its {key} differs: {json.dumps(old.get(key))} vs {json.dumps(new.get(key))}"
    return None


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def format_table(doc: dict[str, Any]) -> str:
    """Tables 6-7 of the paper: per mode and rate, P99 TPOT and completed requests/s isolated vs under CPU
    interference, and their ratios (interference / isolated)."""
    lines = [f"Serving under CPU interference: {doc.get('model', '?')} on {doc.get('device', '?')}; workload "
             f"{doc.get('workload', {}).get('name', '?')}; interference on all cores but the generator's.", "",
             "| mode | rate (req/s) | P99 TPOT isolated (ms) | P99 TPOT interference (ms) | TPOT ratio | "
             "req/s isolated | req/s interference | req/s ratio | engine host CPU isolated / interference (s/min) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    runs = {(r["mode"], bool(r["interference"]), rate_text(r["rate"])): r for r in doc.get("runs", [])}
    keys = sorted({(r["mode"], rate_text(r["rate"])) for r in doc.get("runs", [])},
                  key=lambda k: run_key({"mode": k[0], "interference": False, "rate": k[1]}))
    for mode, rate in keys:
        iso, co = runs.get((mode, False, rate)) or {}, runs.get((mode, True, rate)) or {}
        t_iso, t_co = iso.get("tpot_p99_ms"), co.get("tpot_p99_ms")
        q_iso, q_co = iso.get("req_per_s"), co.get("req_per_s")
        c_iso, c_co = iso.get("engine_cpu_s_per_min"), co.get("engine_cpu_s_per_min")
        cells = [mode, rate, fmt(t_iso, ".2f"), fmt(t_co, ".2f"), fmt(ratio(t_co, t_iso), ".2f") + "x",
                 fmt(q_iso, ".2f"), fmt(q_co, ".2f"), fmt(ratio(q_co, q_iso), ".2f") + "x",
                 f"{fmt(c_iso)} / {fmt(c_co)}"]
        lines.append("| " + " | ".join(cells) + " |")
    skipped = doc.get("skipped", [])
    if skipped:
        lines += ["", "Skipped: " + "; ".join(f"{s['mode']} {'interference' if s['interference'] else 'isolated'} "
                                             f"rate {s['rate']} ({s['reason']})" for s in skipped)]
    for mode, err in doc.get("errors", {}).items():
        lines += ["", f"Error in mode {mode}: {err}"]
    return "\n".join(lines) + "\n"


def write_outputs(doc: dict[str, Any], out: Path, plot: Path | None, table: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".part")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(out)
    say(f"wrote {out}")
    text = format_table(doc)
    table.parent.mkdir(parents=True, exist_ok=True)
    table.write_text(text)
    say(f"wrote {table}\n\n{text}")
    if plot is not None and doc["runs"]:
        try:
            from bench.plots import plot_results
        except ImportError as exc:
            say(f"no plots: {exc} (python -m bench.plots can draw them elsewhere from {out})")
            return
        groups: dict[tuple[str, bool], list[dict[str, Any]]] = {}
        for run in doc["runs"]:
            groups.setdefault((run["mode"], bool(run["interference"])), []).append(run)
        entries = [({"runs": runs}, mode, interf) for (mode, interf), runs in groups.items()]
        for path in plot_results(entries, plot):
            say(f"wrote {path}")


# ---------------------------------------------------------------------- command line
def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"modes must be distinct names among {MODES}: {text!r}")
    return modes


def parse_conditions(text: str) -> list[bool]:
    names = {"isolated": False, "interference": True}
    parts = [c.strip() for c in text.split(",") if c.strip()]
    if not parts or any(p not in names for p in parts):
        raise argparse.ArgumentTypeError(f"conditions must be among isolated,interference: {text!r}")
    return [names[p] for p in parts]


def build_parser() -> argparse.ArgumentParser:
    from dpu_tokenizer.fetch_assets import default_assets_dir

    ap = argparse.ArgumentParser(prog="python -m bench.serving_study", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--modes", type=parse_modes, default=list(MODES), help="comma-separated, among persistent,host")
    ap.add_argument("--conditions", type=parse_conditions, default=[False, True],
                    help="isolated, interference, or both (in that order)")
    ap.add_argument("--rates", type=sb.parse_rates, default=[4.0, 10.0, 16.0, 22.0], help="offered req/s")
    ap.add_argument("--duration-s", type=float, default=25.0, help="sending time per rate")
    ap.add_argument("--drain-s", type=float, default=30.0, help="after sending, requests still open are cut then")
    ap.add_argument("--warmup", type=int, default=8, help="short uncounted requests after the server starts")
    ap.add_argument("--warmup-timeout-s", type=float, default=180.0)
    ap.add_argument("--max-batch", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=4096, help="server limit; longer draws are clipped")
    ap.add_argument("--max-output-tokens", type=int, default=2048, help="server limit; longer draws are clipped")
    ap.add_argument("--max-concurrency", type=int, default=None, help="client cap on requests in flight")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="paper")
    ap.add_argument("--prompt-mean", type=float, default=None, help="override the workload's mean prompt length")
    ap.add_argument("--output-mean", type=float, default=None, help="override the workload's mean output length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-config", choices=[*MODEL_CONFIGS, EMBEDDED], default="8b",
                    help="Llama-3 shape with random weights (small and medium for tests), or the embedded model")
    ap.add_argument("--tokenizer-assets", type=Path, default=default_assets_dir(),
                    help="folder with llama3/tokenizer.json and llama3/tokenizer.model")
    ap.add_argument("--backend-override", choices=("cpu", "host", "persistent"), default=None,
                    help="engine backend for every mode (the mode stays the label), e.g. cpu in tests")
    ap.add_argument("--serve-args", action="append", default=[],
                    help="more flags for blink serve, e.g. '--num-slots 512'; repeatable (a word each where a "
                    "shell splits the value: --serve-args=--max-num-seqs=256 --serve-args=--kv-blocks=4096)")
    ap.add_argument("--startup-timeout-s", type=float, default=420.0)
    ap.add_argument("--free-cores", type=int, default=2, help="cores kept free of co-tenants for the generator")
    ap.add_argument("--interfere-kinds", default="compress,thrash")
    ap.add_argument("--time-budget-s", type=float, default=570.0, help="the whole invocation")
    ap.add_argument("--out", type=Path, default=Path("bench/results/serving.json"))
    ap.add_argument("--plot", type=Path, default=Path("bench/results/serving"), help="PNG prefix")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--table", type=Path, default=None, help="Markdown table; None: the --out path with .md")
    ap.add_argument("--replace", action="store_true", help="start a fresh --out instead of merging into it")
    ap.add_argument("--work-dir", type=Path, default=None, help="server run dirs and logs; None: a temporary folder")
    return ap


def _sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    t_start = time.monotonic()
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.duration_s <= 0 or args.drain_s < 0:
        ap.error("--duration-s must be positive and --drain-s not negative")
    try:
        split_cores(args.free_cores)
    except ValueError as exc:
        ap.error(str(exc))
    if not set(args.interfere_kinds.split(",")) <= set(INTERFERE_KINDS):
        ap.error(f"--interfere-kinds must be among {','.join(INTERFERE_KINDS)}")
    table = args.table or args.out.with_suffix(".md")
    workload = WORKLOADS[args.workload].scaled(args.prompt_mean, args.output_mean)
    header = {"model": model_description(args.model_config),
              "workload": {**workload.record(), "max_prompt": args.max_prompt_tokens,
                           "max_output": args.max_output_tokens, "arrivals": "poisson"}}
    old = None
    if args.out.exists() and not args.replace:
        old = json.loads(args.out.read_text())
        why = compatible(old, header)
        if why:
            say(f"error: {args.out} holds results of another setup ({why}); pass --replace or another --out")
            return 2
    previous = signal.signal(signal.SIGTERM, _sigterm)
    try:
        return study(args, workload, header, old, table, t_start)
    finally:
        signal.signal(signal.SIGTERM, previous)


def study(args: argparse.Namespace, workload: Workload, header: dict[str, Any], old: dict[str, Any] | None,
          table: Path, t_start: float) -> int:
    """Every mode in turn, then the merged results; SIGINT and SIGTERM stop it early (what was measured is kept)."""
    budget = Budget(t_start + args.time_budget_s, args.duration_s + args.drain_s + SETTLE_TYPICAL_S)
    limits = Limits(args.max_prompt_tokens, args.max_output_tokens, args.max_prompt_tokens + args.max_output_tokens)
    work_ctx = (contextlib.nullcontext(str(args.work_dir)) if args.work_dir else
                tempfile.TemporaryDirectory(prefix="blink-serving-"))
    results: dict[str, ModeResult] = {}
    interrupted = False
    with work_ctx as work_name:
        work = Path(work_name)
        from dpu_tokenizer.loader import load_tokenizer

        try:
            model = None if args.model_config == EMBEDDED else build_model_folder(args.model_config,
                                                                                  args.tokenizer_assets, work)
        except FileNotFoundError as exc:
            say(f"error: {exc}")
            return 2
        say(f"model: {header['model']} ({model or 'embedded'}); workload {args.workload} "
            f"{workload.prompt_mean:g}/{workload.output_mean:g}; rates {args.rates}; modes {args.modes}; "
            f"budget {args.time_budget_s:.0f} s")
        tokenizer = load_tokenizer(model)
        plan = Plan(workload, limits, args.rates, args.duration_s, args.drain_s, args.seed, args.warmup,
                    args.max_concurrency, tokenizer)
        try:
            for i, mode in enumerate(args.modes):
                results[mode] = ModeResult()
                run_mode(mode, args, plan, model, budget.share(len(args.modes) - i), work, results[mode])
        except KeyboardInterrupt:
            interrupted = True
            say("interrupted: writing what was measured")
    runs = [r for m in results.values() for r in m.runs]
    backends = [m.info.get("backend", "") for m in results.values()]
    devices = [m.info["device"] for m in results.values() if "device" in m.info]
    gpu = [m.info["device"] for m in results.values() if "device" in m.info and m.info.get("backend") != "cpu"]
    device = (gpu or devices or [device_name(args.backend_override or "cpu")])[0]
    if old is not None and old.get("device") not in (None, device):
        say(f"note: {args.out} was measured on {old['device']!r}, these runs on {device!r} (see 'modes')")
    new = {"device": device, **header, "runs": runs, "skipped": [s for m in results.values() for s in m.skipped],
           "modes": {mode: m.info for mode, m in results.items()},
           "errors": {mode: m.error for mode, m in results.items() if m.error},
           "settings": {"rates": ["inf" if math.isinf(r) else r for r in args.rates], "duration_s": args.duration_s,
                        "drain_s": args.drain_s, "warmup": args.warmup, "max_batch": args.max_batch,
                        "free_cores": args.free_cores, "interfere_kinds": args.interfere_kinds.split(","),
                        "seed": args.seed, "backends": backends}}
    for m in results.values():
        m.info["settings"] = new["settings"]
    doc = merge(old, new, list(results))
    write_outputs(doc, args.out, None if args.no_plot else args.plot, table)
    say(f"total {time.monotonic() - t_start:.0f} s")
    if interrupted:
        return 130
    return 1 if new["errors"] or not runs else 0


if __name__ == "__main__":
    sys.exit(main())
