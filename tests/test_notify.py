"""The wake-ups beside a shared-memory ring (shared/notify.py): the engine wakes the token reader after a
step that published, the tracker wakes an idle engine after it publishes a slot; without them each side
polls as before."""

from __future__ import annotations

import asyncio
import os
import select
import time
from pathlib import Path

import numpy as np

from dpu_gateway.reader import ReaderConfig, TokenReader
from dpu_gateway.tracker import Lane
from gpu_engine.engine import RingEngine
from gpu_engine.kv_cache import BlockAllocator
from gpu_engine.policy import Policy, StepPlan
from gpu_engine.runner import StepOutput
from shared import messages as m
from shared import ring_layout as L
from shared.engine_slots import SlotEngine
from shared.notify import Notifier, look_for, notifier_path
from shared.ring import RingGeometry, create_shm_ring, local_ring
from shared.slots import SlotRequest, SlotWriter
from shared.transport import SHM_DIR, ShmTransport

GEO = RingGeometry(8, 16, 16, 2)


def readable(n: Notifier, timeout_s: float = 0.0) -> bool:
    return bool(select.select([n], [], [], timeout_s)[0])


def test_a_notifier_wakes_the_other_end_and_goes_with_its_segment(ring_name: str) -> None:
    ring = create_shm_ring(ring_name, GEO)
    made = Notifier.create(ring.transport, "tokens")
    other = Notifier.open(ring.transport, "tokens")
    assert made is not None and other is not None
    assert Notifier.open(ring.transport, "work") is None  # not made: the other side polls
    assert not readable(other)
    for _ in range(3):
        made.notify()
    assert readable(other)
    other.drain()
    assert not readable(other)
    for _ in range(70_000):  # more than a FIFO holds: a full one already holds a wake-up
        made.notify()
    other.drain()
    assert not readable(other)
    assert other.take()  # the one waiter
    second = Notifier.open(ring.transport, "tokens")
    assert second is not None and not second.take()
    other.close()
    assert second.take()  # the first let go
    second.close()
    other = Notifier.open(ring.transport, "tokens")
    assert other is not None
    path = notifier_path(ring_name, ring.transport.ino, "tokens")
    assert Path(path).exists() and oct(os.stat(path).st_mode & 0o777) == "0o600"
    made.close()
    other.close()
    ring.close()
    ShmTransport.unlink_name(ring_name)
    assert not any(p.name.startswith(ring_name) for p in SHM_DIR.iterdir())


def test_no_notifier_off_shared_memory_nor_on_a_file_that_is_not_a_fifo(ring_name: str) -> None:
    assert Notifier.create(local_ring(GEO).transport, "tokens") is None
    ring = create_shm_ring(ring_name, GEO)
    try:
        path = Path(notifier_path(ring_name, ring.transport.ino, "work"))
        path.write_bytes(b"")
        assert Notifier.open(ring.transport, "work") is None
        path.unlink()
        path.symlink_to("/dev/null")
        assert Notifier.open(ring.transport, "work") is None  # never followed
    finally:
        ring.transport.unlink()
        ring.close()
    assert not any(p.name.startswith(ring_name) for p in SHM_DIR.iterdir())


def test_a_replaced_segment_has_its_own_notifiers(ring_name: str) -> None:
    old = create_shm_ring(ring_name, GEO)
    stale = Notifier.create(old.transport, "tokens")
    old.close()  # a dead engine's: the next replaces the segment
    new = create_shm_ring(ring_name, GEO)
    try:
        assert new.transport.ino != old.transport.ino
        assert not Path(notifier_path(ring_name, old.transport.ino, "tokens")).exists()
        assert Notifier.open(new.transport, "tokens") is None
    finally:
        assert stale is not None
        stale.close()
        new.transport.unlink()
        new.close()


class Runner:
    """One token per step, the prompt's last plus the tokens so far plus one."""

    def run(self, plan: StepPlan) -> StepOutput:
        toks = [w.req.prompt[-1] + 1 + len(w.req.output) for w in plan.work]
        b = len(toks)
        return StepOutput(toks, np.zeros(b, np.float32), np.zeros((b, 1), np.int32), np.zeros((b, 1), np.float32))


