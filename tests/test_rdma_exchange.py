"""The RDMA path without a device, from the exchange up: real TCP sockets, the engine's ``ExportServer``, the
frontend's ``attach_remote_ring`` and ``RingWatch``, the services' reactions, over the test harness's stand-in
for the NIC (``harness/rdma_standin.py``: it executes the posted work requests on the engine's registered
shared memory and checks what a NIC checks). Nothing here is faked above the verbs layer.

Error paths: a peer that disappears mid-transition (the link down between two work requests of a
publication; the engine gone between two accesses), a stale registration (an rkey of an engine that
restarted), a schema major mismatch (refused in the exchange, and in the header read over RDMA), another
ring's name, an engine that does not answer, nothing listening, too many queue pairs, and no pyverbs; a peer
that trickles its exchange (cut at the deadline, holding up neither other frontends nor the engine's stop), the
verbs layer's own errors (a RingError, and the watch attaches again), an address that does not resolve, and
the leases' keepalive.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from dpu_gateway import ringwatch
from dpu_gateway.reader import RESTARTED, ReaderConfig, TokenReader
from dpu_gateway.ringwatch import RingWatch
from dpu_gateway.tracker import SlotTracker, TrackerConfig
from harness.rdma_standin import SharedMemoryNic, StandInPair, StandInPoster
from harness.serve_proc import free_port
from shared import messages as m
from shared import remote_ring
from shared import ring_layout as L
from shared.engine_slots import SlotEngine
from shared.env import Env
from shared.remote_ring import ExportServer, RdmaAddress, attach_remote_ring, parse_listen, parse_ring_address
from shared.ring import HEADER_OFF, Ring, RingGeometry, create_shm_ring
from shared.slots import SlotRequest, SlotWriter
from shared.transport import RingError, ShmTransport
from shared.transport.rdma import ExchangeRefused, RdmaTransport, RdmaUnavailable, VerbsConfig

GEO = RingGeometry(num_slots=8, max_prompt_tokens=32, max_output_tokens=16, top_logprobs=2)
NIC = SharedMemoryNic()
S = L.SlotState


@dataclasses.dataclass
class Engine:
    """An engine's side in this process: its ring (created in shared memory, served by ``SlotEngine``) and its
    export on a TCP port of this host."""

    ring: Ring
    export: ExportServer
    address: RdmaAddress

    @property
    def slots(self) -> SlotEngine:
        return SlotEngine(self.ring)

    def stop(self) -> None:
        """As a stopping engine does: its leases end, the ring is deregistered, then unlinked."""
        self.export.close()
        self.ring.transport.unlink()  # type: ignore[attr-defined]
        self.ring.close()


def start_engine(name: str, port: int | None = None, **export: object) -> Engine:
    ring = create_shm_ring(name, GEO)
    ring.header_store32("engine_state", L.EngineState.READY)
    ring.header_store64("heartbeat", 1)
    port = port or free_port()
    server = ExportServer(f"127.0.0.1:{port}", nic=NIC, **export)  # type: ignore[arg-type]
    server.start(ring)
    return Engine(ring, server, RdmaAddress("127.0.0.1", port, name))


STANDIN = "harness.rdma_standin:SharedMemoryNic"


@pytest.fixture(autouse=True)
def standin_nic(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's environment as a process started with BLINK_RDMA_NIC naming the stand-in: the services'
    watches (which pick the verbs layer themselves) use it."""
    monkeypatch.setattr(remote_ring, "env", lambda: Env.from_environ({**os.environ, "BLINK_RDMA_NIC": STANDIN}))


@pytest.fixture
def engine(ring_name: str) -> Iterator[Engine]:
    eng = start_engine(ring_name)
    yield eng
    eng.stop()


def attach(eng: Engine, **cfg: object) -> Ring:
    return attach_remote_ring(eng.address, VerbsConfig(**cfg), NIC)  # type: ignore[arg-type]


def eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < end, "condition still false"
        time.sleep(0.01)


def publish(ring: Ring, slot: int, req_id: int = 7) -> int:
    writer = SlotWriter(ring)
    seq = writer.try_reserve(slot, int(ring.read_slots()[slot]["seq"]))
    assert seq is not None
    writer.publish(slot, seq, SlotRequest(req_id, np.arange(1, 6, dtype=np.int32), m.Sampling(4)))
    return seq


