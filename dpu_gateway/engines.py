"""The gateway's view of every engine's ring: limits, ``/health`` and the per-engine ``/metrics`` values.

``RingSet`` holds one ``RingWatch`` per engine (``--data-parallel-size``) and answers what the
handlers ask of "the ring": ``current()`` is the ring of an engine that serves (every engine runs the
same config, so any serving one tells the limits), ``alive()`` is true while at least one serves.

``/health`` (``health_body``): 200 ``{"status": "ok"}`` while every engine serves; 200
``{"status": "degraded", ...}`` naming the engines that do not while at least one does (requests go
to the others); 503 only when none serves.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np

from dpu_gateway.ringwatch import RingWatch
from shared import ring_layout as L
from shared.data_parallel import engine_ring_names
from shared.log import get_logger
from shared.metrics import (
    ENGINE_COUNTERS,
    PREFIX_CACHE_COUNTERS,
    STEP_TOKEN_COUNTERS,
    CacheConfig,
    EngineSample,
    FrontendMetrics,
)
from shared.ring import Ring
from shared.transport import RingError

log = get_logger("gateway")


class RingSet:
    def __init__(self, base_name: str, size: int, heartbeat_timeout_s: float) -> None:
        self.watches = [RingWatch(name, heartbeat_timeout_s) for name in engine_ring_names(base_name, size)]
        self.timeout_s = heartbeat_timeout_s
        self.served = False  # whether an engine was seen serving since this gateway started

    @property
    def generation(self) -> int:
        """0 until a ring of any engine was seen; grows whenever one is attached."""
        return sum(w.generation for w in self.watches)

    def current(self) -> Ring | None:
        """The ring of the first engine that serves, else the first ring attached, else None."""
        attached = None
        for watch in self.watches:
            ring = watch.current()
            try:
                if ring is not None and ring.engine_serving(self.timeout_s):
                    return ring
            except RingError:  # a remote ring whose access failed: its watch lets it go at the next look
                continue
            attached = attached or ring
        return attached

    def alive(self) -> bool:
        alive = [w.alive() for w in self.watches]  # every engine looked at: each one's silence stays current
        self.served = self.served or any(alive)
        return any(alive)

    def problems(self) -> dict[int, str]:
        """Why each engine that does not serve does not (by index), for the log line of a 503."""
        return {i: p for i, w in enumerate(self.watches) if (p := w.problem()) is not None}

    async def follow_beats(self) -> None:
        """Look at every engine's beat counter at an eighth of the heartbeat timeout (at least every 0.1 s), for ever.

        Liveness is what this process saw (``shared.ring.Liveness``): a gateway that looked only when a
        request came would see the counter's last move at its next look, however long ago the engine
        stopped, and call a hung engine alive for another timeout; and a new ring is seen moving (serving) within
        a beat or two of READY. Sampled here, /health turns 503 within
        an eighth of the timeout of the moment the reader ends the streams. A look that fails (a ring being
        replaced, no file descriptor left) is logged and the next one comes as usual."""
        every_s, failing = min(max(self.timeout_s / 8, 0.01), 0.1), False
        while True:
            try:
                self.alive()
                failing = False
            except Exception as exc:  # noqa: BLE001 - the sampler must outlive any one look
                if not failing:
                    log.warning("engine beat not read", error=repr(exc))
                failing = True
            await asyncio.sleep(every_s)

    def close(self) -> None:
        for watch in self.watches:
            watch.close()


@dataclasses.dataclass(frozen=True, slots=True)
class EngineView:
    """One engine at a scrape or a health probe."""

    engine: int
    up: bool
    reason: str                    # why it is not up ("" when it is)
    stats: dict[str, Any] | None   # the ring header's EngineStats (None without a ring)
    slots_in_use: int = 0
    slots_pending: int = 0         # published, not yet claimed by the engine
    cache: CacheConfig | None = None  # the KV cache's configuration (schema minor 6; None: not said)


def engine_view(engine: int, watch: RingWatch, with_slots: bool = False) -> EngineView:
    ring = watch.current()
    if ring is None:
        return EngineView(engine, False, watch.problem() or "no ring", None)
    try:
        return ring_view(engine, ring, watch.timeout_s, with_slots)
    except RingError as exc:  # a remote ring whose access failed: its watch lets it go at the next look
        return EngineView(engine, False, f"the ring cannot be read: {exc}", None)


def ring_view(engine: int, ring: Ring, timeout_s: float, with_slots: bool) -> EngineView:
    header = ring.read_header()
    stats = header["stats"]
    values = {name: stat_value(stats[name]) for name in stats.dtype.names if name != "reserved"}
    values.update({name: ring.header_load64(name) for name in PREFIX_CACHE_COUNTERS})  # header words, minor 4
    values.update({name: ring.header_load64(name) for name in STEP_TOKEN_COUNTERS})  # and minor 7
    reason = ring.serving_problem(timeout_s) or ""
    in_use = pending = 0
    if with_slots:
        states = ring.read_slots()["state"]
        in_use = int(np.count_nonzero(states != L.SlotState.EMPTY))
        pending = int(np.count_nonzero(states == L.SlotState.PREFILL_PENDING))
    cache = CacheConfig.of_header(header, values["kv_blocks_total"])
    return EngineView(engine, not reason, reason, values, in_use, pending, cache)


def engine_views(rings: RingSet, with_slots: bool = False) -> list[EngineView]:
    return [engine_view(i, w, with_slots) for i, w in enumerate(rings.watches)]


def health_body(views: list[EngineView]) -> dict[str, object]:
    """What ``/health`` answers while at least one engine serves."""
    if len(views) == 1:
        return {"status": "ok"}
    engines = [{"engine": v.engine, "status": "ok" if v.up else "down", **({"reason": v.reason} if v.reason else {})}
               for v in views]
    down = [v.engine for v in views if not v.up]
    body: dict[str, object] = {"status": "degraded" if down else "ok", "engines": engines,
                               "serving": len(views) - len(down), "total": len(views)}
    if down:
        body["message"] = (f"engine {', '.join(map(str, down))} is down; requests go to the "
                           f"{len(views) - len(down)} engine(s) that serve")
    return body


def stat_value(v: Any) -> Any:
    """An EngineStats field as Python: an int, or a list of ints for an array (``step_fill``)."""
    return int(v) if np.ndim(v) == 0 else [int(x) for x in v]


def total_stats(views: list[EngineView]) -> dict[str, Any] | None:
    """The engines' stats summed, arrays element by element; ``token_budget``, a per-step limit, is the
    largest engine's (None when no engine has a ring)."""
    present = [v.stats for v in views if v.stats is not None]
    if not present:
        return None
    out: dict[str, Any] = {}
    for name in present[0]:
        values = [s[name] for s in present]
        if isinstance(values[0], list):
            out[name] = [sum(col) for col in zip(*values, strict=True)]
        else:
            out[name] = max(values) if name == "token_budget" else sum(values)
    return out


