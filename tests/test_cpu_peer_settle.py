"""bench.cpu_peer measures a server once its processes have settled: a busy child keeps it waiting."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from bench.cpu_peer import tree_cpu_s, wait_settled


def _spawn(code: str) -> subprocess.Popen[bytes]:
    # a parent that starts the given child, so that the tree (not the parent alone) is what is watched
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {code!r}])"
    return subprocess.Popen([sys.executable, "-c", child], start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # the child too (its own session's group)
    proc.wait()


def test_a_quiet_server_is_settled_after_the_quiet_window() -> None:
    proc = _spawn("import time; time.sleep(30)")
    try:
        time.sleep(0.5)  # the interpreters' start-up
        t0 = time.monotonic()
        wait_settled(proc.pid, quiet_s=1.0, timeout_s=20)
        assert 1.0 <= time.monotonic() - t0 < 10
    finally:
        _stop(proc)


def test_a_busy_child_keeps_the_server_unsettled() -> None:
    proc = _spawn("while True: pass")
    try:
        time.sleep(0.5)
        before = tree_cpu_s(proc.pid)
        with pytest.raises(RuntimeError, match="still busy"):
            wait_settled(proc.pid, quiet_s=1.0, timeout_s=2.5)
        assert tree_cpu_s(proc.pid) - before > 1.0  # the child's time counts, not the idle parent's alone
    finally:
        _stop(proc)
