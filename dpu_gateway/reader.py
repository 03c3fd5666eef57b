"""The token reader service: moves generated tokens from the rings to the owning gateway.

Each cycle is one bulk read of slot metadata. Slots that have produced nothing yet are looked
at first (their first token is the TTFT), then the rest; new tokens (and logprobs) go to the
gateway that owns the request, batched into one frame per gateway. Once a slot is
DECODE_COMPLETED and its tail is read, the reader sends ``Finished`` and releases the slot.
A ring whose engine made a ``tokens`` notifier (``shared/notify.py``: the Python engines write it once
per step that published or ended anything) is read when it wakes the reader, with no polling between;
another is polled, tight while tokens flow, backing off to ``max_poll_s`` when idle. A stale
heartbeat or a replaced ring ends every stream with ``Failed`` (no client hangs); a replaced
or removed ring's requests are failed, and their slots cancelled, before its mapping closes.

With more than one engine (``--data-parallel-size``) there is one ``RingReader`` per engine's ring,
each with its own watch and routes (keyed by slot; a ``Track`` names its engine); one poll loop serves
them all, and a ring that goes fails only its own requests.

Replacing the reader loses no stream (docs/DEPLOY.md). A reader that stops leaves its streams alone:
it fails none and cancels no slot, sends out what it queued, and closes its links. Each gateway's
``GatewayHello`` to the next reader lists the streams it has with the tokens each received
(``Resume``); the new reader finds their slots by request id in the rings, rebuilds their routes from
the slot (seq, logprob fields of the sampling record) and sends from the first token the gateway has
not had (``Tokens.at``). The tracker re-sends its ``Track``s too; one for a route that exists changes
nothing. A reader that crashed is replaced the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dpu_gateway.ringwatch import RingWatch
from shared import ipc
from shared import messages as m
from shared import ring_layout as L
from shared.data_parallel import engine_ring_names
from shared.env import HEARTBEAT_TIMEOUT_S
from shared.log import get_logger
from shared.notify import Notifier, look_for
from shared.ring import Ring
from shared.slots import SlotWriter
from shared.transport import RingError

log = get_logger("reader")
S, F = L.SlotState, L.FinishReason
RESTARTED = "the engine restarted; the request was lost"
NOT_IN_RING = "the request is in no ring any more (its engine restarted); it was lost"
DRAIN_S = 2.0  # a stopping reader's wait for its last frames to reach the gateways
# the slot's clocks sent for the metrics, all of the engine's clock: the claim, the first prompt chunk's step, the
# first and the last token
CLOCKS = ("admit_ns", "schedule_ns", "first_token_ns", "last_token_ns")


@dataclasses.dataclass(frozen=True, slots=True)
class ReaderConfig:
    run_dir: Path
    ring_name: str                   # the base name: engine_ring_names(ring_name, data_parallel_size)
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S
    min_poll_s: float = 50e-6
    max_poll_s: float = 0.002
    health_every_s: float = 0.1
    unowned_grace_s: float = 5.0
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        engine_ring_names(self.ring_name, self.data_parallel_size)  # validates the size

    @property
    def ring_names(self) -> tuple[str, ...]:
        return engine_ring_names(self.ring_name, self.data_parallel_size)


@dataclasses.dataclass(slots=True)
class Route:
    track: m.Track
    sent: int = 0
    orphan: bool = False  # its client was told it failed: read and release quietly
    since: float = dataclasses.field(default_factory=time.monotonic)


def top_pairs(tops: np.ndarray, k: int) -> list[list[tuple[int, float]]]:
    return [[(int(e["token"]), float(e["logprob"])) for e in row[:k]] for row in tops]


class RingReader:
    """One engine's ring: its watch, the routes of the slots published there, and the reading of them."""

    def __init__(self, cfg: ReaderConfig, name: str, gateways: dict[int, ipc.Channel], index: int = 0,
                 wake: Callable[[], None] | None = None) -> None:
        self.cfg = cfg
        self.index = index  # the engine's, under --data-parallel-size
        self.watch = RingWatch(name, cfg.heartbeat_timeout_s, on_detach=self._ring_gone)
        self.starved_said = False  # the current silence's "engine starved" line is logged
        self.ring: Ring | None = None
        self.writer: SlotWriter | None = None
        self.snapshot: np.ndarray | None = None
        # what each slot showed at the last read (state, seq, generated): a route is looked at only when its slot
        # moved since, or while it is in ``pending``; None: every slot counts as moved (no read yet on this ring)
        self.seen: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.routes: dict[int, Route] = {}
        # slots whose route is looked at in the next read whatever its slot shows: a new or resumed route (its
        # tokens may have come before it), one waiting for its gateway's hello
        self.pending: set[int] = set()
        self.gateways = gateways  # shared with the TokenReader: gateway id -> its link
        # The engine's wake-up after a step that published (shared/notify.py), watched by the event loop;
        # None while the ring has none (then the poll loop polls this ring)
        self.notifier: Notifier | None = None
        self._none_here = False  # the attached ring will never have one (notify.look_for): no more looks
        self._wake = wake
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------ one cycle
    def cycle(self) -> bool:
        """Read the ring once and forward what changed; True if any token moved. Only the routes whose slot
        moved since the last read (its state, seq or token count) and the pending ones are looked at: while the
        persistent engine runs a step the reader polls, and most reads find nothing new."""
        if self.ring is None or not self.routes:
            return False
        try:
            snap = self.ring.read_slots(self.snapshot)
            self.ring.transport.fence()  # acquire: the tokens behind every `generated` seen are visible
            look = self._moved(snap)
            look.update(self.pending)
            self.pending = set()
            due = [r for slot, r in self.routes.items() if slot in look]
            moved = False
            for route in [r for r in due if r.sent == 0] + [r for r in due if r.sent > 0]:  # first tokens first
                moved |= self._serve(route, snap[route.track.slot])
        except RingError as exc:
            self.seen = None  # the read was cut short: every slot is looked at again after it
            self._access_failed(exc)
            return False
        return moved

    def _moved(self, snap: np.ndarray) -> set[int]:
        """The slots whose state, seq or token count differ from the last read's; every slot at the first."""
        now = (snap["state"].copy(), snap["seq"].copy(), snap["generated"].copy())
        seen, self.seen = self.seen, now
        if seen is None:
            return set(range(len(snap)))
        return set(np.flatnonzero((now[0] != seen[0]) | (now[1] != seen[1]) | (now[2] != seen[2])).tolist())

    def add_route(self, route: Route) -> None:
        self.routes[route.track.slot] = route
        self.pending.add(route.track.slot)

    def _access_failed(self, exc: RingError) -> None:
        """An access to a remote ring failed (its engine gone, the link down): the watch lets the ring go
        now, which fails its streams (``_ring_gone``), and attaches again when an engine answers."""
        log.warning("ring access failed", engine=self.index, error=str(exc))
        self.check_health()

    def _serve(self, route: Route, meta: np.void) -> bool:
        tr = route.track
        if int(meta["seq"]) != tr.seq:
            self._fail(route, 500, "slot was reused before its request finished")
            del self.routes[tr.slot]
            return False
        state = int(meta["state"])
        if state == S.EMPTY:  # released by an earlier reader, after its Finished: a stale re-sent Track
            del self.routes[tr.slot]
            return False
        chan = self.gateways.get(tr.gateway_id)
        if chan is None and not route.orphan:
            if time.monotonic() - route.since < self.cfg.unowned_grace_s:
                self.pending.add(tr.slot)  # looked at again next read, moved or not
                return False  # its gateway has not said hello yet
            self._orphan(route)
        done = state == S.DECODE_COMPLETED
        assert self.ring is not None
        gen = self.ring.transport.load32(self.ring.slot_field(tr.slot, "generated")) if done else int(
            meta["generated"])
        moved = gen > route.sent
        if moved:
            self._forward(route, chan, gen)
        if done:
            self._finish(route, chan, meta, gen)
        return moved

    def _forward(self, route: Route, chan: ipc.Channel | None, gen: int) -> None:
        assert self.ring is not None
        tr = route.track
        start, route.sent = route.sent, gen
        if route.orphan or chan is None:
            return
        ids = self.ring.read_output(tr.slot, start, gen).tolist()
        # written by the engine before token 0 (schema minor 4)
        cached = self.ring.transport.load32(self.ring.slot_field(tr.slot, "cached_tokens")) if start == 0 else None
        prompt = self._prompt_logprobs(tr) if start == 0 and tr.prompt_logprobs >= 0 else None
        clocks, admit_ns = None, 0
        if start == 0:  # the first three, written before token 0's release
            admit_ns, schedule_ns, first_ns = (self.ring.transport.load64(self.ring.slot_field(tr.slot, f))
                                               for f in CLOCKS[:3])
            clocks = (schedule_ns, first_ns)
        if tr.logprobs or tr.top_logprobs:
            lps, tops = self.ring.read_logprobs(tr.slot, start, gen)
            top = top_pairs(tops, tr.top_logprobs) if tr.top_logprobs else None
            chan.send(m.Tokens(tr.req_id, ids, lps.tolist(), top, at=start, cached_tokens=cached, prompt=prompt,
                               clocks=clocks, admit_ns=admit_ns))
        else:
            chan.send(m.Tokens(tr.req_id, ids, at=start, cached_tokens=cached, prompt=prompt, clocks=clocks,
                               admit_ns=admit_ns))

    def _prompt_logprobs(self, tr: m.Track) -> list[tuple[float, int, list[tuple[int, float]]]]:
        """The slot's prompt log-probs, positions 1.. (the engine wrote them before token 0's release)."""
        assert self.ring is not None
        plen = self.ring.transport.load32(self.ring.slot_field(tr.slot, "prompt_len"))
        entries, tops = self.ring.read_prompt_logprobs(tr.slot, 1, max(plen, 1))
        pairs = top_pairs(tops, tr.prompt_logprobs)
        return [(float(e["logprob"]), int(e["rank"]), p) for e, p in zip(entries, pairs, strict=True)]

    def _finish(self, route: Route, chan: ipc.Channel | None, meta: np.void, gen: int) -> None:
        assert self.writer is not None
        tr = route.track
        if chan is not None and not route.orphan:
            # The snapshot is a plain copy: read the words the state word guards again, after it.
            ring = self.ring
            assert ring is not None
            t = ring.transport
            reason = t.load32(ring.slot_field(tr.slot, "finish_reason"))
            error = t.load32(ring.slot_field(tr.slot, "error_code"))
            # a prompt computed whole whose first token ended it: its log-probs came with no token
            ended = gen == 0 and reason in (F.EOS, F.STOP_ID) and tr.prompt_logprobs >= 0
            prompt = self._prompt_logprobs(tr) if ended else None
            admit_ns, schedule_ns, first_ns, last_ns = (t.load64(ring.slot_field(tr.slot, f)) for f in CLOCKS)
            done = m.Finished(tr.req_id, reason, error, gen, int(meta["prompt_len"]), prompt, schedule_ns=schedule_ns,
                              first_token_ns=first_ns, last_token_ns=last_ns, admit_ns=admit_ns)
            if reason == F.STOP_ID:
                done.stop_token = ring.stop_token(tr.slot)
            chan.send(done)
        self.writer.release(tr.slot, tr.seq)
        del self.routes[tr.slot]

    def _fail(self, route: Route, status: int, message: str) -> None:
        chan = self.gateways.get(route.track.gateway_id)
        if chan is not None and not route.orphan:
            chan.send(m.Failed(route.track.req_id, status, message))
        self._orphan(route)

    def _orphan(self, route: Route) -> None:
        route.orphan = True
        if self.writer is not None:
            with contextlib.suppress(RingError):  # a remote ring that is lost: the slot went with it
                self.writer.cancel(route.track.slot, route.track.seq)

    # ------------------------------------------------------------ hand-over
    def adopt(self, gateway_id: int, received: dict[int, int]) -> set[int]:
        """Route the requests of ``received`` (request id -> tokens its gateway has) found in this ring,
        each from its slot as it is now and from the first token its gateway lacks; their ids."""
        if self.ring is None or not received:
            return set()
        try:
            snap = self.ring.read_slots(self.snapshot)
        except RingError:  # a remote ring lost: its streams are failed as not found
            return set()
        wanted = np.fromiter(received, np.uint64, len(received))
        live = np.isin(snap["request_id"], wanted) & (snap["state"] > S.RESERVED)
        adopted = set()
        for idx in np.flatnonzero(live):
            meta = snap[idx]
            req_id, sampling = int(meta["request_id"]), meta["sampling"]
            flags = int(sampling["flags"])
            track = m.Track(req_id, gateway_id, int(idx), int(meta["seq"]), bool(flags & L.SamplingFlags.WANT_LOGPROBS),
                            int(sampling["num_top_logprobs"]), self.index,
                            int(meta["num_prompt_logprobs"]) if flags & L.SamplingFlags.WANT_PROMPT_LOGPROBS else -1)
            self.add_route(Route(track, sent=received[req_id]))
            adopted.add(req_id)
        return adopted

    def leave(self) -> None:
        """Stop without touching the streams: the next reader serves them (nothing failed or cancelled)."""
        self.routes.clear()
        self.watch.close()
        self._close_notifier()

    # ------------------------------------------------------------ wake-ups
    def _open_notifier(self) -> None:
        """Watch the attached ring's notifier, if it has one and an event loop runs here (a reader driven
        by hand, as in tests, polls)."""
        if self.notifier is not None or self._none_here or self.ring is None or self._wake is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        notifier, final = look_for(self.ring, "tokens")
        if notifier is None:
            self._none_here = final
            return
        if not notifier.take():  # another reader waits on it (the one this replaces): poll until it goes
            notifier.close()
            return
        loop.add_reader(notifier.fileno(), self._notified)
        self.notifier, self._loop = notifier, loop

    def _notified(self) -> None:
        if self.notifier is not None:
            self.notifier.drain()  # before the cycle it wakes: a step that follows writes again
        if self._wake is not None:
            self._wake()

    def _close_notifier(self) -> None:
        notifier, self.notifier, self._none_here = self.notifier, None, False
        if notifier is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(notifier.fileno())
        notifier.close()

    # ------------------------------------------------------------ health
    def check_health(self) -> None:
        try:
            self._check_health()
        except RingError as exc:  # a remote ring whose access failed: its watch lets it go at this next look
            log.warning("ring access failed", engine=self.index, error=str(exc))
            with contextlib.suppress(RingError):
                self.watch.current()

    def _check_health(self) -> None:
        ring = self.watch.current()  # a replaced or removed segment reaches _ring_gone first
        if ring is None or ring is not self.ring:
            self._fail_all(RESTARTED)  # requests tracked while no ring was attached
            self._close_notifier()
            self.ring = ring
            self.writer = SlotWriter(ring) if ring is not None else None
            self.snapshot = np.empty(ring.geometry.num_slots, L.SLOT_DTYPE) if ring is not None else None
            self.seen = None
            self._open_notifier()
            return
        self._open_notifier()  # the engine makes it just before READY: it may come after the segment
        if not ring.engine_alive(self.cfg.heartbeat_timeout_s):
            live = [route for route in self.routes.values() if not route.orphan]
            if live:
                log.warning("engine stopped responding: streams failed with 503", streams=len(live),
                            engine=self.index, timeout_s=self.cfg.heartbeat_timeout_s,
                            silent_s=round(time.monotonic() - ring.liveness.moved_at, 3),
                            starved_s=round(ring.liveness.starved_s, 3),  # left out: the engine waiting for a CPU
                            state=ring.header_load32("engine_state"))
            for route in live:
                self._fail(route, 503, "the engine stopped responding")
            return
        lv = ring.liveness
        if not lv.starved_s:
            self.starved_said = False
            return
        silent = time.monotonic() - lv.moved_at + lv.starved_s  # the starvation counted in
        if not self.starved_said and silent >= self.cfg.heartbeat_timeout_s:
            self.starved_said = True  # once a silence: a busy host slowed the engine, which is not hung
            log.warning("engine starved: silent past the timeout while waiting for a CPU, not taken for hung",
                        engine=self.index, timeout_s=self.cfg.heartbeat_timeout_s, silent_s=round(silent, 3),
                        starved_s=round(lv.starved_s, 3))

    def _ring_gone(self, old: Ring) -> None:
        """The watch is about to close ``old``: end its requests and cancel their slots while it is mapped."""
        if old is not self.ring:
            return
        self._fail_all(RESTARTED)
        self._close_notifier()
        self.ring = self.writer = self.snapshot = self.seen = None

    def _fail_all(self, message: str) -> None:
        for route in self.routes.values():
            self._fail(route, 503, message)
        self.routes.clear()


