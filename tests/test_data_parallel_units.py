"""The data-parallel frontend without processes: the routing rule, the rings' names and devices, the
tracker over two rings (spread, a stale engine skipped, 503 only when none serves), and the tracker's
slot writer dropped when a ring is replaced under it (``on_detach``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpu_gateway.engines import EngineView, health_body
from dpu_gateway.routing import Load, choose_order
from dpu_gateway.tracker import SlotTracker, TrackerConfig
from shared import messages as m
from shared import ring_layout as L
from shared.data_parallel import engine_devices, engine_ring_names
from shared.ring import Ring, RingGeometry, create_shm_ring
from shared.transport import SHM_DIR, RingError, ShmTransport

GEO = RingGeometry(4, 16, 16, 2)


class Chan:
    """Stands in for a gateway's link: records what the tracker answers."""

    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg: object) -> None:
        self.sent.append(msg)


def serving_ring(name: str) -> Ring:
    ring = create_shm_ring(name, GEO)
    ring.header_store32("engine_state", L.EngineState.READY)
    ring.header_store64("heartbeat_ns", time.time_ns())
    ring.stats_store("kv_blocks_total", 100)
    ring.stats_store("kv_blocks_free", 100)
    return ring


@pytest.fixture
def base(ring_name: str) -> Iterator[str]:
    yield ring_name
    for name in engine_ring_names(ring_name, 2):
        (SHM_DIR / name).unlink(missing_ok=True)


def submit(tracker: SlotTracker, chan: Chan, req_id: int) -> object:
    tracker.submit(chan, m.Submit(req_id, 1, [1, 2, 3], m.Sampling(4)))  # type: ignore[arg-type]
    return chan.sent[-1]


def test_rule_waiting_then_slots_then_kv_then_turn() -> None:
    def load(e: int, waiting: int = 0, in_use: int = 0, free: int = 10) -> Load:
        return Load(e, waiting, in_use, free, 10)

    assert choose_order([load(0, waiting=1), load(1, in_use=5)], -1, 2) == [1, 0]
    assert choose_order([load(0, in_use=2), load(1, in_use=1)], -1, 2) == [1, 0]
    assert choose_order([load(0, free=3), load(1, free=9)], -1, 2) == [1, 0]
    assert choose_order([load(0), load(1), load(2)], 0, 3) == [1, 2, 0]  # equals: the next after the last
    assert choose_order([load(0), load(1), load(2)], 2, 3) == [0, 1, 2]


def test_ring_names_and_devices() -> None:
    assert engine_ring_names("r", 1) == ("r",)
    assert engine_ring_names("r", 3) == ("r-dp0", "r-dp1", "r-dp2")
    assert engine_devices(2, None) == ("0", "1")
    assert engine_devices(2, "5, 7,9") == ("5", "7")
    with pytest.raises(ValueError, match="needs 3 GPUs"):
        engine_devices(3, "0,1")
    with pytest.raises(ValueError, match="--data-parallel-size"):
        engine_ring_names("r", 0)


def test_health_names_the_engine_that_is_down() -> None:
    views = [EngineView(0, False, "no ring", None), EngineView(1, True, "", {})]
    body = health_body(views)
    assert body["status"] == "degraded" and body["serving"] == 1
    assert body["engines"] == [{"engine": 0, "status": "down", "reason": "no ring"}, {"engine": 1, "status": "ok"}]
    assert health_body(views[1:]) == {"status": "ok"}


def test_tracker_spreads_skips_a_stale_engine_and_refuses_only_when_none_serves(base: str, tmp_path: Path) -> None:
    rings = [serving_ring(name) for name in engine_ring_names(base, 2)]
    tracker = SlotTracker(TrackerConfig(tmp_path, base, data_parallel_size=2))
    chan = Chan()
    try:
        assert all(isinstance(submit(tracker, chan, i), m.Admitted) for i in range(4))
        assert tracker.routed == [2, 2]
        assert [live.engine for live in tracker.live.values()] == [0, 1, 0, 1]
        # engine 1 stops beating: its counter, which never moves here, was last seen to move 60 s ago
        watched = tracker.lanes[1].watch.current()
        assert watched is not None
        watched.liveness.moved_at -= 60
        assert all(isinstance(submit(tracker, chan, i), m.Admitted) for i in (4, 5))
        assert tracker.routed == [4, 2]  # engine 0's ring is now full: the next one waits
        tracker.submit(chan, m.Submit(6, 1, [1], m.Sampling(4)))  # type: ignore[arg-type]
        assert len(tracker.waiting) == 1
        rings[0].header_store32("engine_state", L.EngineState.FAILED)
        tracker.admit_waiting()
        assert isinstance(chan.sent[-1], m.Rejected) and chan.sent[-1].status == 503
        rejected = submit(tracker, chan, 7)
        assert isinstance(rejected, m.Rejected) and rejected.status == 503
    finally:
        tracker.close()
        for ring in rings:
            ring.close()


def test_tracker_drops_its_slot_writer_when_the_ring_is_replaced(base: str, tmp_path: Path) -> None:
    name = engine_ring_names(base, 2)[0]
    old, other = (serving_ring(n) for n in engine_ring_names(base, 2))
    other.header_store32("engine_state", L.EngineState.STOPPED)  # only engine 0 serves
    tracker = SlotTracker(TrackerConfig(tmp_path, base, data_parallel_size=2))
    chan = Chan()
    try:
        assert isinstance(submit(tracker, chan, 1), m.Admitted)
        lane = tracker.lanes[0]
        stale = lane.cache
        assert stale is not None and stale.ring is not old
        ShmTransport.unlink_name(name)  # the supervisor retires the dead engine's ring
        new = serving_ring(name)        # and the restarted engine creates a fresh one
        tracker.cancel(1)               # finds the ring replaced: the old writer goes, nothing is written
        assert lane.cache is not stale and 1 not in tracker.live
        with pytest.raises(RingError, match="closed"):
            stale.writer.cancel(0, 1)   # the old mapping is closed: that writer must never be used again
        assert isinstance(submit(tracker, chan, 2), m.Admitted)
        assert int(new.read_slots()["request_id"][chan.sent[-1].slot]) == 2
        assert int(old.read_slots()["cancel"].sum()) == 0  # the old ring was never written after it went
        new.close()
    finally:
        tracker.close()
        old.close()
        other.close()
