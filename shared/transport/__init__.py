"""Transports: how a process reaches ring memory.

The services never know which one they use. A transport offers the four things the
ownership rules need (schema/OWNERSHIP.md): read a range, write a range, compare-and-swap a
word, fence; plus acquire loads / release stores of single words and an atomic add for the
doorbell. ``ShmTransport`` maps a POSIX shared-memory segment (the single-host and CPU
modes); ``shared.transport.rdma`` implements the same methods with one-sided verbs, for a frontend
on another host than the engine (docs/RDMA.md). This package holds the interface and every transport
beside it, so that the services choose one without importing another's dependencies.
"""

from __future__ import annotations

import abc
import errno
import mmap
import os
import stat
from pathlib import Path

import numpy as np

from shared import _atomics  # type: ignore[attr-defined]

SHM_DIR = Path("/dev/shm")
PAGE = mmap.PAGESIZE


class RingError(RuntimeError):
    """A ring segment that cannot be used; the message says which and why."""


class SegmentTaken(RingError):
    """The segment's name is held by another user (or is a symbolic link): it is never mapped nor removed."""


class Transport(abc.ABC):
    """Access to one ring segment of ``size`` bytes."""

    size: int

    @abc.abstractmethod
    def read(self, offset: int, nbytes: int) -> bytes: ...

    @abc.abstractmethod
    def read_into(self, offset: int, out: np.ndarray) -> None:
        """Copy ``out.nbytes`` bytes at ``offset`` into the contiguous array ``out``."""

    @abc.abstractmethod
    def write(self, offset: int, data: bytes | memoryview | np.ndarray) -> None: ...

    @abc.abstractmethod
    def cas64(self, offset: int, expected: int, desired: int) -> int:
        """Compare-and-swap an aligned 64-bit word; return the value seen (== expected on success)."""

    @abc.abstractmethod
    def load32(self, offset: int) -> int: ...

    @abc.abstractmethod
    def load64(self, offset: int) -> int: ...

    @abc.abstractmethod
    def store32(self, offset: int, value: int) -> None:
        """Release store: everything written before is visible before this word."""

    @abc.abstractmethod
    def store64(self, offset: int, value: int) -> None: ...

    @abc.abstractmethod
    def fetch_add64(self, offset: int, delta: int) -> int: ...

    @abc.abstractmethod
    def fetch_xor64(self, offset: int, bits: int) -> int:
        """Atomically flip ``bits`` of an aligned 64-bit word; the previous value."""

    @abc.abstractmethod
    def fence(self) -> None: ...

    def local_view(self) -> memoryview | None:
        """Zero-copy access when the ring is in this process's address space, else None."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


class MemoryTransport(Transport):
    """Ring memory mapped into this process (shared memory, or any writable buffer)."""

    def __init__(self, buf: mmap.mmap | bytearray) -> None:
        self._buf = buf
        self._view = memoryview(buf)
        self._np = np.frombuffer(self._view, dtype=np.uint8)
        self.size = len(self._view)
        self.base = int(self._np.ctypes.data)
        self.closed = False

    def _check(self, offset: int, nbytes: int) -> None:
        """Every access goes through here, so none reaches the mapping of a closed transport."""
        if self.closed:
            raise RingError("ring access after its transport was closed (the mapping is gone)")
        if offset < 0 or offset + nbytes > self.size:
            raise IndexError(f"ring access [{offset}, {offset + nbytes}) outside segment of {self.size} bytes")

    def read(self, offset: int, nbytes: int) -> bytes:
        self._check(offset, nbytes)
        return bytes(self._view[offset : offset + nbytes])

    def read_into(self, offset: int, out: np.ndarray) -> None:
        self._check(offset, out.nbytes)
        out.view(np.uint8).reshape(-1)[:] = self._np[offset : offset + out.nbytes]

    def write(self, offset: int, data: bytes | memoryview | np.ndarray) -> None:
        if isinstance(data, np.ndarray):
            raw = data.view(np.uint8).reshape(-1)
        else:
            raw = np.frombuffer(data, dtype=np.uint8)
        self._check(offset, raw.size)
        self._np[offset : offset + raw.size] = raw

    def cas64(self, offset: int, expected: int, desired: int) -> int:
        self._check(offset, 8)
        return _atomics.cas64(self.base + offset, expected, desired)

    def load32(self, offset: int) -> int:
        self._check(offset, 4)
        return _atomics.load_acquire32(self.base + offset)

    def load64(self, offset: int) -> int:
        self._check(offset, 8)
        return _atomics.load_acquire64(self.base + offset)

    def store32(self, offset: int, value: int) -> None:
        self._check(offset, 4)
        _atomics.store_release32(self.base + offset, value)

    def store64(self, offset: int, value: int) -> None:
        self._check(offset, 8)
        _atomics.store_release64(self.base + offset, value)

    def fetch_add64(self, offset: int, delta: int) -> int:
        self._check(offset, 8)
        return _atomics.fetch_add64(self.base + offset, delta)

    def fetch_xor64(self, offset: int, bits: int) -> int:
        self._check(offset, 8)
        return _atomics.fetch_xor64(self.base + offset, bits)

    def fence(self) -> None:
        _atomics.fence()

    def local_view(self) -> memoryview:
        self._check(0, 0)
        return self._view

    def close(self) -> None:
        """Unmap the segment; any later access raises ``RingError`` (never touches unmapped memory)."""
        self.closed = True
        self._np = np.empty(0, np.uint8)
        self._view.release()
        if isinstance(self._buf, mmap.mmap):
            try:
                self._buf.close()
            except BufferError:  # numpy views still alive elsewhere; the OS unmaps at exit
                pass


# The wake-up FIFOs beside a segment (shared/notify.py), named after its inode; removed with it.
NOTIFIER_KINDS = ("tokens", "work")


def notifier_path(name: str, ino: int, kind: str) -> str:
    if kind not in NOTIFIER_KINDS:
        raise ValueError(f"unknown notifier kind {kind!r}")
    return str(SHM_DIR / f"{name}@{ino}.{kind}")


def remove_notifiers(name: str, ino: int) -> None:
    """Unlink the notifiers of segment ``name`` with inode ``ino`` (the segment is going)."""
    for kind in NOTIFIER_KINDS:
        try:
            os.unlink(notifier_path(name, ino, kind))
        except (FileNotFoundError, PermissionError):
            pass


def shm_path(name: str) -> Path:
    if not name or "/" in name or name.startswith("."):
        raise RingError(f"invalid ring name {name!r}: use letters, digits, '-', '_' and '.'")
    return SHM_DIR / name


def _taken_message(name: str, path: Path, st: os.stat_result | None) -> str:
    """Why another user's segment (or a symbolic link) under ``name`` is refused."""
    if st is None:
        try:
            st = os.lstat(path)
        except OSError:
            return f"ring {name}: {path} cannot be opened by uid {os.geteuid()}; refusing it"
    if stat.S_ISLNK(st.st_mode):
        return (f"ring {name}: {path} is a symbolic link (owner uid {st.st_uid}); refusing to follow it: "
                "choose another ring name (--ring or BLINK_RING_NAME), or have its owner remove it")
    return (f"ring {name}: {path} is a segment owned by uid {st.st_uid} (mode {stat.S_IMODE(st.st_mode):04o}), "
            f"not by uid {os.geteuid()}: another user holds this name, so it is left alone; choose another "
            "ring name (--ring or BLINK_RING_NAME), or have its owner remove it")