class TokenReader:
    def __init__(self, cfg: ReaderConfig) -> None:
        self.cfg = cfg
        self.gateways: dict[int, ipc.Channel] = {}
        self._wake = asyncio.Event()
        self.engines = [RingReader(cfg, name, self.gateways, i, self._wake.set)
                        for i, name in enumerate(cfg.ring_names)]

    # ------------------------------------------------------------ links
    async def on_channel(self, chan: ipc.Channel) -> None:
        try:
            while True:
                tracks = []
                for msg in await chan.recv():
                    if isinstance(msg, m.GatewayHello):
                        self.hello(chan, msg)
                    else:
                        tracks.append(msg)
                self.track(tracks)
        except ipc.LinkClosed:
            self.link_closed(chan)

    def link_closed(self, chan: ipc.Channel) -> None:
        """A gateway's link closed: its streams are looked at in the next read whatever their slots do, so that
        they are orphaned (their slots cancelled) once the grace for a gateway to come back is over."""
        gid = chan.info.get("gateway_id")
        if gid is not None and self.gateways.get(gid) is chan:
            del self.gateways[gid]
            for engine in self.engines:
                engine.pending.update(slot for slot, route in engine.routes.items() if route.track.gateway_id == gid)

    def hello(self, chan: ipc.Channel, msg: m.GatewayHello) -> None:
        """A gateway linked: its tokens go to ``chan``; the streams it names are re-attached."""
        chan.info["gateway_id"] = msg.gateway_id
        self.gateways[msg.gateway_id] = chan
        if msg.resume:
            self.resume(chan, msg.gateway_id, {r.req_id: r.received for r in msg.resume})

    def resume(self, chan: ipc.Channel, gateway_id: int, received: dict[int, int]) -> None:
        """Go on with a gateway's streams from the tokens it has: a routed one (its ``Track`` came
        first) from there, another from its slot in the rings; one in no ring is failed."""
        left = dict(received)
        for engine in self.engines:
            for route in engine.routes.values():
                if route.track.req_id in left and route.track.gateway_id == gateway_id:
                    route.sent = left.pop(route.track.req_id)
                    route.orphan = False  # its gateway is here after all (a cancelled slot ends as abort)
                    engine.pending.add(route.track.slot)
        for engine in self.engines:
            if left:
                engine.check_health()
                for req_id in engine.adopt(gateway_id, left):
                    del left[req_id]
        for req_id in left:
            chan.send(m.Failed(req_id, 503, NOT_IN_RING))
        log.info("streams_resumed", gateway=gateway_id, resumed=len(received) - len(left), lost=len(left))
        self._wake.set()

    def track(self, tracks: list[m.Track]) -> None:
        """Route newly published slots; each engine named is checked first, so that a new route
        belongs to its ring as it is now. A ``Track`` for a slot already routed with its seq (the
        tracker re-sends them to a new reader, which may have re-attached the stream) changes nothing."""
        known = [tr for tr in tracks if 0 <= tr.engine < len(self.engines)]
        for tr in (tr for tr in tracks if not 0 <= tr.engine < len(self.engines)):
            log.error("track_for_unknown_engine", engine=tr.engine, req_id=tr.req_id)
        for engine in sorted({tr.engine for tr in known}):
            self.engines[engine].check_health()
        for tr in known:
            ring = self.engines[tr.engine]
            had = ring.routes.get(tr.slot)
            if had is None or had.track.seq != tr.seq:
                ring.add_route(Route(tr))
        if known:
            self._wake.set()

    @property
    def busy(self) -> bool:
        return any(e.routes for e in self.engines)

    def check_health(self) -> None:
        for engine in self.engines:
            engine.check_health()

    def cycle(self) -> bool:
        moved = False
        for engine in self.engines:
            moved |= engine.cycle()
        return moved

    def notified(self) -> bool:
        """Whether every ring with routes wakes this reader when it changes (its engine's notifier)."""
        return all(e.notifier is not None for e in self.engines if e.routes)

    async def poll_loop(self) -> None:
        """Read the rings while they have routes: after each wake-up where every such ring has a notifier
        (one per engine step that published, a ``Track``, or the next health check), else polling,
        tight while tokens flow and backing off to ``max_poll_s``."""
        delay = self.cfg.min_poll_s
        next_health = 0.0
        while True:
            now = time.monotonic()
            if now >= next_health:
                self.check_health()
                next_health = now + self.cfg.health_every_s
            if not self.busy:
                await self._idle()
                delay = self.cfg.min_poll_s
                continue
            moved = self.cycle()
            if self.notified():
                await self._idle()
                continue
            delay = self.cfg.min_poll_s if moved else min(delay * 2, self.cfg.max_poll_s)
            await asyncio.sleep(delay)

    async def _idle(self) -> None:
        """Sleep until a ``Track`` or an engine's wake-up comes (or the next health check).

        ``asyncio.timeout``, not ``wait_for``: on Python 3.11 a ``wait_for`` whose wait ends as the task is
        cancelled returns and drops the cancellation, and with a wake-up per engine step that race is
        common enough that a SIGTERMed reader kept serving (its only stop is that cancellation)."""
        try:
            async with asyncio.timeout(self.cfg.health_every_s):
                await self._wake.wait()
        except TimeoutError:
            pass
        self._wake.clear()

    def close(self) -> None:
        for engine in self.engines:
            engine.watch.close()
            engine._close_notifier()

    async def hand_over(self) -> None:
        """Stop serving and leave every stream to the next reader: no stream failed, no slot cancelled;
        what was queued for the gateways reaches them before their links close (within ``DRAIN_S``)."""
        streams = sum(len(e.routes) for e in self.engines)
        for engine in self.engines:
            engine.leave()
        links = list(self.gateways.values())
        self.gateways.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(chan.aclose() for chan in links)), DRAIN_S)
        log.info("reader_handed_over", streams=streams, gateways=len(links))


