"""The gateway app factory: typed state, start-up and clean-up hooks, draining shutdown.

Before any handler runs, the body middleware reads a request's body against ``body_timeout_s``
(408 and the connection closed when it comes too slowly). The handler's decoder parses it once
(``protocol._decode``): invalid UTF-8 and nesting past the recursion limit are 400s from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
import uuid

from aiohttp import web

from dpu_gateway.backend import Backend
from dpu_gateway.connguard import ConnectionGuard
from dpu_gateway.constrain import REQUEST_HOLDS, GrammarCompiler
from dpu_gateway.engines import RingSet
from dpu_gateway.errors import APIError, error_middleware
from dpu_gateway.openapi import API_KEY_PREFIX
from dpu_gateway.routes import add_routes, max_model_len
from dpu_gateway.state import (
    BACKEND,
    BEATS,
    CLIENT_GONE,
    CODEC,
    CONFIG,
    DRAINING,
    GRAMMAR_REFRESH,
    GRAMMARS,
    LIVE,
    METRICS,
    RECORD,
    RING,
    TOKEN_FLUSH,
    GatewayConfig,
    RequestRecord,
)
from dpu_gateway.textio import TextCodec
from dpu_tokenizer.chat import chat_template_from_arg
from shared import messages as m
from shared.log import get_logger
from shared.metrics import TOKEN_FLUSH_S, FrontendMetrics

log = get_logger("gateway")


def auth_middleware(api_key: str):
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        if request.path.startswith(API_KEY_PREFIX):
            # aiohttp hands header bytes over as UTF-8 with surrogate escapes: any byte string compares
            got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not got:
                raise APIError(401, "You didn't provide an API key. Send it in the Authorization header as "
                               "'Authorization: Bearer YOUR_KEY'.", code="invalid_api_key")
            if not hmac.compare_digest(got, expected):
                raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        return await handler(request)

    return check


QUIET_PATHS = ("/metrics", "/health")  # scraped and probed often: their successes log at debug level
# A request whose client went away before its answer ended (a stream closed mid-way): nginx's 499, not a 500,
# in the log line and the failure counter, whatever status the stream's headers had carried.
CLIENT_CLOSED = 499


def request_log_middleware(cfg: GatewayConfig, metrics: FrontendMetrics):
    """One structured line per answered request (never its text), and the failure counter by status.
    It sits outside the error middleware, so it sees the status every error was answered with."""

    @web.middleware
    async def log_request(request: web.Request, handler) -> web.StreamResponse:
        start = time.monotonic()
        status = 500
        try:
            resp = await handler(request)
            status = CLIENT_CLOSED if request.get(CLIENT_GONE) else resp.status
            return resp
        except web.HTTPException as exc:
            status = exc.status
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            status = CLIENT_CLOSED
            raise
        finally:
            if status >= 400:
                metrics.failed(status)
            metrics.http_request(route_template(request), request.method, status, time.monotonic() - start)
            if cfg.log_requests:
                log_line(request, status, time.monotonic() - start)

    return log_request


def route_template(request: web.Request) -> str:
    """The route a request matched, as its path template (``/v1/models/{model}``); ``none`` when it matched none
    (prometheus-fastapi-instrumentator's ``handler`` label, which vLLM's dashboards group by)."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "none"


def log_line(request: web.Request, status: int, total_s: float) -> None:
    record = request.get(RECORD) or RequestRecord()
    quiet = status < 400 and request.path in QUIET_PATHS
    fields = {"id": request.headers.get("X-Request-Id") or uuid.uuid4().hex[:16], "method": request.method,
              "route": request.path, "status": status, "prompt_tokens": record.prompt_tokens,
              "output_tokens": record.output_tokens,
              "ttft_s": None if record.ttft_s is None else round(record.ttft_s, 4), "total_s": round(total_s, 4),
              "finish_reason": ",".join(record.finish_reasons) or None}
    (log.debug if quiet else log.info)("request", **fields)


def body_middleware(cfg: GatewayConfig, metrics: FrontendMetrics):
    @web.middleware
    async def read_body(request: web.Request, handler) -> web.StreamResponse:
        if request.body_exists:
            try:
                async with asyncio.timeout(cfg.body_timeout_s):
                    await request.read()  # aiohttp keeps it: the handler's read() returns it
            except TimeoutError:
                metrics.timed_out("body")
                raise APIError(408, f"the request body did not arrive within {cfg.body_timeout_s:g} s",
                               code="request_timeout", close=True) from None
        return await handler(request)

    return read_body


