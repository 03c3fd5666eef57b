"""Liveness on one clock: the frontend watches the engine's beat counter on its own monotonic clock and
never compares the engine's clock with its own, so a wall-clock step cannot kill a live engine or hide a
hung one."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from dpu_gateway.ringwatch import RingWatch
from shared import ring_layout as L
from shared.ring import Liveness, Ring, RingGeometry, create_shm_ring, local_ring

GEO = RingGeometry(4, 16, 16, 1)
HOUR_NS = 3600 * 10**9


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def serving(ring: Ring, stamp_ns: int) -> None:
    """READY, with the engine's own clock reading ``stamp_ns`` at its latest beat."""
    ring.header_store32("engine_state", L.EngineState.READY)
    ring.header_store64("heartbeat_ns", stamp_ns)


def beat(ring: Ring, stamp_ns: int) -> None:
    ring.header_store64("heartbeat_ns", stamp_ns)
    ring.transport.fetch_add64(L.FIELD_OFFSETS["RingHeader"]["heartbeat"], 1)


def test_silence_is_measured_on_the_observers_clock_from_the_last_change() -> None:
    clock = FakeClock()
    live = Liveness(clock)
    assert live.silent_s(5) == 0.0  # the first look counts as a move
    clock.t += 1.5
    assert live.silent_s(5) == 1.5
    clock.t += 1.0
    assert live.silent_s(6) == 0.0
    clock.t += 0.25
    assert live.silent_s(6) == 0.25


@pytest.mark.parametrize("skew_ns", [-HOUR_NS, HOUR_NS, -(2**62)])
def test_a_beating_engine_is_alive_whatever_its_clock_says(skew_ns: int) -> None:
    """The engine's clock an hour behind, an hour ahead, or nonsense (a GPU timer with a stale offset):
    before, an engine whose ``heartbeat_ns`` was over 2 s from the frontend's wall clock was dead."""
    ring = local_ring(GEO)
    stamp = max(0, time.time_ns() + skew_ns)
    serving(ring, stamp)
    end = time.monotonic() + 0.6
    while time.monotonic() < end:
        beat(ring, stamp)
        assert ring.engine_alive(0.2)
        time.sleep(0.02)


def test_a_hung_engine_is_dead_even_when_its_stamp_looks_fresh() -> None:
    """Counter stopped, ``heartbeat_ns`` a minute in the future (the frontend's wall clock stepped back):
    before, this engine looked alive for that whole minute."""
    ring = local_ring(GEO)
    serving(ring, time.time_ns() + 60 * 10**9)
    beat(ring, time.time_ns() + 60 * 10**9)
    assert ring.engine_alive(0.2)
    time.sleep(0.3)
    assert not ring.engine_alive(0.2)
    beat(ring, 0)
    assert ring.engine_alive(0.2), "beating again is alive again"


def test_not_ready_is_never_alive() -> None:
    ring = local_ring(GEO)
    beat(ring, time.time_ns())
    for state in (L.EngineState.STARTING, L.EngineState.DRAINING, L.EngineState.STOPPED, L.EngineState.FAILED):
        ring.header_store32("engine_state", state)
        assert not ring.engine_alive(10.0)


@pytest.fixture
def beating(ring_name: str) -> Iterator[tuple[Ring, Callable[[], None]]]:
    """A segment whose engine beats every 20 ms, its clock stamp always 0, and the call that stops the beats (it
    returns once the last beat has landed)."""
    ring = create_shm_ring(ring_name, GEO)
    serving(ring, 0)
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(0.02):
            beat(ring, 0)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def halt() -> None:
        stop.set()
        thread.join()

    yield ring, halt
    halt()
    ring.transport.unlink()  # type: ignore[attr-defined]
    ring.close()


def test_the_frontends_watch_follows_the_counter(beating: tuple[Ring, Callable[[], None]], ring_name: str) -> None:
    """What the gateway's /health and the token reader ask: alive once the counter was seen moving and while it
    moves, dead ``timeout`` after it stops."""
    _, stop = beating
    timeout = 2.0  # past any stall of the 20-ms beater thread on a busy host
    watch = RingWatch(ring_name, timeout)
    try:
        end = time.monotonic() + 30
        while not watch.alive():  # the first look alone is not a move (a crashed server's ring: never)
            assert time.monotonic() < end
            time.sleep(0.01)
        end = time.monotonic() + 0.8
        while time.monotonic() < end:
            assert watch.alive()
            time.sleep(0.05)
        stop()
        silent_from = time.monotonic()
        assert watch.alive()  # a beat since the last look is seen now: silence counts from here
        while watch.alive():
            assert time.monotonic() - silent_from < 30, "a stopped counter never read as dead"
            time.sleep(0.05)
        assert time.monotonic() - silent_from >= timeout  # dead only once the whole timeout was silent
    finally:
        watch.close()


