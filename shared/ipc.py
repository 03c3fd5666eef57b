"""Links between the frontend services: msgspec messages over Unix domain sockets.

A frame is a 4-byte little-endian length followed by a msgpack array of messages. Every
message sent during one turn of the event loop goes out in one frame (one write), and a
reader gets a whole frame at once: the services batch per poll cycle without thinking
about it. Each link has its own tagged union of message types (``shared/messages.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec

from shared.log import get_logger

_LEN = struct.Struct("<I")
MAX_FRAME = 256 * 1024 * 1024


class LinkClosed(ConnectionError):
    """The peer went away."""


class Channel:
    """One end of a link: ``send`` queues, the queue is flushed once per loop turn."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, decoder_type: Any) -> None:
        self._reader = reader
        self._writer = writer
        self._decoder = msgspec.msgpack.Decoder(list[decoder_type])
        self._encoder = msgspec.msgpack.Encoder()
        self._outbox: list[Any] = []
        self._flush_scheduled = False
        self.closed = False
        self.info: dict[str, Any] = {}  # what the owner learns about the peer (e.g. its gateway id)

    def send(self, msg: Any) -> None:
        if self.closed:
            return
        self._outbox.append(msg)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self.closed or not self._outbox:
            return
        body = self._encoder.encode(self._outbox)
        self._outbox = []
        try:
            self._writer.write(_LEN.pack(len(body)) + body)
        except (ConnectionError, RuntimeError):
            self.close()

    async def drain(self) -> None:
        self._flush()
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self._writer.drain()

    async def recv(self) -> list[Any]:
        """The next frame's messages; raises ``LinkClosed`` at end of stream."""
        try:
            head = await self._reader.readexactly(_LEN.size)
            (size,) = _LEN.unpack(head)
            if size > MAX_FRAME:
                raise LinkClosed(f"frame of {size} bytes exceeds {MAX_FRAME}")
            body = await self._reader.readexactly(size)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            self.close()
            raise LinkClosed(str(exc)) from None
        return self._decoder.decode(body)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._writer.close()

    async def aclose(self) -> None:
        """Send what is queued, close, and return once the socket has taken every byte."""
        self._flush()
        self.close()
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self._writer.wait_closed()


Handler = Callable[[Channel], Awaitable[None]]


MAX_SOCKET_PATH = 107  # bytes of a Unix socket path (sun_path holds 108 with the terminating NUL)
SOCKET_SERVICES = ("tokenizer", "tracker", "reader")  # the services that listen on a socket in the run dir
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class RunDirError(RuntimeError):
    """A run dir (or a socket in it) that the services must not use; the message says which and why."""


def socket_path(run_dir: Path, service: str) -> Path:
    return Path(run_dir) / f"{service}.sock"


def run_dir_problem(run_dir: Path) -> str | None:
    """Why the services' sockets cannot live in ``run_dir``, or None (one not made yet is fine).

    The run dir must be private: a real directory (not a symbolic link) owned by this user with no
    access for anyone else (mode 0700 or narrower). Otherwise another local user could have made it
    (``/tmp/blink-UID`` is a name anyone can guess) and put their own sockets in it.
    """
    longest = socket_path(run_dir, max(SOCKET_SERVICES, key=len))
    size = len(os.fsencode(longest))
    if size > MAX_SOCKET_PATH:
        return (f"run dir {run_dir} is too long for Unix sockets ({longest} is {size} bytes, at most "
                f"{MAX_SOCKET_PATH}); choose a shorter --run-dir or BLINK_RUN_DIR")
    try:
        st = os.lstat(run_dir)
    except FileNotFoundError:
        return None
    mode, me = stat.S_IMODE(st.st_mode), os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        kind = "a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        kind = "not a directory"
    elif st.st_uid != me:
        kind = "owned by another user"
    elif mode & 0o077:
        kind = "open to other users"
    else:
        return None
    return (f"run dir {run_dir} is {kind} (owner uid {st.st_uid}, mode {mode:04o}); it must be a directory "
            f"owned by uid {me} with mode 0700, or another local user could put their own sockets in it. "
            "Remove it (or chmod 700 it if it is yours), or choose another --run-dir or BLINK_RUN_DIR")


def ensure_run_dir(run_dir: Path) -> Path:
    """Create ``run_dir`` with mode 0700 if it is missing, then check it is private (RunDirError if not).

    ``mkdir`` with the mode creates it atomically (a umask can only narrow it); a name that already
    exists, a symbolic link included, is never followed, only checked with ``lstat``.
    """
    run_dir = Path(run_dir)
    problem = run_dir_problem(run_dir)
    if problem is None:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(run_dir, 0o700)
        problem = run_dir_problem(run_dir)
    if problem is not None:
        raise RunDirError(problem)
    return run_dir


def peer_uid(sock: Any) -> int:
    """The user id of the process at the other end of a connected Unix socket (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return int(_PEERCRED.unpack(raw)[1])


async def serve(run_dir: Path, service: str, inbound_type: Any, on_channel: Handler) -> asyncio.Server:
    """Listen on ``run_dir/service.sock`` (mode 0600, in a private run dir); ``on_channel`` runs once per
    connected peer of this user (a peer of another user is hung up on)."""
    path = socket_path(ensure_run_dir(run_dir), service)
    path.unlink(missing_ok=True)

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        uid = peer_uid(writer.get_extra_info("socket"))
        if uid != os.geteuid():
            get_logger("ipc").warning("peer_refused", socket=str(path), peer_uid=uid)
            writer.close()
            return
        chan = Channel(reader, writer, inbound_type)
        try:
            await on_channel(chan)
        except asyncio.CancelledError:
            pass  # the service is stopping; asyncio would log a cancelled connection task as an error
        finally:
            chan.close()

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.fchmod(sock.fileno(), 0o600)  # bind gives the socket file this mode, whatever the umask
        sock.bind(str(path))
        return await asyncio.start_unix_server(accept, sock=sock)
    except BaseException:
        sock.close()
        raise


async def connect(run_dir: Path, service: str, inbound_type: Any, *, retry_s: float = 0.05,
                  max_retry_s: float = 1.0) -> Channel:
    """Connect to a service, waiting (with backoff) until its socket accepts.

    RunDirError when the run dir is not private or the socket is served by another user: nothing is
    sent to a peer that is not this user's.
    """
    path = socket_path(run_dir, service)
    delay = retry_s
    while True:
        problem = run_dir_problem(run_dir)
        if problem is not None:
            raise RunDirError(problem)
        try:
            reader, writer = await asyncio.open_unix_connection(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_retry_s)
            continue
        uid = peer_uid(writer.get_extra_info("socket"))
        if uid != os.geteuid():
            writer.close()
            raise RunDirError(f"{path} is served by uid {uid}, not by uid {os.geteuid()}; refusing to use it")
        return Channel(reader, writer, inbound_type)


def ready_path(run_dir: Path, name: str) -> Path:
    return Path(run_dir) / f"{name}.ready"


def mark_ready(run_dir: Path, name: str) -> None:
    """Tell a supervisor this service serves now (it polls for the file)."""
    path = ready_path(ensure_run_dir(run_dir), name)
    path.write_text(f"{os.getpid()}\n")


def clear_ready(run_dir: Path, name: str) -> None:
    ready_path(run_dir, name).unlink(missing_ok=True)
