"""The RDMA transport without a device: work-request plans, their ordering, error paths, and the ring's
publication protocol run through ``RdmaTransport`` over a poster that executes the plans in memory.

The tests that need an RDMA device are at the end; they skip with the reason (docs/RDMA.md).
"""

from __future__ import annotations

import socket
import sys
import threading
import types
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dpu_gateway.reader import ReaderConfig, RingReader, Route
from shared import ring_layout as L
from shared.engine_slots import SlotEngine
from shared.messages import Sampling, Track
from shared.ring import HEADER_OFF, Ring, RingGeometry, attach_ring, init_ring
from shared.slots import SlotRequest, SlotWriter, state_word
from shared.transport import MemoryTransport, RingError, rdma
from shared.transport.rdma import Flag, Opcode, WorkRequest

SIZE = 1 << 16
S = L.SlotState


class MemoryPoster:
    """Executes work requests the way an RC queue pair does, in posting order, on a local 'remote'."""

    def __init__(self, remote: bytearray, max_message: int = rdma.MAX_MESSAGE, max_inline: int = 64) -> None:
        self.remote = np.frombuffer(remote, np.uint8)
        self.staging = np.zeros(4096, np.uint8)
        self.max_message, self.max_inline = max_message, max_inline
        self.log: list[WorkRequest] = []
        self.pending = 0

    def post(self, wrs: Sequence[WorkRequest]) -> None:
        for wr in wrs:
            self.log.append(wr)
            self._execute(wr)
            self.pending += bool(wr.flags & Flag.SIGNALED)

    def _execute(self, wr: WorkRequest) -> None:
        rem = self.remote[wr.remote: wr.remote + wr.length]
        loc = self.staging[wr.local: wr.local + wr.length]
        if wr.opcode == Opcode.RDMA_WRITE:
            rem[:] = loc
        elif wr.opcode == Opcode.RDMA_READ:
            loc[:] = rem
        else:
            word = rem.view(np.uint64)
            old = int(word[0])
            loc.view(np.uint64)[0] = old
            if wr.opcode == Opcode.ATOMIC_FETCH_AND_ADD:
                word[0] = (old + wr.compare) & 0xFFFF_FFFF_FFFF_FFFF
            elif old == wr.compare:
                word[0] = wr.swap

    def wait(self) -> None:
        self.pending = 0


def transport(size: int = SIZE, **kw) -> tuple[rdma.RdmaTransport, MemoryPoster, bytearray]:
    remote = bytearray(size)
    poster = MemoryPoster(remote, **kw)
    return rdma.RdmaTransport(poster, size), poster, remote


# ---------------------------------------------------------------------- plans
def test_read_plan_splits_at_the_message_limit_and_signals_only_the_last() -> None:
    wrs = rdma.plan_read(100, 2500, SIZE, max_message=1000)
    assert [(w.remote, w.local, w.length) for w in wrs] == [(100, 0, 1000), (1100, 1000, 1000), (2100, 2000, 500)]
    assert all(w.opcode == Opcode.RDMA_READ for w in wrs)
    assert [bool(w.flags & Flag.SIGNALED) for w in wrs] == [False, False, True]


def test_release_store_is_its_own_fenced_write() -> None:
    (wr,) = rdma.plan_store(64, 8, SIZE, max_inline=64)
    assert wr.opcode == Opcode.RDMA_WRITE and wr.length == 8
    assert wr.flags & Flag.FENCE and wr.flags & Flag.SIGNALED and wr.flags & Flag.INLINE
    (no_inline,) = rdma.plan_store(64, 4, SIZE, max_inline=0)
    assert not no_inline.flags & Flag.INLINE and no_inline.flags & Flag.FENCE


def test_payload_writes_are_not_fenced() -> None:
    assert all(not w.flags & Flag.FENCE for w in rdma.plan_write(0, 3000, SIZE, max_message=1024))


def test_cas_is_an_8_byte_fenced_atomic_with_masked_operands() -> None:
    (wr,) = rdma.plan_cas64(8, -1, 5, SIZE)
    assert wr.opcode == Opcode.ATOMIC_CMP_AND_SWP and wr.length == 8
    assert wr.flags == Flag.FENCE | Flag.SIGNALED
    assert (wr.compare, wr.swap) == (0xFFFF_FFFF_FFFF_FFFF, 5)


