"""One rate's record: counts, latencies and sustained throughput of the window, and the server's queue.

A record (one per system, co-tenant level and offered rate in ``peers.json``):

- ``arrived``: requests whose arrival fell inside the window; each ended ``completed``, ``failed`` (an HTTP or
  stream error; ``errors`` counts them by kind) or ``unfinished`` (still open at the cut), and
  ``arrived = completed + failed + unfinished``;
- ``ttft_ms``, ``tpot_ms``, ``itl_ms``, ``e2e_ms``: ``p50``, ``p95``, ``p99``, ``p999`` over the completed
  measured requests (vLLM's definitions, ``bench/serve_bench.py``);
- ``sustained_req_s`` / ``sustained_out_tok_s``: requests that completed, and output tokens that streamed,
  inside the window (whatever their arrival), per second of window; ``vllm_def_req_s``: vLLM's benchmark
  throughput of the measured requests (completed over first send to last answer), for reference only;
- ``queue_start``, ``queue_end``, ``queue_max``, ``queue_growth`` (a line fitted through readings every
  second): the server's waiting-requests gauge over the window; ``keeps_up`` and ``keeps_up_why``: the
  plateau's test;
- ``server_cpu_s_per_min`` (by process), ``client_cpu_s_per_min`` (per client process), ``client_busy``;
- ``prefix_cache``: prompt tokens the server looked up in its prefix cache over the window, those it found,
  and ``hit_rate`` (its own counters, read at the window's start and end; None without them);
- under a constrained load (``bench/peers/constraint.py``; the study adds ``config`` and ``response_format``
  labels to every record): ``output_check``, the completed measured answers by finish reason with the invalid
  ones, and ``invalid_outputs``, those that stopped but break the constraint plus those cut at the length
  limit that do not even begin as an object.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import numpy as np

from bench import serve_bench as sb
from bench.peers.constraint import ResponseFormat, check_outputs
from bench.peers.load import CLIENT_BUSY_S_PER_MIN, CUT, QUEUE_EVERY_S, START_LEAD_S, Clients, Outcome, Schedule
from bench.peers.systems import System
from harness.serve_proc import CpuMeter

TTFT_LIMIT_MS = 1000.0  # the plateau's latency bound: TTFT p50 under a second


def pct_ms(seconds: list[float]) -> dict[str, float | None]:
    """p50, p95, p99 and p999 in milliseconds (None without samples)."""
    arr = np.asarray(seconds, dtype=np.float64) * 1e3
    return {name: (round(float(np.percentile(arr, q)), 3) if arr.size else None) for name, q in sb.PERCENTILES.items()}


def queue_slack(arrived: int) -> float:
    """How much the waiting queue may grow over a window and still count as not growing: two requests, or
    2 % of the window's arrivals (gauges are read at instants, and arrivals come in bursts)."""
    return max(2.0, 0.02 * arrived)


def queue_growth(samples: list[tuple[float, float]], window_s: float) -> float | None:
    """The waiting queue's growth over the window, from a least-squares line through its readings."""
    if len(samples) < 2:
        return None
    t, q = np.asarray(samples, dtype=np.float64).T
    if np.ptp(t) <= 0:
        return None
    slope = np.polyfit(t, q, 1)[0]
    return round(float(slope * window_s), 3)


def keeps_up(rec: dict[str, Any]) -> tuple[bool, str]:
    """The plateau's test of one record, and why: the queue did not grow and TTFT p50 stayed under 1 s."""
    p50 = rec["ttft_ms"]["p50"]
    if not rec["completed"] or p50 is None:
        return False, "nothing completed"
    if p50 >= TTFT_LIMIT_MS:
        return False, f"TTFT p50 {p50:.0f} ms >= {TTFT_LIMIT_MS:.0f} ms"
    growth = rec.get("queue_growth")
    if growth is None and rec.get("queue_start") is not None and rec.get("queue_end") is not None:
        growth = rec["queue_end"] - rec["queue_start"]
    if growth is None:  # no gauge: every measured request must have completed
        done = rec["completed"] >= rec["arrived"]
        return done, "no queue gauge; " + ("all measured requests completed" if done else "some did not complete")
    if growth > queue_slack(rec["arrived"]):
        return False, f"queue grew by {growth:.1f} over the window"
    return True, f"queue growth {growth:.1f}, TTFT p50 {p50:.0f} ms"


def latencies(ok: list[Outcome]) -> dict[str, dict[str, float | None]]:
    tpot = [(o.last - o.first) / (o.tokens - 1) for o in ok if o.tokens >= 2]
    itl = np.concatenate([np.diff(o.chunks) for o in ok]) if ok else np.empty(0)
    return {"ttft_ms": pct_ms([o.first - o.sent for o in ok]), "tpot_ms": pct_ms(tpot),
            "itl_ms": pct_ms(itl.tolist()), "e2e_ms": pct_ms([o.last - o.sent for o in ok])}


