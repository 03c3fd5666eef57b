"""A device that hangs or fails to launch is recovered: the engine ends every request the ring holds for
it with ENGINE_FAILURE and exits for a restart, instead of leaving slots in PROCESSING and the service 503.

On the CPU: the fault switch (``BLINK_FAULT``), the bounded poll, the engine's failure path over a real
``RingEngine``, and the persistent mode's host watchdog against a stand-in scheduler. The whole stack
(streams, restart, new requests) is ``tests/test_device_watchdog_stack.py``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

import gpu_engine.serve
from gpu_engine.engine import RingEngine
from gpu_engine.faults import (
    DeviceFailure,
    DeviceHang,
    Fault,
    FaultyRunner,
    LaunchFailure,
    arm,
    parse_faults,
    poll_until,
)
from gpu_engine.gpu import sched_structs as SS
from gpu_engine.gpu.persistent import SchedStats
from gpu_engine.gpu.serve_gpu import watch_scheduler
from gpu_engine.kv_cache import BlockAllocator
from gpu_engine.policy import Policy, StepPlan
from gpu_engine.runner import StepOutput
from gpu_engine.serve import fail_requests
from shared import ring_layout as L
from shared.engine_slots import SlotEngine
from shared.messages import Sampling
from shared.ring import Ring, RingGeometry, local_ring
from shared.slots import SlotRequest, SlotWriter

S, F, E = L.SlotState, L.FinishReason, L.ErrorCode
GEO = RingGeometry(8, 16, 32, 1)


# ---------------------------------------------------------------- the switch


def test_fault_specs_parse_and_bad_ones_are_refused() -> None:
    assert parse_faults("") == ()
    assert parse_faults("hang@200, launch@3") == (Fault("hang", 200), Fault("launch", 3))
    for bad, why in (("hang", "KIND@STEP"), ("hang@x", "KIND@STEP"), ("explode@3", "unknown fault"),
                     ("launch@0", "counts from 1")):
        with pytest.raises(ValueError, match=why):
            parse_faults(bad)


def test_with_a_once_dir_each_fault_fires_in_one_engine_only(tmp_path: Path) -> None:
    faults = parse_faults("launch@5,hang@7")
    assert arm(faults, None) == Fault("launch", 5)
    assert arm(faults, None) == Fault("launch", 5), "without the folder every engine arms the first"
    once = tmp_path / "once"
    assert [arm(faults, once) for _ in range(3)] == [Fault("launch", 5), Fault("hang", 7), None]


def test_the_poll_is_bounded() -> None:
    t0 = time.monotonic()
    with pytest.raises(DeviceHang, match="the decode step was not complete after 0.3 s"):
        poll_until(lambda: False, 0.3, "the decode step")
    assert time.monotonic() - t0 >= 0.3
    ticks = iter(range(1000))
    poll_until(lambda: next(ticks) > 5, 1.0, "quick")  # completes: no error


# ---------------------------------------------------------------- the Python engines

TOKEN = 7


class EchoRunner:
    def run(self, plan: StepPlan) -> StepOutput:
        b = len(plan.work)
        return StepOutput([TOKEN] * b, np.zeros(b, np.float32), np.zeros((b, 1), np.int32),
                          np.zeros((b, 1), np.float32))


def engine_with(fault: Fault, timeout_s: float = 0.3) -> RingEngine:
    policy = Policy(BlockAllocator(64), 4, 2, token_budget=64)
    runner = FaultyRunner(EchoRunner(), fault, timeout_s)
    return RingEngine(local_ring(GEO), runner, policy, (2,), max_context=48, vocab_size=100)


def submit(ring: Ring, n: int) -> list[tuple[int, int]]:
    writer, out = SlotWriter(ring), []
    for idx in range(n):
        seq = writer.try_reserve(idx, int(ring.slots[idx]["seq"]))
        assert seq is not None
        writer.publish(idx, seq, SlotRequest(idx + 1, np.array([3, 4, 5], np.int32), Sampling(20, ignore_eos=True)))
        out.append((idx, seq))
    return out


def outcome(ring: Ring, idx: int) -> tuple[int, int, int]:
    s = ring.slots[idx]
    return int(s["state"]), int(s["finish_reason"]), int(s["error_code"])


@pytest.mark.parametrize(("fault", "error"), [(Fault("launch", 4), LaunchFailure), (Fault("hang", 4), DeviceHang)])
def test_a_failed_step_fails_every_request_with_engine_failure(fault: Fault, error: type) -> None:
    """3 requests of a 2-row batch (one waits in the queue): at step 4 the launch fails or the step hangs.
    Before, the serving loop died and left the slots in PREFILL/DECODE_PROCESSING with no finish reason."""
    engine = engine_with(fault)
    ring = engine.ring
    submit(ring, 3)
    t0 = time.monotonic()
    with pytest.raises(error):
        engine.serve(beat_every_s=0.01)
    took = time.monotonic() - t0
    assert fault.kind != "hang" or took >= 0.3  # a hang is declared after the poll's bound, not before
    assert {int(ring.slots[i]["state"]) for i in range(3)} <= {S.PREFILL_PROCESSING, S.DECODE_PROCESSING}
    assert int(ring.slots[0]["generated"]) > 0, "the fault struck mid-stream"
    fail_requests(ring, error("x"))
    assert [outcome(ring, i) for i in range(3)] == [(S.DECODE_COMPLETED, F.ERROR, E.ENGINE_FAILURE)] * 3
    assert [outcome(ring, i)[0] for i in range(3, GEO.num_slots)] == [S.EMPTY] * (GEO.num_slots - 3)
    assert ring.header_load32("engine_state") == L.EngineState.FAILED


def test_pending_requests_are_failed_too_and_the_frontend_gets_time_to_read_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_engine.serve, "COLLECT_S", 60.0)  # longer than any host takes to read two slots
    ring = local_ring(GEO)
    ring.header_store32("engine_state", L.EngineState.READY)
    published = submit(ring, 2)
    slots = SlotEngine(ring)
    assert slots.claim(*published[0]) is not None
    slots.set_state(0, S.DECODE_PAUSED)
    writer, released = SlotWriter(ring), []

    def reader() -> None:  # what the token reader does with a completed slot
        while len(released) < 2:
            for idx, seq in published:
                if (idx, seq) not in released and int(ring.slots[idx]["state"]) == S.DECODE_COMPLETED:
                    assert int(ring.slots[idx]["error_code"]) == E.ENGINE_FAILURE
                    writer.release(idx, seq)
                    released.append((idx, seq))
            time.sleep(0.005)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    t0 = time.monotonic()
    fail_requests(ring, LaunchFailure("x"))
    assert time.monotonic() - t0 < 60.0, "returns once the frontend read them, not after COLLECT_S"
    thread.join(2)
    assert sorted(released) == published
    assert ring.header_load32("engine_state") == L.EngineState.FAILED


# ---------------------------------------------------------------- the persistent mode's host watchdog


class StandIn:
    """What ``watch_scheduler`` reads of the persistent scheduler, driven by the test."""

    def __init__(self) -> None:
        self.stats = SchedStats()
        self.query_result = 0
        self.queries = self.waits = 0

    def exited(self) -> bool:
        return bool(self.stats.exited)

    def query(self) -> int:
        self.queries += 1
        return self.query_result

    def last_error(self) -> str:
        return "an illegal memory access was encountered"

    def wait(self) -> None:
        self.waits += 1

    def exit(self, reason: int, error: int = 0) -> None:
        self.stats.exit_reason, self.stats.error, self.stats.exited = reason, error, 1


def beating(ring: Ring, stop: threading.Event) -> threading.Thread:
    """The device's beat: the counter moves every 5 ms; its clock stamp is nonsense (a stale offset)."""

    def run() -> None:
        while not stop.wait(0.005):
            ring.header_store64("heartbeat_ns", 1)
            ring.transport.fetch_add64(L.FIELD_OFFSETS["RingHeader"]["heartbeat"], 1)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


