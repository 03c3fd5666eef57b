"""Rings on another host: the ``rdma://HOST:PORT/NAME`` address, the frontend's attach, the engine's export.

The DPU split (docs/RDMA.md): the engine runs on the GPU host and exports its ring (``blink engine
--rdma-listen ADDR:PORT``: ``ExportServer``); the frontend set runs on the DPU and names the ring by its
address (``--ring rdma://HOST:PORT/NAME``: ``attach_remote_ring``). Between them, per frontend process, one
TCP connection (the endpoint exchange, then kept open as the queue pair's lease) and one RC queue pair;
the engine's CPU answers the exchange and is off the data path afterwards.

The verbs layer is ``nic_from_env()``: pyverbs on a real device, or what ``BLINK_RDMA_NIC`` names (the test
harness's stand-in for the NIC). ``rdma_problem`` says, before anything starts, what is missing for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import re
import selectors
import socket
import threading
import time

from shared.env import env
from shared.log import admit_repeat, get_logger
from shared.ring import Ring, attach_ring
from shared.transport import RingError, shm_path
from shared.transport.rdma import (
    Nic,
    PyverbsNic,
    QueuePair,
    RdmaUnavailable,
    RingExport,
    VerbsConfig,
    connect_ring,
    refuse,
)

log = get_logger("rdma")
RDMA_SCHEME = "rdma://"
MAX_PAIRS = 64  # frontend queue pairs an engine serves at once (a frontend set holds one per process)
LISTEN_BACKLOG = 16
DEFAULT_VERBS = VerbsConfig()  # the first device, port 1, GID index 0
# A lease whose peer vanished without closing (its host crashed or lost power, the link cut: no FIN, no RST)
# is found by TCP keepalive: probed after LEASE_IDLE_S of silence, every LEASE_PROBE_S, given up after
# LEASE_PROBES unanswered probes; TCP_USER_TIMEOUT bounds unacknowledged data the same.
LEASE_IDLE_S, LEASE_PROBE_S, LEASE_PROBES = 10, 5, 3


def is_remote(ring: str) -> bool:
    """Whether ``ring`` (a ``--ring`` value) is the address of a ring on another host, not a local name."""
    return ring.lower().startswith(RDMA_SCHEME)


def _host_port(text: str, what: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPV6]:PORT``."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if not rest.startswith(":"):
            raise ValueError(f"{what} {text!r}: write an IPv6 host as [ADDR]:PORT")
        port = rest[1:]
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            raise ValueError(f"{what} {text!r}: HOST:PORT expected")
        if ":" in host:
            raise ValueError(f"{what} {text!r}: write an IPv6 host in brackets, [ADDR]:PORT")
    if not host:
        raise ValueError(f"{what} {text!r}: no host (0.0.0.0 listens on every address)")
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"{what} {text!r}: the port must be a number") from None
    if not 1 <= number <= 65535:
        raise ValueError(f"{what} {text!r}: the port must be within 1..65535")
    return host, number


@dataclasses.dataclass(frozen=True, slots=True)
class RdmaAddress:
    """Where a remote ring is: the engine host's exchange (``host``, ``port``), the ring's name there, and the local
    RDMA device and GID index to reach it by (``?device=NAME&gid_index=N``; default: the first device, index 0)."""

    host: str
    port: int
    name: str
    device: str | None = None
    gid_index: int = 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        query = "&".join(([f"device={self.device}"] if self.device else [])
                         + ([f"gid_index={self.gid_index}"] if self.gid_index else []))
        return f"{RDMA_SCHEME}{host}:{self.port}/{self.name}" + (f"?{query}" if query else "")

    def __str__(self) -> str:
        return self.url

    @property
    def verbs(self) -> VerbsConfig:
        """This side's queue pair settings."""
        return VerbsConfig(device=self.device, gid_index=self.gid_index)

    @property
    def file_name(self) -> str:
        """A name for files of this ring on the frontend's host (``blink serve``'s lock)."""
        return re.sub(r"[^A-Za-z0-9._-]", "_", f"rdma-{self.host}-{self.port}-{self.name}")


