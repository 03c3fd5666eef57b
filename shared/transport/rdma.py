"""The RDMA transport: the ring reached with one-sided verbs over a reliable-connected queue pair.

Three layers, so that everything but the wire can be tested without a device:

* **Plans** (pure functions): which work requests each transport operation posts, in what order,
  with which flags. The ordering is the one ``schema/OWNERSHIP.md`` prescribes: a payload goes in
  RDMA WRITEs, the state word (a release store) in its own WRITE posted after them on the same
  queue pair, flagged ``IBV_SEND_FENCE`` so it cannot pass an earlier READ; claims and releases are
  8-byte ``ATOMIC_CMP_AND_SWP``; a fence is a signaled READ posted behind everything (a READ
  response leaves the responder only after the WRITEs before it are placed).
* **``RdmaTransport``**: the ``shared.transport.Transport`` interface over a ``Poster`` (post a
  plan, wait for its signaled completions, read the local staging buffer).
* **The exchange and the export** (``Endpoint``, ``RingExport``, ``connect_ring``): the engine registers
  the ring memory and answers each frontend's connection exchange (one JSON line each way over a TCP
  socket, kept open as the queue pair's lease), then leaves the data path.
* **The verbs layer** (``Nic``): queue pairs, memory registration, posting. ``PyverbsNic`` is the product's
  (pyverbs, imported lazily: nothing else needs it); on a machine without a device the test harness puts a
  stand-in for the NIC in its place (``harness/rdma_standin.py``), and everything above runs unchanged.

Why here, in ``shared.transport`` beside the shared-memory transport: both sides of a ring use this
module. The engine registers its ring and answers the connection exchange (``RingExport``); the ring's
frontend users, the gateway, the slot tracker and the token reader, reach it through ``RdmaTransport`` as
they reach a local ring through ``ShmTransport`` (``shared/remote_ring.py`` puts the two together).
``shared/`` is the one package both the engine and the frontend may import (docs/DESIGN.md;
``tests/test_layers.py`` holds that rule), and this is the ``Transport`` interface's second
implementation, so it sits with the first.

What has and has not run is in ``docs/RDMA.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import hmac
import json
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from shared import ring_layout as L
from shared.transport import RingError, Transport

SYS_RDMA = Path("/sys/class/infiniband")
MAX_MESSAGE = 1 << 30       # bytes per WR; clamped to the port's max_msg_sz at connect time
STAGING_BYTES = 1 << 20     # local buffer the READs land in and WRITEs leave from


class RdmaUnavailable(RingError):
    """No RDMA here: pyverbs missing, no device, or a device without what the ring needs."""


class Opcode(enum.IntEnum):
    """``enum ibv_wr_opcode`` values."""

    RDMA_WRITE = 0
    RDMA_READ = 4
    ATOMIC_CMP_AND_SWP = 5
    ATOMIC_FETCH_AND_ADD = 6


class Flag(enum.IntFlag):
    """``enum ibv_send_flags`` values."""

    NONE = 0
    FENCE = 1
    SIGNALED = 2
    INLINE = 8


@dataclasses.dataclass(frozen=True, slots=True)
class WorkRequest:
    """One send-queue entry: ``length`` bytes between ring ``remote`` and staging ``local`` offsets."""

    opcode: Opcode
    remote: int
    length: int
    local: int = 0
    flags: Flag = Flag.NONE
    compare: int = 0   # ATOMIC_CMP_AND_SWP: expected; ATOMIC_FETCH_AND_ADD: the addend
    swap: int = 0      # ATOMIC_CMP_AND_SWP: desired


# ---------------------------------------------------------------------- plans (pure)
def _check_range(offset: int, nbytes: int, size: int) -> None:
    if nbytes <= 0:
        raise ValueError(f"RDMA access of {nbytes} bytes: must be > 0")
    if offset < 0 or offset + nbytes > size:
        raise IndexError(f"ring access [{offset}, {offset + nbytes}) outside segment of {size} bytes")


def _check_word(offset: int, width: int, size: int) -> None:
    _check_range(offset, width, size)
    if offset % width:
        raise ValueError(f"{width * 8}-bit ring word at offset {offset} is not {width}-byte aligned")


def _chunks(offset: int, nbytes: int, max_message: int) -> list[tuple[int, int, int]]:
    """(remote, local, length) pieces of at most ``max_message`` bytes."""
    return [(offset + k, k, min(max_message, nbytes - k)) for k in range(0, nbytes, max_message)]


def plan_read(offset: int, nbytes: int, size: int, max_message: int = MAX_MESSAGE) -> list[WorkRequest]:
    """READs of the range into staging; only the last is signaled (RC completes in order)."""
    _check_range(offset, nbytes, size)
    pieces = _chunks(offset, nbytes, max_message)
    return [WorkRequest(Opcode.RDMA_READ, r, n, loc, Flag.SIGNALED if i == len(pieces) - 1 else Flag.NONE)
            for i, (r, loc, n) in enumerate(pieces)]


def plan_write(offset: int, nbytes: int, size: int, max_message: int = MAX_MESSAGE) -> list[WorkRequest]:
    """WRITEs of staging to the range: the payload, never waited for (later WRITEs are placed after it);
    the last is signaled so the send queue can be reaped."""
    _check_range(offset, nbytes, size)
    pieces = _chunks(offset, nbytes, max_message)
    return [WorkRequest(Opcode.RDMA_WRITE, r, n, loc, Flag.SIGNALED if i == len(pieces) - 1 else Flag.NONE)
            for i, (r, loc, n) in enumerate(pieces)]


def plan_store(offset: int, width: int, size: int, max_inline: int) -> list[WorkRequest]:
    """A release store: its own WRITE, fenced so that it cannot pass an earlier READ, after the payload."""
    _check_word(offset, width, size)
    flags = Flag.FENCE | Flag.SIGNALED | (Flag.INLINE if max_inline >= width else Flag.NONE)
    return [WorkRequest(Opcode.RDMA_WRITE, offset, width, 0, flags)]


def plan_load(offset: int, width: int, size: int) -> list[WorkRequest]:
    """An acquire load: a signaled READ, waited for before anything after it is posted."""
    _check_word(offset, width, size)
    return [WorkRequest(Opcode.RDMA_READ, offset, width, 0, Flag.SIGNALED)]


def plan_cas64(offset: int, expected: int, desired: int, size: int) -> list[WorkRequest]:
    """The slot transitions' compare-and-swap: 8-byte atomic, fenced behind earlier READs, waited for."""
    _check_word(offset, 8, size)
    return [WorkRequest(Opcode.ATOMIC_CMP_AND_SWP, offset, 8, 0, Flag.FENCE | Flag.SIGNALED,
                        expected & 0xFFFF_FFFF_FFFF_FFFF, desired & 0xFFFF_FFFF_FFFF_FFFF)]