def engine_samples(views: list[EngineView], queued: int = 0) -> list[EngineSample]:
    """Each engine's values for the per-engine ``/metrics`` series (``engine`` label). Its waiting requests:
    claimed and not running, and published to its ring but not claimed; with one engine also ``queued`` (the
    requests the gateway holds until a ring slot frees), which no engine of several has been chosen for."""
    out = []
    for v in views:
        s = v.stats or {}
        total = s.get("kv_blocks_total", 0)
        waiting = s.get("waiting", 0) + v.slots_pending + (queued if len(views) == 1 else 0)
        out.append(EngineSample(v.engine, v.up, s.get("running", 0), waiting, v.slots_in_use,
                                1.0 - s.get("kv_blocks_free", 0) / total if total else 0.0,
                                {name: s.get(name, 0) for name in (*ENGINE_COUNTERS, *PREFIX_CACHE_COUNTERS)},
                                v.cache, v.stats is not None))
    return out


def set_total_gauges(metrics: FrontendMetrics, samples: list[EngineSample], views: list[EngineView],
                     queued: int) -> None:
    """The unlabelled gauges: over every engine (``queued``: this gateway's requests not yet admitted, which
    ``samples`` count already when there is one engine)."""
    metrics.running.set(sum(s.running for s in samples))
    metrics.waiting.set(sum(s.waiting for s in samples) + (queued if len(samples) > 1 else 0))
    metrics.slots_in_use.set(sum(s.slots_in_use for s in samples))
    free = sum((v.stats or {}).get("kv_blocks_free", 0) for v in views)
    total = sum((v.stats or {}).get("kv_blocks_total", 0) for v in views)
    metrics.kv_usage.set(1.0 - free / total if total else 0.0)
