"""The slot tracker service: admits gateway requests into ring slots, over one ring per engine.

It owns the EMPTY -> RESERVED -> PREFILL_PENDING transitions and the cancel flag. With more than one
engine (``--data-parallel-size``) each request goes to the ring ``dpu_gateway.routing`` chooses: the
engine with the fewest requests waiting, then the fewest slots in use, then the most free KV blocks,
then the next in turn. A request that finds every ring full waits in a bounded FIFO queue; when that
is full too the gateway is told 429 with a Retry-After; only when no engine serves is it told 503.
After publishing a slot it tells the token reader who owns it (``Track``, with the engine's index),
and re-sends every live ``Track`` whenever the reader link is re-established.

Each ring's slot cache (and so its slot writer) is dropped through the ring watch's ``on_detach``,
while the old mapping is still open: nothing in the tracker outlives the ring it writes to. A publication that
a remote ring's failed access cut short (its client told 503) leaves its slot RESERVED where the state word never
landed: the lane keeps that (slot, seq) and gives the slot back (RESERVED -> EMPTY) once it attaches the same
engine's ring again. Where the state word had landed the engine serves it: the lane then hands the slot to the
reader as an orphan (a ``Track`` of no gateway), which stops it and releases it quietly. An engine that restarted
made its ring anew, the slot with it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dpu_gateway.ringwatch import RingWatch
from dpu_gateway.routing import Load, choose_order
from dpu_gateway.slot_cache import SlotCache
from shared import ipc
from shared import messages as m
from shared import ring_layout as L
from shared.data_parallel import engine_ring_names
from shared.env import HEARTBEAT_TIMEOUT_S
from shared.frontend_flags import TRACKER
from shared.log import admit_repeat, get_logger
from shared.notify import Notifier, look_for
from shared.ring import Ring
from shared.slots import SlotRequest
from shared.transport import RingError

log = get_logger("tracker")
NOT_RUNNING = "the engine is not running"
_STATS = L.FIELD_OFFSETS["RingHeader"]["stats"]
STAT_WAITING, STAT_KV_FREE, STAT_KV_TOTAL = (_STATS + L.FIELD_OFFSETS["EngineStats"][f]
                                             for f in ("waiting", "kv_blocks_free", "kv_blocks_total"))


@dataclasses.dataclass(frozen=True, slots=True)
class TrackerConfig:
    run_dir: Path
    ring_name: str                   # the base name: engine_ring_names(ring_name, data_parallel_size)
    max_waiting: int = TRACKER.max_waiting
    retry_after_s: float = TRACKER.retry_after
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S
    busy_poll_s: float = 0.001
    idle_poll_s: float = 0.1
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        engine_ring_names(self.ring_name, self.data_parallel_size)  # validates the size

    @property
    def ring_names(self) -> tuple[str, ...]:
        return engine_ring_names(self.ring_name, self.data_parallel_size)


@dataclasses.dataclass(slots=True)
class Live:
    chan: ipc.Channel
    submit: m.Submit
    engine: int
    slot: int
    seq: int

    def track(self) -> m.Track:
        s = self.submit
        return m.Track(s.req_id, s.gateway_id, self.slot, self.seq, s.sampling.logprobs, s.sampling.top_logprobs,
                       self.engine, s.sampling.prompt_logprobs)


class Lane:
    """One engine's ring as the tracker sees it: the watch and the slot cache of the attached ring."""

    def __init__(self, index: int, name: str, heartbeat_timeout_s: float, on_lost: Callable[[int], None],
                 on_orphan: Callable[[m.Track], None] = lambda track: None) -> None:
        self.index = index
        self.watch = RingWatch(name, heartbeat_timeout_s, on_detach=self._detached)
        self.cache: SlotCache | None = None
        self.work: Notifier | None = None  # the engine's wake-up (shared/notify.py), None while it has none
        self._looked = False  # whether the attached ring's answer about it is final (notify.look_for)
        self.on_lost = on_lost  # called with the index when a ring this lane wrote to goes
        self.cut: list[tuple[int, int, int, int]] = []  # (ring's created_ns, slot, seq, req_id) cut short
        self.on_orphan = on_orphan  # a cut publication the engine has after all, for the reader to release
        self.born = 0  # the attached ring's created_ns

    def _detached(self, old: Ring) -> None:
        """The watch is closing ``old``: drop the cache (and its slot writer) that points into it."""
        if self.cache is not None and self.cache.ring is old:
            self.cache = None
            if self.work is not None:
                self.work.close()
                self.work = None
            self._looked = False
            self.on_lost(self.index)

    def wake_engine(self) -> None:
        """Tell an idle engine that a slot was published (it polls when the ring has no notifier)."""
        if not self._looked and self.cache is not None:  # the engine makes it just before READY
            self.work, self._looked = look_for(self.cache.ring, "work")
        if self.work is not None:
            self.work.notify()

    def slots(self) -> SlotCache | None:
        """The slot cache of the ring attached now, or None when no ring is."""
        ring = self.watch.current()  # a replaced ring reaches _detached first: the old cache goes
        if ring is None:
            return None
        if self.cache is None:
            cache = SlotCache(ring)
            cache.refresh()
            self.cache, self.born = cache, ring.header_load64("created_ns")
            if self.cut:
                self._give_back_cut(cache)
        return self.cache

    def cut_short(self, idx: int, seq: int, req_id: int) -> None:
        """A publication of ``req_id`` into slot ``idx`` (reserved with ``seq``) failed with the ring's access:
        this lane settles the slot when it reaches the same ring again (``_give_back_cut``)."""
        self.cut.append((self.born, idx, seq, req_id))

    def _give_back_cut(self, cache: SlotCache) -> None:
        """RESERVED(seq) -> EMPTY(seq) for each cut publication of this ring (the same engine, attached again: the
        same creation time); those of an engine that has since made a new ring are dropped. A publication whose state
        word had landed is the engine's: handed to the reader to stop and release, and, if the engine has not claimed
        it yet (its flip may be lost, and an engine reads only the slots that flipped), announced by doorbell rings
        that make the engine read every slot. A failed access keeps them for the next attach (giving one back twice
        fails its compare-and-swap: nothing moves; ringing twice costs one more scan of every slot)."""
        try:
            unclaimed = False
            for created, idx, seq, req_id in self.cut:
                if created != self.born:
                    continue
                if cache.writer.abandon(idx, seq):
                    log.info("slot of a publication cut short given back", engine=self.index, slot=idx, seq=seq)
                elif cache.writer.published(idx, seq):  # the state word had landed: the engine has it
                    log.info("publication cut short reached the engine: handed to the reader to stop and release",
                             engine=self.index, slot=idx, seq=seq, req_id=req_id)
                    unclaimed = unclaimed or cache.writer.pending(idx, seq)
                    self.on_orphan(m.Track(req_id, m.NO_GATEWAY, idx, seq, engine=self.index))
            if unclaimed:
                cache.writer.ring_for_full_scan()
            self.cut = []
            cache.refresh()
        except RingError as exc:
            log.warning("publications cut short not given back yet", engine=self.index, error=str(exc))

    def serving(self) -> SlotCache | None:
        """The slot cache when the engine serves (READY with a fresh heartbeat), else None."""
        try:
            cache = self.slots()
            return cache if cache is not None and cache.ring.engine_alive(self.watch.timeout_s) else None
        except RingError:  # a remote ring whose access failed: its watch lets it go at the next look
            return None

    def problem(self) -> str:
        """Why this engine does not serve (for the log line of a refusal)."""
        return self.watch.problem() or "it serves now"

    def load(self, cache: SlotCache) -> Load:
        """What the routing rule compares (``dpu_gateway/routing.py``): three words of the ring header's
        stats and the tracker's own count of slots in use."""
        t = cache.ring.transport
        return Load(self.index, t.load32(STAT_WAITING), cache.in_use(), t.load32(STAT_KV_FREE), t.load32(STAT_KV_TOTAL))


