"""The token reader service: moves generated tokens from the rings to the owning gateway.

Each cycle is one bulk read of slot metadata. Slots that have produced nothing yet are looked
at first (their first token is the TTFT), then the rest; new tokens (and logprobs) go to the
gateway that owns the request, batched into one frame per gateway. Once a slot is
DECODE_COMPLETED and its tail is read, the reader sends ``Finished`` and releases the slot.
Polling is adaptive: tight while tokens flow, backing off to ``max_poll_s`` when idle. A stale
heartbeat or a replaced ring ends every stream with ``Failed`` (no client hangs); a replaced
or removed ring's requests are failed, and their slots cancelled, before its mapping closes.

With more than one engine (``--data-parallel-size``) there is one ``RingReader`` per engine's ring,
each with its own watch and routes (keyed by slot; a ``Track`` names its engine); one poll loop serves
them all, and a ring that goes fails only its own requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import numpy as np

from dpu_gateway.ringwatch import RingWatch
from shared import ipc
from shared import messages as m
from shared import ring_layout as L
from shared.data_parallel import engine_ring_names
from shared.log import get_logger
from shared.ring import Ring
from shared.slots import SlotWriter

log = get_logger("reader")
S = L.SlotState
RESTARTED = "the engine restarted; the request was lost"


@dataclasses.dataclass(frozen=True, slots=True)
class ReaderConfig:
    run_dir: Path
    ring_name: str                   # the base name: engine_ring_names(ring_name, data_parallel_size)
    heartbeat_timeout_s: float = 2.0
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

    def __init__(self, cfg: ReaderConfig, name: str, gateways: dict[int, ipc.Channel]) -> None:
        self.cfg = cfg
        self.watch = RingWatch(name, cfg.heartbeat_timeout_s, on_detach=self._ring_gone)
        self.ring: Ring | None = None
        self.writer: SlotWriter | None = None
        self.snapshot: np.ndarray | None = None
        self.routes: dict[int, Route] = {}
        self.gateways = gateways  # shared with the TokenReader: gateway id -> its link

    # ------------------------------------------------------------ one cycle
    def cycle(self) -> bool:
        """Read the ring once and forward what changed; True if any token moved."""
        if self.ring is None or not self.routes:
            return False
        snap = self.ring.read_slots(self.snapshot)
        self.ring.transport.fence()  # acquire: the tokens behind every `generated` seen are visible
        moved = False
        fresh = [r for r in self.routes.values() if r.sent == 0]
        for route in fresh + [r for r in self.routes.values() if r.sent > 0]:
            moved |= self._serve(route, snap[route.track.slot])
        return moved

    def _serve(self, route: Route, meta: np.void) -> bool:
        tr = route.track
        if int(meta["seq"]) != tr.seq:
            self._fail(route, 500, "slot was reused before its request finished")
            del self.routes[tr.slot]
            return False
        chan = self.gateways.get(tr.gateway_id)
        if chan is None and not route.orphan:
            if time.monotonic() - route.since < self.cfg.unowned_grace_s:
                return False  # its gateway has not said hello yet
            self._orphan(route)
        state = int(meta["state"])
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
        if tr.logprobs or tr.top_logprobs:
            lps, tops = self.ring.read_logprobs(tr.slot, start, gen)
            top = top_pairs(tops, tr.top_logprobs) if tr.top_logprobs else None
            chan.send(m.Tokens(tr.req_id, ids, lps.tolist(), top, cached))
        else:
            chan.send(m.Tokens(tr.req_id, ids, cached_tokens=cached))

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
            chan.send(m.Finished(tr.req_id, reason, error, gen, int(meta["prompt_len"])))
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
            self.writer.cancel(route.track.slot, route.track.seq)

    # ------------------------------------------------------------ health
    def check_health(self) -> None:
        ring = self.watch.current()  # a replaced or removed segment reaches _ring_gone first
        if ring is None or ring is not self.ring:
            self._fail_all(RESTARTED)  # requests tracked while no ring was attached
            self.ring = ring
            self.writer = SlotWriter(ring) if ring is not None else None
            self.snapshot = np.empty(ring.geometry.num_slots, L.SLOT_DTYPE) if ring is not None else None
            return
        if not ring.engine_alive(self.cfg.heartbeat_timeout_s):
            for route in self.routes.values():
                if not route.orphan:
                    self._fail(route, 503, "the engine stopped responding")

    def _ring_gone(self, old: Ring) -> None:
        """The watch is about to close ``old``: end its requests and cancel their slots while it is mapped."""
        if old is not self.ring:
            return
        self._fail_all(RESTARTED)
        self.ring = self.writer = self.snapshot = None

    def _fail_all(self, message: str) -> None:
        for route in self.routes.values():
            self._fail(route, 503, message)
        self.routes.clear()


class TokenReader:
    def __init__(self, cfg: ReaderConfig) -> None:
        self.cfg = cfg
        self.gateways: dict[int, ipc.Channel] = {}
        self.engines = [RingReader(cfg, name, self.gateways) for name in cfg.ring_names]
        self._wake = asyncio.Event()

    # ------------------------------------------------------------ links
    async def on_channel(self, chan: ipc.Channel) -> None:
        try:
            while True:
                tracks = []
                for msg in await chan.recv():
                    if isinstance(msg, m.GatewayHello):
                        chan.info["gateway_id"] = msg.gateway_id
                        self.gateways[msg.gateway_id] = chan
                    else:
                        tracks.append(msg)
                self.track(tracks)
        except ipc.LinkClosed:
            gid = chan.info.get("gateway_id")
            if gid is not None and self.gateways.get(gid) is chan:
                del self.gateways[gid]

    def track(self, tracks: list[m.Track]) -> None:
        """Route newly published slots; each engine named is checked first, so that a new route
        belongs to its ring as it is now."""
        known = [tr for tr in tracks if 0 <= tr.engine < len(self.engines)]
        for tr in (tr for tr in tracks if not 0 <= tr.engine < len(self.engines)):
            log.error("track_for_unknown_engine", engine=tr.engine, req_id=tr.req_id)
        for engine in sorted({tr.engine for tr in known}):
            self.engines[engine].check_health()
        for tr in known:
            self.engines[tr.engine].routes[tr.slot] = Route(tr)
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

    async def poll_loop(self) -> None:
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
            delay = self.cfg.min_poll_s if self.cycle() else min(delay * 2, self.cfg.max_poll_s)
            await asyncio.sleep(delay)

    async def _idle(self) -> None:
        """Nothing to read: sleep until the tracker sends a ``Track`` (or the next health check)."""
        try:
            await asyncio.wait_for(self._wake.wait(), self.cfg.health_every_s)
        except TimeoutError:
            pass
        self._wake.clear()

    def close(self) -> None:
        for engine in self.engines:
            engine.watch.close()


async def run_reader(cfg: ReaderConfig) -> None:
    reader = TokenReader(cfg)
    server = await ipc.serve(cfg.run_dir, "reader", m.ToReader, reader.on_channel)
    ipc.mark_ready(cfg.run_dir, "reader")
    log.info("reader_ready", rings=",".join(cfg.ring_names))
    try:
        await reader.poll_loop()
    finally:
        ipc.clear_ready(cfg.run_dir, "reader")
        server.close()
        reader.close()
