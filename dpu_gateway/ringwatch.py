"""Follow the engine's ring segment: attach when it appears, re-attach when it is replaced.

The engine creates the segment; a restarted engine replaces it. Every service that touches
the ring holds a ``RingWatch`` and asks it for the current ring; ``generation`` changes
whenever the segment behind it changed, so a service can drop what it knew about slots.
A service that keeps objects on the ring (slot writers, routes) passes ``on_detach``: it is
called with the old ring while its mapping is still open, just before the watch closes it;
after that the old ring's transport refuses every access.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from shared import ring_layout as L
from shared.ring import Ring, attach_shm_ring
from shared.transport import RingError, shm_path


class RingWatch:
    def __init__(self, name: str, heartbeat_timeout_s: float,
                 on_detach: Callable[[Ring], None] | None = None) -> None:
        self.name = name
        self.timeout_s = heartbeat_timeout_s
        self.on_detach = on_detach
        self.ring: Ring | None = None
        self.generation = 0
        self._identity: tuple[int, int] | None = None
        self._path = str(shm_path(name))  # built once: current() runs on every request

    def _segment_identity(self) -> tuple[int, int] | None:
        """Device and inode: a replaced segment is a new file (times change with every write)."""
        try:
            st = os.stat(self._path)
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino

    def current(self) -> Ring | None:
        """The attached ring, re-attaching if the segment was replaced; None if there is none."""
        ident = self._segment_identity()
        if ident is not None and ident == self._identity and self.ring is not None:
            return self.ring
        self._detach()
        if ident is None:
            return None
        try:
            self.ring = attach_shm_ring(self.name)
        except (RingError, ValueError):
            return None  # still being created: try again next time
        self._identity = ident
        self.generation += 1
        return self.ring

    def alive(self) -> bool:
        return self.problem() is None

    def problem(self) -> str | None:
        """Why the engine does not serve now (``Ring.serving_problem``), or None when it does."""
        ring = self.current()
        if ring is None:
            return "no ring: the engine is not running or is restarting"
        return ring.serving_problem(self.timeout_s)

    def ready(self) -> bool:
        ring = self.current()
        return ring is not None and ring.header_load32("engine_state") == L.EngineState.READY

    def _detach(self) -> None:
        ring, self.ring, self._identity = self.ring, None, None
        if ring is None:
            return
        try:
            if self.on_detach is not None:
                self.on_detach(ring)
        finally:
            ring.close()

    def close(self) -> None:
        self._detach()
