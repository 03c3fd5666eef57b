"""Soak: steady load at a fraction of saturation, with clients that hang up at random moments.

    python -m bench.soak --duration-s 1200 --out bench/results/soak_cpu_20min.json

Starts its own ``blink serve`` (the real CPU engine, small limits), then:

1. runs every prompt of a fixed set alone (greedy, ``ignore_eos``, fixed ``max_tokens``, ``logprobs=0``):
   the reference text and token strings of each;
2. measures saturation: closed loops at growing concurrency until throughput stops growing;
3. offers Poisson arrivals at ``--load`` x saturation for ``--duration-s``; a ``--disconnect`` share of
   the clients hangs up after a random delay (before admission, during prefill or mid-stream); half of
   the requests stream; a 429 (server full) is retried after its ``Retry-After``, at most 3 times, as the
   ``openai`` client does, and the retries are counted; ``--clients N`` splits the closed and open loops
   evenly over N processes, so that the load generator is not what saturates;
4. checks: every request that was not hung up completed and its text and token strings equal its
   reference (nothing lost, duplicated or reordered); slot and KV-block gauges are back to their start;
   the resident memory of every process (supervisor and children) stayed flat after warm-up; no
   process was restarted.

The summary also gives the CPU time per minute of each server process and of each load process
(60 means one core fully busy: a saturated gateway, or a load generator that cannot keep up).

The summary (JSON) holds the figures and ``violations``; the exit status is 1 when there are any.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.interfere import Interference
from harness.serve_proc import MODEL, CpuMeter, ServeProc
from harness.sse import parse_event, request_body

SERVE_ARGS = ("--max-output-tokens", "32", "--max-prompt-tokens", "64", "--num-slots", "64", "--max-waiting",
              "256", "--drain-timeout", "2")
# The server runs with the product's liveness defaults (BLINK_HEARTBEAT_TIMEOUT_S unset): a soak that needed a
# longer timeout than users get would hide the false outages it is there to catch.
SERVE_ENV: dict[str, str] = {}
# What a request failed for liveness says (the gateway, the tracker, the token reader).
LIVENESS_ERRORS = ("the engine stopped responding", "the engine is not running", "the model is loading")


@dataclasses.dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 120.0
    load: float = 0.8
    disconnect: float = 0.1
    max_tokens: int = 16
    prompts: int = 8
    level_s: float = 6.0
    warmup_s: float = 30.0
    sample_s: float = 5.0
    rss_tolerance_mib: float = 48.0
    rss_tolerance_frac: float = 0.10
    seed: int = 0
    served_name: str = MODEL
    clients: int = 1  # load-generating processes, each with its own event loop and connections
    # Hang-ups fall within 1.5 x the p50 latency at the saturation peak, or of a request alone (concurrency
    # 1): that one stays within a request's life when the peak's latency is inflated by a busy host.
    hang_up_alone: bool = False


@dataclasses.dataclass(frozen=True)
class Answer:
    text: str
    tokens: tuple[str, ...]


@dataclasses.dataclass
class Outcome:
    kind: str  # completed, disconnected, failed
    prompt: int
    stream: bool
    planned_hang_up: bool = False
    retries: int = 0  # 429 answers that were retried after their Retry-After
    latency_s: float = 0.0
    answer: Answer | None = None
    error: str = ""


class RequestFailed(Exception):
    pass


class ServerBusy(RequestFailed):
    """A 429: the server's slots and wait queue are full; retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


BUSY_RETRIES = 3  # as the openai client: a 429 is retried, at most this many times
BUSY_WAIT_CAP_S = 2.0


