"""The token reader's cost per read of a ring (``RingReader.cycle``), on the CPU: a real shared-memory ring of
the GPU defaults' size (320 slots), R running requests routed to one gateway, and three cases: no slot changed
since the last read (most reads while the persistent engine, which wakes no one, runs a step), one request got a
token, and every request got one (a decode step's end).

    python -m bench.reader_cycle [--routes 64,128,256] [--reads 2000] [--out bench/results/reader_cycle.json]

With the persistent engine the reader polls (50 us apart while tokens flow, backing off to 2 ms), so a 30-ms
step costs about 20 reads; what each read costs with nothing new is most of the reader's CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from dpu_gateway.reader import ReaderConfig, TokenReader
from shared import messages as m
from shared import ring_layout as L
from shared.engine_slots import SlotEngine
from shared.ring import RingGeometry, create_shm_ring
from shared.slots import SlotRequest, SlotWriter
from shared.transport import ShmTransport

GEO = RingGeometry(320, 64, 4096, 0, 0)
GATEWAY = 1


class Sink:
    """A gateway's link that keeps the count of frames, as the reader's real links only queue them."""

    def __init__(self) -> None:
        self.frames = 0
        self.info: dict = {}

    def send(self, msg: object) -> None:
        self.frames += 1


def setup(name: str, routes: int, run_dir: Path) -> tuple[Any, TokenReader, SlotEngine, list[m.Track]]:
    ring = create_shm_ring(name, GEO)
    ring.header_store32("engine_state", L.EngineState.READY)
    ring.header_store64("heartbeat_ns", time.time_ns())
    writer, engine = SlotWriter(ring), SlotEngine(ring)
    tracks = []
    for i in range(routes):
        seq = writer.try_reserve(i, 0)
        assert seq is not None
        writer.publish(i, seq, SlotRequest(i + 1, np.arange(1, 9, dtype=np.int32), m.Sampling(4096)))
        assert engine.claim(i, seq) is not None
        tracks.append(m.Track(i + 1, GATEWAY, i, seq, False, 0, 0))
    reader = TokenReader(ReaderConfig(run_dir, name, heartbeat_timeout_s=3600.0))
    reader.check_health()
    reader.hello(Sink(), m.GatewayHello(GATEWAY))  # type: ignore[arg-type]
    reader.track(tracks)
    return ring, reader, engine, tracks


def timed(reads: int, before: Any, reader: TokenReader) -> float:
    """Median microseconds of one ``cycle`` over ``reads`` reads, ``before()`` run untimed before each."""
    times = np.empty(reads)
    for k in range(reads):
        before()
        t0 = time.perf_counter_ns()
        reader.cycle()
        times[k] = time.perf_counter_ns() - t0
    return float(np.median(times)) / 1e3


def measure(routes: int, reads: int) -> dict[str, Any]:
    name = f"blink-bench-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as run_dir:
        ring, reader, engine, tracks = setup(name, routes, Path(run_dir))
        made = [0] * routes
        one_token = np.zeros(1, np.int32)

        def give(which: range) -> None:
            for i in which:
                engine.publish(tracks[i].slot, made[i], one_token)
                made[i] += 1

        try:
            give(range(routes))
            reader.cycle()  # every route has sent its first token
            idle = timed(reads, lambda: None, reader)
            turn = iter(range(reads))  # the one token goes to each route in turn: no slot fills up
            one = timed(reads, lambda: give(range((k := next(turn) % routes), k + 1)), reader)
            every = timed(max(reads // 10, 20), lambda: give(range(routes)), reader)
        finally:
            reader.close()
            ring.close()
            ShmTransport.unlink_name(name)
    return {"routes": routes, "slots": GEO.num_slots, "idle_us": idle, "one_token_us": one, "all_tokens_us": every}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.reader_cycle", description=__doc__.split("\n\n")[0])
    ap.add_argument("--routes", default="64,128,256")
    ap.add_argument("--reads", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=Path("bench/results/reader_cycle.json"))
    args = ap.parse_args(argv)
    rows = [measure(int(r), args.reads) for r in args.routes.split(",")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"reader cycle, median us ({platform.processor() or platform.machine()}, commit {commit})")
    print("| routes | nothing new | one token | every route a token |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['routes']} | {r['idle_us']:.1f} | {r['one_token_us']:.1f} | {r['all_tokens_us']:.1f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"commit": commit, "machine": platform.machine(), "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
