"""Whether a process is waiting for a CPU: what tells an engine starved by a busy host from a hung one.

An engine beats from a thread (``gpu_engine/engine.py``); an observer that sees no beat for the heartbeat timeout
takes the engine for dead (``shared.ring.Liveness``). On a host whose cores other processes keep busy, a live
engine's threads can sit on a run queue, runnable and not running, for seconds: silent, not hung. Linux shows
each thread's state in ``/proc/PID/task/TID/stat``: ``R`` while it runs or waits to run. An engine that is stopped
(SIGSTOP, a frozen cgroup), blocked on a lock or asleep is not ``R``, and one that is gone has no threads.
``RunQueueWait`` counts the time between two readings as waited when a thread was runnable at the second;
``Liveness`` leaves that much of a silence out (up to a bound, since a hang that spins is runnable too).
(The kernel's own run-queue delay, ``schedstat``, is no use here: it grows only when a waiting thread gets the
CPU, so a wait in progress does not show.)

An observer in another PID namespace (a container of its own) sees another process, or none, under the engine's
pid: ``maps_segment`` checks that the process found there maps the ring's segment before anything is read from
it, and where /proc says nothing (not Linux, no access) the silence counts whole, as it always did.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

PROC = "/proc"


class RunQueueWait:
    """The time one process was seen runnable, read as increases between calls."""

    def __init__(self, pid: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.pid, self.clock = pid, clock
        self._at: float | None = None  # the previous call

    def runnable(self) -> bool | None:
        """Whether one of the process's threads is running or waiting to run (state ``R``); None when its threads
        cannot be listed (it is gone, or /proc is not Linux's)."""
        try:
            tids = os.listdir(f"{PROC}/{self.pid}/task")
        except OSError:
            return None
        seen = False
        for tid in tids:
            with contextlib.suppress(OSError, IndexError):  # a thread that ended meanwhile
                with open(f"{PROC}/{self.pid}/task/{tid}/stat", "rb") as f:
                    state = f.read().rpartition(b")")[2].split()[0]  # after "TID (COMM)", which may hold spaces
                seen = True
                if state == b"R":
                    return True
        return False if seen else None

    def advance(self) -> float | None:
        """Seconds since the previous call when the process is runnable now, else 0 (and 0 at the first call);
        None when its threads cannot be read."""
        now, runnable = self.clock(), self.runnable()
        if runnable is None:
            return None
        since = 0.0 if self._at is None else now - self._at
        self._at = now
        return since if runnable else 0.0


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