def progress(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_prompts(n: int, seed: int) -> list[list[int]]:
    """Token-id prompts of 8..24 ordinary tokens (ids clear of the special ones at the start)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(300, 20000, int(rng.integers(8, 25))).tolist() for _ in range(n)]


async def read_whole(resp: aiohttp.ClientResponse) -> Answer:
    data = await resp.json()
    if resp.status != 200:
        raise RequestFailed(f"HTTP {resp.status}: {json.dumps(data)[:300]}")
    choice = data["choices"][0]
    return Answer(choice["text"], tuple(choice["logprobs"]["tokens"]))


async def read_stream(resp: aiohttp.ClientResponse) -> Answer:
    if resp.status != 200:
        raise RequestFailed(f"HTTP {resp.status}: {(await resp.text())[:300]}")
    text: list[str] = []
    tokens: list[str] = []
    done = False
    async for raw in resp.content:
        event = parse_event(raw)
        if event is None:
            continue
        if event == "[DONE]":
            done = True
            break
        assert isinstance(event, dict)
        if "error" in event:
            raise RequestFailed(f"error event: {json.dumps(event)[:300]}")
        for choice in event["choices"]:
            text.append(choice["text"])
            tokens.extend((choice.get("logprobs") or {}).get("tokens") or [])
    if not done:
        raise RequestFailed("stream ended without [DONE]")
    return Answer("".join(text), tuple(tokens))


def retry_after(resp: aiohttp.ClientResponse) -> float:
    try:
        return min(BUSY_WAIT_CAP_S, max(0.0, float(resp.headers.get("Retry-After", "0.1"))))
    except ValueError:
        return 0.1


async def fetch(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Answer:
    resp = await session.post(url + "/v1/completions", json=body)
    try:
        if resp.status == 429:
            raise ServerBusy(f"HTTP 429: {(await resp.text())[:300]}", retry_after(resp))
        return await (read_stream(resp) if body["stream"] else read_whole(resp))
    finally:
        resp.close()  # also on cancellation: the client hangs up


async def one_request(session: aiohttp.ClientSession, url: str, prompts: list[list[int]], idx: int,
                      cfg: SoakConfig, stream: bool, hang_up_after: float | None) -> Outcome:
    out = Outcome("completed", idx, stream, hang_up_after is not None)
    t0 = time.monotonic()
    body = request_body(prompts[idx], cfg.max_tokens, stream, cfg.served_name)

    async def call() -> Answer:
        while True:
            try:
                return await fetch(session, url, body)
            except ServerBusy as busy:
                if out.retries == BUSY_RETRIES:
                    raise
                out.retries += 1
                await asyncio.sleep(busy.retry_after_s)

    try:
        out.answer = await (call() if hang_up_after is None else asyncio.wait_for(call(), hang_up_after))
    except TimeoutError:
        out.kind = "disconnected"
    except (RequestFailed, aiohttp.ClientError, json.JSONDecodeError, KeyError) as exc:
        out.kind, out.error = "failed", f"{type(exc).__name__}: {exc}"
    out.latency_s = time.monotonic() - t0
    return out


async def references(session: aiohttp.ClientSession, url: str, prompts: list[list[int]],
                     cfg: SoakConfig) -> list[Answer]:
    """Each prompt alone, one at a time: what every later run of it must return."""
    refs = []
    for idx in range(len(prompts)):
        out = await one_request(session, url, prompts, idx, cfg, False, None)
        if out.answer is None:
            raise RuntimeError(f"reference request {idx} failed: {out.error}")
        refs.append(out.answer)
    return refs


def mismatch(out: Outcome, refs: list[Answer], max_tokens: int) -> str | None:
    ref, got = refs[out.prompt], out.answer
    assert got is not None
    if len(got.tokens) != max_tokens:
        return f"prompt {out.prompt}: {len(got.tokens)} tokens, expected {max_tokens}"
    if got != ref:
        return f"prompt {out.prompt} (stream={out.stream}): {got.tokens!r} != reference {ref.tokens!r}"
    return None


async def closed_loop(session: aiohttp.ClientSession, url: str, prompts: list[list[int]], cfg: SoakConfig,
                      concurrency: int, seed: int) -> tuple[float, list[Outcome]]:
    """``concurrency`` clients back to back for ``level_s`` (each sends at least one request):
    (seconds until the last one finished, outcomes)."""
    rng = random.Random(seed)
    t0 = time.monotonic()
    outcomes: list[Outcome] = []

    async def client() -> None:
        while True:
            outcomes.append(await one_request(session, url, prompts, rng.randrange(len(prompts)), cfg, False, None))
            if time.monotonic() - t0 >= cfg.level_s:
                return

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.monotonic() - t0, outcomes


def new_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600), connector=aiohttp.TCPConnector(limit=0))


LoadJob = tuple[str, str, list[list[int]], SoakConfig, float, float, int]


async def drive(session: aiohttp.ClientSession, job: LoadJob) -> tuple[float, list[Outcome], float]:
    """A ``closed`` loop of ``amount`` clients or an ``open`` loop of ``amount`` requests/s:
    (seconds, outcomes, CPU seconds of this process meanwhile)."""
    kind, url, prompts, cfg, amount, window_s, seed = job
    t0, cpu0 = time.monotonic(), time.process_time()
    if kind == "closed":
        elapsed, outs = await closed_loop(session, url, prompts, cfg, int(amount), seed)
    else:
        outs = await open_loop(session, url, prompts, cfg, amount, window_s, seed)
        elapsed = time.monotonic() - t0
    return elapsed, outs, time.process_time() - cpu0


def load_process(job: LoadJob) -> tuple[float, list[Outcome], float]:
    """``drive`` in a load-generating process of its own, with its own event loop and connections."""

    async def go() -> tuple[float, list[Outcome], float]:
        async with new_session() as session:
            return await drive(session, job)

    elapsed, outs, cpu = asyncio.run(go())
    same: dict[Answer, Answer] = {}
    for o in outs:  # equal answers become one object, which pickles once
        if o.answer is not None:
            o.answer = same.setdefault(o.answer, o.answer)
    return elapsed, outs, cpu


class Load:
    """Runs closed and open loops in this process (``clients`` = 1) or split over ``clients`` processes,
    so that the load generator is not what saturates."""

    def __init__(self, session: aiohttp.ClientSession, url: str, prompts: list[list[int]], cfg: SoakConfig) -> None:
        self.session, self.url, self.prompts, self.cfg = session, url, prompts, cfg
        spawn = multiprocessing.get_context("spawn")
        self.pool = concurrent.futures.ProcessPoolExecutor(cfg.clients, mp_context=spawn) if cfg.clients > 1 else None
        self.cpu_per_min: list[float] = []  # of each load process, in the last run

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)

    async def run(self, kind: str, amount: float, window_s: float, seed: int) -> tuple[float, list[Outcome]]:
        """``amount``: clients (closed) or requests/s (open), shared evenly by the processes."""
        if self.pool is None:
            parts = [await drive(self.session, (kind, self.url, self.prompts, self.cfg, amount, window_s, seed))]
        else:
            n = min(self.cfg.clients, int(amount)) if kind == "closed" else self.cfg.clients
            shares = [amount // n + (k < amount % n) for k in range(n)] if kind == "closed" else [amount / n] * n
            loop = asyncio.get_running_loop()
            parts = await asyncio.gather(*(loop.run_in_executor(
                self.pool, load_process, (kind, self.url, self.prompts, self.cfg, share, window_s, seed + 7919 * k))
                for k, share in enumerate(shares)))
        self.cpu_per_min = [round(cpu / max(1e-6, t) * 60, 2) for t, _, cpu in parts]
        return max(t for t, _, _ in parts), [o for _, outs, _ in parts for o in outs]


async def saturation(load: Load) -> tuple[list[dict[str, Any]], list[Outcome]]:
    """Throughput at concurrency 1, 2, 4, ... until two levels in a row fail to beat the best by 5 %."""
    table: list[dict[str, Any]] = []
    outcomes: list[Outcome] = []
    best, flat = 0.0, 0
    for level in (1, 2, 4, 8, 16, 32, 64):
        elapsed, outs = await load.run("closed", level, 0.0, load.cfg.seed + level)
        rps = sum(o.kind == "completed" for o in outs) / elapsed
        outcomes += outs
        lat = [o.latency_s for o in outs if o.kind == "completed"]
        table.append({"concurrency": level, "requests_per_s": round(rps, 3),
                      "p50_latency_s": round(float(np.median(lat)), 3) if lat else None,
                      "busiest_load_process_cpu_s_per_min": max(load.cpu_per_min)})  # 60: that process saturated
        errors = sorted({o.error for o in outs if o.kind == "failed"})
        progress(f"saturation: {table[-1]}" + (f"; errors: {errors[:3]}" if errors else ""))
        flat = flat + 1 if rps < best * 1.05 else 0
        best = max(best, rps)
        if flat == 2:
            break
    return table, outcomes


class Sampler:
    """Resident memory, gauges and child pids every ``sample_s`` seconds."""

    def __init__(self, serve: ServeProc, t0: float) -> None:
        self.serve, self.t0 = serve, t0
        self.samples: list[dict[str, Any]] = []

    def sample(self) -> dict[str, Any]:
        pids = self.serve.pids()
        s = {"t": round(time.monotonic() - self.t0, 1), "rss_kib": self.serve.rss(pids),
             "pids": {role: pid for role, pid in pids.items() if role != "supervisor"}, **self.serve.gauges()}
        self.samples.append(s)
        return s

    async def run(self, every_s: float) -> None:
        while True:
            await asyncio.to_thread(self.sample)
            await asyncio.sleep(every_s)


async def open_loop(session: aiohttp.ClientSession, url: str, prompts: list[list[int]], cfg: SoakConfig,
                    rate: float, hang_up_window_s: float, seed: int) -> list[Outcome]:
    """Poisson arrivals at ``rate`` for ``duration_s``; returns every request's outcome."""
    rng = random.Random(seed)
    tasks: list[asyncio.Task[Outcome]] = []
    t_next = time.monotonic()
    end = t_next + cfg.duration_s
    while t_next < end:
        await asyncio.sleep(max(0.0, t_next - time.monotonic()))
        hang_up = rng.uniform(0.0, hang_up_window_s) if rng.random() < cfg.disconnect else None
        stream = rng.random() < 0.5
        tasks.append(asyncio.create_task(
            one_request(session, url, prompts, rng.randrange(len(prompts)), cfg, stream, hang_up)))
        t_next += rng.expovariate(rate)
    return list(await asyncio.gather(*tasks))


def rss_report(samples: list[dict[str, Any]], cfg: SoakConfig) -> tuple[dict, list[str]]:
    """Per process: RSS after warm-up, at the end, peak, growth; violations when it grew."""
    base = next((s for s in samples if s["t"] >= cfg.warmup_s), samples[0])
    last = samples[-1]
    report, bad = {}, []
    for role, kib in base["rss_kib"].items():
        end = last["rss_kib"].get(role)
        peak = max(s["rss_kib"].get(role, 0) for s in samples if s["t"] >= base["t"])
        growth = None if end is None else (end - kib) / 1024
        report[role] = {"after_warmup_mib": round(kib / 1024, 1), "end_mib": None if end is None else
                        round(end / 1024, 1), "peak_mib": round(peak / 1024, 1),
                        "growth_mib": None if growth is None else round(growth, 1)}
        allowed = max(cfg.rss_tolerance_mib, cfg.rss_tolerance_frac * kib / 1024)
        if growth is None or growth > allowed:
            bad.append(f"{role}: resident memory grew {growth} MiB after warm-up (allowed {allowed:.0f})")
    return report, bad


def latency_summary(outs: list[Outcome]) -> dict[str, float]:
    lat = np.array([o.latency_s for o in outs if o.kind == "completed"])
    if not lat.size:
        return {}
    return {k: round(float(np.percentile(lat, q)), 3) for k, q in (("p50", 50), ("p95", 95), ("p99", 99))}


def judge(outs: list[Outcome], refs: list[Answer], cfg: SoakConfig) -> tuple[dict[str, int], list[str]]:
    counts = {"sent": len(outs), "completed": 0, "disconnected": 0, "failed": 0, "mismatched": 0,
              "planned_hang_ups": sum(o.planned_hang_up for o in outs),
              "retried_after_429": sum(o.retries > 0 for o in outs), "retries_429": sum(o.retries for o in outs)}
    bad: list[str] = []
    for out in outs:
        counts[out.kind] += 1
        if out.kind == "failed":
            bad.append(f"request failed: {out.error}")
        elif out.kind == "completed":
            why = mismatch(out, refs, cfg.max_tokens)
            if why:
                counts["mismatched"] += 1
                bad.append(why)
    return counts, bad


async def soak_phase(serve: ServeProc, load: Load, rate: float,
                     window_s: float) -> tuple[list[Outcome], Sampler, dict, dict[str, float]]:
    """The loaded phase: (outcomes, samples, gauges at start and end, CPU seconds per minute of each
    server process under the load). The start is read once the server is idle: requests of the phase before
    (the saturation steps' last ones, hung up or not) may still be finishing."""
    start_gauges = await asyncio.to_thread(serve.wait_gauges, {"slots_in_use": 0.0, "num_requests_running": 0.0},
                                           30.0)
    sampler = Sampler(serve, time.monotonic())
    sampling = asyncio.create_task(sampler.run(load.cfg.sample_s))
    meter = CpuMeter(serve.pids)
    meter.begin()
    try:
        _, outs = await load.run("open", rate, window_s, load.cfg.seed)
        server_cpu, _ = meter.end()
        end_gauges = await asyncio.to_thread(serve.wait_gauges, start_gauges, 30.0)  # back at their start
    finally:
        sampling.cancel()
    await asyncio.to_thread(sampler.sample)
    return outs, sampler, {"start": start_gauges, "end": end_gauges}, server_cpu


async def soak(serve: ServeProc, cfg: SoakConfig) -> dict[str, Any]:
    prompts = make_prompts(cfg.prompts, cfg.seed)
    async with new_session() as session:
        refs = await references(session, serve.url, prompts, cfg)
        progress(f"{len(refs)} references")
        load = Load(session, serve.url, prompts, cfg)
        try:
            table, probe = await saturation(load)
            peak = max(table, key=lambda row: row["requests_per_s"])
            if not peak["requests_per_s"]:
                raise RuntimeError(f"no request finished while measuring saturation: {table}")
            rate = cfg.load * peak["requests_per_s"]
            window = 1.5 * ((table[0] if cfg.hang_up_alone else peak)["p50_latency_s"] or 1.0)
            progress(f"soaking at {rate:.2f} requests/s for {cfg.duration_s:.0f} s from {cfg.clients} process(es)")
            outs, sampler, gauges, server_cpu = await soak_phase(serve, load, rate, window)
        finally:
            load.close()
    counts, bad = judge(outs, refs, cfg)
    _, probe_bad = judge(probe, refs, cfg)
    rss, rss_bad = rss_report(sampler.samples, cfg)
    seen_pids = {s["pids"].get(r) for s in sampler.samples for r in sampler.samples[0]["pids"]}
    bad = probe_bad + bad + rss_bad
    if gauges["end"] != gauges["start"]:
        bad.append(f"gauges did not return to their start: {gauges}")
    if len(seen_pids) != len(sampler.samples[0]["pids"]):
        bad.append(f"a process was restarted during the soak: {[s['pids'] for s in sampler.samples]}")
    return {"saturation": table, "target_rate_rps": round(rate, 3), "hang_up_window_s": round(window, 3),
            "requests": counts, "probe_requests": len(probe), "output_tokens": counts["completed"] * cfg.max_tokens,
            "latency_s": latency_summary(outs), "gauges": gauges, "rss": rss,
            "cpu_s_per_min": {"server": server_cpu, "load_processes": load.cpu_per_min},
            "samples": sampler.samples,
            "failures_by_error": failure_kinds(outs), "liveness_failures": liveness_failures(outs),
            "violations": bad[:50], "violation_count": len(bad)}


def liveness_failures(outs: list[Outcome]) -> int:
    """Requests that failed because a frontend took the engine for down (``LIVENESS_ERRORS``)."""
    return sum(1 for o in outs if o.kind == "failed" and any(e in o.error for e in LIVENESS_ERRORS))


def failure_kinds(outs: list[Outcome], top: int = 10) -> dict[str, int]:
    """The most frequent errors of failed requests (first 120 characters), with their counts."""
    kinds = collections.Counter(o.error[:120] for o in outs if o.kind == "failed")
    return dict(kinds.most_common(top))


def run_soak(cfg: SoakConfig, run_root: Path, extra_args: tuple[str, ...] = (),
             co_tenant: Interference | None = None) -> dict[str, Any]:
    """Start a server (``extra_args`` added to its flags), soak it, stop it; the summary with ``passed``. A
    ``co_tenant`` runs from before the server starts until it stopped: every phase shares the cores with it."""
    t0 = time.time()
    if co_tenant is not None:
        co_tenant.start()
    try:
        serve = ServeProc((*SERVE_ARGS, *extra_args), run_root, env=SERVE_ENV).start()
        try:
            result = asyncio.run(soak(serve, cfg))
        finally:
            code = serve.stop()
    finally:
        co_report = co_tenant.stop() if co_tenant is not None else None
    result["co_tenant"] = co_report
    if result["liveness_failures"]:
        result["violations"].append(f"{result['liveness_failures']} requests failed for liveness")
    result["clean_exit"] = code == 0
    if code != 0:
        result["violations"].append(f"blink serve exited with {code}")
    result["passed"] = not result["violations"]
    meta = {"started_unix": int(t0), "wall_s": round(time.time() - t0, 1), "cpus": os.cpu_count(),
            "machine": platform.machine(), "python": platform.python_version(),
            "serve_args": [*SERVE_ARGS, *extra_args], "serve_env": SERVE_ENV, "config": dataclasses.asdict(cfg),
            "engine": "gpu_engine.serve"}
    return {**meta, **result}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    ap.add_argument("--duration-s", type=float, default=120.0, help="length of the loaded phase")
    ap.add_argument("--load", type=float, default=0.8, help="offered rate as a fraction of saturation")
    ap.add_argument("--disconnect", type=float, default=0.1, help="share of clients that hang up")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--level-s", type=float, default=6.0, help="seconds per concurrency level (saturation)")
    ap.add_argument("--warmup-s", type=float, default=None, help="RSS baseline time (default: 1/4, <= 60 s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clients", type=int, default=1, help="load-generating processes (the load is split evenly)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--backend", default=None, help="engine backend (cpu, host, persistent); default: the engine's")
    ap.add_argument("--dtype", default=None, help="engine dtype (float32 keeps GPU greedy outputs batch-stable)")
    ap.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    ap.add_argument("--random-weights", action="store_true", help="the model's architecture with seeded random weights")
    ap.add_argument("--interfere", default="", help="co-tenant kinds (bench/interfere.py) on every allowed core for "
                    "the whole run, e.g. compress,thrash (default: none)")
    ap.add_argument("--per-core", type=int, default=1, help="co-tenant workers of each kind per core")
    a = ap.parse_args(argv)
    warmup = a.warmup_s if a.warmup_s is not None else min(60.0, a.duration_s / 4)
    cfg = SoakConfig(duration_s=a.duration_s, load=a.load, disconnect=a.disconnect, max_tokens=a.max_tokens,
                     level_s=a.level_s, warmup_s=warmup, seed=a.seed, clients=a.clients,
                     served_name=Path(a.model).name if a.model else MODEL)
    with tempfile.TemporaryDirectory(prefix="blink-soak-") as tmp:
        extra = (("--backend", a.backend) if a.backend else ()) + (("--dtype", a.dtype) if a.dtype else ())
        if a.model:
            extra += ("--model", a.model, "--served-model-name", cfg.served_name)
        if a.random_weights:
            extra += ("--random-weights",)
        co = Interference(kinds=tuple(a.interfere.split(",")), per_core=a.per_core) if a.interfere else None
        summary = run_soak(cfg, Path(tmp), extra, co)
    text = json.dumps(summary, indent=1)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    brief = {k: summary[k] for k in ("saturation", "target_rate_rps", "requests", "latency_s", "gauges", "rss",
                                     "cpu_s_per_min", "liveness_failures", "co_tenant", "violations", "passed")}
    print(json.dumps(brief, indent=1))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