def parse_ring_address(text: str) -> RdmaAddress:
    """``rdma://HOST:PORT/NAME[?device=NAME&gid_index=N]``; ValueError saying what is wrong."""
    if not is_remote(text):
        raise ValueError(f"--ring {text!r}: not an RDMA address (rdma://HOST:PORT/NAME)")
    where, slash, rest = text[len(RDMA_SCHEME):].partition("/")
    name, _, query = rest.partition("?")
    if not slash or not name:
        raise ValueError(f"--ring {text!r}: no ring name: rdma://HOST:PORT/NAME, NAME being the engine's --ring")
    try:
        shm_path(name)
    except RingError as exc:
        raise ValueError(f"--ring {text!r}: {exc}") from None
    try:
        host, port = _host_port(where, "HOST:PORT")
    except ValueError as exc:
        raise ValueError(f"--ring {text!r}: {exc}") from None
    options: dict[str, str] = {}
    for item in filter(None, query.split("&")):
        key, eq, value = item.partition("=")
        if key not in ("device", "gid_index") or not eq or not value:
            raise ValueError(f"--ring {text!r}: {item!r}: the address takes device=NAME and gid_index=N")
        options[key] = value
    try:
        gid_index = int(options.get("gid_index", "0"))
        if gid_index < 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"--ring {text!r}: gid_index must be a number >= 0") from None
    return RdmaAddress(host, port, name, options.get("device"), gid_index)


def parse_listen(text: str) -> tuple[str, int]:
    """``--rdma-listen ADDR:PORT``."""
    return _host_port(text, "--rdma-listen")


def nic_from_env() -> Nic:
    """The verbs layer: pyverbs (``PyverbsNic``), or the object ``BLINK_RDMA_NIC=MODULE:NAME`` names (a class
    is instantiated)."""
    spec = env().rdma_nic
    if not spec:
        return PyverbsNic()
    module, _, attr = spec.partition(":")
    try:
        found = getattr(importlib.import_module(module), attr or "Nic")
    except (ImportError, AttributeError, ValueError) as exc:
        raise RdmaUnavailable(f"BLINK_RDMA_NIC={spec}: cannot load the verbs layer it names ({exc})") from None
    return found() if isinstance(found, type) else found


MIN_SECRET = 16  # bytes of BLINK_RDMA_SECRET_FILE's content


def exchange_secret() -> bytes:
    """The shared secret the endpoint exchange is signed with (``BLINK_RDMA_SECRET_FILE``), or b"" (unset: the
    exchange is open). A file that cannot be read, holds fewer than ``MIN_SECRET`` bytes, that its group or others
    may access, or that another user than this process's (or root) owns is a ``RingError`` naming it (a secret
    others can read or rewrite is no secret). Mode and owner are those of the file as opened."""
    path = env().rdma_secret_file
    if path is None:
        return b""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            secret = f.read().strip()
    except OSError as exc:
        raise RingError(f"BLINK_RDMA_SECRET_FILE={path}: cannot read it ({exc.strerror or exc})") from None
    if st.st_mode & 0o077:
        raise RingError(f"BLINK_RDMA_SECRET_FILE={path}: group or others may access it (mode "
                        f"{st.st_mode & 0o777:o}); chmod 600 it")
    if st.st_uid not in (os.geteuid(), 0):
        raise RingError(f"BLINK_RDMA_SECRET_FILE={path}: owned by uid {st.st_uid}, not by this user "
                        f"({os.geteuid()}) or root")
    if len(secret) < MIN_SECRET:
        raise RingError(f"BLINK_RDMA_SECRET_FILE={path}: {len(secret)} bytes; at least {MIN_SECRET}")
    return secret


