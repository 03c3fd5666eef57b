"""Replacing the token reader loses no stream and repeats no token.

A stopping reader leaves its streams alone (no ``Failed``, no slot cancelled); the next one re-attaches
each stream its gateway names in its hello, from the slot in the ring, at the first token the gateway
lacks; the gateway drops by position whatever it already has. In-process, on real shared-memory
rings; the last test runs two readers and a gateway backend over real sockets. The whole-system
version (separate processes, under load, with a reader of the previous schema minor) is
``tests/test_rolling_upgrade.py``.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import numpy as np

from dpu_gateway.backend import READER_GONE, Backend, RequestStream
from dpu_gateway.reader import NOT_IN_RING, ReaderConfig, TokenReader, clear_own_marker, run_reader
from shared import ipc
from shared import messages as m
from shared import ring_layout as L
from shared.data_parallel import engine_ring_names
from shared.engine_slots import SlotEngine
from shared.ring import RingGeometry, create_shm_ring
from shared.slots import SlotRequest, SlotWriter
from shared.transport import ShmTransport

GEO = RingGeometry(8, 16, 16, 2)
GATEWAY = 7
OUTPUT = np.arange(100, 110, dtype=np.int32)  # the ten tokens the "engine" generates
PLAIN = m.Sampling(10)


class Gateway:
    """Stands in for a gateway's link: records what the reader sends."""

    def __init__(self) -> None:
        self.sent: list = []
        self.info: dict = {}
        self.closed = False

    def send(self, msg: object) -> None:
        assert not self.closed, "sent after the link was closed"
        self.sent.append(msg)

    async def aclose(self) -> None:
        self.closed = True

    def of(self, kind: type) -> list:
        return [x for x in self.sent if isinstance(x, kind)]


def serving_ring(name: str):
    ring = create_shm_ring(name, GEO)
    ring.header_store32("engine_state", L.EngineState.READY)
    ring.header_store64("heartbeat_ns", time.time_ns())
    return ring


def publish(ring, req_id: int, sampling: m.Sampling = PLAIN, engine: int = 0) -> m.Track:
    """Publish a request as the tracker does, and claim it as the engine does; its ``Track``."""
    idx = req_id % GEO.num_slots
    writer = SlotWriter(ring)
    seq = writer.try_reserve(idx, 0)
    assert seq is not None
    writer.publish(idx, seq, SlotRequest(req_id, np.array([1, 2, 3], "int32"), sampling))
    assert SlotEngine(ring).claim(idx, seq) is not None
    return m.Track(req_id, GATEWAY, idx, seq, sampling.logprobs, sampling.top_logprobs, engine)


def generate(ring, track: m.Track, start: int, stop: int, finish: bool = False) -> None:
    eng = SlotEngine(ring)
    eng.publish(track.slot, start, OUTPUT[start:stop], np.full(stop - start, -0.5, np.float32))
    if finish:
        eng.complete(track.slot, L.FinishReason.LENGTH)


def reader_for(tmp_path: Path, ring_name: str, size: int = 1) -> tuple[TokenReader, Gateway]:
    reader = TokenReader(ReaderConfig(tmp_path, ring_name, heartbeat_timeout_s=5.0, data_parallel_size=size))
    reader.check_health()
    return reader, Gateway()


def ids_sent(gateway: Gateway, req_id: int, start: int = 0) -> list[int]:
    """The token ids sent from position ``start`` on, each checked to be where ``at`` says."""
    out: list[int] = []
    for tok in (t for t in gateway.of(m.Tokens) if t.req_id == req_id):
        assert tok.at == start + len(out), (tok.at, start + len(out))  # no gap, no token twice
        out += tok.ids
    return out


