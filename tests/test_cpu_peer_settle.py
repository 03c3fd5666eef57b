"""bench.cpu_peer measures a server once its processes have settled (a busy child keeps it waiting), and counts
their memory as PSS beside RSS summed."""

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
        assert time.monotonic() - t0 >= 1.0  # the whole quiet window, then settled (else wait_settled raised)
    finally:
        _stop(proc)


def test_a_busy_child_keeps_the_server_unsettled() -> None:
    proc = _spawn("while True: pass")
    try:
        time.sleep(0.5)
        before = tree_cpu_s(proc.pid)
        # busy: over 2% of a core, which a spinning child gets on a host however shared (its own core's 25%, the
        # default, a crowded 2-core host need not give it in every half second)
        with pytest.raises(RuntimeError, match="still busy"):
            wait_settled(proc.pid, quiet_s=1.0, busy_below=0.02, timeout_s=2.5)
        # the child's time counts, not the idle parent's alone
        assert tree_cpu_s(proc.pid) - before > 0.02
    finally:
        _stop(proc)


def test_memory_counts_a_page_two_processes_share_once_in_pss(tmp_path) -> None:
    """``memory_mib``: PSS sums what the processes take of the machine (a 32-MiB file both map, read through,
    counted once), RSS sums each one's resident pages (the file twice)."""
    from bench.cpu_peer import memory_mib

    data = tmp_path / "shared.bin"
    data.write_bytes(os.urandom(32 << 20))
    code = (f"import mmap, sys, time; f = open({str(data)!r}, 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ);"
            " s = sum(m[i] for i in range(0, len(m), 4096)); print('mapped', flush=True); time.sleep(60)")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE) for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == b"mapped"
        alone = memory_mib([procs[0].pid])
        both = memory_mib([p.pid for p in procs])
        assert alone["rss"] >= 32 and alone["rss"] - alone["pss"] >= 15  # its PSS holds half of the file
        assert both["rss"] - both["pss"] >= 30  # the file: twice in the RSS sum, once in the PSS sum
    finally:
        for p in procs:
            p.kill()
            p.wait()
