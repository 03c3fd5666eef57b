"""Attach refuses bad rings with exact messages; stale segments are replaced; 0600 segments."""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from shared import ring_layout as L
from shared.ring import HEADER_OFF, RingGeometry, attach_shm_ring, create_shm_ring
from shared.transport import SHM_DIR, RingError, ShmTransport

GEO = RingGeometry(8, 16, 16, 2)


def test_segment_mode_and_alignment(ring_name: str) -> None:
    ring = create_shm_ring(ring_name, GEO)
    st = os.stat(SHM_DIR / ring_name)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_size % 4096 == 0 and st.st_size >= GEO.total_bytes
    ring.close()


def test_major_mismatch_refused_naming_both_versions(ring_name: str) -> None:
    ring = create_shm_ring(ring_name, GEO)
    ring.header["schema_major"] = L.SCHEMA_MAJOR + 1
    ring.header["schema_minor"] = 3
    with pytest.raises(RingError) as err:
        attach_shm_ring(ring_name)
    assert str(err.value) == (
        f"ring {ring_name}: schema version {L.SCHEMA_MAJOR + 1}.3 is incompatible with this program's "
        f"{L.SCHEMA_MAJOR}.{L.SCHEMA_MINOR} (major versions differ); upgrade the older side"
    )
    ring.close()


def test_newer_and_older_minor_accepted(ring_name: str) -> None:
    ring = create_shm_ring(ring_name, GEO)
    older = dataclasses.replace(GEO, max_prompt_logprobs_tokens=0)  # before minor 5: no prompt-logprob arenas
    rows = dataclasses.replace(GEO, max_prompt_logprobs_tokens=GEO.prompt_logprob_rows)  # what the header holds
    for minor, geometry in ((L.SCHEMA_MINOR + 4, rows), (0, older)):
        ring.header["schema_minor"] = minor
        view = attach_shm_ring(ring_name)
        assert view.geometry == geometry
        view.close()
    ring.close()


def test_bad_magic(ring_name: str) -> None:
    ring = create_shm_ring(ring_name, GEO)
    ring.header["magic"] = 0x1122334455667788
    with pytest.raises(RingError) as err:
        attach_shm_ring(ring_name)
    assert str(err.value) == (
        f"ring {ring_name}: bad magic 0x1122334455667788 (expected 0x474e524b4e494c42): "
        "not a Blink ring, or corrupted"
    )
    ring.close()


def test_corrupt_geometry(ring_name: str) -> None:
    ring = create_shm_ring(ring_name, GEO)
    ring.header["num_slots"] = 0
    with pytest.raises(RingError, match=f"^ring {ring_name}: corrupt header: ring geometry: num_slots must be"):
        attach_shm_ring(ring_name)
    ring.header["num_slots"] = 4000  # offsets no longer match
    with pytest.raises(RingError, match="offsets do not match geometry"):
        attach_shm_ring(ring_name)
    ring.close()


def test_truncated_segment(ring_name: str) -> None:
    fd = os.open(SHM_DIR / ring_name, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 512)
    os.close(fd)
    with pytest.raises(RingError) as err:
        attach_shm_ring(ring_name)
    assert str(err.value) == f"ring {ring_name}: segment is 512 bytes, smaller than a header"


def test_missing_segment(ring_name: str) -> None:
    with pytest.raises(RingError) as err:
        attach_shm_ring(ring_name)
    assert str(err.value) == f"ring {ring_name}: no such segment in /dev/shm (is the engine running?)"


def test_other_owner_refused(ring_name: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    ring = create_shm_ring(ring_name, GEO)
    os.chown(SHM_DIR / ring_name, 4321, -1)
    with pytest.raises(RingError) as err:
        ShmTransport.attach(ring_name)
    assert str(err.value).startswith(f"ring {ring_name}: {SHM_DIR / ring_name} is a segment owned by uid 4321 "
                                     "(mode 0600), not by uid 0")
    ring.close()


def test_stale_segment_of_dead_engine_is_replaced(ring_name: str) -> None:
    code = "import os; print(os.getpid())"
    dead = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    ring = create_shm_ring(ring_name, GEO)
    ring.header["engine_pid"] = int(dead.stdout)
    ring.header["engine_state"] = L.EngineState.READY
    ring.slots["state"] = L.SlotState.DECODE_PROCESSING  # left over
    ring.close()
    fresh = create_shm_ring(ring_name, RingGeometry(4, 8, 8, 1))
    assert fresh.geometry.num_slots == 4 and (fresh.slots["state"] == 0).all()
    fresh.close()


def test_segment_of_live_engine_is_not_replaced(ring_name: str) -> None:
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        ring = create_shm_ring(ring_name, GEO)
        ring.transport.store32(HEADER_OFF["engine_pid"], live.pid)
        ring.transport.store32(HEADER_OFF["engine_state"], L.EngineState.READY)
        with pytest.raises(RingError) as err:
            create_shm_ring(ring_name, GEO)
        assert str(err.value) == f"ring {ring_name}: already served by live engine pid {live.pid}"
        ring.close()
    finally:
        live.kill()
        live.wait()


def test_garbage_file_is_replaced(ring_name: str) -> None:
    (SHM_DIR / ring_name).write_bytes(np.random.default_rng(0).bytes(8192))
    os.chmod(SHM_DIR / ring_name, 0o600)
    ring = create_shm_ring(ring_name, GEO)
    assert int(ring.header["magic"][0]) == int.from_bytes(b"BLINKRNG", "little")
    ring.close()