FAILURE_EXITS = [(SS.EXIT_STEP_TIMEOUT, DeviceHang), (SS.EXIT_LAUNCH_FAILED, LaunchFailure),
                 (SS.EXIT_TAIL_LAUNCH_FAILED, LaunchFailure), (SS.EXIT_STATE_OVERWRITTEN, DeviceFailure)]


@pytest.mark.parametrize(("reason", "error"), FAILURE_EXITS)
def test_a_failure_exit_of_the_scheduler_raises_without_a_cuda_wait(reason: int, error: type) -> None:
    """Before, the host waited on the kernel's stream after any exit (it may hold a hung graph) and the
    engine stopped as if shut down."""
    sched, ring = StandIn(), local_ring(GEO)
    threading.Timer(0.1, sched.exit, (reason, 719 if error is LaunchFailure else 0)).start()
    with pytest.raises(error, match=f"exit reason {reason}"):  # long bounds: a late timer is no hang
        watch_scheduler(sched, ring, step_timeout_s=30, stall_s=30)
    assert sched.waits == 0


def test_a_clean_exit_waits_for_the_kernel() -> None:
    sched, ring = StandIn(), local_ring(GEO)
    threading.Timer(0.1, sched.exit, (SS.EXIT_SHUTDOWN,)).start()
    watch_scheduler(sched, ring, step_timeout_s=30, stall_s=30)
    assert sched.waits == 1


def test_a_beating_device_is_never_taken_for_hung_whatever_its_clock() -> None:
    sched, ring, stop = StandIn(), local_ring(GEO), threading.Event()
    thread = beating(ring, stop)
    threading.Timer(0.8, sched.exit, (SS.EXIT_SHUTDOWN,)).start()
    # the stamp is decades old: read as the device's time it is a stall of any length; the beat's 5 ms moves
    # leave 5 s for a busy host to run the beating thread
    watch_scheduler(sched, ring, step_timeout_s=5, stall_s=5)
    stop.set()
    thread.join()
    assert sched.queries == 0, "no CUDA call while the device beats"


def test_a_device_silent_past_the_step_timeout_is_a_hang() -> None:
    """Hung where its own bounded poll cannot see it (say, yielded to a graph that never completes): before,
    the host logged a warning every 5 s, forever."""
    sched, ring = StandIn(), local_ring(GEO)
    t0 = time.monotonic()
    with pytest.raises(DeviceHang, match="no progress"):
        watch_scheduler(sched, ring, step_timeout_s=0.2, stall_s=0.2)
    assert time.monotonic() - t0 >= 0.6  # not before stall + twice the step timeout (a slow host only adds)
    assert sched.queries >= 1


def test_a_kernel_that_stopped_without_exiting_is_a_failure() -> None:
    sched, ring = StandIn(), local_ring(GEO)
    sched.query_result = 700  # cudaErrorIllegalAddress
    with pytest.raises(DeviceFailure, match="stopped without exiting .query 700.: an illegal memory access"):
        watch_scheduler(sched, ring, step_timeout_s=5.0, stall_s=0.1)
