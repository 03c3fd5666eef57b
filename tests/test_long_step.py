"""A long step is not a dead engine: the CPU engine's heartbeat keeps beating through a step that is
computing (within a bound that grows with the step's tokens) and stops only when a step is stuck."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from gpu_engine.engine import RingEngine
from gpu_engine.kv_cache import BlockAllocator
from gpu_engine.policy import Policy, StepPlan
from gpu_engine.runner import StepOutput
from shared import ring_layout as L
from shared.messages import Sampling
from shared.ring import Ring, RingGeometry, local_ring
from shared.slots import SlotRequest, SlotWriter

GEO = RingGeometry(4, 64, 16, 1)
TOKEN = 7  # what the fake model always says
STALL_S = 0.2  # the engine's stall bound in these tests (the default is 60 s)
BEAT_S = 0.02


class SlowPrefillRunner:
    """A model whose prefill takes ``prefill_s`` (or waits for ``release`` when it is None); decode is instant."""

    def __init__(self, prefill_s: float | None) -> None:
        self.prefill_s = prefill_s
        self.release = threading.Event()
        self.in_prefill = threading.Event()
        self.beats: Callable[[], int] = lambda: 0
        self.beats_during: int | None = None  # how far the heartbeat moved during the last prefill

    def run(self, plan: StepPlan) -> StepOutput:
        if plan.kind == "prefill":
            self.in_prefill.set()
            before = self.beats()
            if self.prefill_s is None:
                self.release.wait()
            else:
                time.sleep(self.prefill_s)
            self.beats_during = self.beats() - before
        b = len(plan.work)
        return StepOutput([TOKEN] * b, np.zeros(b, np.float32), np.zeros((b, 1), np.int32),
                          np.zeros((b, 1), np.float32))


def make_engine(runner: SlowPrefillRunner) -> RingEngine:
    policy = Policy(BlockAllocator(64), 4, 4, 64)
    return RingEngine(local_ring(GEO), runner, policy, (2,), max_context=80, vocab_size=100)


class Served:
    """A RingEngine serving a private ring from a thread, with a frontend-side writer."""

    def __init__(self, runner: SlowPrefillRunner, per_token_s: float) -> None:
        self.engine = make_engine(runner)
        self.ring: Ring = self.engine.ring
        runner.beats = self.beats
        self.writer = SlotWriter(self.ring)
        self.thread = threading.Thread(target=self.engine.serve, daemon=True,
                                       kwargs={"beat_every_s": BEAT_S, "drain_timeout_s": 1.0, "stall_s": STALL_S,
                                               "stall_per_token_s": per_token_s})
        self.thread.start()

    def submit(self, idx: int, prompt_len: int, max_new: int) -> None:
        seq = self.writer.try_reserve(idx, int(self.ring.slots[idx]["seq"]))
        assert seq is not None
        prompt = np.arange(3, 3 + prompt_len, dtype=np.int32)
        self.writer.publish(idx, seq, SlotRequest(idx + 1, prompt, Sampling(max_new, ignore_eos=True)))

    def beats(self) -> int:
        return self.ring.header_load64("heartbeat")

    def moves(self, seconds: float) -> int:
        """How many times the heartbeat counter moved while watched for ``seconds`` (a slow host only makes
        fewer: a stopped heartbeat makes none)."""
        end = time.monotonic() + seconds
        last, moved = self.beats(), 0
        while time.monotonic() < end:
            if (beat := self.beats()) != last:
                last, moved = beat, moved + 1
            time.sleep(0.005)
        return moved

    def stop(self) -> None:
        self.ring.header_store32("shutdown", 1)
        self.thread.join(10)
        assert not self.thread.is_alive()


@pytest.fixture
def served_slowly() -> Iterator[Served]:
    # 16 prompt tokens at 0.1 s each: the prefill may run 0.2 + 1.6 s; it takes 1.2 s, six times STALL_S.
    s = Served(SlowPrefillRunner(prefill_s=1.2), per_token_s=0.1)
    yield s
    s.stop()


def test_a_step_longer_than_the_stall_bound_keeps_the_heartbeat_and_completes(served_slowly: Served) -> None:
    s = served_slowly
    s.submit(0, prompt_len=16, max_new=3)
    runner = s.engine.runner
    assert isinstance(runner, SlowPrefillRunner) and runner.in_prefill.wait(5)
    assert s.moves(1.0) >= 2  # beating during the long prefill (or after it, on a slow host: see below)
    deadline = time.monotonic() + 10
    while s.ring.slots[0]["state"] != L.SlotState.DECODE_COMPLETED and time.monotonic() < deadline:
        time.sleep(0.01)
    slot = s.ring.slots[0]
    assert slot["state"] == L.SlotState.DECODE_COMPLETED
    assert s.ring.output_tokens[0, : int(slot["generated"])].tolist() == [TOKEN] * 3
    assert slot["finish_reason"] == L.FinishReason.LENGTH
    # all through the 1.2 s prefill (a beat each 20 ms; a busy host makes fewer, a stopped heartbeat none)
    assert runner.beats_during is not None and runner.beats_during >= 5, runner.beats_during
    assert s.ring.header_load32("engine_state") == L.EngineState.READY


def test_a_stuck_step_stops_the_heartbeat() -> None:
    # 4 tokens at 0.01 s: a step may run 0.24 s; this one never ends until released.
    runner = SlowPrefillRunner(prefill_s=None)
    s = Served(runner, per_token_s=0.01)
    try:
        s.submit(0, prompt_len=4, max_new=2)
        assert runner.in_prefill.wait(5)
        time.sleep(0.5)  # past the bound
        assert s.moves(0.8) == 0  # no beat at all now
    finally:
        runner.release.set()
    deadline = time.monotonic() + 5
    while s.ring.slots[0]["state"] != L.SlotState.DECODE_COMPLETED and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.moves(1.0) >= 2  # beating again once the step came back
    s.stop()


def test_the_stall_rule() -> None:
    e, now = make_engine(SlowPrefillRunner(prefill_s=0.0)), time.monotonic()
    e._loop_seen = now - 1.0
    assert not e.making_progress(now, stall_s=0.5, per_token_s=0.1)  # the loop stuck outside any step
    assert e.making_progress(now, stall_s=1.5, per_token_s=0.1)
    e._in_step = (now - 1.0, 10)  # a 10-token step running for 1 s: its bound is 0.5 + 10 * 0.1
    assert e.making_progress(now, stall_s=0.5, per_token_s=0.1)
    e._in_step = (now - 2.0, 10)
    assert not e.making_progress(now, stall_s=0.5, per_token_s=0.1)
