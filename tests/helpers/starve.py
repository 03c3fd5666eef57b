"""A CPU kept busy by a real-time process for a while: the threads pinned to it wait on its run queue (what a
host whose cores other processes keep busy does to an engine, made certain for a test). Needs two CPUs or more
and the right to SCHED_FIFO (CAP_SYS_NICE); a test skips without them. The kernel's real-time throttling
(``/proc/sys/kernel/sched_rt_runtime_us``, 95% by default) still leaves the CPU a little to others."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HOG = """
import os, sys, time
cpu, seconds = int(sys.argv[1]), float(sys.argv[2])
os.sched_setaffinity(0, {cpu})
try:
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
except PermissionError:
    sys.exit(3)
print("hogging", flush=True)
end = time.monotonic() + seconds
while time.monotonic() < end:
    pass
"""


def two_cpus() -> tuple[int, set[int]]:
    """A CPU to starve and the others (skips the test with fewer than two)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs: one to starve, one for everything else")
    return cpus[-1], set(cpus[:-1])


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (threads that end meanwhile are skipped)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, OSError):
            continue


def hog(cpu: int, seconds: float) -> None:
    """Keep ``cpu`` busy at real-time priority for ``seconds`` (returns when done; skips the test where
    SCHED_FIFO is not allowed)."""
    proc = subprocess.run([sys.executable, "-c", HOG, str(cpu), str(seconds)], capture_output=True, text=True,
                          timeout=seconds + 60)
    if proc.returncode == 3:
        pytest.skip("SCHED_FIFO is not allowed here (CAP_SYS_NICE)")
    assert proc.returncode == 0 and "hogging" in proc.stdout, proc.stderr
