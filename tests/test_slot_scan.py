"""The engine's scan for published prompts (``SlotEngine.scan_pending``) through ``pending_flips``,
with writers of both schema minors on one ring: no publication is missed."""

from __future__ import annotations

import numpy as np

from shared import ring_layout as L
from shared.engine_slots import SlotEngine
from shared.messages import Sampling
from shared.ring import HEADER_OFF, RingGeometry, create_shm_ring
from shared.slots import SlotRequest, SlotWriter

GEO = RingGeometry(64, 8, 8, 1)


def publish(w: SlotWriter, idx: int, rid: int, doorbell: bool = True) -> None:
    seq = w.try_reserve(idx, int(w.ring.slots["seq"][idx]))
    assert seq is not None
    w.publish(idx, seq, SlotRequest(rid, np.array([5, 6], np.int32), Sampling(2)), doorbell=doorbell)


def claim_all(eng: SlotEngine) -> list[int]:
    found = [idx for idx, seq in eng.scan_pending() if eng.claim(idx, seq) is not None]
    return sorted(found)


def test_a_writer_without_flips_is_served_beside_one_with_them(ring_name: str) -> None:
    ring = create_shm_ring(ring_name, GEO)
    eng = SlotEngine(ring)
    new, old = SlotWriter(ring), SlotWriter(ring)
    old.flips = False  # as a frontend of schema minor 0 writes
    assert new.flips and ring.flips_cover_slots()
    assert claim_all(eng) == []
    publish(new, 1, 1)
    assert claim_all(eng) == [1]  # the first scan reads every slot
    publish(new, 2, 2)
    assert claim_all(eng) == [2]  # through the flips
    publish(old, 3, 3)
    publish(new, 4, 4)
    assert claim_all(eng) == [3, 4]  # one flip for two rings: every slot is read
    publish(old, 5, 5)
    assert claim_all(eng) == [5]
    publish(new, 6, 6)
    assert claim_all(eng) == [6]
    assert claim_all(eng) == []
    ring.close()


def test_a_flip_seen_before_its_ring_does_not_hide_a_writer_without_flips(ring_name: str) -> None:
    ring = create_shm_ring(ring_name, GEO)
    eng = SlotEngine(ring)
    new, old = SlotWriter(ring), SlotWriter(ring)
    old.flips = False
    publish(new, 0, 1)
    assert claim_all(eng) == [0]
    # Slot 7 is published as far as its flip; its doorbell increment has not landed yet.
    seq = new.try_reserve(7, int(ring.slots["seq"][7]))
    assert seq is not None
    t, bell = ring.transport, HEADER_OFF["doorbell"]
    new.flips = False
    new.publish(7, seq, SlotRequest(7, np.array([5], np.int32), Sampling(1)))
    t.store64(bell, t.load64(bell) - 1)
    t.fetch_xor64(HEADER_OFF["pending_flips"], 1 << 7)
    publish(old, 9, 9)
    # One flip, one ring: slot 7 is found through its flip, slot 9 not yet.
    assert claim_all(eng) == [7]
    t.fetch_add64(bell, 1)  # slot 7's ring lands
    assert claim_all(eng) == [9]  # no flip for that ring: every slot is read
    ring.close()


def test_publications_that_ring_once_after_the_last_are_found_at_one_look(ring_name: str) -> None:
    """A writer publishing several slots at once adds their count to the doorbell after the last of them (the
    test harness's burst): the engine looks only then, finds them all through their flips, and the count of
    flips against rings still catches a writer without flips afterwards."""
    ring = create_shm_ring(ring_name, GEO)
    eng = SlotEngine(ring)
    new, old = SlotWriter(ring), SlotWriter(ring)
    old.flips = False
    publish(new, 0, 1)
    assert claim_all(eng) == [0]  # the first scan reads every slot
    for idx in (3, 4, 5):
        publish(new, idx, idx, doorbell=False)
    assert int(ring.header["doorbell"][0]) == 1 and claim_all(eng) == []  # not rung yet: not looked for
    new.ring_doorbell(3)
    assert int(ring.header["doorbell"][0]) == 4
    full_reads: list[int] = []
    read_slots = ring.read_slots

    def counted(out: np.ndarray | None = None) -> np.ndarray:  # the engine's read of every slot
        full_reads.append(1)
        return read_slots(out)

    ring.read_slots = counted  # type: ignore[method-assign]
    assert claim_all(eng) == [3, 4, 5] and not full_reads  # three flips for three rings
    publish(old, 6, 6)
    assert claim_all(eng) == [6] and full_reads  # a ring without its flip: every slot is read
    ring.close()


def test_a_ring_of_schema_minor_0_gets_no_flips(ring_name: str) -> None:
    ring = create_shm_ring(ring_name, GEO)
    ring.header["schema_minor"] = 0
    w = SlotWriter(ring)
    assert not w.flips
    publish(w, 3, 3)
    assert not ring.header["pending_flips"].any()
    assert int(ring.header["doorbell"][0]) == 1
    assert (ring.slots["state"][3], claim_all(SlotEngine(ring))) == (L.SlotState.PREFILL_PENDING, [3])
    ring.close()
