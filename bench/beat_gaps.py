"""The engine's heartbeat as an observer sees it, on a loaded host: the longest silences between beats.

    python -m bench.beat_gaps --duration-s 120 --streams 8 --interfere compress,thrash --out gaps.json

Starts its own ``blink serve`` (the real CPU engine, the soak's small limits, no standby engine), optionally
a co-tenant on every allowed core (``bench/interfere.py``), keeps ``--streams`` streaming requests running
in closed loops, and reads the ring header's ``heartbeat`` counter every 10 ms for ``--duration-s``. It
reports the longest silence (time, on this process's monotonic clock, between two seen changes of the
counter) and the longest delay of its own sampling loop (a sample later than asked: this observer was the
one starved), so that the default of ``BLINK_HEARTBEAT_TIMEOUT_S`` can be chosen as a multiple of what a
busy host does to a live engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.interfere import Interference, allowed_cores
from harness.serve_proc import ServeProc
from harness.sse import request_body
from shared.ring import attach_shm_ring

SERVE_ARGS = ("--max-output-tokens", "32", "--max-prompt-tokens", "64", "--num-slots", "64",
              "--drain-timeout", "2", "--no-standby-engine")
PROMPTS = ([1, 504, 2603, 282, 260, 6526], [1, 12620, 253, 1345, 14048, 563, 4444], [1, 21962, 1588, 5891],
           [1, 9397, 667, 253, 19693, 2722, 30, 2])


async def stream_loop(url: str, index: int, stop_at: float, counts: dict[str, int]) -> None:
    """One closed-loop client: a streamed completion, again and again until ``stop_at``."""
    body = request_body(list(PROMPTS[index % len(PROMPTS)]), 32, stream=True)
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < stop_at:
            async with session.post(url + "/v1/completions", json=body) as resp:
                await resp.read()
                counts[str(resp.status)] = counts.get(str(resp.status), 0) + 1


async def sample_beats(ring_name: str, stop_at: float, every_s: float = 0.01) -> dict[str, Any]:
    """The longest gap between seen changes of the beat counter, and this sampler's own longest lateness."""
    ring = attach_shm_ring(ring_name)
    try:
        last_beat, moved_at, asked = ring.header_load64("heartbeat"), time.monotonic(), time.monotonic()
        longest, late, gaps = 0.0, 0.0, []
        while (now := time.monotonic()) < stop_at:
            late = max(late, now - asked - every_s)
            beat = ring.header_load64("heartbeat")
            if beat != last_beat:
                gaps.append(now - moved_at)
                longest, last_beat, moved_at = max(longest, now - moved_at), beat, now
            asked = now
            await asyncio.sleep(every_s)
        longest = max(longest, time.monotonic() - moved_at)
    finally:
        ring.close()
    gaps.sort()
    p999 = gaps[int(len(gaps) * 0.999)] if gaps else 0.0
    return {"longest_silence_s": round(longest, 3), "p999_gap_s": round(p999, 3), "beats_seen": len(gaps),
            "sampler_longest_late_s": round(late, 3)}


async def measure(serve: ServeProc, streams: int, duration_s: float) -> dict[str, Any]:
    stop_at = time.monotonic() + duration_s
    counts: dict[str, int] = {}
    loops = [asyncio.create_task(stream_loop(serve.url, i, stop_at, counts)) for i in range(streams)]
    gaps = await sample_beats(serve.ring, stop_at)
    await asyncio.gather(*loops, return_exceptions=True)
    return {**gaps, "responses": counts}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration-s", type=float, default=120.0)
    ap.add_argument("--streams", type=int, default=8, help="closed-loop streaming clients")
    ap.add_argument("--interfere", default="", help="co-tenant kinds on every allowed core (empty: none)")
    ap.add_argument("--per-core", type=int, default=1, help="co-tenant workers of each kind per core")
    ap.add_argument("--timeout-s", type=float, default=600.0,
                    help="BLINK_HEARTBEAT_TIMEOUT_S for the server (large: the measurement must not be cut short)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    env = {"BLINK_HEARTBEAT_TIMEOUT_S": str(a.timeout_s)}
    with tempfile.TemporaryDirectory(prefix="blink-beats-") as tmp:
        serve = ServeProc(SERVE_ARGS, Path(tmp), env=env).start()
        co = Interference(kinds=tuple(a.interfere.split(",")), per_core=a.per_core) if a.interfere else None
        try:
            if co is not None:
                co.start()
            result = asyncio.run(measure(serve, a.streams, a.duration_s))
        finally:
            if co is not None:
                co.stop()
            serve.stop()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result.update({"duration_s": a.duration_s, "streams": a.streams, "interfere": a.interfere or None,
                   "per_core": a.per_core,
                   "cores": len(allowed_cores()), "machine": platform.node(), "commit": commit,
                   "date": time.strftime("%Y-%m-%d %H:%M")})
    print(json.dumps(result, indent=1))
    if a.out is not None:
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