def test_a_one_shot_probe_waits_for_a_beat(beating: tuple[Ring, Callable[[], None]], ring_name: str) -> None:
    from shared.ring import attach_shm_ring

    _, stop = beating
    probe = attach_shm_ring(ring_name)
    try:
        assert probe.wait_for_beat(10.0)  # returns at the first move (every 20 ms): the bound is for a busy host
        stop()  # the beat under way, if any, has landed
        t0 = time.monotonic()
        assert not probe.wait_for_beat(0.2)
        assert time.monotonic() - t0 >= 0.2
    finally:
        probe.close()


async def test_the_gateways_beat_sampler_outlives_a_failed_look() -> None:
    """RingSet.follow_beats keeps looking after one look raises (a ring being replaced, no descriptor left):
    a sampler that died would leave /health calling a hung engine alive for one more timeout."""
    import asyncio

    from dpu_gateway.engines import RingSet

    rings = RingSet(f"blink-no-such-ring-{os.getpid()}", 1, 0.08)
    looks: list[int] = []

    def alive() -> bool:
        looks.append(1)
        if len(looks) == 1:
            raise OSError(24, "Too many open files")
        return False

    rings.watches[0].alive = alive  # type: ignore[method-assign]
    task = asyncio.create_task(rings.follow_beats())
    deadline = time.monotonic() + 60  # looks every 10 ms (an eighth of 80 ms); a busy host only slows them
    while len(looks) < 4:
        assert not task.done() and time.monotonic() < deadline, looks
        await asyncio.sleep(0.01)
    task.cancel()


def test_an_observer_frozen_with_the_engine_does_not_take_the_freeze_for_silence() -> None:
    """The observer and the engine stopped together (``docker pause``, a suspended VM): at the observer's first
    look after 30 s, at most ``MAX_LOOK_GAP_S`` of that gap counts, so a live engine is not declared hung;
    looked at steadily, a counter that does not move still adds up to the timeout."""
    from shared.ring import MAX_LOOK_GAP_S

    clock = FakeClock()
    live = Liveness(clock)
    live.silent_s(5)
    clock.t += 30.0
    assert live.silent_s(5) == pytest.approx(MAX_LOOK_GAP_S)
    for _ in range(20):
        clock.t += 0.5
        live.silent_s(5)
    assert live.silent_s(5) == pytest.approx(MAX_LOOK_GAP_S + 10.0)


class Waits:
    """What ``shared.runwait.RunQueueWait.advance`` says at each call, set by the test (the arithmetic's input;
    the reading of /proc itself is in tests/test_runwait.py)."""

    def __init__(self) -> None:
        self.next: float | None = 0.0
        self.calls = 0

    def __call__(self) -> float | None:
        self.calls += 1
        return self.next


def test_a_silence_spent_waiting_for_a_cpu_is_left_out_and_the_rest_counts() -> None:
    from shared.ring import STARVED_AFTER_S

    clock, waits = FakeClock(), Waits()
    live = Liveness(clock, waits=waits)
    live.silent_s(5)
    clock.t += STARVED_AFTER_S / 2
    assert live.silent_s(5) == pytest.approx(STARVED_AFTER_S / 2) and waits.calls == 1  # a beat or two late
    clock.t += STARVED_AFTER_S
    waits.next = 5.0  # mostly from before this silence: no more than the silence is left out
    assert live.silent_s(5) == 0.0 and waits.calls == 2  # the first look primed it
    assert live.starved_s == pytest.approx(1.5 * STARVED_AFTER_S)
    for _ in range(10):  # 1 s each, of which the engine's beat thread waited 0.9 s for a CPU
        clock.t += 1.0
        waits.next = 0.9
        live.silent_s(5)
    assert live.silent_s(5) == pytest.approx(1.0, abs=1e-9)
    assert live.starved_s == pytest.approx(1.5 * STARVED_AFTER_S + 9.0)
    clock.t += 0.1
    assert live.silent_s(6) == 0.0 and live.starved_s == 0.0  # it beat: a new silence starts from nothing


def test_a_stopped_or_unreadable_engine_is_silent_whole_and_starvation_is_left_out_only_so_far() -> None:
    from shared.ring import MAX_STARVED_S

    clock, waits = FakeClock(), Waits()
    live = Liveness(clock, waits=waits)
    live.silent_s(5)
    for _ in range(20):  # stopped: it waits for no CPU
        clock.t += 0.5
        live.silent_s(5)
    assert live.silent_s(5) == pytest.approx(10.0)
    waits.next = None  # its threads cannot be read (gone, another PID namespace)
    for _ in range(4):
        clock.t += 0.5
        live.silent_s(5)
    assert live.silent_s(5) == pytest.approx(12.0)
    live, waits.next = Liveness(clock, waits=waits), 1.0  # an engine that waits for ever: a spinning hang
    live.silent_s(7)
    for _ in range(200):
        clock.t += 1.0
        live.silent_s(7)
    assert live.starved_s == pytest.approx(MAX_STARVED_S)
    assert live.silent_s(7) == pytest.approx(200.0 - MAX_STARVED_S)
    clock.t += 1.0
    assert live.silent_s(8) == 0.0 and live.starved_s == 0.0  # it beat again: a new silence, a new allowance
