"""Whether a process is waiting for a CPU: what tells an engine starved by a busy host from a hung one.

An engine beats from a thread (``gpu_engine/engine.py``); an observer that sees no beat for the heartbeat timeout
takes the engine for dead (``shared.ring.Liveness``). On a host whose cores other processes keep busy, a live
engine's threads can sit on a run queue, runnable and not running, for seconds: silent, not hung. Linux shows
each thread's state in ``/proc/PID/task/TID/stat``: ``R`` while it runs or waits to run, with the CPU time it has
had. An engine that is stopped (SIGSTOP, a frozen cgroup), blocked on a lock or asleep is not ``R``, and one that
is gone has no threads. ``RunQueueWait`` counts the time between two readings, less the CPU time a thread got in
it, as waited when that thread is runnable at the second; ``Liveness`` leaves that much of a silence out (up to a
bound: a hang that spins beside busy neighbours waits for a CPU too).
(The kernel's own run-queue delay, ``schedstat``, is no use here: it grows only when a waiting thread gets the
CPU, so a wait in progress does not show.)

An observer in another PID namespace (a container of its own) sees another process, or none, under the engine's
pid: ``maps_segment`` checks that the process found there maps the ring's segment before anything is read from
it, and where /proc says nothing (not Linux, no access) the silence counts whole, as it always did.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

PROC = "/proc"
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")  # the unit of a thread's CPU time in /proc/PID/task/TID/stat


def thread_stat(pid: int, tid: str) -> tuple[bytes, float, int] | None:
    """A thread's state (``R``, ``S``, ``T``, ...), its CPU time so far in seconds and its start time (clock ticks
    after boot); None when it cannot be read (it ended)."""
    try:
        with open(f"{PROC}/{pid}/task/{tid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()  # after "TID (COMM)", which may hold spaces
        # from the state on: state is field 3 of proc(5), utime 14, stime 15, starttime 22
        return fields[0], (int(fields[11]) + int(fields[12])) * TICK_S, int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


class RunQueueWait:
    """The time one process spent waiting for a CPU, read as increases between calls: for each thread that is
    runnable (state ``R``) at a reading, the time since the previous reading less the CPU time it got meanwhile (a
    thread that spins is running, not waiting); the most of any thread."""

    def __init__(self, pid: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.pid, self.clock = pid, clock
        self._at: float | None = None  # the previous call
        self._cpu: dict[str, float] = {}  # thread id -> its CPU time at the previous call
        self._started: int | None = None  # the process's start time: another process under a reused pid is not it

    def advance(self) -> float | None:
        """Seconds waited since the previous call (0 at the first, and for threads not seen at it); None when the
        process's threads cannot be read (it is gone, it is another process now, or /proc is not Linux's)."""
        now = self.clock()
        try:
            tids = os.listdir(f"{PROC}/{self.pid}/task")
        except OSError:
            return None
        stats = {tid: st for tid in tids if (st := thread_stat(self.pid, tid)) is not None}
        main = stats.get(str(self.pid))
        if main is None or (self._started is not None and main[2] != self._started):
            return None
        self._started = main[2]
        since = 0.0 if self._at is None else now - self._at
        waited = max((since - (cpu - self._cpu[tid]) for tid, (state, cpu, _) in stats.items()
                      if state == b"R" and tid in self._cpu), default=0.0)
        self._at, self._cpu = now, {tid: cpu for tid, (_, cpu, _) in stats.items()}
        return max(waited, 0.0)


def pid_namespace(pid: int | str = "self") -> int:
    """The inode of process ``pid``'s PID namespace (32 bits, as the ring header keeps it); 0 when it cannot be read."""
    try:
        return os.stat(f"{PROC}/{pid}/ns/pid").st_ino & 0xFFFFFFFF
    except OSError:
        return 0


def maps_segment(pid: int, segment: str) -> bool:
    """Whether process ``pid``, as this process sees it, maps the shared-memory segment ``segment`` (a name under
    /dev/shm): the engine of that ring, not a process of another PID namespace under the same number."""
    try:
        with open(f"{PROC}/{pid}/maps", "rb") as f:
            path = f"/dev/shm/{segment}".encode()
            for line in f:
                fields = line.split(maxsplit=5)  # address, perms, offset, device, inode, path
                if len(fields) == 6 and fields[5].rstrip() in (path, path + b" (deleted)"):
                    return True
    except OSError:
        pass
    return False
