"""Steady-state load at one offered rate: a Poisson stream sent by several client processes, measured in a window.

Timeline of one rate (seconds from a start shared by every client process; ``time.perf_counter`` is
``CLOCK_MONOTONIC`` on Linux, the same clock in every process):

    0 ........ warm-up ........ start ====== window ====== end ... tail ... hard end (end + drain)

Arrivals of one Poisson process of the rate cover the whole span; the requests are dealt round-robin to the
client processes. Only requests that arrive inside the window are *measured* (their latencies, and whether
they completed, failed or were still unfinished at the cut). Arrivals keep coming after the window (the tail)
so that the window's last requests are served under the same load, until every measured request of that
process has finished or the hard end; then whatever is still open is cut. Sustained throughput counts what
completed (requests) and streamed (output tokens) inside the window, whatever its arrival time.

A constrained load (``bench/peers/constraint.py``) puts one ``response_format`` into every request, drops
``ignore_eos`` and keeps each answer's text and finish reason for the check.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import math
import multiprocessing
import os
import time
import zlib
from typing import Any

import aiohttp
import numpy as np

from bench import serve_bench as sb
from bench.workloads import Limits, PromptMaker, RequestSpec, Workload, build_requests, draw_lengths

START_LEAD_S = 2.0  # from dealing the requests to the first arrival: every client process is ready by then
QUEUE_EVERY_S = 1.0  # how often the server's waiting gauge is read during the window
MAX_PROMPT_TOKENS, MAX_OUTPUT_TOKENS = 4096, 2048  # what the study's servers accept unless told (its CLI defaults)
CLIENT_BUSY_S_PER_MIN = 48.0  # a client process using 80 % of a core is close to being what saturates
CUT = ("cut", "not_sent")  # requests that never ended: unfinished, not failed


def peer_limits(max_prompt: int = MAX_PROMPT_TOKENS, max_output: int = MAX_OUTPUT_TOKENS) -> Limits:
    """The study's request limits: a prompt, an output, and the two together."""
    return Limits(max_prompt, max_output, max_prompt + max_output)


@dataclasses.dataclass(frozen=True)
class Window:
    """Seconds of warm-up, measurement and the longest tail after it."""

    warmup_s: float
    window_s: float
    drain_s: float

    def __post_init__(self) -> None:
        if self.warmup_s < 0 or self.window_s <= 0 or self.drain_s < 0:
            raise ValueError(f"warm-up {self.warmup_s} and drain {self.drain_s} must be >= 0 and the window "
                             f"{self.window_s} > 0")

    @property
    def start(self) -> float:
        return self.warmup_s

    @property
    def end(self) -> float:
        return self.warmup_s + self.window_s

    @property
    def hard_end(self) -> float:
        return self.end + self.drain_s


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One rate's arrivals (seconds from the start) and requests: the same for every system and co-tenant."""

    rate: float
    offsets: tuple[float, ...]
    specs: tuple[RequestSpec, ...]
    window: Window

    def measured(self, i: int) -> bool:
        return self.window.start <= self.offsets[i] < self.window.end

    @property
    def arrived(self) -> int:
        return sum(self.window.start <= t < self.window.end for t in self.offsets)


def rate_seed(seed: int, rate: float) -> int:
    """The seed of one rate's stream: a rate run twice (or by two systems) draws the same requests."""
    return seed * 1_000_003 + round(rate * 1000)


ARRIVALS = "poisson, one stream scaled by the rate"  # the results header's name for scaled_offsets


def scaled_offsets(rate: float, seed: int, end_s: float) -> list[float]:
    """Poisson arrivals of `rate` over [0, end_s): one unit-rate stream of `seed`, its times divided by the rate.
    Every rate sends the same stream, compressed, so a higher rate offers more of it in any window than a lower one
    but for the stream's own noise (rates drawn apart moved a plateau by about 1 req/s: BENCHMARKS.md, "What ends
    a plateau")."""
    unit = sb.arrival_offsets(1.0, np.random.default_rng(seed), None, rate * end_s)
    return [t / rate for t in unit]