def test_fence_is_a_signaled_read_behind_everything() -> None:
    (wr,) = rdma.plan_fence(SIZE)
    assert wr.opcode == Opcode.RDMA_READ and wr.flags == Flag.FENCE | Flag.SIGNALED


def test_xor_is_a_cas_from_the_value_seen() -> None:
    assert rdma.xor_step(0b1010, 0b0110) == (0b1010, 0b1100)


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize(("plan", "exc", "words"), [
    (lambda: rdma.plan_cas64(12, 0, 1, SIZE), ValueError, "not 8-byte aligned"),
    (lambda: rdma.plan_load(SIZE - 4, 8, SIZE), IndexError, "outside segment"),
    (lambda: rdma.plan_read(0, 0, SIZE), ValueError, "must be > 0"),
    (lambda: rdma.plan_write(-8, 8, SIZE), IndexError, "outside segment"),
    (lambda: rdma.plan_store(2, 4, SIZE, 64), ValueError, "4-byte aligned"),
])
def test_bad_accesses_are_refused_before_anything_is_posted(plan, exc, words: str) -> None:
    with pytest.raises(exc, match=words):
        plan()


def test_an_access_larger_than_staging_goes_in_staging_sized_round_trips() -> None:
    t, poster, remote = transport(size=4 * 4096 + 64)
    data = np.arange(3 * 4096 + 5, dtype=np.uint32).astype(np.uint8)
    t.write(8, data)
    writes = [w for w in poster.log if w.opcode == Opcode.RDMA_WRITE]
    assert [w.length for w in writes] == [4096, 4096, 4096, 5] and all(w.local == 0 for w in writes)
    assert bytes(remote[8 : 8 + data.size]) == data.tobytes()
    poster.log.clear()
    assert t.read(8, data.size) == data.tobytes()
    assert [(w.opcode, w.length) for w in poster.log] == [(Opcode.RDMA_READ, n) for n in (4096, 4096, 4096, 5)]
    poster.log.clear()
    assert t.read(8, 0) == b"" and poster.log == []  # an empty range is no access, as on a mapping


def test_no_device_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(rdma.RdmaUnavailable, match="no RDMA device.*shared-memory transport"):
        rdma.pick_device(None, tmp_path / "infiniband")
    (tmp_path / "ib").mkdir()
    (tmp_path / "ib" / "mlx5_0").mkdir()
    assert rdma.pick_device(None, tmp_path / "ib") == "mlx5_0"
    with pytest.raises(rdma.RdmaUnavailable, match="'rxe0' not found; this host has mlx5_0"):
        rdma.pick_device("rxe0", tmp_path / "ib")


def test_opening_a_queue_pair_here_says_why_it_cannot() -> None:
    """Without pyverbs, or without a device, the error names what is missing (never an ImportError)."""
    with pytest.raises(rdma.RdmaUnavailable, match="pyverbs|no RDMA device"):
        rdma.VerbsQueuePair(rdma.VerbsConfig())


def test_endpoint_exchange_round_trips_and_rejects_garbage() -> None:
    a, b = socket.socketpair()
    ours = rdma.Endpoint(qp_num=17, psn=5, lid=3, gid="fe80" + "0" * 28, mtu=5, addr=4096, rkey=99, size=SIZE)
    peer = rdma.Endpoint(qp_num=18, psn=6, lid=4, gid="", mtu=3)
    got: list[rdma.Endpoint] = []
    th = threading.Thread(target=lambda: got.append(rdma.exchange(b, peer)))
    th.start()
    assert rdma.exchange(a, ours) == peer
    th.join()
    assert got == [ours]
    with pytest.raises(RingError, match="malformed"):
        rdma.Endpoint.decode(b'{"qp_num": 1}\n')
    with pytest.raises(RingError, match="24-bit"):
        rdma.Endpoint.decode(rdma.Endpoint(qp_num=1 << 24, psn=0, lid=0, gid="", mtu=1).encode())
    a.close()
    with pytest.raises(RingError, match="closed the connection"):
        rdma.exchange(b, peer, timeout_s=2)
    b.close()


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="queue_depth"):
        rdma.VerbsConfig(queue_depth=0)