class Trickler:
    """A peer of the exchange port that sends its line a byte at a time, every ``every_s``, and never ends it."""

    def __init__(self, port: int, every_s: float = 0.2) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._trickle, args=(every_s,), daemon=True)
        self._thread.start()

    def _trickle(self, every_s: float) -> None:
        while True:
            try:
                self.sock.send(b" ")
            except OSError:
                return
            if self._stop.wait(every_s):
                return

    def cut_off(self) -> bool:
        """Whether the engine closed this connection."""
        try:
            return self.sock.recv(1, socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sock.close()


class PyverbsRDMAError(Exception):
    """What pyverbs raises for a call the device refused: not a RingError."""


class CountingNic(SharedMemoryNic):
    """The stand-in, counting the queue pairs made for frontends (those sharing the export's domain)."""

    def __init__(self) -> None:
        self.frontend_pairs = 0

    def queue_pair(self, cfg: VerbsConfig, shared_with: object = None) -> StandInPair:
        self.frontend_pairs += shared_with is not None
        return super().queue_pair(cfg, shared_with)


class Lines:
    """Stands in for a module's logger: the lines it was given, (level, event, fields)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict]] = []

    def __getattr__(self, level: str) -> Callable[..., None]:
        return lambda event, **fields: self.lines.append((level, event, fields))

    def named(self, event: str) -> list[dict]:
        return [fields for _, e, fields in self.lines if e == event]


class Chan:
    """Stands in for a gateway's link: what a service sends it."""

    def __init__(self) -> None:
        self.sent: list = []
        self.info: dict = {}

    def send(self, msg: object) -> None:
        self.sent.append(msg)


# ---------------------------------------------------------------------- addresses
def test_ring_addresses_and_listen_addresses_parse_or_say_why() -> None:
    a = parse_ring_address("rdma://gpu-host:7471/blink-ring")
    assert (a.host, a.port, a.name, a.url) == ("gpu-host", 7471, "blink-ring", "rdma://gpu-host:7471/blink-ring")
    v6 = parse_ring_address("rdma://[fd00::1]:7471/r")
    assert (v6.host, v6.url, v6.file_name) == ("fd00::1", "rdma://[fd00::1]:7471/r", "rdma-fd00__1-7471-r")
    assert parse_listen("0.0.0.0:7471") == ("0.0.0.0", 7471)
    for bad, why in (("rdma://h:1/", "no ring name"), ("rdma://h/x", "HOST:PORT expected"),
                     ("rdma://::1:5/x", "IPv6 host in brackets"), ("rdma://h:0/x", "1..65535"),
                     ("rdma://h:1/a/b", "invalid ring name"), ("blink-ring", "not an RDMA address")):
        with pytest.raises(ValueError, match=why):
            parse_ring_address(bad)
    with pytest.raises(ValueError, match="no host"):
        parse_listen(":7471")
    # the frontend's own device and GID index (a DPU has several devices: the one on the host's link)
    dev = parse_ring_address("rdma://192.168.100.1:7471/blink-ring?device=mlx5_2&gid_index=3")
    assert (dev.name, dev.verbs.device, dev.verbs.gid_index) == ("blink-ring", "mlx5_2", 3)
    assert dev.url == "rdma://192.168.100.1:7471/blink-ring?device=mlx5_2&gid_index=3"
    assert a.verbs == VerbsConfig()
    for bad, why in (("rdma://h:1/r?port=2", "takes device=NAME and gid_index=N"),
                     ("rdma://h:1/r?gid_index=-1", "gid_index must be a number")):
        with pytest.raises(ValueError, match=why):
            parse_ring_address(bad)


# ---------------------------------------------------------------------- the exchange over real sockets
def test_a_frontend_attaches_over_tcp_and_its_publication_lands_in_the_engines_memory(engine: Engine) -> None:
    ring = attach(engine)
    try:
        assert isinstance(ring.transport, RdmaTransport) and ring.transport.local_view() is None
        assert ring.geometry.segment_bytes == GEO.segment_bytes and ring.geometry.num_slots == GEO.num_slots
        assert ring.name == engine.address.url
        eventually(lambda: len(engine.export.leases) == 1)
        seq = publish(ring, 3)
        # the engine sees it in its own memory: state word, prompt, the flip and the doorbell
        assert engine.slots.scan_pending() == [(3, seq)]
        meta = engine.slots.claim(3, seq)
        assert meta is not None and int(meta["request_id"]) == 7
        assert engine.slots.prompt(3, 5).tolist() == [1, 2, 3, 4, 5]
        assert ring.header_load64("doorbell") == 1
    finally:
        ring.close()
    eventually(lambda: not engine.export.leases)  # the frontend's end closed: the engine drops its pair


def test_the_exchange_refuses_another_rings_name(engine: Engine) -> None:
    wrong = dataclasses.replace(engine.address, name="another-ring")
    with pytest.raises(ExchangeRefused, match=f"exports ring '{engine.address.name}', not 'another-ring'"):
        attach_remote_ring(wrong, nic=NIC)
    assert not engine.export.leases


def with_secret(monkeypatch: pytest.MonkeyPatch, path: Path | None) -> None:
    """This process as one started with BLINK_RDMA_SECRET_FILE=path (None: unset), the stand-in NIC kept."""
    extra = {} if path is None else {"BLINK_RDMA_SECRET_FILE": str(path)}
    monkeypatch.setattr(remote_ring, "env",
                        lambda: Env.from_environ({**os.environ, "BLINK_RDMA_NIC": STANDIN, **extra}))


def secret_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / f"secret-{len(list(tmp_path.iterdir()))}"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_signed_exchange_attaches_and_an_unsigned_or_wrongly_signed_peer_is_refused(
        ring_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With BLINK_RDMA_SECRET_FILE the engine signs its answer and refuses a frontend whose line is unsigned or
    signed with another secret before making a queue pair for it; a frontend with a secret refuses an engine
    that answers unsigned. The same secret on both sides attaches and serves."""
    good = secret_file(tmp_path, "correct horse battery staple\n")
    with_secret(monkeypatch, good)
    eng = start_engine(ring_name)  # reads the secret now
    try:
        ring = attach_remote_ring(eng.address, nic=NIC)
        assert ring.engine_alive(10.0)
        ring.close()
        with_secret(monkeypatch, None)
        with pytest.raises(ExchangeRefused, match="authentication failed: the peer's endpoint is not signed"):
            attach_remote_ring(eng.address, nic=NIC)
        with_secret(monkeypatch, secret_file(tmp_path, "another secret of enough bytes"))
        with pytest.raises(ExchangeRefused, match="signature does not match"):
            attach_remote_ring(eng.address, nic=NIC)
        eventually(lambda: len(eng.export.leases) == 0)  # refused before any queue pair was made for them
    finally:
        eng.stop()
    with_secret(monkeypatch, None)
    open_engine = start_engine(ring_name)  # no secret: the engine answers unsigned
    try:
        with_secret(monkeypatch, good)
        with pytest.raises(RingError, match="engine's answer failed authentication: .* not signed"):
            attach_remote_ring(open_engine.address, nic=NIC)
    finally:
        open_engine.stop()


def test_a_signed_frontend_line_sent_again_is_refused_by_the_engine(
        ring_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A frontend's signed line, replayed within its window by whoever saw it, gets a refusal, not a lease."""
    from shared.transport.rdma import Endpoint

    key = secret_file(tmp_path, "correct horse battery staple\n")
    with_secret(monkeypatch, key)
    eng = start_engine(ring_name)
    try:
        line = Endpoint(qp_num=5, psn=7, lid=1, gid="", mtu=3, ring=ring_name, schema_major=L.SCHEMA_MAJOR,
                        schema_minor=L.SCHEMA_MINOR).signed(key.read_bytes().strip(), "frontend").encode()
        answers = []
        for _ in range(2):
            with socket.create_connection(("127.0.0.1", eng.address.port), timeout=30) as sock:
                sock.sendall(line)
                answers.append(sock.makefile("rb").readline())
        assert "error" not in json.loads(answers[0])
        assert "used already (a replay)" in json.loads(answers[1])["error"]
    finally:
        eng.stop()


def test_a_stale_signature_is_refused() -> None:
    from shared.transport.rdma import SIGNATURE_WINDOW_S, Endpoint

    ep = Endpoint(qp_num=5, psn=7, lid=1, gid="", mtu=3, ring="r").signed(b"s" * 16, "frontend")
    assert ep.check_signature(b"s" * 16, "frontend") is None
    old = dataclasses.replace(ep, ts=ep.ts - int((SIGNATURE_WINDOW_S + 1) * 1e9))
    assert "signature does not match" in (old.check_signature(b"s" * 16, "frontend") or "")  # ts is signed too
    resigned = dataclasses.replace(old, mac="")
    resigned = dataclasses.replace(resigned, mac=resigned._digest(b"s" * 16, "frontend", ""))
    assert "signed more than" in (resigned.check_signature(b"s" * 16, "frontend") or "")
    forged = dataclasses.replace(ep, qp_num=6)  # another queue pair under the first one's signature
    assert "does not match" in (forged.check_signature(b"s" * 16, "frontend") or "")


def test_a_signature_covers_the_signer_s_role_and_the_line_the_engine_answers() -> None:
    """An engine's signed answer is no frontend line (reflected to an engine, it is refused), and it answers one
    frontend line: checked against another, it is refused."""
    from shared.transport.rdma import Endpoint

    key = b"k" * 16
    asked = Endpoint(qp_num=5, psn=7, lid=1, gid="", mtu=3, ring="r").signed(key, "frontend")
    answer = Endpoint(qp_num=9, psn=1, lid=1, gid="", mtu=3, ring="r", rkey=3, size=64).signed(key, "engine",
                                                                                              answers=asked.mac)
    assert answer.check_signature(key, "engine", answers=asked.mac) is None
    assert "does not match" in (answer.check_signature(key, "frontend") or "")  # reflected: not a frontend's
    other = Endpoint(qp_num=6, psn=7, lid=1, gid="", mtu=3, ring="r").signed(key, "frontend")
    assert "does not match" in (answer.check_signature(key, "engine", answers=other.mac) or "")
    assert "does not match" in (asked.check_signature(key, "engine") or "")
    with pytest.raises(ValueError, match="role"):
        asked.signed(key, "client")


def test_unsigned_lines_carry_no_signature_fields_and_bad_ones_are_malformed() -> None:
    """Without a secret the line is what an engine that knows no signature reads (no ts, no mac); a signed line's
    ts and mac of the wrong types are a malformed message (a RingError), not a TypeError."""
    from shared.transport.rdma import Endpoint

    plain = Endpoint(qp_num=5, psn=7, lid=1, gid="", mtu=3, ring="r")
    assert set(json.loads(plain.encode())) == {f.name for f in dataclasses.fields(Endpoint)} - {"ts", "mac"}
    assert Endpoint.decode(plain.encode()) == plain
    signed = plain.signed(b"s" * 16, "frontend")
    assert Endpoint.decode(signed.encode()) == signed
    for bad in ({"mac": 5}, {"mac": "\u00e9" * 64}, {"ts": "1"}, {"ts": 1.5}):
        line = json.dumps({**json.loads(signed.encode()), **bad}).encode()
        with pytest.raises(RingError, match="malformed"):
            Endpoint.decode(line)


def test_the_engine_refuses_a_signed_frontend_line_it_accepted_already(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused again within twice the window (a line's time may be that far from the engine's clock either way),
    forgotten after it (its time is refused by then): the clock is this test's, so a slow host changes nothing."""
    from shared.transport import rdma

    now = [10**12]
    monkeypatch.setattr(rdma.time, "monotonic_ns", lambda: now[0])
    seen = rdma.SeenSignatures(window_s=60.0)
    assert seen.first_time("a") and seen.first_time("b") and not seen.first_time("a")
    now[0] += 119 * 10**9
    assert not seen.first_time("a")
    now[0] += 2 * 10**9  # 121 s after "a" was accepted
    assert seen.first_time("a")


@pytest.mark.parametrize(("text", "mode", "why"), [("short", 0o600, "5 bytes; at least 16"),
                                                   ("x" * 32, 0o644, "group or others may access it")])
def test_a_bad_secret_file_stops_the_export_before_the_model_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, mode: int, why: str) -> None:
    with_secret(monkeypatch, secret_file(tmp_path, text, mode))
    with pytest.raises(RingError, match=why):
        ExportServer(f"127.0.0.1:{free_port()}", nic=NIC)
    with_secret(monkeypatch, tmp_path / "missing")
    with pytest.raises(RingError, match="cannot read it"):
        ExportServer(f"127.0.0.1:{free_port()}", nic=NIC)


def test_a_secret_file_another_user_owns_stops_the_export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mode 600 is not enough when the file is another user's (who may read it or rewrite it): refused, naming the
    owner; this user's file, or root's, is taken."""
    path = secret_file(tmp_path, "x" * 32)
    with_secret(monkeypatch, path)
    assert remote_ring.exchange_secret() == b"x" * 32
    owner = path.stat().st_uid
    if owner == 0:  # root runs this: the file goes to another user
        os.chown(path, 65534, -1)
        owner = 65534
    else:  # this process as another (non-root) user
        monkeypatch.setattr(remote_ring.os, "geteuid", lambda: owner + 1)
    with pytest.raises(RingError, match=f"owned by uid {owner}, not by this user"):
        ExportServer(f"127.0.0.1:{free_port()}", nic=NIC)


def test_a_schema_major_mismatch_is_refused_in_the_exchange_naming_both(ring_name: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine refuses a frontend of another major before it makes a queue pair for it, and says so once,
    not once per attempt (a frontend tries again every 0.2 s)."""
    ring = create_shm_ring(ring_name, GEO)
    ring.header_store32("schema_major", L.SCHEMA_MAJOR + 1)  # an engine of another major
    nic = CountingNic()
    lines = Lines()
    monkeypatch.setattr(remote_ring, "log", lines)
    eng = Engine(ring, ExportServer(f"127.0.0.1:{free_port()}", nic=nic), RdmaAddress("127.0.0.1", 0, ring_name))
    eng.export.start(ring)
    eng.address = dataclasses.replace(eng.address, port=eng.export.port)
    try:
        for _ in range(3):
            with pytest.raises(ExchangeRefused, match=rf"schema version {L.SCHEMA_MAJOR + 1}\.\d+ is incompatible "
                               rf"with the frontend's {L.SCHEMA_MAJOR}\.{L.SCHEMA_MINOR}"):
                attach(eng)
        assert nic.frontend_pairs == 0 and not eng.export.leases
    finally:
        eng.stop()  # its exchanges' threads joined: every line they write is written
    refused = lines.named("rdma exchange failed")
    assert len(refused) == 1 and "major versions differ" in refused[0]["error"]


def test_a_header_of_another_major_is_refused_when_read_over_rdma(engine: Engine) -> None:
    """The exchange said the right major (an export made before the header changed); the header, read through
    the queue pair as ``attach_ring`` reads it, says another: refused the same way."""
    engine.ring.header_store32("schema_major", L.SCHEMA_MAJOR + 1)
    with pytest.raises(RingError, match="major versions differ"):
        attach(engine)
    eventually(lambda: not engine.export.leases)


def test_an_engine_that_does_not_answer_and_nothing_listening_are_said() -> None:
    with socket.create_server(("127.0.0.1", 0)) as mute:  # accepts, never answers
        port = mute.getsockname()[1]
        with pytest.raises(RingError, match=r"no answer within 0\.3s"):
            attach_remote_ring(RdmaAddress("127.0.0.1", port, "r"), VerbsConfig(timeout_s=0.3), NIC)
    with pytest.raises(RingError, match="nothing answers at 127.0.0.1:.*is the engine running there"):
        attach_remote_ring(RdmaAddress("127.0.0.1", port, "r"), nic=NIC)


def test_a_peer_that_trickles_its_line_is_cut_at_the_deadline_and_holds_up_no_other(ring_name: str) -> None:
    """The exchange's deadline is for the whole line: a peer that sends a byte now and then, never the end, is
    cut when it passes; meanwhile other frontends attach, each exchange in its own thread."""
    eng = start_engine(ring_name, cfg=VerbsConfig(timeout_s=1.0))
    slow = Trickler(eng.address.port)
    try:
        ring = attach(eng)  # while the slow peer's exchange is under way
        eventually(lambda: len(eng.export.leases) == 1)
        ring.close()
        eventually(slow.cut_off)
        eventually(lambda: not eng.export.leases)
        attach(eng).close()
    finally:
        slow.stop()
        eng.stop()


def test_the_engine_stops_with_exchanges_under_way(ring_name: str) -> None:
    """``close`` cuts the exchanges under way and ends the leases; it returns, whatever its peers do."""
    eng = start_engine(ring_name)
    slow = [Trickler(eng.address.port) for _ in range(2)]
    held = attach(eng)
    try:
        eventually(lambda: len(eng.export.leases) == 1)
        closing = threading.Thread(target=eng.export.close, daemon=True)
        closing.start()
        closing.join(60)
        assert not closing.is_alive()
        assert not eng.export.leases
        eventually(lambda: all(s.cut_off() for s in slow))
        eventually(lambda: not held.transport.lease_open())  # type: ignore[attr-defined]
    finally:
        held.close()
        for s in slow:
            s.stop()
        eng.ring.transport.unlink()  # type: ignore[attr-defined]
        eng.ring.close()


def test_both_ends_of_a_lease_have_tcp_keepalive(engine: Engine) -> None:
    """A peer that vanishes without closing its end (a crashed host: no FIN, no RST) is found by keepalive
    probes, on the engine's side (its queue pair dropped) and the frontend's (the ring let go)."""
    ring = attach(engine)
    try:
        eventually(lambda: len(engine.export.leases) == 1)
        ends = [*engine.export.leases, ring.transport.lease]  # type: ignore[attr-defined]
        for end in ends:
            assert end.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert end.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == remote_ring.LEASE_IDLE_S
            assert end.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == remote_ring.LEASE_PROBE_S
            assert end.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == remote_ring.LEASE_PROBES
            assert end.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 1000 * (
                remote_ring.LEASE_IDLE_S + remote_ring.LEASE_PROBE_S * remote_ring.LEASE_PROBES)
        assert 0 < remote_ring.LEASE_IDLE_S + remote_ring.LEASE_PROBE_S * remote_ring.LEASE_PROBES <= 60
    finally:
        ring.close()


def test_a_listen_address_that_does_not_resolve_is_a_ring_error() -> None:
    with pytest.raises(RingError, match=r"--rdma-listen badhost\.invalid:7471: cannot resolve 'badhost\.invalid'"):
        ExportServer("badhost.invalid:7471", nic=NIC)


def test_the_export_refuses_past_its_queue_pair_limit(ring_name: str) -> None:
    eng = start_engine(ring_name, max_pairs=1)
    try:
        first = attach(eng)
        with pytest.raises(ExchangeRefused, match="serves 1 frontend queue pairs already"):
            attach(eng)
        first.close()
        eventually(lambda: not eng.export.leases)
        attach(eng).close()  # room again
    finally:
        eng.stop()


class RefusedConnect(StandInPair):
    def connect(self, peer: object) -> None:
        raise PyverbsRDMAError("Failed to modify QP state to RTR. Errno: 22, Invalid argument")


class FrontendVerbsFail(SharedMemoryNic):
    """The stand-in, whose frontend-side calls fail as pyverbs' do (not a RingError): at ``where``."""

    def __init__(self, where: str) -> None:
        self.where = where

    def queue_pair(self, cfg: VerbsConfig, shared_with: object = None) -> StandInPair:
        if shared_with is not None:
            return super().queue_pair(cfg, shared_with)  # (never asked of it: the engine has its own nic)
        if self.where == "queue_pair":
            raise PyverbsRDMAError("Failed to query gid 3 of port 1. Errno: 22, Invalid argument")
        return RefusedConnect(cfg)


@pytest.mark.parametrize(("where", "said"), [("queue_pair", "queue pair setup failed: Failed to query gid 3"),
                                             ("connect", r"queue pair connection to the engine's qp \d+ failed: "
                                                         "Failed to modify QP state to RTR")])
def test_the_verbs_layers_own_errors_are_ring_errors(engine: Engine, where: str, said: str) -> None:
    with pytest.raises(RingError, match=f"RDMA {said}"):
        attach_remote_ring(engine.address, VerbsConfig(), FrontendVerbsFail(where))
    eventually(lambda: not engine.export.leases)  # the engine's pair dropped with the connection


def test_a_watch_attempt_that_raises_anything_is_tried_again(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """An attempt that fails with an exception nobody expected still ends with a result: the watch says why,
    and attaches at a later attempt (it does not wait forever for one that ended)."""
    real = ringwatch.attach_remote_ring
    broken = [True]

    def flaky(addr: RdmaAddress) -> Ring:
        if broken[0]:
            raise PyverbsRDMAError("Failed to allocate PD. Errno: 12")
        return real(addr)

    monkeypatch.setattr(ringwatch, "attach_remote_ring", flaky)
    watch = RingWatch(engine.address.url, 10.0)
    try:
        eventually(lambda: watch.current() is None and watch.failure == "PyverbsRDMAError: Failed to allocate PD. "
                   "Errno: 12")
        broken[0] = False
        eventually(lambda: watch.current() is not None)
        assert watch.failure is None and watch.generation == 1
    finally:
        watch.close()


# ---------------------------------------------------------------------- a peer that disappears
def test_the_link_going_down_mid_publication_leaves_the_slot_unpublished(engine: Engine) -> None:
    """The publication's payload WRITEs go, then the link: the state word's fenced WRITE never lands, so the
    engine never sees a half-written slot as pending; the transport keeps the failure and refuses every access
    after it without posting."""
    ring = attach(engine)
    writer = SlotWriter(ring)
    seq = writer.try_reserve(2, 0)
    assert seq is not None
    poster = ring.transport.poster  # type: ignore[attr-defined]
    assert isinstance(poster, StandInPoster)
    poster.link_down_after = 2  # the prompt's WRITE and the slot record's WRITE, then nothing
    with pytest.raises(RingError, match="RETRY_EXC_ERR.*link went down"):
        writer.publish(2, seq, SlotRequest(9, np.arange(1, 4, dtype=np.int32), m.Sampling(4)))
    slot = engine.ring.read_slots()[2]
    assert int(slot["state"]) == S.RESERVED and int(slot["request_id"]) == 9  # payload placed, state not
    assert engine.slots.scan_pending() == [] and engine.ring.header_load64("doorbell") == 0
    executed = poster.executed
    with pytest.raises(RingError, match="lost: .*link went down"):
        ring.header_load64("heartbeat")
    assert poster.executed == executed and not ring.transport.lease_open()  # type: ignore[attr-defined]
    ring.close()


def test_the_engine_going_between_two_accesses(ring_name: str) -> None:
    """The engine stops (its leases end, its pairs and registration go): the frontend's next access fails with
    the completion a NIC gives for a responder that is gone, and its lease shows the end without any access."""
    eng = start_engine(ring_name)
    ring = attach(eng)
    assert ring.engine_alive(10.0)
    eng.stop()
    with pytest.raises(RingError, match="RETRY_EXC_ERR.*does not answer"):
        ring.header_load32("engine_state")
    ring.close()
    eng = start_engine(ring_name)
    ring = attach(eng)
    eng.stop()
    eventually(lambda: not ring.transport.lease_open())  # type: ignore[attr-defined]
    assert "closed its connection" in str(ring.transport.lost)  # type: ignore[attr-defined]
    ring.close()


def test_a_stale_registration_after_an_engine_restart(ring_name: str) -> None:
    """A frontend still holding the rkey of an engine that restarted: on a queue pair the new engine answers,
    that rkey is refused (remote access error); the watch lets the old ring go (``on_detach`` first) and attaches
    the new one."""
    old = start_engine(ring_name)
    port = old.address.port
    gone: list[Ring] = []
    watch = RingWatch(old.address.url, 10.0, on_detach=gone.append)
    eventually(lambda: watch.current() is not None)
    stale = watch.current()
    assert stale is not None
    old_endpoint = stale.transport.poster.ring  # type: ignore[attr-defined]
    old.stop()
    new = start_engine(ring_name, port=port)
    try:
        fresh = attach(new)
        pair = fresh.transport.poster.pair  # type: ignore[attr-defined]
        assert fresh.transport.poster.ring.rkey != old_endpoint.rkey  # type: ignore[attr-defined]
        behind = RdmaTransport(NIC.poster(pair, old_endpoint), old_endpoint.size)
        with pytest.raises(RingError, match=r"REM_ACCESS_ERR.*stale registration"):
            behind.load64(HEADER_OFF["heartbeat"])
        eventually(lambda: watch.current() not in (None, stale))
        assert gone == [stale] and watch.generation == 2
        assert watch.current().transport.poster.ring.rkey != old_endpoint.rkey  # type: ignore[union-attr]
        with pytest.raises(RingError, match="lost"):
            stale.header_load64("heartbeat")
        watch.close()
        fresh.close()
    finally:
        new.stop()


# ---------------------------------------------------------------------- the services over RDMA
def test_the_watch_says_why_there_is_no_ring_and_attaches_when_the_engine_comes(ring_name: str) -> None:
    port = free_port()
    watch = RingWatch(f"rdma://127.0.0.1:{port}/{ring_name}", 10.0)
    watch.current()
    assert watch.settled(10.0)
    assert "no ring: ring rdma://" in watch.problem() and "nothing answers" in watch.problem()  # type: ignore[operator]
    eng = start_engine(ring_name, port=port)
    try:
        eventually(lambda: watch.current() is not None)
        assert watch.ready() and watch.generation == 1
        watch.close()
        eventually(lambda: not eng.export.leases)
    finally:
        eng.stop()


def test_the_tracker_answers_503_when_the_ring_goes_mid_publication_and_serves_again(ring_name: str,
                                                                                      tmp_path: Path) -> None:
    eng = start_engine(ring_name)
    port = eng.address.port
    tracker = SlotTracker(TrackerConfig(tmp_path, eng.address.url))
    chan = Chan()
    try:
        eventually(lambda: bool(tracker.serving()))
        tracker.submit(chan, m.Submit(1, 1, [1, 2, 3], m.Sampling(4)))  # type: ignore[arg-type]
        assert isinstance(chan.sent[-1], m.Admitted) and 1 in tracker.live
        cache = tracker.lanes[0].cache
        assert cache is not None
        # the liveness READs (2), the claim's CAS, the prompt's WRITE; then the link goes, mid-publication
        cache.ring.transport.poster.link_down_after = 4  # type: ignore[attr-defined]
        tracker.submit(chan, m.Submit(2, 1, [4, 5, 6], m.Sampling(4)))  # type: ignore[arg-type]
        refused = chan.sent[-1]
        assert isinstance(refused, m.Rejected) and refused.status == 503 and "cannot be reached" in refused.message
        assert [int(s) for s in eng.ring.read_slots()["state"][:2]] == [S.PREFILL_PENDING, S.RESERVED]
        assert tracker.serving() == [] and tracker.live == {}  # the ring let go: its requests forgotten
        assert tracker.lanes[0].cut  # the cut slot, to give back should the same ring be reached again
        eng.stop()
        eng = start_engine(ring_name, port=port)  # the engine restarted: a new ring, a new registration
        eventually(lambda: bool(tracker.serving()))
        assert not tracker.lanes[0].cut  # another ring: nothing of it to give back
        tracker.submit(chan, m.Submit(3, 1, [1, 2], m.Sampling(4)))  # type: ignore[arg-type]
        assert isinstance(chan.sent[-1], m.Admitted)
        assert eng.slots.scan_pending() != []
    finally:
        tracker.close()
        eng.stop()


@pytest.mark.parametrize("accesses", [4, 7, 8], ids=["before-the-state-word", "before-the-flip", "before-the-doorbell"])
def test_a_slot_whose_publication_the_link_cut_is_settled_when_the_same_engine_is_reached_again(
        ring_name: str, tmp_path: Path, accesses: int) -> None:
    """The link goes mid-publication (its client told 503) and comes back to the same engine (no restart). Cut
    before the state word landed, the slot left RESERVED is given back (EMPTY, its seq kept); cut after it (the
    flip or the doorbell lost), the engine has the request: the slot goes to the reader as an orphan (a Track of
    no gateway), which stops and releases it, and the engine, whose look reads only the slots that flipped, is made to
    read every slot: it finds the request. Either way the ring loses no slot and the next request is admitted."""
    eng = start_engine(ring_name)
    tracker = SlotTracker(TrackerConfig(tmp_path, eng.address.url))
    chan = Chan()
    try:
        eventually(lambda: bool(tracker.serving()))
        tracker.submit(chan, m.Submit(1, 1, [1, 2, 3], m.Sampling(4)))  # type: ignore[arg-type]
        engine = eng.slots  # one engine's looks: every slot the first time, then the slots that flipped since
        first = engine.scan_pending()
        assert len(first) == 1 and engine.claim(*first[0]) is not None
        cache = tracker.lanes[0].cache
        assert cache is not None
        # the liveness READs (2), the claim's CAS, the prompt's and the record's WRITEs, the state word's, the flip's
        cache.ring.transport.poster.link_down_after = accesses  # type: ignore[attr-defined]
        tracker.submit(chan, m.Submit(2, 1, [4, 5, 6], m.Sampling(4)))  # type: ignore[arg-type]
        assert isinstance(chan.sent[-1], m.Rejected) and chan.sent[-1].status == 503
        cut = engine_slot_states(eng)
        landed = S.PREFILL_PENDING in cut
        assert cut.count(S.PREFILL_PENDING if landed else S.RESERVED) == 1 and tracker.lanes[0].cut
        assert landed == (accesses >= 7)
        idx = cut.index(S.PREFILL_PENDING if landed else S.RESERVED)
        seq = int(eng.ring.read_slots()["seq"][idx])
        eventually(lambda: bool(tracker.serving()))  # the watch attaches the same engine's ring again
        assert not tracker.lanes[0].cut and int(eng.ring.read_slots()["seq"][idx]) == seq
        if landed:  # no reader linked here: kept for it
            assert engine_slot_states(eng)[idx] == S.PREFILL_PENDING
            assert tracker.orphans == [m.Track(2, m.NO_GATEWAY, idx, seq)]
            assert engine.scan_pending() == [(idx, seq)]  # found, though its flip may not have landed
            # kept for every reader that links (one that restarted first included) while the slot holds it
            assert tracker._orphans_held() == [m.Track(2, m.NO_GATEWAY, idx, seq)]
            assert engine.claim(idx, seq) is not None
            engine.complete(idx, L.FinishReason.CANCELLED)
            assert tracker._orphans_held() == [m.Track(2, m.NO_GATEWAY, idx, seq)]
            assert tracker.serving()[0][1].writer.release(idx, seq)  # what the reader does
            assert tracker._orphans_held() == [] and tracker.orphans == []
        else:
            assert engine_slot_states(eng).count(S.EMPTY) == GEO.num_slots - 1 and tracker.orphans == []
            assert engine.scan_pending() == []
        tracker.submit(chan, m.Submit(3, 1, [1, 2], m.Sampling(4)))  # type: ignore[arg-type]
        assert isinstance(chan.sent[-1], m.Admitted)
    finally:
        tracker.close()
        eng.stop()


def engine_slot_states(eng: Engine) -> list[int]:
    return [int(s) for s in eng.ring.read_slots()["state"]]


def test_the_reader_streams_over_rdma_and_fails_the_streams_of_an_engine_that_goes(ring_name: str,
                                                                                   tmp_path: Path) -> None:
    eng = start_engine(ring_name)
    reader = TokenReader(ReaderConfig(tmp_path, eng.address.url))
    gw = Chan()
    reader.gateways[5] = gw  # type: ignore[assignment]
    frontend = attach(eng)
    try:
        eventually(lambda: (reader.check_health(), reader.engines[0].ring is not None)[1])
        seq = publish(frontend, 1, req_id=41)
        seq2 = publish(frontend, 2, req_id=42)
        reader.track([m.Track(41, 5, 1, seq), m.Track(42, 5, 2, seq2)])
        engine = eng.slots
        assert engine.claim(1, seq) is not None and engine.claim(2, seq2) is not None
        engine.publish(1, 0, np.array([7, 8], np.int32))
        engine.complete(1, L.FinishReason.LENGTH)
        engine.publish(2, 0, np.array([9], np.int32))
        eventually(lambda: (reader.cycle(), any(isinstance(x, m.Finished) for x in gw.sent))[1])
        tokens = [x for x in gw.sent if isinstance(x, m.Tokens) and x.req_id == 41]
        assert sum((t.ids for t in tokens), []) == [7, 8]
        assert int(eng.ring.read_slots()[1]["state"]) == S.EMPTY  # released through the queue pair
        eng.stop()  # request 42 is still running: its stream must end, not hang
        eventually(lambda: (reader.cycle(), reader.check_health(),
                            any(isinstance(x, m.Failed) and x.req_id == 42 for x in gw.sent))[2])
        failed = next(x for x in gw.sent if isinstance(x, m.Failed))
        assert failed.status == 503 and failed.message == RESTARTED
    finally:
        frontend.close()
        reader.close()
        ShmTransport.unlink_name(ring_name)


# ---------------------------------------------------------------------- no RDMA here
def test_without_pyverbs_every_rdma_start_says_what_is_missing(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """This machine has no pyverbs and no device: the product's verbs layer is refused at once, naming it."""
    monkeypatch.setattr(remote_ring, "env", lambda: Env.from_environ({}))
    assert "needs pyverbs" in (remote_ring.rdma_problem() or "")
    with pytest.raises(RdmaUnavailable, match="needs pyverbs"):
        ExportServer(f"127.0.0.1:{free_port()}")
    with pytest.raises(RdmaUnavailable, match="needs pyverbs"):
        attach_remote_ring(engine.address)  # an engine answers; this host cannot make a queue pair
    eventually(lambda: not engine.export.leases)
    monkeypatch.setattr(remote_ring, "env", lambda: Env.from_environ({"BLINK_RDMA_NIC": "no_such_module:Nic"}))
    with pytest.raises(RdmaUnavailable, match="BLINK_RDMA_NIC=no_such_module:Nic: cannot load"):
        remote_ring.nic_from_env()


def test_a_bound_port_is_refused_at_once(engine: Engine) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        with pytest.raises(RingError, match="cannot bind"):
            ExportServer(f"127.0.0.1:{taken.getsockname()[1]}", nic=NIC)
