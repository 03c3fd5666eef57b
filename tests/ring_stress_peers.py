"""Processes for the ring stress test: a submitter and a stand-in engine.

``python -m tests.ring_stress_peers engine NAME`` plays the engine's side of the state machine
(claims, "generates" numbered tokens, completes, honours cancellation).
``python -m tests.ring_stress_peers submit NAME FIRST COUNT [minor0]`` pushes COUNT requests with ids
FIRST.. through the full lifecycle, checks every token, and prints a JSON summary; with ``minor0`` it
publishes as a frontend of schema minor 0 does, without flipping ``pending_flips``.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from shared import ring_layout as L
from shared.engine_slots import SlotEngine
from shared.messages import Sampling
from shared.ring import HEADER_OFF, attach_shm_ring
from shared.slots import SlotRequest, SlotWriter, split_word

S = L.SlotState
WINDOW = 48


def token(rid: int, j: int) -> int:
    return (rid * 7 + j) % 2_000_000_000


def max_new(rid: int) -> int:
    return 1 + rid % 4


def run_engine(name: str) -> None:
    ring = attach_shm_ring(name)
    eng = SlotEngine(ring)
    active: dict[int, list[int]] = {}  # slot -> [request_id, generated, max_new]
    while True:
        for idx, seq in eng.scan_pending():  # through pending_flips, as the GPU scheduler finds them
            meta = eng.claim(idx, seq)
            if meta is not None:
                active[idx] = [int(meta["request_id"]), 0, int(meta["max_new_tokens"])]
        cancel = eng.cancel_flags() if active else None
        for idx in list(active):
            rid, gen, limit = active[idx]
            if cancel is not None and cancel[idx]:
                eng.complete(idx, L.FinishReason.CANCELLED)
                del active[idx]
                continue
            eng.publish(idx, gen, np.array([token(rid, gen)], np.int32))
            if gen == 0:
                eng.set_state(idx, S.DECODE_PROCESSING)
            active[idx][1] = gen + 1
            if gen + 1 == limit:
                eng.complete(idx, L.FinishReason.LENGTH)
                del active[idx]
        if not active and ring.transport.load32(HEADER_OFF["shutdown"]):
            break
        if not active:
            time.sleep(0)
    ring.close()


class Submitter:
    def __init__(self, name: str, first: int, count: int, flips: bool) -> None:
        self.ring = attach_shm_ring(name)
        self.w = SlotWriter(self.ring)
        self.w.flips = flips
        self.t = self.ring.transport
        self.todo = list(range(first, first + count))[::-1]
        self.inflight: dict[int, tuple[int, int, int]] = {}  # slot -> (rid, seq, tokens seen)
        self.done = self.cancelled = self.errors = 0
        self.hint = first % self.ring.geometry.num_slots
        self.messages: list[str] = []

    def submit_some(self, snap: np.ndarray) -> None:
        n = len(snap)
        free = np.flatnonzero(snap["state"] == S.EMPTY)
        free = np.concatenate([free[free >= self.hint], free[free < self.hint]])
        for idx in free:
            if not self.todo or len(self.inflight) >= WINDOW:
                return
            seq = self.w.try_reserve(int(idx), int(snap["seq"][idx]))
            if seq is None:
                continue  # another submitter won this slot
            rid = self.todo.pop()
            req = SlotRequest(rid, np.array([rid % 1000, 1, 2], np.int32), Sampling(max_new(rid)))
            self.w.publish(int(idx), seq, req)
            if rid % 10 == 0:
                self.w.cancel(int(idx), seq)
            self.inflight[int(idx)] = (rid, seq, 0)
            self.hint = (int(idx) + 1) % n

    def collect(self) -> None:
        for idx, (rid, seq, seen) in list(self.inflight.items()):
            state, cur = split_word(self.t.load64(self.ring.slot_offset(idx)))
            gen = self.t.load32(self.ring.slot_field(idx, "generated"))
            if cur != seq:
                self.fail(f"request {rid}: slot {idx} seq changed to {cur} while in flight")
            if gen > seen:
                got = self.ring.read_output(idx, seen, gen)
                want = [token(rid, j) for j in range(seen, gen)]
                if list(got) != want:
                    self.fail(f"request {rid}: tokens {list(got)} != {want}")
                self.inflight[idx] = (rid, seq, gen)
            if state == S.DECODE_COMPLETED:
                self.finish(idx, rid, seq, gen)

    def finish(self, idx: int, rid: int, seq: int, gen: int) -> None:
        reason = self.t.load32(self.ring.slot_field(idx, "finish_reason"))
        if reason == L.FinishReason.CANCELLED:
            self.cancelled += 1
        elif reason != L.FinishReason.LENGTH or gen != max_new(rid):
            self.fail(f"request {rid}: finished {reason} with {gen} tokens")
        self.done += 1
        if not self.w.release(idx, seq):
            self.fail(f"request {rid}: release of slot {idx} failed")
        del self.inflight[idx]

    def fail(self, msg: str) -> None:
        self.errors += 1
        if len(self.messages) < 10:
            self.messages.append(msg)

    def run(self) -> dict[str, object]:
        snap = np.empty(self.ring.geometry.num_slots, L.SLOT_DTYPE)
        while self.todo or self.inflight:
            self.ring.read_slots(snap)
            self.submit_some(snap)
            self.collect()
        return {"done": self.done, "cancelled": self.cancelled, "errors": self.errors, "messages": self.messages}


if __name__ == "__main__":
    if sys.argv[1] == "engine":
        run_engine(sys.argv[2])
    else:
        print(json.dumps(Submitter(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:] != ["minor0"]).run()))