def marker_stamp(run_dir: Path) -> tuple[int, int] | None:
    """The reader's ready marker as written: its inode and modification time, or None if there is none."""
    with contextlib.suppress(FileNotFoundError):
        st = ipc.ready_path(run_dir, "reader").stat()
        return st.st_ino, st.st_mtime_ns
    return None


def clear_own_marker(run_dir: Path, stamp: tuple[int, int] | None = None) -> None:
    """Remove the ready marker if it is this process's: a new reader started before this one stopped
    has written its own. The pid alone cannot tell in containers (each reader is pid 1 of its own
    namespace), so with ``stamp`` (``marker_stamp`` when this one wrote it) the file must match it too."""
    path = ipc.ready_path(run_dir, "reader")
    with contextlib.suppress(FileNotFoundError, ValueError):
        if int(path.read_text().strip()) == os.getpid() and (stamp is None or marker_stamp(run_dir) == stamp):
            path.unlink(missing_ok=True)


async def run_reader(cfg: ReaderConfig) -> None:
    """Serve until cancelled (SIGTERM), then hand over. A new reader may start while this one runs: it
    takes the socket's name (new links reach it) and this one's links close once it stopped."""
    reader = TokenReader(cfg)
    server = await ipc.serve(cfg.run_dir, "reader", m.ToReader, reader.on_channel)
    ipc.mark_ready(cfg.run_dir, "reader")
    stamp = marker_stamp(cfg.run_dir)
    log.info("reader_ready", rings=",".join(cfg.ring_names))
    try:
        await reader.poll_loop()
    finally:
        clear_own_marker(cfg.run_dir, stamp)
        server.close()
        await reader.hand_over()
