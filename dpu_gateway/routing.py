"""Which engine's ring a request goes to, when ``blink serve --data-parallel-size`` runs more than one.

The rule, in order (the first difference decides):

1. the fewest requests waiting there: the engine's own queue (claimed, not yet in its batch, or
   preempted; the ring header's ``stats.waiting``) plus the slots published that it has not claimed
   yet (PREFILL_PENDING in the tracker's last view of the ring);
2. the fewest slots in use (every state but EMPTY: the tracker's own view, which counts its own
   reservations at once and sees releases at its next refresh, at most 0.1 s later);
3. the largest fraction of free KV cache blocks (``stats.kv_blocks_free / kv_blocks_total``);
4. the next engine after the one the previous request went to (round robin among equals).

Only engines that serve (READY, with a fresh heartbeat) are compared; a full ring is skipped for
the next in this order. Everything compared is read from memory the tracker already maps (one
header read per engine and a count over its slot view), so the choice costs microseconds per request
(``bench/dp_routing.py`` measures it).
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