def plan_fetch_add64(offset: int, delta: int, size: int) -> list[WorkRequest]:
    _check_word(offset, 8, size)
    return [WorkRequest(Opcode.ATOMIC_FETCH_AND_ADD, offset, 8, 0, Flag.FENCE | Flag.SIGNALED,
                        delta & 0xFFFF_FFFF_FFFF_FFFF)]


def plan_fence(size: int) -> list[WorkRequest]:
    """Everything posted before is placed at the responder: a fenced, signaled 8-byte READ of the magic."""
    _check_word(0, 8, size)
    return [WorkRequest(Opcode.RDMA_READ, 0, 8, 0, Flag.FENCE | Flag.SIGNALED)]


def xor_step(seen: int, bits: int) -> tuple[int, int]:
    """Verbs have no atomic XOR: the (expected, desired) of the next CAS, given the word last seen."""
    return seen, (seen ^ bits) & 0xFFFF_FFFF_FFFF_FFFF


# ---------------------------------------------------------------------- the transport
class Poster(Protocol):
    """What ``RdmaTransport`` needs of a queue pair: post WRs, wait for their signaled ones, staging.

    ``post`` and ``wait`` raise ``RingError`` when the queue pair failed (an error completion: the peer gone,
    a registration no longer valid); after that the queue pair is in the error state and everything fails."""

    staging: np.ndarray     # uint8, STAGING_BYTES: the local memory region
    max_message: int
    max_inline: int

    def post(self, wrs: Sequence[WorkRequest]) -> None: ...

    def wait(self) -> None:
        """Block until every signaled WR posted so far has completed (raise on an error completion)."""


