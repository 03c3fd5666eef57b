"""The interference tool: workers on the requested cores, all gone soon after exit, even after a SIGKILL."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.interfere import Interference, parse_cores


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def catches_term(pid: int) -> bool:
    """The worker has its SIGTERM handler, so it reports when stopped."""
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        caught = next(line.split(":", 1)[1] for line in lines if line.startswith("SigCgt:"))
        return bool(int(caught, 16) >> (signal.SIGTERM - 1) & 1)
    return False


def cpu_s(pid: int) -> float:
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return 0.0


def wait_working(pids: list[int], work_s: float = 0.2, timeout_s: float = 120.0) -> None:
    """Until every worker catches SIGTERM and has run ``work_s`` of CPU since: on a busy host that takes longer,
    and a worker stopped sooner would have nothing (or no handler) to report."""
    deadline = time.monotonic() + timeout_s
    while not all(catches_term(pid) for pid in pids):
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.05)
    started = {pid: cpu_s(pid) for pid in pids}
    while not all(cpu_s(pid) - started[pid] >= work_s for pid in pids):
        assert time.monotonic() < deadline, "the workers did not work"
        time.sleep(0.05)


def test_parse_cores() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    assert parse_cores("all") == allowed
    assert parse_cores("all but 1") == allowed[1:] == parse_cores("all-but-1")
    assert parse_cores(f"{allowed[0]}-{allowed[-1]}") == list(range(allowed[0], allowed[-1] + 1))
    with pytest.raises(ValueError):
        parse_cores("100000")
    with pytest.raises(ValueError):
        parse_cores(f"all-but-{len(allowed)}")


def test_workers_pinned_and_stopped() -> None:
    cores = sorted(os.sched_getaffinity(0))[-2:]
    with Interference(cores=cores, kinds=("compress", "thrash"), thrash_mb=64) as co:
        assert len(co.pids) == 2 * len(cores)
        assert sorted(os.sched_getaffinity(pid).pop() for pid in co.pids) == sorted(cores * 2)
        assert all(len(os.sched_getaffinity(pid)) == 1 for pid in co.pids)
        assert {os.getpgid(pid) for pid in co.pids} == {co.pgid}
        wait_working(co.pids)
        pids = co.pids
        exited = time.monotonic()
    assert not wait_gone(pids, 60.0 - (time.monotonic() - exited))
    report = co.report
    assert report is not None and report["reported"] == len(pids)
    assert report["compress_mb_per_s"] > 0 and report["thrash_accesses_per_s"] > 0  # how fast is the host's business


def test_duration_bounds_the_workers() -> None:
    co = Interference(cores=sorted(os.sched_getaffinity(0))[:1], kinds=("compress",), duration_s=0.5).start()
    co.wait(60.0)  # they end by themselves after 0.5 s of work; a busy host starts them late
    assert all(p.poll() is not None for p in co.procs)
    assert co.stop()["reported"] == 1


PARENT = """
import sys, time
from bench.interfere import Interference
co = Interference(cores=[int(sys.argv[1])], kinds=("compress", "thrash"), thrash_mb=64).start()
print(" ".join(map(str, co.pids)), flush=True)
time.sleep(60)
"""


def test_children_die_with_a_killed_parent() -> None:
    core = sorted(os.sched_getaffinity(0))[0]
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(core)], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert parent.stdout is not None
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 2 and all(alive(p) for p in pids)
    wait_working(pids)  # started (a worker still allocating its memory on a busy core would be slow to notice)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert not wait_gone(pids, 60.0)


def test_cli_stops_on_sigterm(tmp_path) -> None:
    out = tmp_path / "r.json"
    proc = subprocess.Popen([sys.executable, "-m", "bench.interfere", "--cores", "all", "--kinds", "compress",
                             "--json", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not catches_term(proc.pid):  # until its handler is in place (a busy host imports slowly)
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert out.exists() and '"reported"' in out.read_text()


def test_churn_workers_per_core_report_their_operations() -> None:
    core = sorted(os.sched_getaffinity(0))[-1]
    with Interference(cores=[core], kinds=("churn",), per_core=3, block_kb=64, churn_mb=8) as co:
        assert len(co.pids) == 3
        assert all(os.sched_getaffinity(pid) == {core} for pid in co.pids)
        wait_working(co.pids)
    report = co.report
    assert report is not None and report["reported"] == 3 and report["per_core"] == 3
    assert report["churn_ops_per_s"] > 1 and report["churn_map_mb"] == 8 and report["compress_mb_per_s"] is None
    with pytest.raises(ValueError, match="per_core"):
        Interference(cores=[core], kinds=("churn",), per_core=0)


def test_a_worker_stopped_before_it_began_still_reports_work() -> None:
    """A worker told to stop before its first unit (on a busy host, while its buffer was still being built) does one
    unit, so its rate is never a zero that says nothing about the host."""
    from bench.interfere import churn_loop, compress_loop, thrash_loop

    def stopped() -> bool:
        return True

    assert thrash_loop(stopped, 1, 0) > 0
    assert compress_loop(stopped, 4) > 0
    assert churn_loop(stopped, 4, 1) == 1