def test_a_stopping_reader_fails_nothing_and_the_next_resumes_from_the_ring(ring_name: str, tmp_path: Path) -> None:
    ring = serving_ring(ring_name)
    old, gw_old = reader_for(tmp_path, ring_name)
    old.hello(gw_old, m.GatewayHello(GATEWAY))  # type: ignore[arg-type]
    track = publish(ring, 1)
    old.track([track])
    generate(ring, track, 0, 4)
    old.cycle()
    asyncio.run(old.hand_over())
    assert gw_old.closed and not gw_old.of(m.Failed) and not gw_old.of(m.Finished)
    slot = ring.read_slots()[track.slot]
    assert int(slot["cancel"]) == 0 and int(slot["state"]) == L.SlotState.PREFILL_PROCESSING  # untouched
    generate(ring, track, 4, 10, finish=True)  # the engine goes on while no reader runs

    new, gw_new = reader_for(tmp_path, ring_name)
    new.hello(gw_new, m.GatewayHello(GATEWAY, [m.Resume(1, len(ids_sent(gw_old, 1)))]))  # type: ignore[arg-type]
    new.track([track])  # the tracker re-sends its Track: the re-attached route keeps its place
    new.cycle()
    assert ids_sent(gw_old, 1) + ids_sent(gw_new, 1, start=4) == OUTPUT.tolist()
    first = gw_new.of(m.Tokens)[0]
    assert first.at == 4 and first.ids == OUTPUT[4:].tolist()
    (fin,) = gw_new.of(m.Finished)
    assert fin.generated == 10 and fin.reason == L.FinishReason.LENGTH
    assert int(ring.read_slots()[track.slot]["state"]) == L.SlotState.EMPTY  # released once, by the new one
    new.close()
    ring.close()


def test_a_track_before_the_hello_waits_for_the_gateways_count(ring_name: str, tmp_path: Path) -> None:
    ring = serving_ring(ring_name)
    track = publish(ring, 2)
    generate(ring, track, 0, 6)
    reader, gw = reader_for(tmp_path, ring_name)
    reader.track([track])  # the tracker linked first
    reader.cycle()  # the gateway has not said hello: nothing goes out, nothing is counted as sent
    reader.hello(gw, m.GatewayHello(GATEWAY, [m.Resume(2, 5)]))  # type: ignore[arg-type]
    reader.cycle()
    (tok,) = gw.of(m.Tokens)
    assert (tok.at, tok.ids) == (5, OUTPUT[5:6].tolist())
    reader.close()
    ring.close()


def test_a_stream_in_no_ring_is_failed_at_once(ring_name: str, tmp_path: Path) -> None:
    ring = serving_ring(ring_name)
    reader, gw = reader_for(tmp_path, ring_name)
    reader.hello(gw, m.GatewayHello(GATEWAY, [m.Resume(3, 2)]))  # type: ignore[arg-type]
    assert [(f.req_id, f.status, f.message) for f in gw.of(m.Failed)] == [(3, 503, NOT_IN_RING)]
    assert not reader.busy
    reader.close()
    ring.close()


def test_a_released_slot_re_sent_by_the_tracker_is_dropped(ring_name: str, tmp_path: Path) -> None:
    """The old reader finished and released it; a stale live entry of the tracker must not linger."""
    ring = serving_ring(ring_name)
    track = publish(ring, 4)
    generate(ring, track, 0, 10, finish=True)
    assert SlotWriter(ring).release(track.slot, track.seq)
    reader, gw = reader_for(tmp_path, ring_name)
    reader.hello(gw, m.GatewayHello(GATEWAY))  # type: ignore[arg-type]
    reader.track([track])
    reader.cycle()
    assert not reader.busy and gw.sent == []
    reader.close()
    ring.close()


def test_resume_finds_the_stream_in_its_engines_ring_with_its_logprob_fields(ring_name: str, tmp_path: Path) -> None:
    rings = [serving_ring(name) for name in engine_ring_names(ring_name, 2)]
    try:
        track = publish(rings[1], 5, m.Sampling(10, logprobs=True, top_logprobs=2), engine=1)
        generate(rings[1], track, 0, 3, finish=True)
        reader, gw = reader_for(tmp_path, ring_name, size=2)
        reader.hello(gw, m.GatewayHello(GATEWAY, [m.Resume(5, 1)]))  # type: ignore[arg-type]
        route = reader.engines[1].routes[track.slot]
        assert route.track == track and route.sent == 1 and not reader.engines[0].routes
        reader.cycle()
        (tok,) = gw.of(m.Tokens)
        assert (tok.at, tok.ids, tok.logprobs) == (1, OUTPUT[1:3].tolist(), [-0.5, -0.5])
        assert tok.top is not None and len(tok.top) == 2
        assert len(gw.of(m.Finished)) == 1
        reader.close()
    finally:
        for ring in rings:
            ring.close()
        for name in engine_ring_names(ring_name, 2):
            ShmTransport.unlink_name(name)