# ---------------------------------------------------------------------- the transport over the plans
def test_words_and_ranges_round_trip() -> None:
    t, _, remote = transport()
    t.write(128, b"payload!")
    assert t.read(128, 8) == b"payload!"
    t.store64(256, 0xDEAD_BEEF_0000_0001)
    assert t.load64(256) == 0xDEAD_BEEF_0000_0001
    t.store32(260, 7)
    assert t.load32(260) == 7
    assert t.cas64(256, 1, 2) != 1  # wrong expectation: nothing changes, the value seen comes back
    seen = t.load64(256)
    assert t.cas64(256, seen, 42) == seen and t.load64(256) == 42
    assert t.fetch_add64(256, 3) == 42 and t.load64(256) == 45
    assert t.fetch_xor64(256, 0b101) == 45 and t.load64(256) == 45 ^ 0b101


def test_a_slot_publication_posts_payload_then_fenced_state_then_flip_then_doorbell() -> None:
    """schema/OWNERSHIP.md over RDMA: the payload's WRITEs, the state word in its own fenced WRITE after
    them, the pending_flips XOR (CAS) after the state, the doorbell's atomic add last."""
    g = RingGeometry(num_slots=4, max_prompt_tokens=16, max_output_tokens=8, top_logprobs=0)
    local = bytearray(g.segment_bytes)
    init_ring(MemoryTransport(local), g, "rdma-test")
    poster = MemoryPoster(local)
    ring = attach_ring(rdma.RdmaTransport(poster, g.segment_bytes), "rdma-test")
    writer = SlotWriter(ring)
    slot = 2
    seq = writer.try_reserve(slot, 0)
    assert seq == 1
    poster.log.clear()
    writer.publish(slot, seq, SlotRequest(7, np.arange(5, dtype=np.int32), Sampling(4)))
    state_at = ring.slot_field(slot, "state")
    kinds = [(w.opcode, w.remote, w.flags) for w in poster.log]
    i_state = next(i for i, w in enumerate(poster.log)
                   if w.opcode == Opcode.RDMA_WRITE and w.remote == state_at and w.length == 4)
    assert kinds[i_state][2] & Flag.FENCE, "the state word's WRITE must be fenced"
    payload = {ring.prompt_offset(slot), ring.slot_offset(slot)}
    before = [(op, off, flags) for op, off, flags in kinds[:i_state] if op == Opcode.RDMA_WRITE]
    assert {off for _, off, _ in before} == payload and not any(flags & Flag.FENCE for *_, flags in before), \
        "the payload's WRITEs (prompt, slot record) come before the state word, unfenced"
    i_flip = next(i for i, (op, off, _) in enumerate(kinds)
                  if op == Opcode.ATOMIC_CMP_AND_SWP and off == HEADER_OFF["pending_flips"])
    i_bell = next(i for i, (op, off, _) in enumerate(kinds)
                  if op == Opcode.ATOMIC_FETCH_AND_ADD and off == HEADER_OFF["doorbell"])
    assert i_state < i_flip < i_bell
    assert ring.read_slots()[slot]["state"] == L.SlotState.PREFILL_PENDING


# ---------------------------------------------------------------------- on a device
needs_device = pytest.mark.skipif(
    not rdma.rdma_devices(),
    reason="needs an RDMA device (none in /sys/class/infiniband: no HCA here, and the kernel has no "
           "InfiniBand support, so SoftRoCE cannot be loaded); see docs/RDMA.md")


@needs_device
def test_loopback_ring_over_a_real_queue_pair() -> None:  # pragma: no cover - needs a device
    g = RingGeometry(num_slots=4, max_prompt_tokens=16, max_output_tokens=8, top_logprobs=0)
    local = MemoryTransport(bytearray(g.segment_bytes))
    init_ring(local, g, "rdma-loopback")
    export = rdma.RingExport(local, "rdma-loopback", (L.SCHEMA_MAJOR, L.SCHEMA_MINOR))
    a, b = socket.socketpair()
    th = threading.Thread(target=export.accept, args=(a,))
    th.start()
    remote = rdma.connect_ring(b, "rdma-loopback")
    th.join()
    ring = attach_ring(remote, "rdma-loopback")
    writer = SlotWriter(ring)
    seq = writer.try_reserve(0, 0)
    assert seq == 1 and local.load64(ring.slot_offset(0)) >> 32 == seq
    remote.close()


