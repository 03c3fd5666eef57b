"""The slot tracker service: admits gateway requests into ring slots.

It owns the EMPTY -> RESERVED -> PREFILL_PENDING transitions and the cancel flag. A request
that finds the ring full waits in a bounded FIFO queue; when that is full too the gateway is
told 429 with a Retry-After. After publishing a slot it tells the token reader who owns it
(``Track``), and re-sends every live ``Track`` whenever the reader link is re-established.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from pathlib import Path

import numpy as np

from dpu_gateway.ringwatch import RingWatch
from dpu_gateway.slot_cache import SlotCache
from shared import ipc
from shared import messages as m
from shared import ring_layout as L
from shared.log import get_logger
from shared.slots import SlotRequest

log = get_logger("tracker")


@dataclasses.dataclass(frozen=True, slots=True)
class TrackerConfig:
    run_dir: Path
    ring_name: str
    max_waiting: int = 256
    retry_after_s: float = 1.0
    heartbeat_timeout_s: float = 2.0
    busy_poll_s: float = 0.001
    idle_poll_s: float = 0.1

    def __post_init__(self) -> None:
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")


@dataclasses.dataclass(slots=True)
class Live:
    chan: ipc.Channel
    submit: m.Submit
    slot: int
    seq: int

    def track(self) -> m.Track:
        s = self.submit
        return m.Track(s.req_id, s.gateway_id, self.slot, self.seq, s.sampling.logprobs, s.sampling.top_logprobs)


class SlotTracker:
    def __init__(self, cfg: TrackerConfig) -> None:
        self.cfg = cfg
        self.watch = RingWatch(cfg.ring_name, cfg.heartbeat_timeout_s)
        self.cache: SlotCache | None = None
        self._generation = 0
        self.waiting: collections.deque[tuple[ipc.Channel, m.Submit]] = collections.deque()
        self.live: dict[int, Live] = {}
        self.reader: ipc.Channel | None = None
        self._wake = asyncio.Event()

    # ------------------------------------------------------------ ring
    def _slots(self) -> SlotCache | None:
        ring = self.watch.current()
        if ring is None:
            self.cache = None
            return None
        if self.watch.generation != self._generation:
            self._generation = self.watch.generation
            self.cache = SlotCache(ring)
            self.cache.refresh()
            self.live.clear()  # the old ring's requests are failed by the reader
        return self.cache

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
        cache = self._slots()
        if cache is None or not self.watch.alive():
            chan.send(m.Rejected(sub.req_id, 503, "the engine is not running"))
            return
        if not self.waiting and self._publish(cache, chan, sub):
            return
        if len(self.waiting) >= self.cfg.max_waiting:
            chan.send(m.Rejected(sub.req_id, 429, "server busy: the ring and the wait queue are full",
                                 self.cfg.retry_after_s))
            return
        self.waiting.append((chan, sub))
        self._wake.set()

    def _publish(self, cache: SlotCache, chan: ipc.Channel, sub: m.Submit) -> bool:
        """Write ``sub`` into a free slot; False when none is free."""
        got = cache.reserve_refreshing()
        if got is None:
            return False
        idx, seq = got
        try:
            cache.writer.publish(idx, seq, SlotRequest(sub.req_id, np.asarray(sub.prompt, np.int32), sub.sampling))
        except (ValueError, OverflowError) as exc:  # one bad request must not cost the gateway its link
            cache.writer.abandon(idx, seq)
            chan.send(m.Rejected(sub.req_id, 400, str(exc)))
            return True
        live = Live(chan, sub, idx, seq)
        self.live[sub.req_id] = live
        if self.reader is not None:
            self.reader.send(live.track())
        chan.send(m.Admitted(sub.req_id, idx))
        return True

    def cancel(self, req_id: int) -> None:
        for i, (_, sub) in enumerate(self.waiting):
            if sub.req_id == req_id:
                del self.waiting[i]
                return
        live = self.live.get(req_id)
        if live is not None and self.cache is not None:
            self.cache.writer.cancel(live.slot, live.seq)
        elif live is None:
            self._cancel_by_ring(req_id)

    def _cancel_by_ring(self, req_id: int) -> None:
        """A request this process does not know (an earlier tracker process admitted it): find its
        slot by request id in the ring; ``cancel`` leaves slots that finished or were reused alone."""
        cache = self._slots()
        if cache is None:
            return
        snap = cache.refresh()
        for idx in np.flatnonzero(snap["request_id"] == np.uint64(req_id)):
            cache.writer.cancel(int(idx), int(snap["seq"][idx]))

    def drop_channel(self, chan: ipc.Channel) -> None:
        """A gateway went away: forget its queued requests and cancel its slots."""
        self.waiting = collections.deque(w for w in self.waiting if w[0] is not chan)
        for req_id in [r for r, live in self.live.items() if live.chan is chan]:
            self.cancel(req_id)

    # ------------------------------------------------------------ admission loop
    def admit_waiting(self) -> None:
        cache = self._slots()
        if cache is None or not self.watch.alive():
            while self.waiting:
                chan, sub = self.waiting.popleft()
                chan.send(m.Rejected(sub.req_id, 503, "the engine is not running"))
            return
        snap = cache.refresh()
        self._forget_finished(snap)
        while self.waiting:
            chan, sub = self.waiting[0]
            if not self._publish(cache, chan, sub):
                break
            self.waiting.popleft()

    def _forget_finished(self, snap: np.ndarray) -> None:
        for req_id, live in list(self.live.items()):
            state, seq = int(snap["state"][live.slot]), int(snap["seq"][live.slot])
            if seq != live.seq or state == L.SlotState.EMPTY:
                del self.live[req_id]

    async def admission_loop(self) -> None:
        while True:
            poll = self.cfg.busy_poll_s if self.waiting else self.cfg.idle_poll_s
            try:
                await asyncio.wait_for(self._wake.wait(), poll)
            except TimeoutError:
                pass
            self._wake.clear()
            self.admit_waiting()

    # ------------------------------------------------------------ reader link
    async def reader_link(self) -> None:
        while True:
            chan = await ipc.connect(self.cfg.run_dir, "reader", m.FromReader)
            self.reader = chan
            for live in self.live.values():
                chan.send(live.track())
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
    log.info("tracker_ready", ring=cfg.ring_name, max_waiting=cfg.max_waiting)
    try:
        await asyncio.gather(*tasks)
    finally:
        ipc.clear_ready(cfg.run_dir, "tracker")
        server.close()
        tracker.watch.close()