def build_schedule(rate: float, window: Window, workload: Workload, limits: Limits, tokenizer: Any,
                   seed: int, level: str = "") -> Schedule:
    """One (rate, co-tenant level) point's arrivals and requests: the arrivals `scaled_offsets`; the i-th request's
    lengths the same at every rate, its text the rate's own (a server serves the rates in turn, and one whose
    cache held an earlier rate's prompts would find them cached). Conversations (the ``shared`` workload) are
    drawn per level too: a server serves every level in turn, and one whose cache still held an earlier level's
    conversations would find them all cached (only the system prompt is meant to be shared)."""
    if not rate > 0 or math.isinf(rate):
        raise ValueError(f"a steady-state rate must be positive and finite, got {rate}")
    s = rate_seed(seed, rate)
    if workload.conversations is not None:
        offsets = scaled_offsets(rate, seed, window.hard_end)
        specs = build_requests(workload, max(1, len(offsets)), tokenizer, limits, s + zlib.crc32(level.encode()))
    else:
        offsets, lengths = stream_draws(rate, seed, window.hard_end, workload, limits)
        maker = PromptMaker(tokenizer, s)
        specs = [maker.request(p, o) for p, o in lengths]
    return Schedule(rate, tuple(offsets), tuple(specs[:len(offsets)]), window)


def stream_draws(rate: float, seed: int, end_s: float, workload: Workload,
                 limits: Limits) -> tuple[list[float], list[tuple[int, int]]]:
    """A rate's arrival offsets over [0, end_s) (`scaled_offsets`) and its requests' (prompt, output) lengths
    (`stream_lengths`, at least one)."""
    offsets = scaled_offsets(rate, seed, end_s)
    return offsets, stream_lengths(workload, max(1, len(offsets)), limits, seed)


STREAM_REQUESTS = 8192  # lengths drawn at once for every rate: a run of fewer requests takes the same first ones


def stream_lengths(workload: Workload, n: int, limits: Limits, seed: int) -> list[tuple[int, int]]:
    """The first `n` (prompt, output) lengths of `seed`'s stream: the same i-th pair at every rate (a draw's mean is
    fitted over the whole draw, so the draw's size is fixed, not the rate's count)."""
    return draw_lengths(workload, max(n, STREAM_REQUESTS), limits, seed)[:n]


# ---------------------------------------------------------------------- one client process
@dataclasses.dataclass
class Outcome:
    """One request, times in seconds from the shared start; chunk times of every content chunk; the answer's
    text only under a constraint."""

    idx: int
    ok: bool
    error: str
    sent: float
    first: float
    last: float
    tokens: int
    chunks: np.ndarray
    finish: str = ""
    text: str | None = None


@dataclasses.dataclass(frozen=True)
class Job:
    """What one client process sends: ``items`` are (index, offset, prompt, output tokens, measured)."""

    url: str
    model: str
    t0: float
    window: Window
    items: tuple[tuple[int, float, list[int] | str, int, bool], ...]
    response_format: dict[str, Any] | None = None