class RdmaTransport(Transport):
    """The ring of a remote engine through one RC queue pair (see the module docstring).

    ``lease`` is the connection the endpoints were exchanged over, kept open for the queue pair's life: the
    engine drops its side of the pair when it closes, and this side sees the engine go (``lease_open``) when
    the engine's end closes, which a stopped or crashed engine's does at once. The first failure (an error
    completion, the lease closed) is kept in ``lost``; every later access raises ``RingError`` without
    posting anything, and the services let the ring go and connect again (``dpu_gateway/ringwatch.py``)."""

    def __init__(self, poster: Poster, size: int, lease: socket.socket | None = None) -> None:
        self.poster = poster
        self.size = size
        self.lease = lease
        if lease is not None:
            lease.setblocking(False)  # looked at, never waited on (lease_open)
        self.lost: str | None = None
        self._u64 = poster.staging[:8].view(np.uint64)

    # every call into the queue pair goes through these two: a failure is kept, and refuses what follows
    def _post(self, wrs: list[WorkRequest]) -> None:
        if self.lost is not None:
            raise RingError(f"the ring over RDMA is lost: {self.lost}")
        try:
            self.poster.post(wrs)
        except RingError as exc:
            self._lose(str(exc))

    def _wait(self) -> None:
        if self.lost is not None:
            raise RingError(f"the ring over RDMA is lost: {self.lost}")
        try:
            self.poster.wait()
        except RingError as exc:
            self._lose(str(exc))

    def _lose(self, why: str) -> None:
        self.lost = why
        raise RingError(f"the ring over RDMA is lost: {why}")

    def lease_open(self) -> bool:
        """Whether the engine still holds this queue pair's connection (one non-blocking look, no network
        round trip); False, and ``lost`` set, once its end closed. Always True without a lease."""
        if self.lost is not None:
            return False
        if self.lease is None:
            return True
        try:
            got = self.lease.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError as exc:
            self.lost = f"the engine's connection failed ({exc.strerror or exc})"
            return False
        if got:
            return True  # the engine sends nothing after the exchange; a byte is not an end
        self.lost = "the engine closed its connection (it stopped, or its process ended)"
        return False

    def read(self, offset: int, nbytes: int) -> bytes:
        out = np.empty(nbytes, np.uint8)
        self.read_into(offset, out)
        return out.tobytes()

    def read_into(self, offset: int, out: np.ndarray) -> None:
        """READs through staging, one staging buffer at a time (a larger range is several round trips)."""
        dst = out.view(np.uint8).reshape(-1)
        if not dst.size:  # nothing to read (as a mapping, an empty range is no access)
            return
        _check_range(offset, dst.size, self.size)
        step = self.poster.staging.size
        self._wait()  # a READ lands in the staging buffer: earlier WRITEs must have left it
        for k in range(0, dst.size, step):
            n = min(step, dst.size - k)
            self._post(plan_read(offset + k, n, self.size, self.poster.max_message))
            self._wait()
            dst[k : k + n] = self.poster.staging[:n]

    def write(self, offset: int, data: bytes | memoryview | np.ndarray) -> None:
        """WRITEs from staging, never waited for but to reuse the staging buffer for a larger range's next piece."""
        raw = data.view(np.uint8).reshape(-1) if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
        if not raw.size:
            return
        _check_range(offset, raw.size, self.size)
        step = self.poster.staging.size
        for k in range(0, raw.size, step):
            n = min(step, raw.size - k)
            self._wait()  # the staging buffer is free once earlier WRITEs left it
            self.poster.staging[:n] = raw[k : k + n]
            self._post(plan_write(offset + k, n, self.size, self.poster.max_message))

    def _word(self, wrs: list[WorkRequest]) -> int:
        self._post(wrs)
        self._wait()
        return int(self._u64[0])

    def cas64(self, offset: int, expected: int, desired: int) -> int:
        self._wait()
        return self._word(plan_cas64(offset, expected, desired, self.size))

    def load32(self, offset: int) -> int:
        self._wait()
        self._post(plan_load(offset, 4, self.size))
        self._wait()
        return int(self.poster.staging[:4].view(np.uint32)[0])

    def load64(self, offset: int) -> int:
        self._wait()
        return self._word(plan_load(offset, 8, self.size))

    def _store(self, offset: int, width: int, value: int) -> None:
        self._wait()
        self.poster.staging[:width] = np.frombuffer(struct.pack("<I" if width == 4 else "<Q", value), np.uint8)
        self._post(plan_store(offset, width, self.size, self.poster.max_inline))

    def store32(self, offset: int, value: int) -> None:
        self._store(offset, 4, value & 0xFFFF_FFFF)

    def store64(self, offset: int, value: int) -> None:
        self._store(offset, 8, value & 0xFFFF_FFFF_FFFF_FFFF)

    def fetch_add64(self, offset: int, delta: int) -> int:
        self._wait()
        return self._word(plan_fetch_add64(offset, delta, self.size))

    def fetch_xor64(self, offset: int, bits: int) -> int:
        seen = self.load64(offset)
        while True:
            expected, desired = xor_step(seen, bits)
            got = self.cas64(offset, expected, desired)
            if got == expected:
                return got
            seen = got

    def fence(self) -> None:
        self._wait()
        self._post(plan_fence(self.size))
        self._wait()

    def close(self) -> None:
        """Destroy the queue pair (the poster's) and close the lease, which tells the engine to drop its side."""
        if self.lost is None:
            self.lost = "closed by this process"
        closer = getattr(self.poster, "close", None)
        try:
            if closer is not None:
                closer()
        finally:
            if self.lease is not None:
                self.lease.close()


# ---------------------------------------------------------------------- devices (pyverbs, lazy)
def _pyverbs() -> Any:
    try:
        import pyverbs.device  # type: ignore[import-not-found]  # noqa: F401, PLC0415 - optional
    except ImportError as exc:
        raise RdmaUnavailable(
            f"the RDMA transport needs pyverbs ({exc}): apt-get install python3-pyverbs rdma-core, "
            "or pip install pyverbs") from None
    import pyverbs  # type: ignore[import-not-found]  # noqa: PLC0415

    return pyverbs


def rdma_devices(sys_dir: Path = SYS_RDMA) -> list[str]:
    """The RDMA devices the kernel exposes (``/sys/class/infiniband``), without opening any."""
    try:
        return sorted(p.name for p in sys_dir.iterdir())
    except FileNotFoundError:
        return []


def pick_device(name: str | None, sys_dir: Path = SYS_RDMA) -> str:
    """The device to open: the named one, or the only/first one; a clear error when there is none."""
    found = rdma_devices(sys_dir)
    if not found:
        raise RdmaUnavailable(
            f"no RDMA device: {sys_dir} is empty or missing (no HCA, or a kernel without InfiniBand "
            "support; SoftRoCE needs the rdma_rxe module); use the shared-memory transport")
    if name is None:
        return found[0]
    if name not in found:
        raise RdmaUnavailable(f"RDMA device {name!r} not found; this host has {', '.join(found)}")
    return name


SIGNATURE_WINDOW_S = 120.0  # how far from now a signed endpoint's time may be
ROLES = ("frontend", "engine")  # who signed a line: part of what its signature covers