def test_connecting_without_pyverbs_or_a_device_says_which() -> None:
    import sys

    assert "pyverbs" not in sys.modules  # importing shared.transport.rdma does not import it
    a, b = socket.socketpair()
    with a, b, pytest.raises(rdma.RdmaUnavailable, match="pyverbs|no RDMA device"):
        rdma.connect_ring(a, "blink-ring")


class PyverbsRDMAError(Exception):
    """What pyverbs raises for a call the device refused: not a RingError."""


def fake_pyverbs(monkeypatch: pytest.MonkeyPatch, fails: str) -> list[str]:
    """pyverbs, as far as the verbs layer calls it, over no device: every object it makes records its close;
    the class or method named ``fails`` raises as pyverbs does when the device refuses. The closes, in order."""
    closed: list[str] = []

    def refuse(what: str) -> None:
        if what == fails:
            raise PyverbsRDMAError(f"Failed to {what}. Errno: 22, Invalid argument")

    class Made:
        def __init__(self, *args: object, **kwargs: object) -> None:
            refuse(type(self).__name__)

        def close(self) -> None:
            closed.append(type(self).__name__)

    class Context(Made):
        def query_device(self) -> SimpleNamespace:
            return SimpleNamespace(atomic_caps=1)

        def query_port(self, port: int) -> SimpleNamespace:
            return SimpleNamespace(lid=1, active_mtu=5, max_msg_sz=1 << 30)

        def query_gid(self, port: int, index: int) -> str:
            refuse("query_gid")
            return "fe80:0000:0000:0000:0000:0000:0000:0001"

    class QP(Made):
        qp_num = 7

        def to_rts(self, attr: object) -> None:
            refuse("to_rts")

    class Attr:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

    made = {name: type(name, (Made,), {}) for name in ("PD", "CQ", "MR", "DmaBufMR")}
    enums = {name: bit for bit, name in enumerate(("IBV_ACCESS_LOCAL_WRITE", "IBV_ACCESS_REMOTE_READ",
                                                   "IBV_ACCESS_REMOTE_WRITE", "IBV_ACCESS_REMOTE_ATOMIC",
                                                   "IBV_QPT_RC", "IBV_QPS_INIT", "IBV_WR_RDMA_WRITE",
                                                   "IBV_WR_RDMA_READ", "IBV_WR_ATOMIC_CMP_AND_SWP",
                                                   "IBV_WR_ATOMIC_FETCH_AND_ADD"), 1)}
    parts = {"device": {"Context": Context}, "pd": {"PD": made["PD"]}, "cq": {"CQ": made["CQ"]},
             "qp": {"QP": QP, "QPCap": Attr, "QPInitAttr": Attr, "QPAttr": Attr},
             "addr": {"GID": Attr, "AHAttr": Attr, "GlobalRoute": Attr},
             "mr": {"MR": made["MR"], "DmaBufMR": made["DmaBufMR"]}, "enums": {"IBV_ATOMIC_NONE": 0, **enums}}
    package = types.ModuleType("pyverbs")
    package.__path__ = []
    monkeypatch.setitem(sys.modules, "pyverbs", package)
    for name, attrs in parts.items():
        module = types.ModuleType(f"pyverbs.{name}")
        module.__dict__.update(attrs)
        setattr(package, name, module)
        monkeypatch.setitem(sys.modules, f"pyverbs.{name}", module)
    monkeypatch.setattr(rdma, "pick_device", lambda name, sys_dir=rdma.SYS_RDMA: "mlx5_0")
    return closed


@pytest.mark.parametrize(("fails", "closed"), [("PD", ["Context"]), ("CQ", ["PD", "Context"]),
                                               ("QP", ["CQ", "PD", "Context"])])
def test_pyverbs_errors_making_a_queue_pair_are_ring_errors_and_close_what_was_made(
        monkeypatch: pytest.MonkeyPatch, fails: str, closed: list[str]) -> None:
    made = fake_pyverbs(monkeypatch, fails)
    with pytest.raises(RingError, match=f"RDMA queue pair setup failed: Failed to {fails}"):
        rdma.VerbsQueuePair(rdma.VerbsConfig())
    assert made == closed


