"""What routing over several engines' rings costs the slot tracker per request (``--data-parallel-size``).

The tracker's whole admission path (``SlotTracker.submit``: which engines serve, the routing rule, the
slot reservation and the publish into the ring) runs against 1, 2, 4 and 8 real shared-memory rings
that say READY with a fresh heartbeat; no engine consumes them, so each batch of requests fits in the
rings' slots. The routing share is the time of the rule alone (each serving engine's load read from its
ring header and slot view, then ordered); the difference between N engines and one is what data
parallelism adds per request. Prints a table and writes ``bench/results/dp_routing.json``.

    python -m bench.dp_routing [--requests 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from pathlib import Path

from dpu_gateway.routing import choose_order
from dpu_gateway.tracker import SlotTracker, TrackerConfig
from harness.serve_proc import cpu_name
from shared import messages as m
from shared import ring_layout as L
from shared.data_parallel import engine_ring_names
from shared.ring import Ring, RingGeometry, create_shm_ring
from shared.transport import ShmTransport

OUT = Path(__file__).resolve().parent / "results" / "dp_routing.json"
PROMPT = list(range(1, 65))  # a 64-token prompt


class Chan:
    def __init__(self) -> None:
        self.sent = 0

    def send(self, msg: object) -> None:
        self.sent += 1


def serving_rings(base: str, engines: int, slots: int) -> list[Ring]:
    rings = []
    for name in engine_ring_names(base, engines):
        ring = create_shm_ring(name, RingGeometry(slots, 128, 16, 0))
        ring.header_store32("engine_state", L.EngineState.READY)
        ring.header_store64("heartbeat_ns", time.time_ns() + 3600 * 10**9)  # fresh for the whole run
        ring.stats_store("kv_blocks_total", 1000)
        ring.stats_store("kv_blocks_free", 1000)
        rings.append(ring)
    return rings


def one_batch(engines: int, requests: int, tmp: Path) -> tuple[list[float], list[float], list[int]]:
    """(submit times, rule times, requests per engine) of ``requests`` submits over ``engines`` rings."""
    base = f"blink-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    slots = -(-requests // engines) + 8
    rings = serving_rings(base, engines, slots)
    tracker = SlotTracker(TrackerConfig(tmp, base, data_parallel_size=engines))
    chan = Chan()
    submit_s, rule_s = [], []
    try:
        for req in range(requests):
            sub = m.Submit(req + 1, 1, PROMPT, m.Sampling(16))
            t0 = time.perf_counter()
            tracker.submit(chan, sub)  # type: ignore[arg-type]
            submit_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            serving = tracker.serving()
            choose_order([lane.load(cache) for lane, cache in serving], tracker.last_engine, engines)
            rule_s.append(time.perf_counter() - t0)
        assert chan.sent == requests and not tracker.waiting
        return submit_s, rule_s, list(tracker.routed)
    finally:
        tracker.close()
        for name, ring in zip(engine_ring_names(base, engines), rings, strict=True):
            ring.close()
            ShmTransport.unlink_name(name)


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.dp_routing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000, help="submits per batch")
    ap.add_argument("--repeats", type=int, default=5, help="batches per engine count (the median is reported)")
    ap.add_argument("--engines", default="1,2,4,8", help="engine counts to measure")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    tmp = Path("/tmp") / f"blink-bench-run-{os.getpid()}"
    tmp.mkdir(mode=0o700, exist_ok=True)
    rows = []
    for engines in (int(x) for x in a.engines.split(",")):
        batches = [one_batch(engines, a.requests, tmp) for _ in range(a.repeats)]
        row = {"engines": engines,
               "submit_us_p50": statistics.median(pct(b[0], 0.5) for b in batches),
               "submit_us_p99": statistics.median(pct(b[0], 0.99) for b in batches),
               "rule_us_p50": statistics.median(pct(b[1], 0.5) for b in batches),
               "rule_us_p99": statistics.median(pct(b[1], 0.99) for b in batches),
               "per_engine": batches[-1][2]}
        rows.append(row)
    base = rows[0]["submit_us_p50"]
    print(f"{'engines':>7} {'submit p50 us':>14} {'submit p99 us':>14} {'rule p50 us':>12} {'rule p99 us':>12} "
          f"{'added p50 us':>13}  requests per engine")
    for r in rows:
        r["added_us_p50"] = r["submit_us_p50"] - base
        print(f"{r['engines']:>7} {r['submit_us_p50']:>14.1f} {r['submit_us_p99']:>14.1f} {r['rule_us_p50']:>12.1f} "
              f"{r['rule_us_p99']:>12.1f} {r['added_us_p50']:>13.1f}  {r['per_engine']}")
    record = {"bench": "dp_routing", "cpu": cpu_name(), "requests": a.requests, "repeats": a.repeats,
              "prompt_tokens": len(PROMPT), "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "rows": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {a.out}")
    tmp.rmdir()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