class ShmTransport(MemoryTransport):
    """A POSIX shared-memory segment under /dev/shm, created 0600 and page-aligned."""

    def __init__(self, name: str, fd: int, size: int, *, owner: bool) -> None:
        self.name = name
        self.owner = owner
        self.ino = os.fstat(fd).st_ino  # names the segment's notifiers (shared/notify.py)
        buf = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        super().__init__(buf)

    @classmethod
    def create(cls, name: str, size: int) -> ShmTransport:
        """Create a new segment (FileExistsError if the name exists: callers decide about stale ones).

        O_EXCL with O_NOFOLLOW: never opens what is already there, a symbolic link included."""
        path = shm_path(name)
        size = (size + PAGE - 1) // PAGE * PAGE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return cls(name, fd, size, owner=True)

    @classmethod
    def attach(cls, name: str) -> ShmTransport:
        """Map an existing segment of this user; SegmentTaken (before any mapping) when it is not ours."""
        path = shm_path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise RingError(f"ring {name}: no such segment in {SHM_DIR} (is the engine running?)") from None
        except OSError as exc:  # ELOOP: a symbolic link; EACCES: another user's segment
            if exc.errno not in (errno.ELOOP, errno.EACCES, errno.EPERM):
                raise
            raise SegmentTaken(_taken_message(name, path, None)) from None
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            os.close(fd)
            raise SegmentTaken(_taken_message(name, path, st))
        if st.st_size == 0:
            os.close(fd)
            raise RingError(f"ring {name}: segment is empty (engine still creating it, or corrupt)")
        return cls(name, fd, st.st_size, owner=False)

    def unlink(self) -> None:
        """Remove the segment's name and its notifiers."""
        remove_notifiers(self.name, self.ino)
        shm_path(self.name).unlink(missing_ok=True)

    @staticmethod
    def unlink_name(name: str) -> None:
        """Remove the segment named ``name``, with its notifiers."""
        path = shm_path(name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            remove_notifiers(name, st.st_ino)
        path.unlink(missing_ok=True)
