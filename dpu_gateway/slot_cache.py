"""The slot tracker's local view of which ring slots are free.

One bulk ``read_slots()`` refreshes the cache; between refreshes a hint-based circular scan
finds the next free slot without touching the ring, and ``try_reserve`` (a CAS on the ring)
settles any race. Slots this process reserved are marked taken at once.
"""

from __future__ import annotations

import numpy as np

from shared import ring_layout as L
from shared.ring import Ring
from shared.slots import SlotWriter

S = L.SlotState


class SlotCache:
    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self.writer = SlotWriter(ring)
        self.snapshot = np.empty(ring.geometry.num_slots, L.SLOT_DTYPE)
        self.free = np.zeros(ring.geometry.num_slots, bool)
        self.hint = 0

    def refresh(self) -> np.ndarray:
        snap = self.ring.read_slots(self.snapshot)
        np.equal(snap["state"], S.EMPTY, out=self.free)
        return snap

    def in_use(self) -> int:
        return int(self.free.size - np.count_nonzero(self.free))

    def _next_free(self) -> int | None:
        after = np.flatnonzero(self.free[self.hint:])
        if after.size:
            return self.hint + int(after[0])
        before = np.flatnonzero(self.free[: self.hint])
        return int(before[0]) if before.size else None

    def reserve(self) -> tuple[int, int] | None:
        """(slot, seq) of a freshly RESERVED slot, or None when the cache sees none free."""
        while True:
            idx = self._next_free()
            if idx is None:
                return None
            self.free[idx] = False
            self.hint = (idx + 1) % self.free.size
            seq = self.writer.try_reserve(idx, int(self.snapshot["seq"][idx]))
            if seq is not None:
                return idx, seq
            # lost a race or the cache was stale for this slot: keep scanning

    def reserve_refreshing(self) -> tuple[int, int] | None:
        """Try the cache first, then one bulk refresh and try again."""
        got = self.reserve()
        if got is None:
            self.refresh()
            got = self.reserve()
        return got