def window_counts(schedule: Schedule, outs: list[Outcome]) -> dict[str, Any]:
    """What arrived inside the window and how it ended, and what the server delivered inside it."""
    w = schedule.window
    measured = [o for o in outs if schedule.measured(o.idx)]
    ok = [o for o in measured if o.ok]
    failed = [o for o in measured if not o.ok and o.error not in CUT]
    every_ok = [o for o in outs if o.ok]
    per_chunk = (sum(o.tokens for o in every_ok) / max(1, sum(len(o.chunks) for o in every_ok))) if every_ok else 1.0
    chunks_in = sum(int(np.count_nonzero((o.chunks >= w.start) & (o.chunks < w.end))) for o in outs)
    done_in = sum(1 for o in every_ok if w.start <= o.last < w.end)
    span = (max(o.last for o in ok) - min(o.sent for o in ok)) if ok else 0.0
    errors: dict[str, int] = {}
    for o in failed:
        errors[o.error] = errors.get(o.error, 0) + 1
    return {"arrived": schedule.arrived, "completed": len(ok), "failed": len(failed),
            "unfinished": schedule.arrived - len(ok) - len(failed), "errors": errors,
            "sustained_req_s": round(done_in / w.window_s, 4),
            "sustained_out_tok_s": round(per_chunk * chunks_in / w.window_s, 2),
            "vllm_def_req_s": round(len(ok) / span, 4) if span > 0 else None,
            "output_tokens": sum(o.tokens for o in ok), **latencies(ok)}


async def watch_queue(system: System, t0: float, schedule: Schedule) -> list[tuple[float, float]]:
    """(seconds from the start, waiting requests) read every ``QUEUE_EVERY_S`` from the window's start to its end."""
    w = schedule.window
    samples: list[tuple[float, float]] = []
    steps = max(1, math.ceil(w.window_s / QUEUE_EVERY_S))
    for k in range(steps + 1):
        at = t0 + w.start + min(w.window_s, k * QUEUE_EVERY_S)
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        waiting, _ = await asyncio.to_thread(system.gauges)
        if waiting is not None:
            samples.append((round(time.perf_counter() - t0, 3), waiting))
    return samples


async def meter_window(meter: CpuMeter, t0: float, schedule: Schedule) -> dict[str, float]:
    """The server's CPU seconds per minute (by process) over the window."""
    await asyncio.sleep(max(0.0, t0 + schedule.window.start - time.perf_counter()))
    await asyncio.to_thread(meter.begin)
    await asyncio.sleep(max(0.0, t0 + schedule.window.end - time.perf_counter()))
    per_min, _ = await asyncio.to_thread(meter.end)
    return per_min


async def cache_window(system: System, t0: float, schedule: Schedule) -> dict[str, Any] | None:
    """The prefix cache over the window, from the server's own counters read at its start and end: prompt
    tokens looked up, found, and their ratio (None where the server has no such counters)."""
    w = schedule.window
    await asyncio.sleep(max(0.0, t0 + w.start - time.perf_counter()))
    q0, h0 = await asyncio.to_thread(system.cache_counters)
    await asyncio.sleep(max(0.0, t0 + w.end - time.perf_counter()))
    q1, h1 = await asyncio.to_thread(system.cache_counters)
    if None in (q0, h0, q1, h1):
        return None
    queries, hits = q1 - q0, h1 - h0  # type: ignore[operator]
    return {"queries": queries, "hits": hits, "hit_rate": round(hits / queries, 4) if queries > 0 else None}


def output_check(schedule: Schedule, outs: list[Outcome], fmt: ResponseFormat) -> dict[str, Any]:
    """The constraint's check of the completed answers that arrived inside the window."""
    answers = [(o.finish, o.text or "") for o in outs if o.ok and schedule.measured(o.idx)]
    check = check_outputs(answers, fmt)
    return {"output_check": check, "invalid_outputs": check["invalid"] + check["length_not_object"]}


async def measure(system: System, clients: Clients, model: str, schedule: Schedule,
                  fmt: ResponseFormat | None = None) -> dict[str, Any]:
    """Send one rate's stream to ``system`` (each request with ``fmt``'s ``response_format`` if given) and
    return its record (without system, co-tenant and setup labels)."""
    t0 = time.perf_counter() + START_LEAD_S
    meter = CpuMeter(system.pids)
    queue_task = asyncio.create_task(watch_queue(system, t0, schedule))
    cpu_task = asyncio.create_task(meter_window(meter, t0, schedule))
    cache_task = asyncio.create_task(cache_window(system, t0, schedule))
    outs, client_cpu = await clients.send(f"{system.url}/v1/completions", model, schedule, t0,
                                          fmt.body if fmt is not None else None)
    samples, server_cpu, cache = await queue_task, await cpu_task, await cache_task
    w = schedule.window
    rec: dict[str, Any] = {"rate": schedule.rate, "window_s": w.window_s, "warmup_s": w.warmup_s,
                           "drain_s": w.drain_s, **window_counts(schedule, outs)}
    rec.update(queue_start=samples[0][1] if samples else None, queue_end=samples[-1][1] if samples else None,
               queue_max=max(q for _, q in samples) if samples else None,
               queue_growth=queue_growth(samples, w.window_s), queue_readings=len(samples),
               server_cpu_s_per_min=server_cpu, client_cpu_s_per_min=client_cpu, prefix_cache=cache,
               client_busy=bool(client_cpu) and max(client_cpu) >= CLIENT_BUSY_S_PER_MIN)
    rec["keeps_up"], rec["keeps_up_why"] = keeps_up(rec)
    if fmt is not None:
        rec.update(output_check(schedule, outs, fmt))
    return rec
