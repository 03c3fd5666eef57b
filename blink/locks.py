"""One ``blink serve`` per run dir, ring and port: locks held for the server's life.

Each lock is an ``flock`` on a file that holds its owner's record (pid, run dir, ring, port, as JSON): the
run dir's ``serve.lock``, and for each ring name and for the port a file in this user's lock folder in the
shared-memory directory (``/dev/shm/blink-locks-UID``, where the rings live: one namespace for both). The
kernel drops an ``flock`` when its holder dies however it dies (SIGKILL included), so a crashed server
never blocks the next one; a live one is named in the refusal. Lock files are never removed: removing one
while another server has it open would let that server lock the removed file and a third one a new file of
the same name, both believing they own it. The folder must be this user's alone (another local user could
otherwise make it first and hold its locks). A second server that started anyway would
replace the first one's sockets, attach its reader and tracker to the first one's ring, and delete its
``metrics/`` on exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import stat
from pathlib import Path

from shared.transport import SHM_DIR


class ServerRunning(Exception):
    """Another live ``blink serve`` holds one of this server's run dir, rings or port."""


@dataclasses.dataclass(frozen=True, slots=True)
class Owner:
    pid: int
    run_dir: str
    ring: str
    port: int

    def describe(self) -> str:
        return f"blink serve pid {self.pid} (run dir {self.run_dir}, ring {self.ring}, port {self.port})"


def lock_folder() -> Path:
    """This user's folder of ring and port locks, made private; ServerRunning where a folder of that name is
    not a directory of this user's closed to others (made by someone else, in a directory anyone may write)."""
    folder = SHM_DIR / f"blink-locks-{os.geteuid()}"
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise ServerRunning(f"the lock folder {folder} is not a private directory of this user (another user may "
                            "have made it): remove it, or ask its owner to")
    return folder


def _holder(fd: int) -> str:
    """The owner record in a lock file another process holds (best effort: it may be mid-write)."""
    with contextlib.suppress(OSError, ValueError, TypeError):
        raw = os.pread(fd, 4096, 0)
        return Owner(**json.loads(raw)).describe()
    return "another blink serve"


def _take(path: Path, what: str, owner: Owner) -> int:
    """Lock ``path`` for this process and write ``owner`` in it; ServerRunning names the live holder."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise ServerRunning(f"{what} is already served by {holder}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(dataclasses.asdict(owner)).encode(), 0)
    return fd


class ServerLocks:
    """The locks of one server: ``acquire`` before anything starts, ``release`` after everything stopped."""

    def __init__(self, run_dir: Path, rings: tuple[str, ...], port: int) -> None:
        self.run_dir, self.rings, self.port = run_dir, rings, port
        self.held: list[int] = []  # the lock files' descriptors

    def acquire(self, owner: Owner) -> None:
        """Every lock, or none (ServerRunning, naming the server that holds one)."""
        try:
            self.held.append(_take(self.run_dir / "serve.lock", f"run dir {self.run_dir}", owner))
            folder = lock_folder()
            for ring in self.rings:
                self.held.append(_take(folder / f"ring-{ring}.lock", f"ring {ring}", owner))
            if self.port:
                self.held.append(_take(folder / f"port-{self.port}.lock", f"port {self.port}", owner))
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        for fd in reversed(self.held):
            os.close(fd)
        self.held.clear()