def test_a_stopping_reader_leaves_a_newer_readers_ready_marker(tmp_path: Path) -> None:
    ipc.ready_path(tmp_path, "reader").write_text(f"{os.getpid() + 1}\n")
    clear_own_marker(tmp_path)
    assert ipc.ready_path(tmp_path, "reader").exists()
    ipc.mark_ready(tmp_path, "reader")
    clear_own_marker(tmp_path)
    assert not ipc.ready_path(tmp_path, "reader").exists()


# ---------------------------------------------------------------------- the gateway's side
async def test_the_gateway_keeps_each_token_once_by_position() -> None:
    stream = RequestStream(1)
    assert stream.fresh(m.Tokens(1, [10, 11], at=0)) == m.Tokens(1, [10, 11], at=0)
    assert stream.fresh(m.Tokens(1, [10, 11, 12], [0.1, 0.2, 0.3], at=0)) == m.Tokens(1, [12], [0.3], at=2)
    assert stream.fresh(m.Tokens(1, [11, 12], at=1)) is None
    stream.link_pos = 0  # a new link to a reader of an earlier build: it sends without ``at``, from 0
    assert stream.fresh(m.Tokens(1, [10, 11, 12, 13])) == m.Tokens(1, [13], at=3)
    assert stream.fresh(m.Tokens(1, [14])) == m.Tokens(1, [14])  # new: passed as it came
    gap = stream.fresh(m.Tokens(1, [20], at=9))
    assert isinstance(gap, m.Failed) and gap.status == 500
    assert stream.received == 5


async def test_streams_wait_for_the_next_reader_then_fail(tmp_path: Path) -> None:
    backend = Backend(tmp_path, gateway_id=GATEWAY, reattach_s=0.05)
    waiting, placed = RequestStream(1), RequestStream(2)
    placed.admitted.set_result(3)
    placed.received = 4
    backend.streams = {1: waiting, 2: placed}
    hello = backend._hello()
    assert hello == m.GatewayHello(GATEWAY, [m.Resume(2, 4)])  # the one not admitted yet is not named
    backend._reader_down()
    backend._hello()  # a reader linked within the wait: nothing fails
    await asyncio.sleep(0.1)
    assert placed.events.empty() and waiting.events.empty()
    backend._reader_down()
    await asyncio.sleep(0.1)  # none came
    assert [placed.events.get_nowait().message, waiting.events.get_nowait().message] == [READER_GONE] * 2


# ---------------------------------------------------------------------- over real sockets
async def collect(stream: RequestStream) -> list[int]:
    ids: list[int] = []
    while True:
        msg = await asyncio.wait_for(stream.events.get(), 10)
        if isinstance(msg, m.Finished):
            return ids
        assert isinstance(msg, m.Tokens), msg
        ids += msg.ids


async def engine_steps(ring, track: m.Track, start: int, stop: int, pause_s: float) -> None:
    for pos in range(start, stop):
        generate(ring, track, pos, pos + 1, finish=pos == len(OUTPUT) - 1)
        await asyncio.sleep(pause_s)


async def test_a_new_reader_started_beside_the_old_takes_its_streams(ring_name: str) -> None:
    """The upgrade order of docs/DEPLOY.md: the new reader starts (it takes the socket's name), the old
    one is stopped mid-stream; the gateway's stream gets every token once and the slot is released."""
    run_dir = Path(f"/tmp/blink-ho-{os.getpid()}-{time.monotonic_ns() % 10**6}")
    ring = serving_ring(ring_name)
    cfg = ReaderConfig(run_dir, ring_name, heartbeat_timeout_s=30.0)
    readers = [asyncio.create_task(run_reader(cfg))]
    backend = Backend(run_dir, gateway_id=GATEWAY)
    backend.start()
    try:
        await asyncio.wait_for(backend._linked["reader"].wait(), 10)
        tracker = await ipc.connect(run_dir, "reader", m.FromReader)
        stream = RequestStream(backend.next_id())
        backend.streams[stream.req_id] = stream
        track = publish(ring, stream.req_id)
        stream.admitted.set_result(track.slot)
        tracker.send(m.Track(stream.req_id, GATEWAY, track.slot, track.seq))
        got = asyncio.create_task(collect(stream))
        await engine_steps(ring, track, 0, 5, 0.02)
        readers.append(asyncio.create_task(run_reader(cfg)))
        await asyncio.sleep(0.2)  # the new one listens
        engine = asyncio.create_task(engine_steps(ring, track, 5, len(OUTPUT), 0.02))
        readers[0].cancel()
        await asyncio.gather(readers[0], return_exceptions=True)
        assert await got == OUTPUT.tolist()
        await engine
        deadline = time.monotonic() + 5
        while int(ring.read_slots()[track.slot]["state"]) != L.SlotState.EMPTY:
            assert time.monotonic() < deadline, "the new reader did not release the slot"
            await asyncio.sleep(0.01)
    finally:
        await backend.close()
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        ring.close()