class SeenSignatures:
    """The signatures of the frontend lines an engine accepted within the last ``window_s``: a line that comes
    again inside the window (a replay; outside it its time is refused) is refused."""

    def __init__(self, window_s: float = SIGNATURE_WINDOW_S) -> None:
        self.window_ns = int(2 * window_s * 1e9)  # a line's time may be up to window_s ahead of now or behind it
        self._seen: dict[str, int] = {}
        self._lock = threading.Lock()

    def first_time(self, mac: str) -> bool:
        """Whether ``mac`` was not accepted within the window; it is from now on."""
        now = time.monotonic_ns()
        with self._lock:
            self._seen = {m: t for m, t in self._seen.items() if now - t < self.window_ns}
            if mac in self._seen:
                return False
            self._seen[mac] = now
            return True


@dataclasses.dataclass(frozen=True, slots=True)
class Endpoint:
    """What each side tells the other to connect an RC queue pair (exchanged as one JSON line).

    The frontend speaks first, naming the ring it wants (``ring``); the engine answers with its queue pair,
    the ring's memory region (``addr``, ``rkey``, ``size``) and the ring's schema version, or with a refusal
    (``{"error": ...}``, raised here as ``ExchangeRefused``). With a shared secret each side signs its line
    (``ts``, ``mac``: HMAC-SHA256 over the other fields, the signer's role, and for the engine the frontend's
    ``mac`` it answers) and refuses a peer's that is unsigned, signed with another secret or for the other role,
    or signed more than ``SIGNATURE_WINDOW_S`` from now; the engine refuses a frontend line it has already
    accepted (`SeenSignatures`). So an engine's answer is no frontend line (its role), it answers one frontend
    line only (the binding), and a frontend line replayed within the window gets nothing. Unsigned, the line has
    no ``ts`` and ``mac`` (as before the secret existed)."""

    qp_num: int
    psn: int
    lid: int
    gid: str          # 16 bytes as hex ("" on InfiniBand with a LID)
    mtu: int          # enum ibv_mtu
    addr: int = 0     # ring: virtual address (or IOVA) of its memory region; frontend: 0
    rkey: int = 0
    size: int = 0
    ring: str = ""    # frontend: the ring asked for; engine: the ring exported
    schema_major: int = 0  # engine: the ring's schema version (schema/ring.fbs); frontend: its own
    schema_minor: int = 0
    ts: int = 0       # with a shared secret: when it was signed (ns since the epoch), and the signature
    mac: str = ""

    def encode(self) -> bytes:
        fields = dataclasses.asdict(self)
        if not self.mac:  # unsigned: the line an engine without the secret's fields reads too
            del fields["ts"], fields["mac"]
        return (json.dumps(fields) + "\n").encode()

    def signed(self, secret: bytes, role: str, answers: str = "") -> Endpoint:
        """This endpoint with ``ts`` now and ``mac`` the HMAC-SHA256 under ``secret`` of every other field, the
        signer's ``role`` ("frontend" or "engine") and the ``mac`` of the line it ``answers`` (the engine's)."""
        ep = dataclasses.replace(self, ts=time.time_ns(), mac="")
        return dataclasses.replace(ep, mac=ep._digest(secret, role, answers))

    def check_signature(self, secret: bytes, role: str, answers: str = "",
                        window_s: float = SIGNATURE_WINDOW_S) -> str | None:
        """Why this endpoint's signature under ``secret``, as ``role``'s line answering ``answers``, is not good
        (none, wrong, or signed more than ``window_s`` from now), or None."""
        if not self.mac:
            return "the peer's endpoint is not signed (set BLINK_RDMA_SECRET_FILE on both sides)"
        if not hmac.compare_digest(self.mac.encode(), dataclasses.replace(self, mac="")._digest(
                secret, role, answers).encode()):
            return "the peer's endpoint signature does not match this side's secret"
        if abs(time.time_ns() - self.ts) > window_s * 1e9:
            return f"the peer's endpoint was signed more than {window_s:.0f}s from now (a replay, or clocks apart)"
        return None

    def _digest(self, secret: bytes, role: str, answers: str) -> str:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        text = json.dumps([role, answers, dataclasses.asdict(self)], sort_keys=True).encode()
        return hmac.new(secret, text, hashlib.sha256).hexdigest()

    @classmethod
    def decode(cls, line: bytes) -> Endpoint:
        try:
            fields = json.loads(line)
            if isinstance(fields, dict) and set(fields) == {"error"}:
                raise ExchangeRefused(f"RDMA endpoint exchange: the engine refused: {fields['error']}")
            ep = cls(**fields)
            if not (isinstance(ep.mac, str) and ep.mac.isascii() and type(ep.ts) is int):
                raise ValueError("ts must be an integer and mac an ASCII string")
        except (ValueError, TypeError) as exc:
            raise RingError(f"RDMA endpoint exchange: malformed message {line[:200]!r}: {exc}") from None
        if not 0 < ep.qp_num < 1 << 24 or not 0 <= ep.psn < 1 << 24:
            raise RingError(f"RDMA endpoint exchange: qp_num {ep.qp_num} / psn {ep.psn} out of 24-bit range")
        return ep


class ExchangeRefused(RingError):
    """The engine answered the exchange with a refusal (another ring's name, no room for a queue pair)."""


MAX_LINE = 65536