def rdma_problem(cfg: VerbsConfig = DEFAULT_VERBS) -> str | None:
    """What this host lacks to use the RDMA transport (pyverbs, a device, atomics), or None."""
    try:
        nic_from_env().check(cfg)
    except RdmaUnavailable as exc:
        return str(exc)
    return None


def keep_lease_alive(sock: socket.socket) -> None:
    """TCP keepalive on a lease's connection (both ends): a peer that vanished without closing it is seen gone
    after about ``LEASE_IDLE_S + LEASE_PROBE_S * LEASE_PROBES`` seconds (the engine drops its queue pair, the
    frontend lets the ring go), instead of never. Options this platform lacks are left out."""
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", LEASE_IDLE_S), ("TCP_KEEPINTVL", LEASE_PROBE_S),
                        ("TCP_KEEPCNT", LEASE_PROBES),
                        ("TCP_USER_TIMEOUT", 1000 * (LEASE_IDLE_S + LEASE_PROBE_S * LEASE_PROBES))):
        if hasattr(socket, name):
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    for level, option, value in options:
        with contextlib.suppress(OSError):
            sock.setsockopt(level, option, value)


# ---------------------------------------------------------------------- the frontend side
def attach_remote_ring(addr: RdmaAddress, cfg: VerbsConfig | None = None, nic: Nic | None = None) -> Ring:
    """Connect to the engine's exchange, bring a queue pair up, and attach the ring through it (its header
    read and validated over RDMA, as ``attach_shm_ring`` does over the mapping). ``RingError`` saying why not
    (nothing listening, another ring's name, another schema major, no device). ``cfg``: the address's device
    and GID index unless given."""
    cfg = cfg or addr.verbs
    nic = nic or nic_from_env()
    secret = exchange_secret()  # a bad file refused before any connection
    try:
        sock = socket.create_connection((addr.host, addr.port), timeout=cfg.timeout_s)
    except OSError as exc:
        raise RingError(f"ring {addr}: nothing answers at {addr.host}:{addr.port} ({exc.strerror or exc}); is the "
                        "engine running there with --rdma-listen?") from None
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    keep_lease_alive(sock)
    transport = connect_ring(sock, addr.name, cfg, nic, secret)  # closes the socket when it fails
    try:
        return attach_ring(transport, addr.url)
    except BaseException:
        transport.close()
        raise


