"""The gateway process: serve the app on host:port until SIGTERM/SIGINT, then drain (new requests get 503).

SO_REUSEPORT only when asked (``--reuse-port``; ``blink serve --gateways N`` asks for its own N): without it a
port another server holds is refused at bind, not silently shared. At SIGTERM a gateway that shares its port stops
listening at once (the others take the new connections: a rolling replacement); one alone keeps listening through
its drain, answering every new request 503 with Retry-After.

The listening socket's connections go through a ``ConnectionGuard`` (the connection cap and the
request-head deadline); aiohttp closes idle connections after ``keepalive_timeout_s``. The cap
stays below the process's file-descriptor limit (raised towards the hard limit where it is lower),
so accepting never fails for want of descriptors.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import signal

from aiohttp import web

from dpu_gateway.app import create_app, drain
from dpu_gateway.connguard import ConnectionGuard, ConnectionLimits
from dpu_gateway.state import BACKEND, RING, GatewayConfig
from shared import ipc
from shared.env import env
from shared.log import get_logger
from shared.metrics import FrontendMetrics

log = get_logger("gateway")
FD_RESERVE = 256  # descriptors kept for everything but client connections (links, ring, refused sockets)
LINGER_S = 2.0    # how long an unread request body is drained after the answer, before closing
# A gateway starts listening once linked to the other services and once it saw an engine serve (a ring's beat
# seen moving), or after this long: a restarted gateway that shares its port lets the others answer meanwhile
# instead of a 503 of its own.
LISTEN_WAIT_S = 2.0


def connection_cap(wanted: int) -> int:
    """``wanted``, or less where the descriptor limit (raised as far as allowed) cannot hold it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        new = need if hard == resource.RLIM_INFINITY else min(need, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    cap = wanted if soft == resource.RLIM_INFINITY else max(1, min(wanted, soft - FD_RESERVE))
    if cap < wanted:
        log.warning("connection_cap_lowered", wanted=wanted, cap=cap, fd_limit=soft)
    return cap


class GuardedSite(web.BaseSite):
    """A TCP site (like ``web.TCPSite``) whose connections are made by the guard."""

    def __init__(self, runner: web.BaseRunner, guard: ConnectionGuard, host: str, port: int,
                 reuse_port: bool = False) -> None:
        super().__init__(runner, backlog=1024)
        self._guard, self._host, self._port, self._reuse_port = guard, host, port, reuse_port

    @property
    def guard(self) -> ConnectionGuard:
        return self._guard

    @property
    def port(self) -> int:
        """The bound port (``port`` 0 asks the kernel for a free one)."""
        sockets = getattr(self._server, "sockets", None)
        return int(sockets[0].getsockname()[1]) if sockets else self._port

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        self._guard.make_protocol = server
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._guard, self._host, self._port, backlog=self._backlog,
                                                reuse_port=self._reuse_port)


async def start_gateway(cfg: GatewayConfig, host: str, port: int,
                        reuse_port: bool = False) -> tuple[web.AppRunner, GuardedSite]:
    """The app, served on host:port under the configured connection limits."""
    metrics = FrontendMetrics(cfg.served_model_name, env().metrics_dir, cfg.data_parallel_size)
    guard = ConnectionGuard(ConnectionLimits(connection_cap(cfg.max_connections), cfg.header_timeout_s), metrics)
    app = create_app(cfg, guard=guard, metrics=metrics)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=cfg.drain_timeout_s + 5,
                           access_log=None, keepalive_timeout=cfg.keepalive_timeout_s, lingering_time=LINGER_S)
    await runner.setup()
    await _until_serving(app, LISTEN_WAIT_S)
    site = GuardedSite(runner, guard, host, port, reuse_port)
    await site.start()
    return runner, site


async def _until_serving(app: web.Application, limit_s: float) -> None:
    end = asyncio.get_running_loop().time() + limit_s
    while not (app[BACKEND].linked() and app[RING].served) and asyncio.get_running_loop().time() < end:
        await asyncio.sleep(0.02)


async def _mark_ready_when_linked(app: web.Application, cfg: GatewayConfig, name: str) -> None:
    """The ready marker once linked to the other services and once an engine was seen serving (so that the
    server's ``ready`` is a ``/health`` of 200, not a ``model_loading`` while the first beats are seen)."""
    await app[BACKEND].wait_linked()
    while not app[RING].served:
        await asyncio.sleep(0.02)
    ipc.mark_ready(cfg.run_dir, name)
    log.info("gateway_ready", name=name)


async def run_gateway(cfg: GatewayConfig, host: str, port: int, name: str = "gateway",
                      reuse_port: bool = False) -> None:
    runner, site = await start_gateway(cfg, host, port, reuse_port)
    app = runner.app
    log.info("gateway_listening", host=host, port=port, model=cfg.served_model_name)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready = asyncio.create_task(_mark_ready_when_linked(app, cfg, name))
    try:
        await stop.wait()
        log.info("gateway_draining", listening=not reuse_port)
        if reuse_port:  # another gateway may share the port: the kernel gives it the new connections from now,
            await site.stop()  # and the clients of this one's idle connections reconnect there
            site.guard.close_idle()
        await drain(app)  # requests that still reach this gateway get 503 with Retry-After
    finally:
        ready.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ready
        ipc.clear_ready(cfg.run_dir, name)
        await runner.cleanup()
