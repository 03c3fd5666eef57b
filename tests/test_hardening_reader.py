"""A ring that goes away under the token reader: its requests end with the engine's error, nothing
touches the closed mapping, and the reader keeps serving the next ring.

The whole-stack version (a real CPU engine killed with streams in flight) is
``tests/test_hardening_engine_kill.py``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dpu_gateway.reader import RESTARTED, ReaderConfig, Route, TokenReader
from shared import messages as m
from shared import ring_layout as L
from shared.ring import RingGeometry, attach_shm_ring, create_shm_ring
from shared.slots import SlotRequest, SlotWriter
from shared.transport import RingError, ShmTransport

GEO = RingGeometry(8, 16, 16, 2)


class Gateway:
    """Stands in for a gateway's link: records what the reader sends."""

    def __init__(self) -> None:
        self.sent: list = []
        self.info: dict = {}

    def send(self, msg: object) -> None:
        self.sent.append(msg)


def serving_ring(name: str):
    ring = create_shm_ring(name, GEO)
    ring.header_store32("engine_state", L.EngineState.READY)
    ring.header_store64("heartbeat_ns", time.time_ns())
    return ring


def admit(ring, req_id: int) -> m.Track:
    """Publish a request in a free slot, as the tracker does; its ``Track``."""
    writer = SlotWriter(ring)
    idx = req_id % GEO.num_slots
    seq = writer.try_reserve(idx, 0)
    assert seq is not None
    writer.publish(idx, seq, SlotRequest(req_id, np.array([1, 2, 3], "int32"), m.Sampling(4)))
    return m.Track(req_id, 7, idx, seq)


def test_closed_transport_refuses_every_access(ring_name: str) -> None:
    """In a child process, so that a regression (a segfault) fails this test instead of the run."""
    code = (
        "import sys\n"
        "from shared.ring import attach_shm_ring\n"
        "from shared.transport import RingError\n"
        f"ring = attach_shm_ring({ring_name!r}); t = ring.transport; ring.close()\n"
        "ops = [lambda: t.load32(0), lambda: t.load64(0), lambda: t.store32(0, 1), lambda: t.store64(0, 1),\n"
        "       lambda: t.cas64(0, 0, 1), lambda: t.fetch_add64(0, 1), lambda: t.fetch_xor64(0, 1),\n"
        "       lambda: t.read(0, 8), lambda: t.write(0, b'x'), lambda: t.local_view(), lambda: ring.read_slots()]\n"
        "for op in ops:\n"
        "    try:\n"
        "        op()\n"
        "    except RingError as exc:\n"
        "        assert 'closed' in str(exc), exc\n"
        "    else:\n"
        "        sys.exit('an access after close succeeded')\n"
        "print('refused', len(ops))\n"
    )
    owner = serving_ring(ring_name)
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                              cwd=Path(__file__).resolve().parents[1])
    finally:
        owner.close()
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "refused 11"


def test_closed_transport_raises_ring_error(ring_name: str) -> None:
    owner = serving_ring(ring_name)
    view = attach_shm_ring(ring_name)
    view.close()
    with pytest.raises(RingError, match="closed"):
        view.header_load32("engine_state")
    owner.close()


@pytest.mark.parametrize("how", ["replaced", "removed"])
def test_reader_fails_the_old_rings_requests_and_survives(ring_name: str, tmp_path: Path, how: str) -> None:
    old = serving_ring(ring_name)
    service = TokenReader(ReaderConfig(tmp_path, ring_name, heartbeat_timeout_s=5.0))
    reader = service.engines[0]  # the one engine's ring
    gateway = Gateway()
    service.gateways[7] = gateway  # type: ignore[assignment]
    reader.check_health()
    tracks = [admit(old, req_id) for req_id in (1, 2, 3)]
    for tr in tracks:
        reader.routes[tr.slot] = Route(tr)
    ShmTransport.unlink_name(ring_name)  # the supervisor removes a dead engine's segment
    new = serving_ring(ring_name) if how == "replaced" else None
    reader.check_health()  # before the fix: a segfault, cancelling through the closed mapping
    failed = [msg for msg in gateway.sent if isinstance(msg, m.Failed)]
    assert sorted(f.req_id for f in failed) == [1, 2, 3]
    assert {(f.status, f.message) for f in failed} == {(503, RESTARTED)}
    assert reader.routes == {}
    # the old slots were cancelled while the old mapping was still open
    slots = old.read_slots()
    assert all(int(slots[tr.slot]["cancel"]) for tr in tracks), slots["cancel"]
    if new is not None:
        assert reader.ring is not None and reader.ring is not old
        tr = admit(new, 4)
        reader.routes[tr.slot] = Route(tr)
        reader.cycle()  # reads the new ring: nothing generated yet, nothing sent, no error
        assert reader.routes.keys() == {tr.slot}
        new.close()
    else:
        assert reader.ring is None
    reader.watch.close()
    old.close()
