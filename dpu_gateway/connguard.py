"""The connection limits of one gateway: a cap on open connections and a deadline on request heads.

aiohttp closes idle connections itself (``keepalive_timeout``, counted from the connection's start
or its last response), and the app reads each body against a deadline (``app.body_middleware``).
What aiohttp's server lacks is here, as a wrapper around its protocol factory:

- at ``max_connections`` open connections, the one idle longest (no request in progress, no request head
  begun: a keep-alive between requests, or one that never sent a byte), if idle for ``EVICTABLE_IDLE_S``, is
  closed to make room
  (``blink:http_connections_timed_out{phase="idle"}``): a peer holding every connection idle cannot lock the
  other clients, or ``/health``, out; only when none is idle is a new one answered with a canned 503 at once
  and closed (``blink:http_connections_refused``), so those held busy cannot starve the ones that follow;
- a request head (request line and headers) must be complete ``header_timeout_s`` after its first
  byte, else the connection is closed (``blink:http_connections_timed_out{phase="header"}``): a
  client that trickles its headers holds a connection for that long, not for ever.

``ConnectionGuard.middleware`` (the app's outermost) tells the guard where a head was complete.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from shared.metrics import FrontendMetrics

REFUSE_LINGER_S = 0.5  # how long a refused connection may still deliver its request before closing
# An idle connection is closed to make room only once idle this long: a client that has just connected and is
# about to send its request keeps its place, and a flood of new connections refuses itself rather than each new
# one closing the one before.
EVICTABLE_IDLE_S = 1.0
_REFUSED_BODY = (b'{"error": {"message": "the server holds its maximum of open connections; retry later", '
                 b'"type": "service_unavailable", "param": null, "code": "too_many_connections"}}')
REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
           b"Connection: close\r\nContent-Length: " + str(len(_REFUSED_BODY)).encode() + b"\r\n\r\n"
           + _REFUSED_BODY)


@dataclasses.dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float

    def __post_init__(self) -> None:
        if self.max_connections < 1 or not self.header_timeout_s > 0:
            raise ValueError(f"bad connection limits: {self}")


class ConnectionGuard:
    """The listening socket's protocol factory: ``loop.create_server(guard, ...)``."""

    def __init__(self, limits: ConnectionLimits, metrics: FrontendMetrics,
                 make_protocol: Callable[[], asyncio.Protocol] | None = None) -> None:
        self.limits, self.metrics = limits, metrics
        self.make_protocol = make_protocol  # aiohttp's (``runner.server``), set once the runner is up
        self.open: dict[asyncio.BaseTransport, Guarded] = {}

    def __call__(self) -> asyncio.Protocol:
        if len(self.open) >= self.limits.max_connections and not self._close_longest_idle():
            self.metrics.connections_refused.inc()
            return Refused()
        assert self.make_protocol is not None, "the guard serves once make_protocol is set"
        return Guarded(self, self.make_protocol())

    def _close_longest_idle(self) -> bool:
        """Close the connection idle longest, if any is idle; whether one was (its room is free at once)."""
        now = time.monotonic()
        idle = [c for c in self.open.values() if c.idle() and now - c.idle_since >= EVICTABLE_IDLE_S]
        if not idle:
            return False
        victim = min(idle, key=lambda c: c.idle_since)
        assert victim.transport is not None
        self.open.pop(victim.transport, None)
        self.metrics.timed_out("idle")
        victim.transport.close()
        return True

    def close_idle(self) -> None:
        """Close every idle connection (a gateway that stops listening: their next request goes elsewhere)."""
        for conn in [c for c in self.open.values() if c.idle()]:
            assert conn.transport is not None
            conn.transport.close()

    def opened(self, conn: Guarded) -> None:
        assert conn.transport is not None
        self.open[conn.transport] = conn
        self.metrics.connections_open.set(len(self.open))

    def closed(self, conn: Guarded) -> None:
        if conn.transport is not None:
            self.open.pop(conn.transport, None)
        self.metrics.connections_open.set(len(self.open))

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        conn = self.open.get(request.transport) if request.transport is not None else None
        if conn is not None:
            conn.head_complete()
        try:
            return await handler(request)
        finally:
            if conn is not None:
                conn.busy, conn.idle_since = False, time.monotonic()


class Guarded(asyncio.Protocol):
    """One accepted connection: forwards everything to aiohttp's protocol and times request heads."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard, self.inner = guard, inner
        self.transport: asyncio.Transport | None = None
        self.busy = False  # a request is being handled: its head is complete
        self._deadline: asyncio.TimerHandle | None = None
        self.idle_since = time.monotonic()  # its start, or the end of its last request

    def idle(self) -> bool:
        """No request in progress and none begun (its head's deadline not running)."""
        return not self.busy and self._deadline is None and self.transport is not None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.guard.opened(self)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.busy and self._deadline is None and data:
            loop = asyncio.get_running_loop()
            self._deadline = loop.call_later(self.guard.limits.header_timeout_s, self._head_too_slow)
        self.inner.data_received(data)

    def head_complete(self) -> None:
        self.busy = True
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _head_too_slow(self) -> None:
        self._deadline = None
        if self.transport is not None and not self.busy:
            self.guard.metrics.timed_out("header")
            self.transport.abort()

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self.guard.closed(self)
        self.inner.connection_lost(exc)


class Refused(asyncio.Protocol):
    """A connection over the cap: the 503 goes out at once; closed on its first bytes or soon after."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(REFUSED)
        self._timer = asyncio.get_running_loop().call_later(REFUSE_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        self._timer.cancel()
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._timer.cancel()
