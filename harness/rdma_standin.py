"""A stand-in for the RDMA NIC, for machines without one: it replaces the NIC and nothing else.

The RDMA path of the product is the connection exchange (``shared.transport.rdma``: ``Endpoint`` over TCP,
``RingExport``, ``connect_ring``), the work-request plans, ``RdmaTransport``, and under them the verbs layer
(``Nic``: queue pairs, memory registration, posting), which needs a device. ``SharedMemoryNic`` is that
layer for processes on one host: ``BLINK_RDMA_NIC=harness.rdma_standin:SharedMemoryNic`` in the engine's and
the frontend's environment puts it in place of ``PyverbsNic``, and everything above it runs as it would on
a device.

What it does is what a NIC does with the work requests it is given, nothing more: RDMA WRITE, RDMA READ,
ATOMIC_CMP_AND_SWP and ATOMIC_FETCH_AND_ADD, executed on the memory region the engine registered. On one host
that region is the engine's shared-memory segment, which the poster maps to play the part of the NIC's DMA
engine: it reads and writes that mapping only as a work request says, at the offset the request's remote
address and the registration give, through the staging buffer the transport posts from.

What a NIC checks, it checks, so that the error paths are real:

* the remote address and rkey must fall in a region the peer has registered: a stale rkey (the engine
  deregistered its ring, or restarted and registered a new one) completes with ``IBV_WC_REM_ACCESS_ERR``;
* the peer's queue pair must exist and be connected to this one: a peer that is gone (its process ended,
  its pair destroyed) completes with ``IBV_WC_RETRY_EXC_ERR``, as a responder that never answers does;
* atomics are 8 bytes at 8-byte-aligned addresses (``IBV_WC_REM_INV_REQ_ERR``);
* after an error completion the queue pair is in the error state: what follows is flushed
  (``IBV_WC_WR_FLUSH_ERR``), and ``wait`` raises as ``VerbsPoster.wait`` does.

Registrations and queue pairs are records in this user's folder in /dev/shm (the NIC's tables); a record
whose process has ended counts for nothing, as the kernel releases a dead process's verbs resources.

What it cannot show: it executes each work request when it is posted, in posting order (a real RC queue
pair completes later, in the same order), so it cannot reorder, delay or lose packets; there is no PCIe, no
wire, no timing worth measuring. ``StandInPoster.link_down_after`` is its one fault: after that many more
work requests the link is down (``IBV_WC_RETRY_EXC_ERR``), the peer gone in the middle of a transition.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shared.ring import pid_alive
from shared.transport import SHM_DIR, RingError, ShmTransport, Transport
from shared.transport.rdma import (
    MAX_MESSAGE,
    STAGING_BYTES,
    Endpoint,
    Opcode,
    RdmaUnavailable,
    VerbsConfig,
    WorkRequest,
)

# enum ibv_wc_status
STATUS = {"WR_FLUSH_ERR": 5, "LOC_PROT_ERR": 4, "REM_INV_REQ_ERR": 9, "REM_ACCESS_ERR": 10, "RETRY_EXC_ERR": 12}
GID = "fe800000000000000000000000000001"  # a link-local GID: any non-zero one routes the stand-in's pairs
MTU_4096 = 5


def registry() -> Path:
    """This user's folder of registration and queue-pair records, private."""
    folder = SHM_DIR / f"blink-rdma-standin-{os.geteuid()}"
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise RdmaUnavailable(f"the stand-in NIC's folder {folder} is not a private directory of this user")
    return folder


def _create(path: Path, record: dict[str, Any]) -> bool:
    """Write a new record; False when the name is taken."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    return True


def _replace(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def _read(path: Path) -> dict[str, Any] | None:
    """A record whose process is alive, else None."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if pid_alive(int(record.get("pid", 0))) else None


def _sweep(folder: Path) -> None:
    """Remove the records of processes that ended (their resources went with them)."""
    for path in folder.glob("*.json"):
        if _read(path) is None:
            with contextlib.suppress(OSError):
                path.unlink()


class StandInPair:
    """A queue pair: a number, a PSN, and (once connected) its peer, in a record the peer's poster checks."""

    def __init__(self, cfg: VerbsConfig) -> None:
        self.cfg = cfg
        self.folder = registry()
        self.psn = secrets.randbelow(1 << 24)
        self.peer: Endpoint | None = None
        while True:
            self.qp_num = 1 + secrets.randbelow((1 << 24) - 1)
            if _create(self._path, {"pid": os.getpid(), "peer": 0}):
                break

    @property
    def _path(self) -> Path:
        return self.folder / f"qp-{self.qp_num}.json"

    def endpoint(self, addr: int = 0, rkey: int = 0, size: int = 0) -> Endpoint:
        return Endpoint(self.qp_num, self.psn, 0, GID, MTU_4096, addr, rkey, size)

    def connect(self, peer: Endpoint) -> None:
        self.peer = peer
        _replace(self._path, {"pid": os.getpid(), "peer": peer.qp_num})

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._path.unlink()


class StandInRegion:
    """A registration: the segment behind ``transport`` (by name and inode), its address here, and an rkey."""

    def __init__(self, transport: Transport) -> None:
        name, ino, base = (getattr(transport, a, None) for a in ("name", "ino", "base"))
        if not isinstance(name, str) or not isinstance(ino, int) or base is None:
            raise RdmaUnavailable("the stand-in NIC registers a shared-memory segment only (ShmTransport)")
        self.folder = registry()
        _sweep(self.folder)
        self.addr = int(base)
        record = {"pid": os.getpid(), "segment": name, "ino": ino, "addr": self.addr, "size": transport.size}
        while True:
            self.rkey = 1 + secrets.randbelow((1 << 32) - 1)
            if _create(self.folder / f"mr-{self.rkey}.json", {**record, "rkey": self.rkey}):
                break

    def close(self) -> None:
        with contextlib.suppress(OSError):
            (self.folder / f"mr-{self.rkey}.json").unlink()