@web.middleware
async def grammar_hold_middleware(request: web.Request, handler) -> web.StreamResponse:
    """The grammars a request's compiles return stay in the store until it ends (``constrain.REQUEST_HOLDS``)."""
    holds: list[int] = []
    token = REQUEST_HOLDS.set(holds)
    try:
        return await handler(request)
    finally:
        REQUEST_HOLDS.reset(token)
        request.app[GRAMMARS].release(holds)


@web.middleware
async def drain_middleware(request: web.Request, handler) -> web.StreamResponse:
    """After SIGTERM the gateway drains: live requests finish, new ones get 503 with Retry-After (to another
    gateway, or to this server once restarted) and their connection is closed."""
    if request.app[DRAINING].is_set():
        raise APIError(503, "the server is shutting down", code="server_draining", retry_after_s=1, close=True)
    return await handler(request)


async def on_startup(app: web.Application) -> None:
    cfg = app[CONFIG]
    app[BACKEND] = Backend(cfg.run_dir, cfg.gateway_id)
    app[BACKEND].start()
    app[BEATS] = asyncio.create_task(app[RING].follow_beats(), name="engine beats")
    app[TOKEN_FLUSH] = asyncio.create_task(flush_token_metrics(app[METRICS]), name="token metrics")
    app[GRAMMAR_REFRESH] = asyncio.create_task(app[GRAMMARS].refresh(), name="grammar store refresh")


async def flush_token_metrics(metrics: FrontendMetrics) -> None:
    """Write the per-token observations counted in this process every ``TOKEN_FLUSH_S``, for ever (a scrape
    answered by another gateway reads them from the shared values)."""
    while True:
        await asyncio.sleep(TOKEN_FLUSH_S)
        try:
            metrics.flush_tokens()
        except Exception as exc:  # noqa: BLE001 - a failed write (the metrics folder's disk) must not end the task
            log.warning("token metrics not written", error=repr(exc))


async def drain(app: web.Application) -> None:
    """Refuse new requests (``drain_middleware``) and let live ones finish for up to ``drain_timeout_s``, with
    the port still open: a client sent here meanwhile gets a 503 with Retry-After, not a refused connection."""
    app[DRAINING].set()
    live = app[LIVE]
    deadline = time.monotonic() + app[CONFIG].drain_timeout_s
    while live and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


async def on_shutdown(app: web.Application) -> None:
    """Drain (unless ``drain`` already did), then end the live requests left with an error."""
    if not app[DRAINING].is_set():
        await drain(app)
    live = app[LIVE]
    if live:
        log.warning("stopping_live_streams", n=len(live))
    for stream in list(live):
        stream.events.put_nowait(m.Failed(stream.req_id, 503, "the server is shutting down"))


async def on_cleanup(app: web.Application) -> None:
    for task in (app[BEATS], app[TOKEN_FLUSH], app[GRAMMAR_REFRESH]):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    app[METRICS].flush_tokens()
    await app[BACKEND].close()
    app[GRAMMARS].close()  # its workers would die with the gateway too; an app made in-process leaks none
    app[RING].close()


def chat_template_text(value: str | None) -> str | None:
    """--chat-template's text (read from its file), or None for the tokenizer's own."""
    return None if value is None else chat_template_from_arg(value)


def create_app(cfg: GatewayConfig, codec: TextCodec | None = None, *, guard: ConnectionGuard | None = None,
               metrics: FrontendMetrics | None = None) -> web.Application:
    """The app; ``guard`` (the server's connection limits) shares ``metrics`` with it."""
    metrics = metrics or FrontendMetrics(cfg.served_model_name, engines=cfg.data_parallel_size)
    middlewares = [guard.middleware] if guard is not None else []
    middlewares += [request_log_middleware(cfg, metrics), error_middleware, drain_middleware, grammar_hold_middleware]
    if cfg.api_key:
        middlewares.append(auth_middleware(cfg.api_key))
    middlewares.append(body_middleware(cfg, metrics))
    app = web.Application(client_max_size=cfg.max_body_bytes, middlewares=middlewares)
    app[CONFIG] = cfg
    app[CODEC] = codec or TextCodec(cfg.model, chat_template_text(cfg.chat_template))
    app[RING] = RingSet(cfg.ring_name, cfg.data_parallel_size, cfg.heartbeat_timeout_s)
    app[GRAMMARS] = GrammarCompiler(app[CODEC], cfg.ring_name, store_bytes=cfg.grammar_store_mb * 2**20)
    app[METRICS] = metrics
    metrics.context = lambda: max_model_len(app)  # vLLM's token histograms' boundaries go up to it
    app[LIVE] = set()
    app[DRAINING] = asyncio.Event()
    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    add_routes(app)
    return app