class SlotTracker:
    def __init__(self, cfg: TrackerConfig) -> None:
        self.cfg = cfg
        self.lanes = [Lane(i, name, cfg.heartbeat_timeout_s, self._forget_engine, self._hand_orphan)
                      for i, name in enumerate(cfg.ring_names)]
        self.waiting: collections.deque[tuple[ipc.Channel, m.Submit]] = collections.deque()
        self.live: dict[int, Live] = {}
        self.reader: ipc.Channel | None = None
        self.orphans: list[m.Track] = []  # slots of cut publications the engine has: for every reader that links
        self.last_engine = -1  # the engine the last request went to (ties go to the next one)
        self.routed = [0] * len(self.lanes)  # requests published to each engine since start
        self._wake = asyncio.Event()

    # ------------------------------------------------------------ rings
    def serving(self) -> list[tuple[Lane, SlotCache]]:
        """The lanes whose engine serves now, with their caches; forgets the live requests of rings let go."""
        return [(lane, cache) for lane in self.lanes if (cache := lane.serving()) is not None]

    def _forget_engine(self, engine: int) -> None:
        """Engine ``engine``'s ring went: the reader fails its requests; this process forgets them."""
        for req_id in [r for r, live in self.live.items() if live.engine == engine]:
            del self.live[req_id]

    # ------------------------------------------------------------ gateway link
    async def on_gateway(self, chan: ipc.Channel) -> None:
        try:
            while True:
                for msg in await chan.recv():
                    if isinstance(msg, m.Submit):
                        self.submit(chan, msg)
                    else:
                        self.cancel(msg.req_id)
        except ipc.LinkClosed:
            self.drop_channel(chan)

    def submit(self, chan: ipc.Channel, sub: m.Submit) -> None:
        serving = self.serving()
        if not serving:
            self._log_not_running(1)
            chan.send(m.Rejected(sub.req_id, 503, NOT_RUNNING))
            return
        try:
            if not self.waiting and self._publish(serving, chan, sub):
                return
        except RingError as exc:  # a remote ring lost mid-publication (its watch lets it go at the next look)
            log.warning("ring access failed: 503", req_id=sub.req_id, error=str(exc))
            chan.send(m.Rejected(sub.req_id, 503, f"{NOT_RUNNING}: its ring cannot be reached"))
            return
        if len(self.waiting) >= self.cfg.max_waiting:
            chan.send(m.Rejected(sub.req_id, 429, "server busy: the ring and the wait queue are full",
                                 self.cfg.retry_after_s))
            return
        self.waiting.append((chan, sub))
        self._wake.set()

    def _publish(self, serving: list[tuple[Lane, SlotCache]], chan: ipc.Channel, sub: m.Submit) -> bool:
        """Write ``sub`` into a free slot of the engine the routing rule puts first; False when every
        serving ring is full."""
        caches = dict((lane.index, cache) for lane, cache in serving)
        order = [serving[0][0].index] if len(serving) == 1 else choose_order(
            [lane.load(cache) for lane, cache in serving], self.last_engine, len(self.lanes))
        for engine in order:
            cache = caches[engine]
            got = cache.reserve_refreshing()
            if got is not None:
                self._write(engine, cache, got, chan, sub)
                return True
        return False

    def _write(self, engine: int, cache: SlotCache, got: tuple[int, int], chan: ipc.Channel, sub: m.Submit) -> None:
        idx, seq = got
        try:
            cache.writer.publish(idx, seq, SlotRequest(sub.req_id, np.asarray(sub.prompt, np.int32), sub.sampling))
        except (ValueError, OverflowError) as exc:  # one bad request must not cost the gateway its link
            cache.writer.abandon(idx, seq)
            chan.send(m.Rejected(sub.req_id, 400, str(exc)))
            return
        except RingError:  # a remote ring lost mid-publication: the slot is given back when it is reached again
            self.lanes[engine].cut_short(idx, seq, sub.req_id)
            raise
        self.lanes[engine].wake_engine()
        live = Live(chan, sub, engine, idx, seq)
        self.live[sub.req_id] = live
        self.last_engine = engine
        self.routed[engine] += 1
        if self.reader is not None:
            self.reader.send(live.track())
        chan.send(m.Admitted(sub.req_id, idx, engine))

    def cancel(self, req_id: int) -> None:
        try:
            self._cancel(req_id)
        except RingError as exc:  # the ring is going: so is the request
            log.warning("cancel not written: ring access failed", req_id=req_id, error=str(exc))

    def _cancel(self, req_id: int) -> None:
        for i, (_, sub) in enumerate(self.waiting):
            if sub.req_id == req_id:
                del self.waiting[i]
                return
        live = self.live.get(req_id)
        if live is None:
            self._cancel_by_ring(req_id)
            return
        cache = self.lanes[live.engine].slots()  # None, and the request forgotten, when its ring went
        if cache is not None and req_id in self.live:
            cache.writer.cancel(live.slot, live.seq)

    def _cancel_by_ring(self, req_id: int) -> None:
        """A request this process does not know (an earlier tracker process admitted it): find its
        slot by request id in every ring; ``cancel`` leaves slots that finished or were reused alone."""
        for lane in self.lanes:
            cache = lane.slots()
            if cache is None:
                continue
            snap = cache.refresh()
            for idx in np.flatnonzero(snap["request_id"] == np.uint64(req_id)):
                cache.writer.cancel(int(idx), int(snap["seq"][idx]))

    def _log_not_running(self, refused: int) -> None:
        if (repeated := admit_repeat("engine not running")) is not None:
            log.warning("engine not running: 503", refused=refused, timeout_s=self.cfg.heartbeat_timeout_s,
                        repeated=repeated, engines={str(lane.index): lane.problem() for lane in self.lanes})

    def drop_channel(self, chan: ipc.Channel) -> None:
        """A gateway went away: forget its queued requests and cancel its slots."""
        self.waiting = collections.deque(w for w in self.waiting if w[0] is not chan)
        for req_id in [r for r, live in self.live.items() if live.chan is chan]:
            self.cancel(req_id)

    # ------------------------------------------------------------ admission loop
    def admit_waiting(self) -> None:
        serving = self.serving()
        if not serving:
            if self.waiting:
                self._log_not_running(len(self.waiting))
            while self.waiting:
                chan, sub = self.waiting.popleft()
                chan.send(m.Rejected(sub.req_id, 503, NOT_RUNNING))
            return
        for lane, cache in serving:
            self._forget_finished(lane.index, cache.refresh())
        while self.waiting:
            chan, sub = self.waiting[0]
            if not self._publish(serving, chan, sub):
                break
            self.waiting.popleft()

    def _forget_finished(self, engine: int, snap: np.ndarray) -> None:
        for req_id, live in list(self.live.items()):
            if live.engine != engine:
                continue
            state, seq = int(snap["state"][live.slot]), int(snap["seq"][live.slot])
            if seq != live.seq or state == L.SlotState.EMPTY:
                del self.live[req_id]

    async def admission_loop(self) -> None:
        while True:
            poll = self.cfg.busy_poll_s if self.waiting else self.cfg.idle_poll_s
            try:  # asyncio.timeout: a wait_for ending as the task is cancelled drops the cancellation (3.11)
                async with asyncio.timeout(poll):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                self.admit_waiting()
            except RingError as exc:  # a remote ring lost: the next round sees it gone
                log.warning("admission: ring access failed", error=str(exc))

    def close(self) -> None:
        for lane in self.lanes:
            lane.watch.close()

    def _hand_orphan(self, track: m.Track) -> None:
        """A slot the engine serves for a request whose client was told 503: the reader stops it and releases
        it (a route of no gateway); kept, and sent again to a reader that links later (one that restarted before
        releasing it included), while the slot still holds that request."""
        self.orphans.append(track)
        if self.reader is not None:
            self.reader.send(track)

    def _orphans_held(self) -> list[m.Track]:
        """The orphans whose slot still holds their request (not EMPTY, the same seq), or whose ring cannot be
        read now (kept, to look again at the next link); the others are forgotten. An orphan that a ring attached
        here hands over (`_give_back_cut`) was sent by `_hand_orphan` already: it is kept, not returned."""
        looked, self.orphans, kept = self.orphans, [], []
        for track in looked:
            try:
                cache = self.lanes[track.engine].slots()
                held = cache is None or cache.writer.published(track.slot, track.seq)
            except RingError:
                held = True
            if held:
                kept.append(track)
        self.orphans = kept + self.orphans
        return kept

    # ------------------------------------------------------------ reader link
    async def reader_link(self) -> None:
        while True:
            chan = await ipc.connect(self.cfg.run_dir, "reader", m.FromReader)
            self.reader = chan
            for live in self.live.values():
                chan.send(live.track())
            for track in self._orphans_held():
                chan.send(track)
            log.info("reader_linked", live=len(self.live))
            try:
                while True:
                    await chan.recv()  # the reader sends nothing to the tracker
            except ipc.LinkClosed:
                self.reader = None
                log.warning("reader_link_lost")


async def run_tracker(cfg: TrackerConfig) -> None:
    tracker = SlotTracker(cfg)
    server = await ipc.serve(cfg.run_dir, "tracker", m.ToTracker, tracker.on_gateway)
    tasks = [asyncio.create_task(tracker.reader_link()), asyncio.create_task(tracker.admission_loop())]
    ipc.mark_ready(cfg.run_dir, "tracker")
    log.info("tracker_ready", rings=",".join(cfg.ring_names), max_waiting=cfg.max_waiting)
    try:
        await asyncio.gather(*tasks)
    finally:
        ipc.clear_ready(cfg.run_dir, "tracker")
        server.close()
        tracker.close()