def test_a_track_of_no_gateway_is_stopped_and_released_quietly(ring_name: str, tmp_path: Path) -> None:
    """A slot the tracker hands over after its client was told 503 (a publication cut short that reached the
    engine after all): after the unowned grace the reader cancels it, sends nothing to anyone, and releases it
    once it finishes."""
    ring = serving_ring(ring_name)
    track = publish(ring, 5)
    orphan = m.Track(track.req_id, m.NO_GATEWAY, track.slot, track.seq)
    generate(ring, track, 0, 3)
    reader = TokenReader(ReaderConfig(tmp_path, ring_name, heartbeat_timeout_s=5.0, unowned_grace_s=0.0))
    reader.check_health()
    gw = Gateway()
    reader.hello(gw, m.GatewayHello(GATEWAY))  # type: ignore[arg-type]
    reader.track([orphan])
    reader.cycle()
    assert int(ring.read_slots()[track.slot]["cancel"]) == 1  # the engine is asked to stop it
    generate(ring, track, 3, 4, finish=True)  # the engine stops it
    reader.cycle()
    assert int(ring.read_slots()[track.slot]["state"]) == L.SlotState.EMPTY and gw.sent == []
    assert not reader.busy
    reader.close()
    ring.close()


def test_a_read_serves_moved_slots_and_routes_whose_tokens_came_before_them(ring_name: str, tmp_path: Path) -> None:
    """A read looks only at slots that moved since the last one, and at new routes: a request whose tokens were all
    written before its ``Track`` reached the reader (its slot never moves again) still gets them, and a stream
    whose slot did not move gets nothing twice."""
    ring = serving_ring(ring_name)
    reader, gw = reader_for(tmp_path, ring_name)
    reader.hello(gw, m.GatewayHello(GATEWAY))  # type: ignore[arg-type]
    first, late = publish(ring, 1), publish(ring, 2)
    reader.track([first])
    generate(ring, first, 0, 3)
    generate(ring, late, 0, 5)  # the engine ran ahead of the tracker's Track for request 2
    assert reader.cycle()
    assert reader.cycle() is False  # nothing moved
    reader.track([late])
    assert reader.cycle()  # the new route, whose slot has not moved since the last read
    generate(ring, first, 3, 10, finish=True)
    reader.cycle()
    assert ids_sent(gw, 1) == OUTPUT.tolist() and ids_sent(gw, 2) == OUTPUT[:5].tolist()
    assert [f.req_id for f in gw.of(m.Finished)] == [1]
    reader.close()
    ring.close()


def test_the_streams_of_a_gateway_that_went_are_cancelled_though_their_slots_stand_still(
        ring_name: str, tmp_path: Path) -> None:
    """A gateway's link closes while its request waits in the engine's queue (its slot does not move): once the
    grace for the gateway to come back is over, the next read cancels the slot, so no dead client's request runs."""
    ring = serving_ring(ring_name)
    reader = TokenReader(ReaderConfig(tmp_path, ring_name, heartbeat_timeout_s=5.0, unowned_grace_s=0.0))
    reader.check_health()
    gw = Gateway()
    reader.hello(gw, m.GatewayHello(GATEWAY))  # type: ignore[arg-type]
    track = publish(ring, 3)
    reader.track([track])
    reader.cycle()
    reader.cycle()  # nothing moved: the route is not looked at
    reader.link_closed(gw)  # type: ignore[arg-type]
    reader.cycle()
    assert int(ring.read_slots()[track.slot]["cancel"]) == 1
    assert not gw.of(m.Failed)  # nobody left to tell
    reader.close()
    ring.close()
