"""Attach refuses bad rings with exact messages; stale segments are replaced; 0600 segments."""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys
import threading

import numpy as np
import pytest

from shared import ring_layout as L
from shared.ring import HEADER_OFF, Ring, RingGeometry, attach_shm_ring, create_shm_ring
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


def _other_namespace_engine(ring_name: str, pid: int, state: int) -> Ring:
    """A segment whose header says its engine runs in another PID namespace (a container sharing /dev/shm)."""
    ring = create_shm_ring(ring_name, GEO)
    here = ring.header_load32("engine_pid_ns")
    assert here == os.stat("/proc/self/ns/pid").st_ino & 0xFFFFFFFF and here  # the creator's own namespace
    ring.transport.store32(HEADER_OFF["engine_pid_ns"], here ^ 0x5A5A)
    ring.transport.store32(HEADER_OFF["engine_pid"], pid)
    ring.transport.store32(HEADER_OFF["engine_state"], state)
    return ring


def test_another_namespaces_stale_segment_is_replaced_though_its_pid_runs_here(ring_name: str) -> None:
    """The pid in the header of another namespace's engine is a process of this namespace that has nothing to do
    with the ring: not taken for the engine; its heartbeat does not move, so the segment is stale and replaced."""
    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        ring = _other_namespace_engine(ring_name, unrelated.pid, L.EngineState.READY)
        ring.close()
        fresh = create_shm_ring(ring_name, RingGeometry(4, 8, 8, 1))
        assert fresh.geometry.num_slots == 4 and fresh.header_load32("engine_pid") == os.getpid()
        fresh.close()
    finally:
        unrelated.kill()
        unrelated.wait()


@pytest.mark.parametrize("pid", [0x3FFFFFF0, "own"])
def test_another_namespaces_engine_keeps_its_segment_while_it_beats(ring_name: str, pid: int | str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine of another namespace whose pid is nothing here, or this process's own number: refused while its
    heartbeat moves; once it stops, the segment is stale, starting or serving alike (a container that died starting
    and was restarted is not refused for good)."""
    pid = os.getpid() if pid == "own" else pid
    ring = _other_namespace_engine(ring_name, pid, L.EngineState.READY)
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            ring.transport.fetch_add64(HEADER_OFF["heartbeat"], 1)
            stop.wait(0.02)

    beater = threading.Thread(target=beat)
    beater.start()
    monkeypatch.setattr("shared.ring.STALE_WATCH_S", 60.0)  # a busy host may hold the beater back; a move ends it
    try:
        with pytest.raises(RingError, match=rf"a live engine of another PID namespace \(its pid {pid}\), whose "
                                            r"heartbeat moves"):
            create_shm_ring(ring_name, GEO)
    finally:
        stop.set()
        beater.join()
    monkeypatch.setattr("shared.ring.STALE_WATCH_S", 0.2)
    ring.transport.store32(HEADER_OFF["engine_state"], L.EngineState.STARTING)  # beats no more: stale
    fresh = create_shm_ring(ring_name, GEO)
    assert fresh.header_load32("engine_pid") == os.getpid()
    fresh.close()
    ring.close()


def test_garbage_file_is_replaced(ring_name: str) -> None:
    (SHM_DIR / ring_name).write_bytes(np.random.default_rng(0).bytes(8192))
    os.chmod(SHM_DIR / ring_name, 0o600)
    ring = create_shm_ring(ring_name, GEO)
    assert int(ring.header["magic"][0]) == int.from_bytes(b"BLINKRNG", "little")
    ring.close()