def request_payload(model: str, spec: RequestSpec, response_format: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed completion; under a constraint with ``response_format`` and without ``ignore_eos``."""
    payload = sb.make_payload(model, spec)
    if response_format is not None:
        payload.update(response_format=response_format, ignore_eos=False)
    return payload


def outcome(idx: int, res: sb.RequestResult, t0: float) -> Outcome:
    error = res.error or ("" if res.ok else "cut")
    return Outcome(idx, res.ok, error, res.sent - t0, res.first - t0, res.last - t0, res.output_tokens,
                   np.asarray(res.chunk_times, dtype=np.float64) - t0, res.finish_reason,
                   "".join(res.text) if res.text is not None else None)


async def drive(job: Job) -> list[Outcome]:
    """Send the job's requests on time; after the window only while its measured requests are still open."""
    keep_text = job.response_format is not None
    results = {i: sb.RequestResult(prompt_len=len(p) if isinstance(p, list) else 0, text=[] if keep_text else None)
               for i, _, p, _, _ in job.items}
    open_measured = sum(m for *_, m in job.items)
    all_measured_done = asyncio.Event()
    if not open_measured:
        all_measured_done.set()

    async def one(session: aiohttp.ClientSession, i: int, prompt: list[int] | str, out: int, measured: bool) -> None:
        nonlocal open_measured
        try:
            payload = request_payload(job.model, RequestSpec(prompt, results[i].prompt_len, out), job.response_format)
            await sb.send_one(session, job.url, payload, {}, results[i])
        finally:
            if measured:
                open_measured -= 1
                if not open_measured:
                    all_measured_done.set()

    hard_end = job.t0 + job.window.hard_end
    tasks: list[asyncio.Task[None]] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=None)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        for i, offset, prompt, out, measured in job.items:
            at = job.t0 + offset
            if at >= hard_end:
                break
            wait_s = at - time.perf_counter()
            if offset >= job.window.end:
                if await _set_within(all_measured_done, wait_s):
                    break
            elif wait_s > 0:
                await asyncio.sleep(wait_s)
            tasks.append(asyncio.create_task(one(session, i, prompt, out, measured)))
        await _set_within(all_measured_done, hard_end - time.perf_counter())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    sent = {i for i, *_ in job.items[:len(tasks)]}
    return [outcome(i, res, job.t0) if i in sent else Outcome(i, False, "not_sent", math.nan, math.nan, math.nan,
                                                              0, np.empty(0)) for i, res in results.items()]


async def _set_within(event: asyncio.Event, seconds: float) -> bool:
    """Whether ``event`` is set within ``seconds`` (at once when it already is)."""
    if event.is_set():
        return True
    try:
        await asyncio.wait_for(event.wait(), max(0.0, seconds))
    except TimeoutError:
        return False
    return True


def run_job(job: Job) -> tuple[list[Outcome], float, float]:
    """``drive`` in a client process: (outcomes, CPU seconds, wall seconds) of this process meanwhile."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    outs = asyncio.run(drive(job))
    return outs, time.process_time() - cpu0, time.perf_counter() - wall0


def _pin(cores: tuple[int, ...]) -> None:
    os.sched_setaffinity(0, set(cores))


class Clients:
    """``n`` client processes (spawned once, pinned to ``cores``) that send one rate's stream together."""

    def __init__(self, n: int, cores: list[int]) -> None:
        if n < 1:
            raise ValueError(f"clients must be >= 1, got {n}")
        self.n, self.cores = n, list(cores)
        self.pool = concurrent.futures.ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"),
                                                           initializer=_pin, initargs=(tuple(cores),))
        for f in [self.pool.submit(time.sleep, 0.01) for _ in range(n)]:  # start them before any window
            f.result()

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)

    def jobs(self, url: str, model: str, schedule: Schedule, t0: float,
             response_format: dict[str, Any] | None = None) -> list[Job]:
        items = [(i, schedule.offsets[i], s.prompt, s.output_len, schedule.measured(i))
                 for i, s in enumerate(schedule.specs)]
        return [Job(url, model, t0, schedule.window, tuple(items[k::self.n]), response_format) for k in range(self.n)]

    async def send(self, url: str, model: str, schedule: Schedule, t0: float,
                   response_format: dict[str, Any] | None = None) -> tuple[list[Outcome], list[float]]:
        """Every outcome, and each process's CPU seconds per minute."""
        loop = asyncio.get_running_loop()
        parts = await asyncio.gather(*(loop.run_in_executor(self.pool, run_job, job)
                                       for job in self.jobs(url, model, schedule, t0, response_format)))
        cpu = [round(c / max(1e-6, w) * 60, 2) for _, c, w in parts]
        return [o for outs, _, _ in parts for o in outs], cpu