# ---------------------------------------------------------------------- the engine side
class ExportServer:
    """The engine's export: ``--rdma-listen ADDR:PORT``.

    Made before the model loads (``nic.check``, the address and the bind fail at once: no device, no pyverbs, a
    host that does not resolve, a port in use); ``start(ring)`` registers the ring and listens. A thread (the
    lease thread) then accepts each frontend's connection and keeps it, once its exchange is done, as the lease
    of that frontend's queue pair, which is closed when the connection ends (the frontend process stopped or
    died; keepalive finds a peer that vanished without closing). Each exchange runs in a thread of its own,
    within one deadline (``cfg.timeout_s``, the whole exchange: a line must arrive whole by then), so a slow or
    silent peer costs only its own attach. None of these threads does anything else: the engine's loop never
    waits on them, and the frontends' verbs reach the ring through the NIC alone. ``close`` (before the ring is
    unmapped) cuts the exchanges under way, ends every lease, which each frontend sees at its next look, and
    deregisters the ring, waiting for its threads a bounded time."""

    def __init__(self, listen: str, cfg: VerbsConfig = DEFAULT_VERBS, nic: Nic | None = None,
                 max_pairs: int = MAX_PAIRS) -> None:
        self.host, self.port = parse_listen(listen)
        self.cfg, self.max_pairs = cfg, max_pairs
        self.nic = nic or nic_from_env()
        self.nic.check(cfg)
        self.secret = exchange_secret()  # read before the model loads: a bad file fails the start at once
        try:
            family, kind, proto, _, where = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM,
                                                               flags=socket.AI_PASSIVE)[0]
        except socket.gaierror as exc:
            raise RingError(f"--rdma-listen {listen}: cannot resolve {self.host!r} ({exc.strerror or exc})") from None
        try:
            self.listener = socket.socket(family, kind, proto)
        except OSError as exc:
            raise RingError(f"--rdma-listen {listen}: cannot open a socket ({exc.strerror or exc})") from None
        try:
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.listener.bind(where)
        except OSError as exc:
            self.listener.close()
            raise RingError(f"--rdma-listen {listen}: cannot bind ({exc.strerror or exc})") from None
        self.export: RingExport | None = None
        # under _lock: the leases (each frontend's connection and queue pair, from the end of its exchange), those
        # the lease thread does not watch yet, the exchanges under way (their sockets), and the exchanges' threads
        # (until they end: one still logs after its exchange is off the books)
        self._lock = threading.Lock()
        self.leases: dict[socket.socket, QueuePair] = {}
        self._unwatched: list[socket.socket] = []
        self._exchanges: set[socket.socket] = set()
        self._workers: list[threading.Thread] = []
        self._stopping = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._thread: threading.Thread | None = None

    def start(self, ring: Ring) -> None:
        """Register ``ring``'s memory and answer exchanges from now on."""
        header = ring.read_header()
        self.export = RingExport(ring.transport, ring.name, (int(header["schema_major"]), int(header["schema_minor"])),
                                 self.nic, self.cfg, secret=self.secret)
        self.listener.listen(LISTEN_BACKLOG)
        self.listener.setblocking(False)  # accepted only when the selector says one waits
        self._thread = threading.Thread(target=self._serve, name="rdma-export", daemon=True)
        self._thread.start()
        log.info("rdma export ready", listen=f"{self.host}:{self.port}", ring=ring.name, size=ring.transport.size,
                 rkey=self.export.region.rkey, exchange="signed" if self.secret else "open")

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while True:
                for key, _ in sel.select():
                    if key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                        if self._stopping:
                            return
                        self._watch_new(sel)
                    elif key.fileobj is self.listener:
                        self._accept()
                    else:
                        self._lease_event(sel, key.fileobj)  # type: ignore[arg-type]
        finally:
            with self._lock:
                self._stopping = True  # an exchange that ends now closes its own pair
                ending = list(self.leases)
            for conn in ending:
                self._drop(sel, conn, "the engine is stopping")
            sel.close()

    def _accept(self) -> None:
        """A connection waits: its exchange goes to a thread of its own (refused at once past ``max_pairs``)."""
        try:
            conn, peer = self.listener.accept()
        except OSError:
            return
        keep_lease_alive(conn)
        with self._lock:
            stopping = self._stopping
            busy = len(self.leases) + len(self._exchanges)
            if not stopping and busy < self.max_pairs:
                thread = threading.Thread(target=self._exchange, args=(conn, str(peer)), name="rdma-exchange",
                                          daemon=True)
                self._exchanges.add(conn)
                self._workers = [t for t in self._workers if t.is_alive()] + [thread]
                thread.start()
                return
        if not stopping:
            refuse(conn, f"this engine serves {self.max_pairs} frontend queue pairs already")
            if (repeated := admit_repeat("rdma frontend refused: too many queue pairs")) is not None:
                log.warning("rdma frontend refused: too many queue pairs", peer=str(peer), pairs=len(self.leases),
                            exchanges=busy - len(self.leases), repeated=repeated)
        conn.close()

    def _exchange(self, conn: socket.socket, peer: str) -> None:
        """In its own thread: one frontend's exchange (``RingExport.accept``, one deadline for all of it); the
        pair it brought up is a lease from then on, which the lease thread watches."""
        export, pair, failure = self.export, None, None
        try:
            if export is None:
                raise RingError("the export is closed")
            pair = export.accept(conn)
        except Exception as exc:  # noqa: BLE001 - a failed exchange (or device call) costs that frontend only
            failure = exc
        with self._lock:
            self._exchanges.discard(conn)  # from now on close() leaves this socket to this thread
            stopping = self._stopping
            if pair is not None and not stopping:
                self.leases[conn] = pair
                self._unwatched.append(conn)
                pairs = len(self.leases)
        if pair is not None and not stopping:
            log.info("rdma frontend connected", peer=peer, qp=pair.qp_num, pairs=pairs)
            with contextlib.suppress(OSError):
                self._wake_w.send(b"x")
            return
        conn.close()
        if pair is not None:  # the engine began stopping meanwhile: nobody will hold this pair's lease
            self._close_pair(pair)
        if failure is not None and not stopping:  # (stopping: close() cut it)
            error, kind = str(failure), type(failure).__name__
            if (repeated := admit_repeat("rdma exchange failed", kind, error)) is not None:
                log.warning("rdma exchange failed", peer=peer, error=error, kind=kind, repeated=repeated)

    def _watch_new(self, sel: selectors.BaseSelector) -> None:
        """The leases of the exchanges done since the last look, watched from now on."""
        with self._lock:
            new, self._unwatched = self._unwatched, []
        for conn in new:
            conn.setblocking(False)
            sel.register(conn, selectors.EVENT_READ)

    def _lease_event(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        """A frontend's connection is readable: its end (or anything it sends, which the exchange has not
        got: the lease carries nothing) ends its queue pair."""
        try:
            got = conn.recv(1)
        except BlockingIOError:
            return
        except OSError:
            got = b""  # reset, or keepalive gave up on a peer that vanished
        self._drop(sel, conn, "the frontend closed its connection" if not got else "the frontend sent after the "
                   "exchange")

    def _drop(self, sel: selectors.BaseSelector, conn: socket.socket, why: str) -> None:
        with self._lock:
            pair = self.leases.pop(conn)
            pairs = len(self.leases)
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(conn)
        conn.close()
        self._close_pair(pair)
        log.info("rdma frontend gone", qp=pair.qp_num, why=why, pairs=pairs)

    @staticmethod
    def _close_pair(pair: QueuePair) -> None:
        try:
            pair.close()
        except Exception as exc:  # noqa: BLE001 - one pair's teardown must not end the others' leases
            log.warning("rdma queue pair not closed cleanly", qp=pair.qp_num, error=str(exc))

    def close(self) -> None:
        """Cut the exchanges under way, end every lease, deregister the ring, stop listening (idempotent). Waits
        for the export's threads at most ``cfg.timeout_s`` (an exchange's own deadline) in all."""
        if self._thread is not None:
            with self._lock:
                self._stopping = True
                for conn in self._exchanges:  # its thread's recv or send returns at once, failed
                    with contextlib.suppress(OSError):
                        conn.shutdown(socket.SHUT_RDWR)
                workers = list(self._workers)
            with contextlib.suppress(OSError):
                self._wake_w.send(b"x")
            until = time.monotonic() + self.cfg.timeout_s
            threads = [self._thread, *workers]
            for thread in threads:
                thread.join(max(0.0, until - time.monotonic()))
            if stuck := [thread.name for thread in threads if thread.is_alive()]:
                log.warning("rdma export: threads not stopped in time; closing without them", threads=stuck,
                            waited_s=self.cfg.timeout_s)
            self._thread = None
        export, self.export = self.export, None
        try:
            if export is not None:
                export.close()
        finally:
            for s in (self.listener, self._wake_r, self._wake_w):
                s.close()


def export_problem(listen: str) -> str | None:
    """Why ``--rdma-listen`` cannot be served here, without binding anything (``blink serve``'s early check)."""
    try:
        parse_listen(listen)
    except ValueError as exc:
        return str(exc)
    return rdma_problem()


__all__ = ["ExportServer", "RdmaAddress", "attach_remote_ring", "export_problem", "is_remote", "nic_from_env",
           "parse_listen", "parse_ring_address", "rdma_problem"]
