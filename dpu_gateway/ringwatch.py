"""Follow the engine's ring: attach when it appears, re-attach when it is replaced.

The engine creates the segment; a restarted engine replaces it. Every service that touches
the ring holds a ``RingWatch`` and asks it for the current ring; ``generation`` changes
whenever the segment behind it changed, so a service can drop what it knew about slots.
A service that keeps objects on the ring (slot writers, routes) passes ``on_detach``: it is
called with the old ring while its mapping is still open, just before the watch closes it;
after that the old ring's transport refuses every access.

A ring on another host (``rdma://HOST:PORT/NAME``, ``shared/remote_ring.py``) is followed the same way
through ``RdmaTransport``: it is attached by a connection exchange with the engine, in a thread, so that a
host that does not answer never holds up the service's event loop; it is let go when its lease ends (the
engine stopped or died: its end of the connection closed) or an access failed (an error completion), and
attached again, at most every ``RETRY_S``, to whatever engine then answers at that address. Each service
attaches on its own: for a moment after an engine (re)starts, one may serve it while another has not yet.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from shared import ring_layout as L
from shared.log import get_logger
from shared.remote_ring import attach_remote_ring, is_remote, parse_ring_address
from shared.ring import Ring, attach_shm_ring
from shared.transport import RingError, shm_path

log = get_logger("ringwatch")
RETRY_S = 0.2  # between attempts to attach a remote ring (one refused at once costs a millisecond)


class RingWatch:
    def __init__(self, name: str, heartbeat_timeout_s: float,
                 on_detach: Callable[[Ring], None] | None = None) -> None:
        self.name = name
        self.timeout_s = heartbeat_timeout_s
        self.on_detach = on_detach
        self.ring: Ring | None = None
        self.generation = 0
        self._identity: tuple[int, int] | None = None
        self.remote = parse_ring_address(name) if is_remote(name) else None
        self._path = "" if self.remote is not None else str(shm_path(name))  # built once: current() runs often
        # a remote ring: why the last attempt failed, the attempt under way and what it brought
        self.failure: str | None = None
        self._attempt: threading.Thread | None = None
        self._result: tuple[Ring | None, str | None] | None = None
        self._next_try = 0.0
        self._lock = threading.Lock()
        self._attempts = 0  # the number of the attempt whose result counts (close() makes any in flight stale)

    def _segment_identity(self) -> tuple[int, int] | None:
        """Device and inode: a replaced segment is a new file (times change with every write)."""
        try:
            st = os.stat(self._path)
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino

    def current(self) -> Ring | None:
        """The attached ring, re-attaching if the segment was replaced; None if there is none."""
        if self.remote is not None:
            return self._current_remote()
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

    # ------------------------------------------------------------ a remote ring
    def _current_remote(self) -> Ring | None:
        ring = self.ring
        if ring is not None:
            lease_open = getattr(ring.transport, "lease_open", None)
            if lease_open is None or lease_open():
                return ring
            self.failure = f"the ring was lost: {ring.transport.lost}"  # type: ignore[attr-defined]
            log.warning("ring lost", ring=self.name, reason=self.failure)
            self._detach()
        with self._lock:
            result, self._result = self._result, None
        if result is not None:
            self._attempt = None
            got, why = result
            if got is None:
                if why != self.failure:
                    log.warning("ring not attached", ring=self.name, reason=why)
                self.failure = why
            else:
                self.ring, self.failure = got, None
                self.generation += 1
                log.info("ring attached", ring=self.name, transport=type(got.transport).__name__,
                         size=got.transport.size, slots=got.geometry.num_slots)
                return got
        if self._attempt is None and time.monotonic() >= self._next_try:
            self._next_try = time.monotonic() + RETRY_S
            with self._lock:
                self._attempts += 1
                number = self._attempts
            self._attempt = threading.Thread(target=self._attach_remote, args=(number,), name="ring-attach",
                                             daemon=True)
            self._attempt.start()
        return None

    def _attach_remote(self, number: int) -> None:
        """In a thread: one attempt; its ring (or why not) is taken by the next ``current``. A result is posted
        whatever the attempt raised: an attempt that left none would be waited for forever, never retried."""
        assert self.remote is not None
        result: tuple[Ring | None, str | None] = (None, "the attempt to attach ended without a result")
        try:
            result = (attach_remote_ring(self.remote), None)
        except (RingError, ValueError, OSError) as exc:
            result = (None, str(exc))
        except Exception as exc:  # noqa: BLE001 - anything else (a verbs layer's own error): retried the same
            result = (None, f"{type(exc).__name__}: {exc}")
        finally:
            self._post(number, result)

    def _post(self, number: int, result: tuple[Ring | None, str | None]) -> None:
        with self._lock:
            if number == self._attempts:
                self._result = result
                return
        if result[0] is not None:  # the watch was closed meanwhile: this attempt's ring is nobody's
            result[0].close()

    def settled(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for an attempt under way to finish (for one-shot tools and tests); whether
        none is under way now."""
        attempt = self._attempt
        if attempt is not None:
            attempt.join(timeout_s)
            return not attempt.is_alive()
        return True

    # ------------------------------------------------------------ the engine's state
    def alive(self) -> bool:
        return self.problem() is None

    def problem(self) -> str | None:
        """Why the engine does not serve now (``Ring.serving_problem``), or None when it does."""
        ring = self.current()
        if ring is None:
            if self.remote is not None:
                return f"no ring: {self.failure or 'connecting to ' + self.name}"
            return "no ring: the engine is not running or is restarting"
        try:
            return ring.serving_problem(self.timeout_s)
        except RingError as exc:  # a remote ring whose access failed: let go at the next look
            return f"the ring cannot be read: {exc}"

    def ready(self) -> bool:
        ring = self.current()
        try:
            return ring is not None and ring.header_load32("engine_state") == L.EngineState.READY
        except RingError:
            return False

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
        with self._lock:
            self._attempts += 1
            result, self._result = self._result, None
        self._attempt = None
        if result is not None and result[0] is not None:
            result[0].close()
        self._detach()
