"""Whether a real process is waiting for a CPU (``shared/runwait.py``): a process that wants the CPU counts the time
between two readings less the CPU it got, one asleep or stopped counts none, one gone (or another under its pid)
reads as nothing; and a process is known for the ring's engine only once it is seen to map the ring's segment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.ring import RingGeometry, create_shm_ring
from shared.runwait import RunQueueWait, maps_segment

SPIN = "import sys\nsys.stdout.write('up\\n'); sys.stdout.flush()\nwhile True: pass\n"
SLEEP = "import sys, time\nsys.stdout.write('up\\n'); sys.stdout.flush()\ntime.sleep(3600)\n"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def started(code: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "up\n"
    return proc


def wait_for_state(pid: int, state: bytes) -> None:
    """Until the process's state is ``state`` (a signal is delivered asynchronously)."""
    deadline = time.monotonic() + 60
    while Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[0] != state:
        assert time.monotonic() < deadline, f"process {pid} never reached state {state!r}"
        time.sleep(0.01)


@pytest.fixture
def spinner() -> Iterator[int]:
    """A process that always wants a CPU (running, or on a run queue)."""
    proc = started(SPIN)
    yield proc.pid
    proc.kill()
    proc.wait()


def test_a_process_that_wants_the_cpu_counts_the_time_and_a_stopped_one_does_not(spinner: int) -> None:
    clock = Clock()
    wait = RunQueueWait(spinner, clock)
    started = time.monotonic()
    assert wait.advance() == 0.0  # the first reading only sets where it counts from
    clock.t += 1.5
    waited = wait.advance()
    # 1.5 s on the reading's clock, less the CPU the spinner got in the real time between the readings (at most
    # that time, give or take a clock tick of the kernel's accounting)
    assert waited is not None and 1.5 - (time.monotonic() - started) - 0.02 <= waited <= 1.5
    os.kill(spinner, signal.SIGSTOP)
    try:
        wait_for_state(spinner, b"T")
        clock.t += 2.0
        assert wait.advance() == 0.0  # stopped: on no run queue
    finally:
        os.kill(spinner, signal.SIGCONT)


def test_another_process_under_the_same_pid_is_not_read_as_it(spinner: int) -> None:
    wait = RunQueueWait(spinner)
    assert wait.advance() == 0.0
    wait._started = (wait._started or 0) + 1  # what a process started later under this pid would show
    assert wait.advance() is None


def test_a_sleeping_process_counts_nothing_and_one_that_is_gone_reads_as_nothing() -> None:
    sleeper = started(SLEEP)
    try:
        wait_for_state(sleeper.pid, b"S")  # asleep (it may still be on its way there after its line)
        clock = Clock()
        wait = RunQueueWait(sleeper.pid, clock)
        wait.advance()
        clock.t += 3.0
        assert wait.advance() == 0.0
    finally:
        sleeper.kill()
        sleeper.wait()
    assert RunQueueWait(sleeper.pid).advance() is None
    assert not maps_segment(sleeper.pid, "anything")


def test_the_engine_is_the_process_that_maps_the_rings_segment() -> None:
    name = f"blink-test-runwait-{uuid.uuid4().hex[:8]}"
    ring = create_shm_ring(name, RingGeometry(4, 16, 16, 1))
    other = started(SLEEP)
    try:
        assert maps_segment(os.getpid(), name)
        assert not maps_segment(os.getpid(), name[:-1])  # a name that only begins the same
        assert not maps_segment(other.pid, name)  # a process that does not map it: not this ring's engine
    finally:
        other.kill()
        other.wait()
        ring.transport.unlink()
        ring.close()


def test_an_engine_of_another_pid_namespace_is_not_read_by_its_pid() -> None:
    """The observer reads the waits of the process the header names once it maps the segment; where the header says
    the engine is in another PID namespace, that number is not its engine here and nothing is read."""
    from shared.ring import HEADER_OFF, EngineWaits

    name = f"blink-test-runwait-{uuid.uuid4().hex[:8]}"
    ring = create_shm_ring(name, RingGeometry(4, 16, 16, 1))
    code = ("import sys, time; from shared.ring import attach_shm_ring; r = attach_shm_ring(sys.argv[1]); "
            "print('mapped', flush=True); time.sleep(30)")
    engine = subprocess.Popen([sys.executable, "-c", code, name], stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout is not None and engine.stdout.readline().strip() == "mapped"
        ring.transport.store32(HEADER_OFF["engine_pid"], engine.pid)
        assert EngineWaits(ring, name)() is not None  # this namespace's engine: its waits are read
        here = ring.header_load32("engine_pid_ns")
        ring.transport.store32(HEADER_OFF["engine_pid_ns"], here ^ 0x5A5A)
        assert EngineWaits(ring, name)() is None
    finally:
        engine.kill()
        engine.wait()
        ring.transport.unlink()
        ring.close()
