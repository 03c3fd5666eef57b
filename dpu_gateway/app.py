"""The gateway app factory: typed state, start-up and clean-up hooks, draining shutdown."""

from __future__ import annotations

import asyncio
import hmac
import time

from aiohttp import web

from dpu_gateway.backend import Backend
from dpu_gateway.errors import APIError, error_middleware
from dpu_gateway.ringwatch import RingWatch
from dpu_gateway.routes import add_routes
from dpu_gateway.state import BACKEND, CODEC, CONFIG, LIVE, METRICS, RING, GatewayConfig
from dpu_gateway.textio import TextCodec
from shared import messages as m
from shared.log import get_logger
from shared.metrics import FrontendMetrics

log = get_logger("gateway")


def auth_middleware(api_key: str):
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        if request.path.startswith("/v1/"):
            got = request.headers.get("Authorization", "").encode()
            if not got:
                raise APIError(401, "You didn't provide an API key. Send it in the Authorization header as "
                               "'Authorization: Bearer YOUR_KEY'.", code="invalid_api_key")
            if not hmac.compare_digest(got, expected):
                raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        return await handler(request)

    return check


async def on_startup(app: web.Application) -> None:
    cfg = app[CONFIG]
    app[BACKEND] = Backend(cfg.run_dir, cfg.gateway_id)
    app[BACKEND].start()


async def on_shutdown(app: web.Application) -> None:
    """Let live requests finish for up to ``drain_timeout_s``, then end the rest with an error."""
    live = app[LIVE]
    deadline = time.monotonic() + app[CONFIG].drain_timeout_s
    while live and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if live:
        log.warning("stopping_live_streams", n=len(live))
    for stream in list(live):
        stream.events.put_nowait(m.Failed(stream.req_id, 503, "the server is shutting down"))


async def on_cleanup(app: web.Application) -> None:
    await app[BACKEND].close()
    app[RING].close()


def create_app(cfg: GatewayConfig, codec: TextCodec | None = None) -> web.Application:
    middlewares = [error_middleware]
    if cfg.api_key:
        middlewares.append(auth_middleware(cfg.api_key))
    app = web.Application(client_max_size=cfg.max_body_bytes, middlewares=middlewares)
    app[CONFIG] = cfg
    app[CODEC] = codec or TextCodec(cfg.model)
    app[RING] = RingWatch(cfg.ring_name, cfg.heartbeat_timeout_s)
    app[METRICS] = FrontendMetrics(cfg.served_model_name)
    app[LIVE] = set()
    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    add_routes(app)
    return app
