"""Wake-ups beside a shared-memory ring: a FIFO whose bytes say "look at the ring now".

Everything the engine and the frontend tell each other stays in the ring; a notifier only ends the wait of
a process that would otherwise poll it. Two per segment, each made by the engine that creates the segment
and named after the segment's inode (``<ring>@<inode>.<kind>`` in /dev/shm), so a notifier always belongs to
the segment it was opened beside and one left by a dead engine is never mistaken for the live one's:

* ``tokens``: the engine writes a byte after a step that published tokens or ended requests; the token
  reader waits on it instead of polling.
* ``work``: the slot tracker writes a byte after it publishes a slot; an idle engine waits on it (with its
  polling interval as the timeout, for writers that cannot reach it, as over RDMA).

The waiting side takes the FIFO's lock first (``Notifier.take``): one waiter per notifier, so a second one
(a token reader starting beside the one it replaces) polls until the first lets go. A process that finds
no notifier (an RDMA transport, a backend that writes the ring from the device, one not made yet) polls as
before. Both ends open the FIFO read-write and non-blocking: a write never blocks nor fails for want of a
reader (a full FIFO already holds a wake-up), a read never waits.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from typing import TYPE_CHECKING

from shared import ring_layout as L
from shared.transport import NOTIFIER_KINDS as KINDS
from shared.transport import Transport, notifier_path, remove_notifiers

if TYPE_CHECKING:
    from shared.ring import Ring

__all__ = ["KINDS", "Notifier", "look_for", "notifier_path", "remove_notifiers"]


def look_for(ring: Ring, kind: str) -> tuple[Notifier | None, bool]:
    """The ring's notifier of ``kind``, and whether the answer is final. An engine makes its notifiers before
    it says READY, so a ring seen READY (or past it) before the look that finds none never gets one (the
    persistent scheduler, RDMA): the caller polls it and need not look again."""
    ready = ring.header_load32("engine_state") >= L.EngineState.READY  # read first: then the look is final
    found = Notifier.open(ring.transport, kind)
    return found, found is not None or ready


def _segment(transport: Transport) -> tuple[str, int] | None:
    """The (name, inode) of a shared-memory transport's segment; None for any other transport."""
    name, ino = getattr(transport, "name", None), getattr(transport, "ino", None)
    return (name, ino) if isinstance(name, str) and isinstance(ino, int) else None


class Notifier:
    """One end of a notifier FIFO."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @classmethod
    def create(cls, transport: Transport, kind: str) -> Notifier | None:
        """Make the segment's notifier of ``kind`` (its creator's side); None off shared memory or when the
        name cannot be had (another user's file there)."""
        seg = _segment(transport)
        if seg is None:
            return None
        path = notifier_path(*seg, kind)
        with contextlib.suppress(FileNotFoundError, PermissionError):
            os.unlink(path)  # ours, from an earlier segment that had this inode
        try:
            os.mkfifo(path, 0o600)
        except OSError:
            return None
        return cls.open(transport, kind)

    @classmethod
    def open(cls, transport: Transport, kind: str) -> Notifier | None:
        """Open the segment's notifier of ``kind``; None when there is none (or it is not this user's FIFO)."""
        seg = _segment(transport)
        if seg is None:
            return None
        try:
            fd = os.open(notifier_path(*seg, kind), os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        st = os.fstat(fd)
        if not stat.S_ISFIFO(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            return None
        return cls(fd)

    def fileno(self) -> int:
        return self.fd

    def take(self) -> bool:
        """Become the one process that waits on this notifier (an exclusive lock, let go at close); False while
        another holds it. A byte wakes only the waiter that reads it: a second waiter (a token reader started
        beside the one it replaces) must poll instead until the first is gone."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def notify(self) -> None:
        """Wake the waiting side (a full FIFO already holds a wake-up)."""
        try:
            os.write(self.fd, b"\x01")
        except BlockingIOError:
            pass
        except OSError as exc:
            if exc.errno != errno.EBADF:
                raise

    def drain(self) -> None:
        """Take every pending wake-up; call it before looking at the ring, so none that follows is lost."""
        try:
            while len(os.read(self.fd, 4096)) == 4096:
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