def test_the_engine_wakes_the_reader_per_step_and_the_tracker_wakes_the_engine(ring_name: str) -> None:
    ring = create_shm_ring(ring_name, GEO)
    engine = RingEngine(ring, Runner(), Policy(BlockAllocator(64), 4, 4, 64), (2,), max_context=32, vocab_size=100)
    engine.tokens_out = Notifier.create(ring.transport, "tokens")
    engine.work_in = Notifier.create(ring.transport, "work")
    reader_end = Notifier.open(ring.transport, "tokens")
    try:
        assert reader_end is not None
        t0 = time.monotonic()
        engine.wait_for_work(0.05)  # nothing published: the whole timeout
        assert time.monotonic() - t0 >= 0.04
        lane = Lane(0, ring_name, 5.0, lambda _: None)
        ring.header_store32("engine_state", L.EngineState.READY)
        ring.header_store64("heartbeat_ns", time.time_ns())
        cache = lane.slots()
        assert cache is not None
        idx, seq = cache.reserve_refreshing() or (0, 0)
        cache.writer.publish(idx, seq, SlotRequest(9, np.array([5, 6, 7], np.int32), m.Sampling(3, ignore_eos=True)))
        lane.wake_engine()
        t0 = time.monotonic()
        engine.wait_for_work(60.0)  # woken, not after the whole timeout (however slow the host)
        assert time.monotonic() - t0 < 60.0
        assert not readable(reader_end)
        assert engine.step()
        engine.wake_reader()
        assert readable(reader_end)  # the first token
        reader_end.drain()
        engine.wake_reader()
        assert not readable(reader_end)  # once per step that published
        while engine.step():
            engine.wake_reader()
            assert readable(reader_end)
            reader_end.drain()
        out = ring.read_output(idx, 0, 3).tolist()
        assert out == [8, 9, 10] and ring.read_slots()["state"][idx] == L.SlotState.DECODE_COMPLETED
        lane.watch.close()
    finally:
        for n in (engine.tokens_out, engine.work_in, reader_end):
            if n is not None:
                n.close()
        ring.transport.unlink()
        ring.close()


async def _stream_one(ring_name: str, tmp_path: Path, notified: bool) -> tuple[list[int], int]:
    """The ids a reader sends for three tokens published 0.1 s apart, and how many cycles it ran; its
    polling interval is 10 s, so only a wake-up brings them in time."""
    ring = create_shm_ring(ring_name, GEO)
    ring.header_store32("engine_state", L.EngineState.READY)
    ring.header_store64("heartbeat_ns", time.time_ns())
    bell = Notifier.create(ring.transport, "tokens") if notified else None
    reader = TokenReader(ReaderConfig(tmp_path, ring_name, heartbeat_timeout_s=30.0, min_poll_s=10.0,
                                      max_poll_s=10.0, health_every_s=10.0))
    sent: list = []

    class Gateway:
        info: dict = {}

        def send(self, msg: object) -> None:
            sent.append(msg)

    reader.gateways[7] = Gateway()  # type: ignore[assignment]
    cycles = 0
    cycle = reader.cycle

    def counted() -> bool:
        nonlocal cycles
        cycles += 1
        return cycle()

    reader.cycle = counted  # type: ignore[method-assign]
    writer, eng = SlotWriter(ring), SlotEngine(ring)
    seq = writer.try_reserve(1, 0)
    assert seq is not None
    writer.publish(1, seq, SlotRequest(4, np.array([1, 2, 3], np.int32), m.Sampling(3)))
    assert eng.claim(1, seq) is not None
    loop = asyncio.create_task(reader.poll_loop())
    try:
        await asyncio.sleep(0.05)
        reader.track([m.Track(4, 7, 1, seq)])
        for i in range(3):
            await asyncio.sleep(0.1)
            eng.publish(1, i, np.array([100 + i], np.int32), np.zeros(1, np.float32))
            if bell is not None:
                bell.notify()
        await asyncio.sleep(0.1)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        reader.close()
        if bell is not None:
            bell.close()
        ring.transport.unlink()
        ring.close()
    return [t for msg in sent if isinstance(msg, m.Tokens) for t in msg.ids], cycles


def test_the_reader_reads_a_notified_ring_at_each_wake_up_only(ring_name: str, tmp_path: Path) -> None:
    ids, cycles = asyncio.run(_stream_one(ring_name, tmp_path, notified=True))
    assert ids == [100, 101, 102]
    assert cycles <= 6  # the Track's, one per token and nothing between them


def test_the_reader_polls_a_ring_without_a_notifier(ring_name: str, tmp_path: Path) -> None:
    ids, _ = asyncio.run(_stream_one(ring_name, tmp_path, notified=False))
    assert ids == []  # polled every 10 s: none read within the test's half second


def test_a_look_is_final_once_the_engine_said_ready(ring_name: str) -> None:
    """`look_for`: before READY a missing notifier may still come (look again); from READY on, one missing
    never will (the persistent scheduler makes none), so the frontend stops looking and polls."""
    ring = create_shm_ring(ring_name, GEO)
    try:
        ring.header_store32("engine_state", L.EngineState.STARTING)
        assert look_for(ring, "work") == (None, False)
        ring.header_store32("engine_state", L.EngineState.READY)
        assert look_for(ring, "work") == (None, True)
        made = Notifier.create(ring.transport, "work")
        found, final = look_for(ring, "work")
        assert made is not None and found is not None and final
        found.close()
        made.close()
    finally:
        ring.close()
        ShmTransport.unlink_name(ring_name)