@pytest.mark.parametrize(("fails", "call", "said"), [
    ("query_gid", lambda pair: pair.endpoint(), r"GID query \(port 1, index 3\) failed"),
    ("to_rts", lambda pair: pair.connect(rdma.Endpoint(5, 1, 1, "fe80" + "0" * 27 + "1", 5)),
     "queue pair connection to qp 5 failed"),
    ("MR", lambda pair: rdma.VerbsRegion(pair, MemoryTransport(bytearray(4096))),
     r"registration of the ring's memory \(4096 bytes; is the memlock limit above that\?\) failed"),
    ("MR", lambda pair: rdma.VerbsPoster(pair, rdma.Endpoint(5, 1, 1, "", 5, 4096, 9, 4096)),
     "registration of the staging buffer failed"),
])
def test_pyverbs_errors_after_the_queue_pair_is_made_are_ring_errors_naming_the_call(
        monkeypatch: pytest.MonkeyPatch, fails: str, call, said: str) -> None:
    fake_pyverbs(monkeypatch, fails)
    pair = rdma.VerbsQueuePair(rdma.VerbsConfig(gid_index=3))
    with pytest.raises(RingError, match=f"RDMA {said}: Failed to {fails}"):
        call(pair)
    pair.close()


def test_a_pyverbs_error_checking_the_device_says_rdma_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_pyverbs(monkeypatch, "Context")
    with pytest.raises(rdma.RdmaUnavailable, match="RDMA check of device mlx5_0 failed: Failed to Context"):
        rdma.PyverbsNic().check(rdma.VerbsConfig())


# ---------------------------------------------------------------------- every frontend transition's plan
G4 = RingGeometry(num_slots=4, max_prompt_tokens=16, max_output_tokens=8, top_logprobs=0)
FENCED = Flag.FENCE | Flag.SIGNALED


def remote_ring() -> tuple[Ring, MemoryPoster, Ring]:
    """A ring in local memory (the engine's view) and the same ring through RdmaTransport (the frontend's)."""
    local = bytearray(G4.segment_bytes)
    engine_view = init_ring(MemoryTransport(local), G4, "rdma-test")
    poster = MemoryPoster(local)
    return attach_ring(rdma.RdmaTransport(poster, G4.segment_bytes), "rdma-test"), poster, engine_view


def posted(poster: MemoryPoster) -> list[tuple]:
    return [(w.opcode, w.remote, w.length, w.flags, w.compare, w.swap) for w in poster.log]


def published(ring: Ring, poster: MemoryPoster, slot: int) -> int:
    writer = SlotWriter(ring)
    seq = writer.try_reserve(slot, 0)
    assert seq is not None
    writer.publish(slot, seq, SlotRequest(7, np.arange(1, 6, dtype=np.int32), Sampling(4)))
    poster.log.clear()
    return seq


def test_reserve_is_one_fenced_cas_of_the_state_word() -> None:
    """EMPTY(seq) -> RESERVED(seq + 1): the claim is an 8-byte compare-and-swap of the state word, waited for."""
    ring, poster, _ = remote_ring()
    poster.log.clear()
    assert SlotWriter(ring).try_reserve(1, 0) == 1
    # the writer's construction reads the header once (its schema minor); the claim is the last request
    assert posted(poster)[-1] == (Opcode.ATOMIC_CMP_AND_SWP, ring.slot_offset(1), 8, FENCED,
                                  state_word(S.EMPTY, 0), state_word(S.RESERVED, 1))
    poster.log.clear()
    assert SlotWriter(ring).try_reserve(1, 0) is None  # taken: the CAS sees RESERVED(1), nothing is written
    assert [p[0] for p in posted(poster)][-1] == Opcode.ATOMIC_CMP_AND_SWP
    assert not any(p[0] == Opcode.RDMA_WRITE for p in posted(poster))


def test_abandon_is_one_fenced_cas_back_to_empty() -> None:
    ring, poster, engine = remote_ring()
    writer = SlotWriter(ring)
    seq = writer.try_reserve(2, 0)
    assert seq is not None
    poster.log.clear()
    assert writer.abandon(2, seq)
    assert posted(poster) == [(Opcode.ATOMIC_CMP_AND_SWP, ring.slot_offset(2), 8, FENCED,
                               state_word(S.RESERVED, seq), state_word(S.EMPTY, seq))]
    assert int(engine.read_slots()[2]["state"]) == S.EMPTY