class StandInPoster:
    """Executes posted work requests on the peer's registered memory, in posting order (see the module)."""

    def __init__(self, pair: StandInPair, ring: Endpoint) -> None:
        self.pair, self.ring = pair, ring
        self.staging = np.zeros(STAGING_BYTES, np.uint8)
        self.max_message = MAX_MESSAGE
        self.max_inline = pair.cfg.max_inline
        self.link_down_after: int | None = None  # the fault: work requests still carried before the link goes
        self.executed = 0  # work requests carried out on the peer's memory
        self._error: str | None = None
        self._mem: ShmTransport | None = None
        self._reg: dict[str, Any] | None = None

    def _fail(self, status: str, detail: str) -> None:
        if self._error is None:
            self._error = f"RDMA work request failed: completion status {STATUS[status]} (IBV_WC_{status}): {detail}"

    def _target(self) -> tuple[str, str] | None:
        """What a NIC would find wrong with the peer now: its queue pair, its registration, its memory."""
        peer = self.pair.peer
        if peer is None:
            return "RETRY_EXC_ERR", "the queue pair was never connected"
        folder = self.pair.folder
        qp = _read(folder / f"qp-{peer.qp_num}.json")
        if qp is None or qp.get("peer") != self.pair.qp_num:
            return "RETRY_EXC_ERR", (f"queue pair {peer.qp_num} does not answer (the engine's side is gone: its "
                                     "process ended, or it closed the pair)")
        reg = _read(folder / f"mr-{self.ring.rkey}.json")
        if reg is None:
            return "REM_ACCESS_ERR", (f"rkey {self.ring.rkey:#x} is not registered (a stale registration: the "
                                      "engine deregistered its ring, or restarted and registered another)")
        if self._mem is None or self._reg is None or self._reg["ino"] != reg["ino"]:
            if self._mem is not None:
                self._mem.close()
                self._mem = None
            try:
                mem = ShmTransport.attach(reg["segment"])
            except RingError as exc:
                return "REM_ACCESS_ERR", f"the registered memory is gone ({exc})"
            if mem.ino != reg["ino"]:
                mem.close()
                return "REM_ACCESS_ERR", "the registered segment was replaced (a stale registration)"
            self._mem = mem
        self._reg = reg
        return None

    def post(self, wrs: Sequence[WorkRequest]) -> None:
        problem = None if self._error is not None else self._target()
        for wr in wrs:
            if self._error is not None:
                continue  # IBV_WC_WR_FLUSH_ERR: the queue pair is in the error state
            if self.link_down_after is not None:
                if self.link_down_after <= 0:
                    problem = ("RETRY_EXC_ERR", "the link went down (no ACK from the responder)")
                else:
                    self.link_down_after -= 1
            if problem is not None:
                self._fail(*problem)
                continue
            bad = self._execute(wr)
            if bad is not None:
                self._fail(*bad)
            else:
                self.executed += 1

    def _execute(self, wr: WorkRequest) -> tuple[str, str] | None:
        reg, mem = self._reg, self._mem
        assert reg is not None and mem is not None
        address = self.ring.addr + wr.remote
        off = address - int(reg["addr"])
        if off < 0 or off + wr.length > int(reg["size"]):
            return "REM_ACCESS_ERR", f"[{address:#x}, +{wr.length}) is outside the region rkey {self.ring.rkey:#x}"
        if wr.local < 0 or wr.local + wr.length > self.staging.size:
            return "LOC_PROT_ERR", f"staging [{wr.local}, +{wr.length}) is outside the local region"
        local = self.staging[wr.local : wr.local + wr.length]
        if wr.opcode == Opcode.RDMA_WRITE:
            mem.write(off, local)
        elif wr.opcode == Opcode.RDMA_READ:
            mem.read_into(off, local)
        else:
            if wr.length != 8 or address % 8:
                return "REM_INV_REQ_ERR", f"an atomic of {wr.length} bytes at {address:#x}: 8, 8-byte aligned"
            if wr.opcode == Opcode.ATOMIC_CMP_AND_SWP:
                old = mem.cas64(off, wr.compare, wr.swap)
            else:
                old = mem.fetch_add64(off, wr.compare)
            local.view(np.uint64)[0] = old
        return None

    def wait(self) -> None:
        if self._error is not None:
            raise RingError(self._error)

    def close(self) -> None:
        if self._mem is not None:
            self._mem.close()
            self._mem = None
        self.pair.close()


class SharedMemoryNic:
    """The verbs layer (``shared.transport.rdma.Nic``) for processes on one host, without a device."""

    def check(self, cfg: VerbsConfig) -> None:
        registry()

    def queue_pair(self, cfg: VerbsConfig, shared_with: Any = None) -> StandInPair:
        return StandInPair(cfg)

    def register(self, pair: Any, transport: Transport, dmabuf_fd: int | None = None) -> StandInRegion:
        if dmabuf_fd is not None:
            raise RdmaUnavailable("the stand-in NIC registers host memory only, not a dma-buf")
        return StandInRegion(transport)

    def poster(self, pair: StandInPair, ring: Endpoint) -> StandInPoster:
        return StandInPoster(pair, ring)