def _time_left(deadline: float) -> float:
    """Seconds to ``deadline`` (a ``time.monotonic()`` time); TimeoutError once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def send_line(sock: socket.socket, line: bytes, timeout_s: float, deadline: float | None = None) -> None:
    """The whole line sent within ``timeout_s``, or by ``deadline`` when given (the exchange's own)."""
    try:
        sock.settimeout(_time_left(time.monotonic() + timeout_s if deadline is None else deadline))
        sock.sendall(line)  # the timeout bounds the whole call, however many sends it takes
    except (BrokenPipeError, ConnectionResetError):
        raise RingError("RDMA endpoint exchange: the peer closed the connection") from None
    except TimeoutError:
        raise RingError(f"RDMA endpoint exchange: could not send within {timeout_s}s") from None


def read_line(sock: socket.socket, timeout_s: float, deadline: float | None = None) -> bytes:
    """One line of the exchange, byte by byte up to its newline: nothing after it is taken from the socket
    (the connection stays open as the queue pair's lease, and must show the peer's end, not stray bytes).

    The whole line must come within ``timeout_s`` (by ``deadline`` when given), however its bytes are spread:
    a peer that sends a byte now and then is cut off at the deadline, not kept for as long as it trickles."""
    deadline = time.monotonic() + timeout_s if deadline is None else deadline
    buf = bytearray()
    try:
        while not buf.endswith(b"\n"):
            sock.settimeout(_time_left(deadline))
            chunk = sock.recv(1)
            if not chunk:
                raise ConnectionResetError("end of stream")
            buf += chunk
            if len(buf) > MAX_LINE:
                raise RingError("RDMA endpoint exchange: a message longer than 64 KiB")
    except (BrokenPipeError, ConnectionResetError):
        raise RingError("RDMA endpoint exchange: the peer closed the connection before answering") from None
    except TimeoutError:
        if buf:
            raise RingError(f"RDMA endpoint exchange: the line was not whole within {timeout_s}s ({len(buf)} "
                            "bytes came)") from None
        raise RingError(f"RDMA endpoint exchange: no answer within {timeout_s}s") from None
    return bytes(buf)


def exchange(sock: socket.socket, ours: Endpoint, timeout_s: float = 10.0) -> Endpoint:
    """Send our endpoint, read the peer's (one line each way, out of band), both within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    send_line(sock, ours.encode(), timeout_s, deadline)
    return Endpoint.decode(read_line(sock, timeout_s, deadline))


def refuse(sock: socket.socket, why: str, timeout_s: float = 1.0) -> None:
    """Answer an exchange with a refusal the frontend raises with ``why`` (best effort: it may be gone)."""
    with contextlib.suppress(RingError, OSError):
        send_line(sock, (json.dumps({"error": why}) + "\n").encode(), timeout_s)

# ---------------------------------------------------------------------- queue pairs (pyverbs)
@dataclasses.dataclass(frozen=True, slots=True)
class VerbsConfig:
    device: str | None = None      # None: the first device in /sys/class/infiniband
    port: int = 1
    gid_index: int = 0             # RoCE needs a GID; InfiniBand may use the LID
    queue_depth: int = 256
    max_inline: int = 64
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.port < 1 or self.gid_index < 0 or not 1 <= self.queue_depth <= 65536:
            raise ValueError(f"RDMA config: port >= 1, gid_index >= 0, queue_depth in 1..65536; got {self}")


REMOTE_RING_ACCESS = ("IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_READ", "IBV_ACCESS_REMOTE_WRITE",
                      "IBV_ACCESS_REMOTE_ATOMIC")


@contextlib.contextmanager
def verbs_errors(what: str, kind: type[RingError] = RingError) -> Iterator[None]:
    """pyverbs' own errors (``PyverbsRDMAError``, ``PyverbsError``: a call the device refused) as ``kind``, a
    ``RingError``, saying what failed: the callers keep a RingError as a ring not reached, or lost, and never see
    pyverbs' exceptions. RingErrors pass unchanged."""
    try:
        yield
    except RingError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever pyverbs raises, and it raises several kinds
        raise kind(f"RDMA {what} failed: {exc}") from None


def _access(e: Any, names: Sequence[str]) -> int:
    flags = 0
    for name in names:
        flags |= int(getattr(e, name))
    return flags


class VerbsQueuePair:
    """One RC queue pair on a device, with its CQ and a protection domain: both sides build one."""

    def __init__(self, cfg: VerbsConfig, shared_with: VerbsQueuePair | None = None) -> None:
        pv = _pyverbs()
        from pyverbs import enums as e  # type: ignore[import-not-found]  # noqa: PLC0415
        from pyverbs.cq import CQ  # type: ignore[import-not-found]  # noqa: PLC0415
        from pyverbs.device import Context  # type: ignore[import-not-found]  # noqa: PLC0415
        from pyverbs.pd import PD  # type: ignore[import-not-found]  # noqa: PLC0415
        from pyverbs.qp import QP, QPCap, QPInitAttr  # type: ignore[import-not-found]  # noqa: PLC0415

        self.e, self.pv, self.cfg = e, pv, cfg
        self.ctx: Any = None
        self.pd: Any = None
        self.cq: Any = None
        self.qp: Any = None
        self.owner = shared_with is None  # the first pair owns the device context and protection domain
        try:
            with verbs_errors("queue pair setup"):
                if shared_with is not None:
                    self.ctx, self.pd = shared_with.ctx, shared_with.pd
                else:
                    self.ctx = Context(name=pick_device(cfg.device))
                    if int(self.ctx.query_device().atomic_caps) == int(e.IBV_ATOMIC_NONE):
                        raise RdmaUnavailable("this RDMA device has no atomics: the ring's slot transitions need "
                                              "8-byte CAS")
                    self.pd = PD(self.ctx)
                self.cq = CQ(self.ctx, cfg.queue_depth)
                cap = QPCap(max_send_wr=cfg.queue_depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1,
                            max_inline_data=cfg.max_inline)
                self.qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap,
                                                 sq_sig_all=0))
                self.port_attr = self.ctx.query_port(cfg.port)
        except BaseException:
            with contextlib.suppress(Exception):
                self.close()  # what was made before the failure
            raise
        self.psn = secrets.randbelow(1 << 24)  # a fresh start per pair: no packet of an earlier one is taken

    @property
    def qp_num(self) -> int:
        return int(self.qp.qp_num)

    def endpoint(self, addr: int = 0, rkey: int = 0, size: int = 0) -> Endpoint:
        with verbs_errors(f"GID query (port {self.cfg.port}, index {self.cfg.gid_index})"):
            gid = str(self.ctx.query_gid(self.cfg.port, self.cfg.gid_index)).replace(":", "")
        return Endpoint(self.qp.qp_num, self.psn, int(self.port_attr.lid), gid, int(self.port_attr.active_mtu),
                        addr, rkey, size)

    def connect(self, peer: Endpoint) -> None:
        """RESET -> INIT -> RTR -> RTS towards the peer's queue pair."""
        from pyverbs.addr import GID, AHAttr, GlobalRoute  # type: ignore[import-not-found]  # noqa: PLC0415
        from pyverbs.qp import QPAttr  # type: ignore[import-not-found]  # noqa: PLC0415

        e = self.e
        with verbs_errors(f"queue pair connection to qp {peer.qp_num}"):
            attr = QPAttr(qp_state=e.IBV_QPS_INIT, port_num=self.cfg.port)
            attr.qp_access_flags = _access(e, REMOTE_RING_ACCESS)
            attr.path_mtu = min(peer.mtu, int(self.port_attr.active_mtu))
            attr.dest_qp_num, attr.rq_psn, attr.sq_psn = peer.qp_num, peer.psn, self.psn
            attr.max_rd_atomic = attr.max_dest_rd_atomic = 1
            attr.timeout, attr.retry_cnt, attr.rnr_retry, attr.min_rnr_timer = 14, 7, 7, 12
            gr = GlobalRoute(dgid=GID(":".join(peer.gid[i:i + 4] for i in range(0, 32, 4))),
                             sgid_index=self.cfg.gid_index) if peer.gid.strip("0") else None
            attr.ah_attr = AHAttr(port_num=self.cfg.port, dlid=peer.lid, is_global=gr is not None, gr=gr)
            self.qp.to_rts(attr)

    def close(self) -> None:
        for name in ("qp", "cq", "pd", "ctx") if self.owner else ("qp", "cq"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()


def wc_status_name(e: Any, status: int) -> str:
    """The ``IBV_WC_*_ERR`` name of an error completion's status, from pyverbs' enums (the number where none
    matches; the opcodes share the prefix, not the suffix)."""
    for name in dir(e):
        if name.startswith("IBV_WC_") and name.endswith("_ERR") and getattr(e, name) == status:
            return name
    return str(status)


class VerbsPoster:
    """The frontend side: posts plans on its queue pair against the engine's ring region."""

    def __init__(self, qp: VerbsQueuePair, ring: Endpoint) -> None:
        from pyverbs.mr import MR  # type: ignore[import-not-found]  # noqa: PLC0415

        self.qp, self.ring = qp, ring
        e = qp.e
        self.staging = np.zeros(STAGING_BYTES, np.uint8)
        with verbs_errors("registration of the staging buffer"):
            self.mr = MR(qp.pd, STAGING_BYTES, _access(e, ("IBV_ACCESS_LOCAL_WRITE",)),
                         address=self.staging.ctypes.data)
        self.max_message = min(MAX_MESSAGE, int(qp.port_attr.max_msg_sz))
        self.max_inline = qp.cfg.max_inline
        self._signaled = 0
        self._opcodes = {Opcode.RDMA_WRITE: e.IBV_WR_RDMA_WRITE, Opcode.RDMA_READ: e.IBV_WR_RDMA_READ,
                         Opcode.ATOMIC_CMP_AND_SWP: e.IBV_WR_ATOMIC_CMP_AND_SWP,
                         Opcode.ATOMIC_FETCH_AND_ADD: e.IBV_WR_ATOMIC_FETCH_AND_ADD}

    def post(self, wrs: Sequence[WorkRequest]) -> None:
        from pyverbs.wr import SGE, SendWR  # type: ignore[import-not-found]  # noqa: PLC0415

        for wr in wrs:
            sge = SGE(self.staging.ctypes.data + wr.local, wr.length, self.mr.lkey)
            send = SendWR(opcode=self._opcodes[wr.opcode], num_sge=1, sg=[sge], send_flags=int(wr.flags))
            if wr.opcode in (Opcode.ATOMIC_CMP_AND_SWP, Opcode.ATOMIC_FETCH_AND_ADD):
                send.set_wr_atomic(self.ring.rkey, self.ring.addr + wr.remote, wr.compare, wr.swap)
            else:
                send.set_wr_rdma(self.ring.rkey, self.ring.addr + wr.remote)
            try:
                self.qp.qp.post_send(send)
            except Exception as exc:  # pyverbs' own error (a queue pair in the error state, a full queue)
                raise RingError(f"RDMA post failed: {exc}") from None
            self._signaled += bool(wr.flags & Flag.SIGNALED)

    def wait(self) -> None:
        import time  # noqa: PLC0415

        deadline = time.monotonic() + self.qp.cfg.timeout_s
        while self._signaled:
            try:
                n, wcs = self.qp.cq.poll(self._signaled)
            except Exception as exc:  # pyverbs' own error
                raise RingError(f"RDMA completion queue poll failed: {exc}") from None
            for wc in wcs[:n]:
                if wc.status != self.qp.e.IBV_WC_SUCCESS:
                    raise RingError(f"RDMA work request failed: completion status {wc.status} "
                                    f"({wc_status_name(self.qp.e, int(wc.status))})")
            self._signaled -= n
            if self._signaled and time.monotonic() > deadline:
                raise RingError(f"RDMA: {self._signaled} work requests not completed after {self.qp.cfg.timeout_s}s")

    def close(self) -> None:
        self.mr.close()
        self.qp.close()


class VerbsRegion:
    """The ring's memory registered for remote READ, WRITE and atomics (host memory, or a dma-buf)."""

    def __init__(self, pair: VerbsQueuePair, transport: Transport, dmabuf_fd: int | None = None) -> None:
        from pyverbs.mr import MR, DmaBufMR  # type: ignore[import-not-found]  # noqa: PLC0415

        access = _access(pair.e, REMOTE_RING_ACCESS)
        if dmabuf_fd is not None:  # ring in GPU memory, exported by the driver as a dma-buf
            with verbs_errors(f"registration of the ring's dma-buf ({transport.size} bytes)"):
                self.mr = DmaBufMR(pair.pd, transport.size, access, dmabuf=dmabuf_fd, offset=0)
            self.addr = 0  # a dma-buf region is addressed from IOVA 0
        else:
            base = getattr(transport, "base", None)
            if base is None:
                raise RingError("RDMA export needs a ring mapped in this process (ShmTransport or MemoryTransport)")
            with verbs_errors(f"registration of the ring's memory ({transport.size} bytes; is the memlock limit "
                              "above that?)"):
                self.mr = MR(pair.pd, transport.size, access, address=base)
            self.addr = int(base)
        self.rkey = int(self.mr.rkey)

    def close(self) -> None:
        self.mr.close()


# ---------------------------------------------------------------------- the verbs layer, as both sides use it
class QueuePair(Protocol):
    @property
    def qp_num(self) -> int: ...

    def endpoint(self, addr: int = 0, rkey: int = 0, size: int = 0) -> Endpoint: ...

    def connect(self, peer: Endpoint) -> None:
        """Bring the queue pair up towards ``peer`` (RESET -> INIT -> RTR -> RTS)."""

    def close(self) -> None: ...


class Region(Protocol):
    addr: int
    rkey: int

    def close(self) -> None: ...


class Nic(Protocol):
    """The verbs layer: what the engine's export and the frontend's connection ask of an RDMA device. The one
    implementation of the product is ``PyverbsNic``; ``shared.remote_ring.nic_from_env`` picks it, or what
    ``BLINK_RDMA_NIC`` names (the test harness's stand-in, ``harness/rdma_standin.py``, on machines with no
    device). Everything above this layer (the exchange, the plans, the transport) is the same either way."""

    def check(self, cfg: VerbsConfig) -> None:
        """Raise ``RdmaUnavailable`` naming what is missing (pyverbs, a device, atomics), before any start."""

    def queue_pair(self, cfg: VerbsConfig, shared_with: Any = None) -> QueuePair:
        """A new RC queue pair; ``shared_with``: a pair whose device context and protection domain it uses."""

    def register(self, pair: Any, transport: Transport, dmabuf_fd: int | None = None) -> Region:
        """The ring's memory, registered in ``pair``'s protection domain for remote access."""

    def poster(self, pair: Any, ring: Endpoint) -> Poster:
        """Posting on ``pair`` (connected) against the ring region ``ring`` announced."""


class PyverbsNic:
    """The verbs layer over pyverbs (rdma-core's Python binding): a real device."""

    def check(self, cfg: VerbsConfig) -> None:
        _pyverbs()
        from pyverbs import enums as e  # type: ignore[import-not-found]  # noqa: PLC0415
        from pyverbs.device import Context  # type: ignore[import-not-found]  # noqa: PLC0415

        name = pick_device(cfg.device)
        with verbs_errors(f"check of device {name}", RdmaUnavailable):
            ctx = Context(name=name)
            try:
                if int(ctx.query_device().atomic_caps) == int(e.IBV_ATOMIC_NONE):
                    raise RdmaUnavailable(f"RDMA device {name} has no atomics: the ring's slot transitions need "
                                          "8-byte compare-and-swap")
                ctx.query_port(cfg.port)
            finally:
                ctx.close()

    def queue_pair(self, cfg: VerbsConfig, shared_with: Any = None) -> VerbsQueuePair:
        return VerbsQueuePair(cfg, shared_with)

    def register(self, pair: Any, transport: Transport, dmabuf_fd: int | None = None) -> VerbsRegion:
        return VerbsRegion(pair, transport, dmabuf_fd)

    def poster(self, pair: Any, ring: Endpoint) -> VerbsPoster:
        return VerbsPoster(pair, ring)


class RingExport:
    """The engine side: the ring's memory registered once; each frontend connects a queue pair to it over an
    out-of-band socket, after which the engine is off the data path (the NIC serves the verbs).

    The export's first queue pair owns the device context and the protection domain and serves no frontend;
    each frontend gets its own pair in that domain (``accept``), closed when its lease ends (``drop``)."""

    def __init__(self, transport: Transport, name: str, schema: tuple[int, int], nic: Nic | None = None,
                 cfg: VerbsConfig = VerbsConfig(), dmabuf_fd: int | None = None, secret: bytes = b"") -> None:
        self.nic: Nic = nic or PyverbsNic()
        self.cfg, self.size, self.name, self.schema = cfg, transport.size, name, schema
        self.secret = secret  # non-empty: every frontend's endpoint must be signed with it, and ours is
        self.seen = SeenSignatures()  # the frontend lines accepted lately: none is accepted twice
        self._owner = self.nic.queue_pair(cfg)
        try:
            self.region = self.nic.register(self._owner, transport, dmabuf_fd)
        except BaseException:
            self._owner.close()
            raise

    def accept(self, sock: socket.socket) -> QueuePair:
        """Connect one frontend: read its endpoint from ``sock``, answer with the ring's, bring a queue pair
        up, all within ``cfg.timeout_s`` (one deadline for the whole exchange). A frontend asking for another
        ring, or of another schema major, is refused before any queue pair is made (``ExchangeRefused`` here,
        its reason sent back)."""
        deadline = time.monotonic() + self.cfg.timeout_s
        peer = Endpoint.decode(read_line(sock, self.cfg.timeout_s, deadline))
        why = peer.check_signature(self.secret, "frontend") if self.secret else None
        if why is not None:
            why = f"authentication failed: {why}"
        elif self.secret and not self.seen.first_time(peer.mac):
            why = "authentication failed: this signed endpoint was used already (a replay)"
        elif peer.ring != self.name:
            why = f"this engine exports ring {self.name!r}, not {peer.ring!r}"
        elif peer.schema_major != self.schema[0]:
            why = (f"ring {self.name}: schema version {self.schema[0]}.{self.schema[1]} is incompatible with the "
                   f"frontend's {peer.schema_major}.{peer.schema_minor} (major versions differ); upgrade the older "
                   "side")
        if why is not None:
            refuse(sock, why)
            raise ExchangeRefused(why)
        pair = self.nic.queue_pair(self.cfg, shared_with=self._owner)
        try:
            ours = dataclasses.replace(pair.endpoint(self.region.addr, self.region.rkey, self.size), ring=self.name,
                                       schema_major=self.schema[0], schema_minor=self.schema[1])
            ours = ours.signed(self.secret, "engine", answers=peer.mac) if self.secret else ours
            # up before the answer: the frontend posts as soon as it has it, and this pair must be ready to respond
            pair.connect(peer)
            send_line(sock, ours.encode(), self.cfg.timeout_s, deadline)
        except BaseException:
            pair.close()
            raise
        return pair

    def close(self) -> None:
        """Deregister the ring and release the device (every frontend's pair closed first, by its owner)."""
        try:
            self.region.close()
        finally:
            self._owner.close()


def connect_ring(sock: socket.socket, ring_name: str, cfg: VerbsConfig = VerbsConfig(),
                 nic: Nic | None = None, secret: bytes = b"") -> RdmaTransport:
    """The frontend side of ``RingExport.accept``: the ring as a Transport over a fresh queue pair. ``sock``
    becomes the transport's lease (closed with it). A ring of another schema major is refused here, before
    the queue pair is connected, naming both versions; with ``secret``, our endpoint is signed and an engine's
    that is not signed with it is refused too. Whatever the verbs layer raises is a ``RingError``."""
    nic = nic if nic is not None else PyverbsNic()
    try:
        with verbs_errors("queue pair setup"):
            pair = nic.queue_pair(cfg)
    except BaseException:
        sock.close()
        raise
    poster: Any = None
    try:
        with verbs_errors("queue pair setup"):
            ours = dataclasses.replace(pair.endpoint(), ring=ring_name, schema_major=L.SCHEMA_MAJOR,
                                       schema_minor=L.SCHEMA_MINOR)
        ours = ours.signed(secret, "frontend") if secret else ours
        ring = exchange(sock, ours, cfg.timeout_s)
        if secret and (why := ring.check_signature(secret, "engine", answers=ours.mac)) is not None:
            raise RingError(f"ring {ring_name}: the engine's answer failed authentication: {why}")
        if ring.schema_major != L.SCHEMA_MAJOR:
            raise RingError(f"ring {ring_name}: schema version {ring.schema_major}.{ring.schema_minor} is "
                            f"incompatible with this program's {L.SCHEMA_MAJOR}.{L.SCHEMA_MINOR} (major versions "
                            "differ); upgrade the older side")
        if ring.size <= 0 or ring.rkey == 0:
            raise RingError(f"RDMA: the engine announced no ring region (size {ring.size}, rkey {ring.rkey})")
        with verbs_errors(f"queue pair connection to the engine's qp {ring.qp_num}"):
            pair.connect(ring)
            poster = nic.poster(pair, ring)
        return RdmaTransport(poster, ring.size, lease=sock)
    except BaseException:
        closer = getattr(poster, "close", None)
        if closer is not None:
            closer()  # the poster owns the pair
        else:
            pair.close()
        sock.close()
        raise