def test_cancel_reads_the_state_word_then_writes_the_flag_in_a_fenced_write() -> None:
    """Cancel: an acquire load of the state word (a signaled READ, waited for), then the flag as a release store
    (its own fenced WRITE, inline), so it cannot pass the READ that decided it."""
    ring, poster, engine = remote_ring()
    seq = published(ring, poster, 3)
    assert SlotWriter(ring).cancel(3, seq)
    header_read, *rest = posted(poster)  # the writer's construction reads the header
    assert header_read[0] == Opcode.RDMA_READ and header_read[1] == 0
    assert rest == [(Opcode.RDMA_READ, ring.slot_offset(3), 8, Flag.SIGNALED, 0, 0),
                    (Opcode.RDMA_WRITE, ring.slot_field(3, "cancel"), 4, FENCED | Flag.INLINE, 0, 0)]
    assert int(engine.read_slots()[3]["cancel"]) == 1


def test_release_is_one_fenced_cas_completed_to_empty() -> None:
    ring, poster, engine = remote_ring()
    seq = published(ring, poster, 0)
    slots = SlotEngine(engine)
    assert slots.claim(0, seq) is not None
    slots.publish(0, 0, np.array([42], np.int32))
    slots.complete(0, L.FinishReason.EOS)
    writer = SlotWriter(ring)
    poster.log.clear()
    assert writer.release(0, seq)
    assert posted(poster) == [(Opcode.ATOMIC_CMP_AND_SWP, ring.slot_offset(0), 8, FENCED,
                               state_word(S.DECODE_COMPLETED, seq), state_word(S.EMPTY, seq))]
    assert int(engine.read_slots()[0]["state"]) == S.EMPTY


def test_liveness_is_two_acquire_loads_of_the_header() -> None:
    """The engine's liveness over RDMA: its beat counter and its state, each a signaled READ waited for."""
    ring, poster, engine = remote_ring()
    engine.header_store32("engine_state", L.EngineState.READY)
    engine.header_store64("heartbeat", 5)
    poster.log.clear()
    assert ring.engine_alive(10.0)
    assert posted(poster) == [(Opcode.RDMA_READ, HEADER_OFF["heartbeat"], 8, Flag.SIGNALED, 0, 0),
                              (Opcode.RDMA_READ, HEADER_OFF["engine_state"], 4, Flag.SIGNALED, 0, 0)]


def test_reading_a_slots_tokens_reads_them_after_the_fence_that_orders_them() -> None:
    """The token reader's cycle: one bulk READ of the slots, a fenced READ (the acquire: every ``generated`` seen
    has its tokens placed), then the tokens; a completed slot's ``generated`` is loaded again before its tail,
    and the slot released by CAS last."""
    ring, poster, engine = remote_ring()
    seq = published(ring, poster, 1)
    slots = SlotEngine(engine)
    assert slots.claim(1, seq) is not None
    slots.publish(1, 0, np.array([11, 12, 13], np.int32))
    slots.complete(1, L.FinishReason.LENGTH)
    gw = Recorder()
    reader = RingReader(ReaderConfig(Path("/nonexistent"), "unused"), "unused", {5: gw})  # type: ignore[dict-item]
    reader.ring, reader.writer = ring, SlotWriter(ring)
    reader.snapshot = np.empty(G4.num_slots, L.SLOT_DTYPE)
    reader.routes[1] = Route(Track(9, 5, 1, seq))
    poster.log.clear()
    assert reader.cycle()
    kinds = [(p[0], p[1], p[3]) for p in posted(poster)]
    assert kinds[0] == (Opcode.RDMA_READ, G4.slots_offset, Flag.SIGNALED)
    assert kinds[1] == (Opcode.RDMA_READ, 0, FENCED)
    assert kinds[2] == (Opcode.RDMA_READ, ring.slot_field(1, "generated"), Flag.SIGNALED)
    assert (Opcode.RDMA_READ, ring.output_offset(1), Flag.SIGNALED) in kinds[3:]
    assert kinds[-1] == (Opcode.ATOMIC_CMP_AND_SWP, ring.slot_offset(1), FENCED)
    assert [type(x).__name__ for x in gw.sent] == ["Tokens", "Finished"] and gw.sent[0].ids == [11, 12, 13]
    reader.watch.close()


class Recorder:
    """Stands in for a gateway's link: what the reader sends it."""

    def __init__(self) -> None:
        self.sent: list = []
        self.info: dict = {}

    def send(self, msg: object) -> None:
        self.sent.append(msg)
