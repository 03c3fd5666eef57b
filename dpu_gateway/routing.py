"""Which engine's ring a request goes to, when ``blink serve --data-parallel-size`` runs more than one.

The rule, in order (the first difference decides):

1. the fewest requests waiting in the engine: claimed but not yet in its batch, or preempted (the
   ring header's ``stats.waiting``, which the engine refreshes every step or 0.1 s);
2. the fewest slots in use (every state but EMPTY: the tracker's own view, which counts its own
   reservations at once and sees releases at its next refresh, at most 0.1 s later);
3. the largest fraction of free KV cache blocks (``stats.kv_blocks_free / kv_blocks_total``);
4. the next engine after the one the previous request went to (round robin among equals).

Only engines that serve (READY, with a fresh heartbeat) are compared; a full ring is skipped for
the next in this order. Everything compared is read from memory the tracker already maps (three
header words per engine and a count over its own slot view), so the choice costs microseconds per
request (``bench/dp_routing.py`` measures it). Slots published but not yet claimed count in 2 (they
are in use); they are not added to 1, which would need a scan of the slots per request.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class Load:
    """One engine's load as the routing rule sees it."""

    engine: int
    waiting: int
    in_use: int
    kv_free: int
    kv_total: int

    @property
    def kv_free_fraction(self) -> float:
        return self.kv_free / self.kv_total if self.kv_total else 1.0


def choose_order(loads: list[Load], last: int, engines: int) -> list[int]:
    """Engine indices best first by the rule above; ``last`` is the engine the previous request went to
    (-1: none yet), ``engines`` the number of engines (for the turn)."""

    def key(load: Load) -> tuple[int, int, float, int]:
        turn = (load.engine - last - 1) % engines
        return load.waiting, load.in_use, -load.kv_free_fraction, turn

    return [load.engine for load in sorted(loads, key=key)]
