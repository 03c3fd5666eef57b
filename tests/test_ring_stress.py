"""Several submitter processes push 100,000 requests through the slot lifecycle against a
process playing the engine: nothing lost or duplicated, tokens in order, all slots EMPTY. One
submitter publishes as a frontend of schema minor 0 (no ``pending_flips``)."""

from __future__ import annotations

import json
import subprocess
import sys

from shared import ring_layout as L
from shared.ring import HEADER_OFF, RingGeometry, create_shm_ring

SUBMITTERS = 4
PER_SUBMITTER = 25_000


def test_100k_requests_through_the_ring(ring_name: str) -> None:
    ring = create_shm_ring(ring_name, RingGeometry(256, 8, 8, 1))
    peers = [sys.executable, "-m", "tests.ring_stress_peers"]
    engine = subprocess.Popen([*peers, "engine", ring_name])
    subs = [subprocess.Popen([*peers, "submit", ring_name, str(1 + k * PER_SUBMITTER), str(PER_SUBMITTER),
                              *(["minor0"] if k == 0 else [])], stdout=subprocess.PIPE, text=True)
            for k in range(SUBMITTERS)]
    try:
        results = [json.loads(p.communicate(timeout=600)[0]) for p in subs]
        ring.transport.store32(HEADER_OFF["shutdown"], 1)
        assert engine.wait(timeout=30) == 0
    finally:
        for p in [engine, *subs]:
            p.kill()
    for r in results:
        assert r["errors"] == 0, r["messages"]
        assert r["done"] == PER_SUBMITTER
    assert sum(int(r["done"]) for r in results) == SUBMITTERS * PER_SUBMITTER
    assert sum(int(r["cancelled"]) for r in results) > 0
    assert (ring.slots["state"] == L.SlotState.EMPTY).all()
    assert int(ring.header["doorbell"][0]) == SUBMITTERS * PER_SUBMITTER
    ring.close()
