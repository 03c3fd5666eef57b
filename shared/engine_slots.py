"""Engine-side slot transitions, for engines written in Python (CPU and host-driven GPU).

The persistent CUDA scheduler performs the same transitions with the same ordering in
``gpu_engine/csrc``; schema/OWNERSHIP.md is the contract for both.
"""

from __future__ import annotations

import time

import numpy as np

from shared import ring_layout as L
from shared.ring import HEADER_OFF, Ring
from shared.slots import split_word, state_word

S = L.SlotState
ENGINE_HELD = (S.PREFILL_PROCESSING, S.DECODE_PROCESSING, S.DECODE_PAUSED)  # the engine's states of a request


class SlotEngine:
    """Claim, publish and complete slots; one engine per ring."""

    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self.t = ring.transport
        n = ring.geometry.num_slots
        self._snapshot = np.empty(n, L.SLOT_DTYPE)
        self._bell = -1  # doorbell value at the last scan
        # The header's pending_flips (schema minor >= 1) name the slots published since the last scan.
        self._flip_words = -(-n // 64) if ring.flips_cover_slots() else 0
        self._flips_seen: np.ndarray | None = None  # at the last scan; None: the next scan reads every slot
        self._credit = 0  # flips seen minus doorbell increments seen, since the last scan of every slot

    def scan_pending(self) -> list[tuple[int, int]]:
        """(slot, seq) of every PREFILL_PENDING slot, oldest submission first (FCFS).

        The slots are read only when the doorbell moved since the last scan (the doorbell is read
        first, so a publication racing with the scan is seen by the next one). On a ring with
        ``pending_flips`` only the slots whose bit flipped since the last scan are read, as the
        persistent scheduler does (schema/OWNERSHIP.md); the first scan, and one that finds fewer flips
        than doorbell increments, reads every slot."""
        bell = self.ring.header_load64("doorbell")
        if bell == self._bell:
            return []
        flipped = self._flipped()
        if flipped is not None:
            # Each publication flips (before its doorbell increment, so no later than it is counted)
            # and rings once. Fewer flips than rings: a writer that does not flip (an older frontend)
            # published, so every slot is read. Flips counted ahead of their rings can only delay that.
            self._credit += flipped.size - (bell - self._bell)
            if self._credit < 0:
                flipped = None
        self._bell = bell
        if flipped is None:
            self._credit = 0
            idx, snap = np.arange(self.ring.geometry.num_slots), self.ring.read_slots(self._snapshot)
        else:
            idx, snap = flipped, np.empty(flipped.size, L.SLOT_DTYPE)
            for k, i in enumerate(flipped):  # each after the flips, so a flipped slot reads PENDING
                self.t.read_into(self.ring.slot_offset(int(i)), snap[k : k + 1])
        pending = snap["state"] == S.PREFILL_PENDING
        idx, meta = idx[pending], snap[pending]
        if idx.size == 0:
            return []
        order = np.lexsort((meta["request_id"], meta["submit_ns"]))
        return [(int(idx[k]), int(meta["seq"][k])) for k in order]

    def _flipped(self) -> np.ndarray | None:
        """Slots whose ``pending_flips`` bit changed since the last call, read before their state words;
        None when every slot must be read (no flips on this ring, or the first call)."""
        if not self._flip_words:
            return None
        now = np.array([self.t.load64(HEADER_OFF["pending_flips"] + 8 * k) for k in range(self._flip_words)],
                       np.uint64)
        seen, self._flips_seen = self._flips_seen, now
        if seen is None:
            return None
        bits = np.unpackbits((now ^ seen).view(np.uint8), bitorder="little")
        return np.flatnonzero(bits[: self.ring.geometry.num_slots])

    def claim(self, idx: int, seq: int) -> np.void | None:
        """PREFILL_PENDING(seq) -> PREFILL_PROCESSING(seq) by CAS; returns the slot's metadata."""
        off = self.ring.slot_offset(idx)
        if self.t.cas64(off, state_word(S.PREFILL_PENDING, seq),
                        state_word(S.PREFILL_PROCESSING, seq)) != state_word(S.PREFILL_PENDING, seq):
            return None
        self.t.store64(self.ring.slot_field(idx, "admit_ns"), time.time_ns())
        meta = np.frombuffer(self.t.read(off, L.SLOT_DTYPE.itemsize), L.SLOT_DTYPE)[0]
        return meta

    def prompt(self, idx: int, length: int) -> np.ndarray:
        out = np.empty(length, np.int32)
        self.t.read_into(self.ring.prompt_offset(idx), out)
        return out

    def cancelled(self, idx: int) -> bool:
        return self.t.load32(self.ring.slot_field(idx, "cancel")) != 0

    def cancel_flags(self) -> np.ndarray:
        """Cancel flags of every slot, one bulk read."""
        return self.ring.read_slots(self._snapshot)["cancel"]

    def publish(self, idx: int, start: int, tokens: np.ndarray, logprobs: np.ndarray | None = None,
                top: np.ndarray | None = None) -> None:
        """Append tokens at position ``start``; then bump ``generated`` (release)."""
        t, ring = self.t, self.ring
        t.write(ring.output_offset(idx, start), np.ascontiguousarray(tokens, np.int32))
        if logprobs is not None:
            t.write(ring.logprob_offset(idx, start), np.ascontiguousarray(logprobs, np.float32))
        if top is not None:
            t.write(ring.top_logprob_offset(idx, start), np.ascontiguousarray(top))
        now = time.time_ns()
        if start == 0:
            t.store64(ring.slot_field(idx, "first_token_ns"), now)
        t.store64(ring.slot_field(idx, "last_token_ns"), now)
        t.fence()
        t.store32(ring.slot_field(idx, "generated"), start + len(tokens))

    def write_prompt_logprobs(self, idx: int, start: int, entries: np.ndarray, top: np.ndarray) -> None:
        """Prompt positions ``start ..`` of the slot's prompt-logprob rows (``PromptLogprob`` entries and
        ``TopLogprob`` rows); published by the release of token 0 (``publish`` at 0), or of the completion when
        that token ended the request, which must follow."""
        self.t.write(self.ring.prompt_logprob_offset(idx, start), np.ascontiguousarray(entries))
        self.t.write(self.ring.prompt_top_logprob_offset(idx, start), np.ascontiguousarray(top))

    def set_state(self, idx: int, state: int) -> None:
        """Engine-owned moves among PREFILL_PROCESSING, DECODE_PROCESSING and DECODE_PAUSED."""
        self.t.store32(self.ring.slot_field(idx, "state"), state)

    def complete(self, idx: int, reason: int, error: int = L.ErrorCode.OK, stop_token: int = -1) -> None:
        """-> DECODE_COMPLETED: reason and error first (with ``STOP_ID``, the stop token id that ended it), the
        state word last."""
        t, ring = self.t, self.ring
        if reason == L.FinishReason.STOP_ID and stop_token >= 0:
            t.store32(ring.slot_field(idx, "stop_token"), stop_token)
        t.store32(ring.slot_field(idx, "finish_reason"), reason)
        t.store32(ring.slot_field(idx, "error_code"), error)
        t.fence()
        t.store32(ring.slot_field(idx, "state"), S.DECODE_COMPLETED)

    def fail_in_flight(self, error: int = L.ErrorCode.ENGINE_FAILURE) -> list[tuple[int, int]]:
        """After the engine failed (nothing else of it writes the ring any more): complete every request the
        ring holds for it with ``ERROR`` and ``error``, those it holds and those pending (claimed first, so a
        frontend's CAS never races); the (slot, seq) of each."""
        snap = self.ring.read_slots()
        failed = []
        for idx in range(self.ring.geometry.num_slots):
            state, seq = int(snap["state"][idx]), int(snap["seq"][idx])
            if state == S.PREFILL_PENDING:
                if self.claim(idx, seq) is None:
                    continue
            elif state not in ENGINE_HELD:
                continue
            self.complete(idx, L.FinishReason.ERROR, error)
            failed.append((idx, seq))
        return failed

    def wait_collected(self, slots: list[tuple[int, int]], timeout_s: float, poll_s: float = 0.01) -> bool:
        """Wait until the frontend has read and released each completed (slot, seq), or ``timeout_s``;
        whether it did."""
        end = time.monotonic() + timeout_s
        left = list(slots)
        while left:
            left = [(i, q) for i, q in left if self.state_of(i) == (S.DECODE_COMPLETED, q)]
            if not left:
                break
            if time.monotonic() >= end:
                return False
            time.sleep(poll_s)
        return True

    def state_of(self, idx: int) -> tuple[int, int]:
        return split_word(self.t.load64(self.ring.slot_offset(idx)))

    def beat(self) -> None:
        self.ring.header_store64("heartbeat_ns", time.time_ns())
        self.t.fetch_add64(L.FIELD_OFFSETS["RingHeader"]["heartbeat"], 1)
