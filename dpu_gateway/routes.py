"""HTTP handlers: the OpenAI endpoints, /health, /metrics and /openapi.json."""

from __future__ import annotations

import time

import msgspec
import numpy as np
from aiohttp import web

from dpu_gateway import openai_format as fmt
from dpu_gateway.errors import APIError
from dpu_gateway.generation import Generation
from dpu_gateway.openapi import DocLimits, openapi_document
from dpu_gateway.params import Plan, completion_prompt, plan_chat, plan_completion
from dpu_gateway.protocol import ChatDecoder, CompletionDecoder
from dpu_gateway.respond import CHAT, COMPLETION, Shape, answer_stream, answer_whole
from dpu_gateway.state import BACKEND, CODEC, CONFIG, LIVE, METRICS, RING, engine_limits
from shared import ring_layout as L

STARTED = int(time.time())


def check_model(app: web.Application, model: str) -> None:
    name = app[CONFIG].served_model_name
    if model != name:
        raise APIError(404, f"The model `{model}` does not exist. This server serves `{name}`.", param="model",
                       code="model_not_found")


async def models(request: web.Request) -> web.Response:
    ring = request.app[RING].current()
    ctx = ring.header_load32("max_context") if ring is not None else 0
    return web.json_response(fmt.model_list(request.app[CONFIG].served_model_name, STARTED, ctx))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    app = request.app
    req = ChatDecoder.decode(await request.read())
    check_model(app, req.model)
    limits = engine_limits(app)
    ids = await app[BACKEND].encode(app[CODEC].render_chat(req.messages), add_special=False)
    plan = plan_chat(req, len(ids), limits)
    usage = bool(req.stream_options and req.stream_options.include_usage)
    return await run(request, CHAT, ids, plan, req.stream, usage, arrival)


async def completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    app = request.app
    req = CompletionDecoder.decode(await request.read())
    check_model(app, req.model)
    limits = engine_limits(app)
    prompt = completion_prompt(req)
    ids = prompt if isinstance(prompt, list) else await app[BACKEND].encode(prompt, add_special=True)
    check_token_ids(app, ids)
    plan = plan_completion(req, len(ids), limits)
    usage = bool(req.stream_options and req.stream_options.include_usage)
    return await run(request, COMPLETION, ids, plan, req.stream, usage, arrival)


def vocab_size(app: web.Application) -> int:
    """The served model's vocabulary size from the ring, 0 while no engine has written it."""
    ring = app[RING].current()
    return ring.header_load32("vocab_size") if ring is not None else 0


def check_token_ids(app: web.Application, ids: list[int]) -> None:
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
    vocab = vocab_size(app)
    if vocab and not all(0 <= t < vocab for t in ids):
        raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt", code="invalid_value")


async def run(request: web.Request, shape: Shape, ids: list[int], plan: Plan, stream: bool, usage: bool,
              arrival: float) -> web.StreamResponse:
    app = request.app
    backend, codec, model = app[BACKEND], app[CODEC], app[CONFIG].served_model_name
    handle = await backend.submit(ids, plan.sampling)
    app[LIVE].add(handle)
    try:
        gen = Generation(codec, plan, backend, handle, app[METRICS], arrival, len(ids))
        if stream:
            return await answer_stream(request, gen, shape, codec, model, usage)
        return await answer_whole(gen, shape, codec, model)
    finally:
        app[LIVE].discard(handle)
        backend.forget(handle, cancel=True)


async def health(request: web.Request) -> web.Response:
    watch = request.app[RING]
    if not watch.alive():
        raise APIError(503, "the engine is not running (no ring, or its heartbeat is stale)",
                       code="engine_unavailable")
    if not request.app[BACKEND].linked():
        raise APIError(503, "frontend services are not all connected", code="service_unavailable")
    return web.json_response({"status": "ok"})


def refresh_gauges(app: web.Application) -> None:
    mt, ring = app[METRICS], app[RING].current()
    queued = sum(1 for s in app[BACKEND].streams.values() if not s.admitted.done())
    if ring is None:
        for gauge in (mt.running, mt.kv_usage, mt.slots_in_use):
            gauge.set(0)
        mt.waiting.set(queued)
        return
    stats = ring.read_header()["stats"]
    states = ring.read_slots()["state"]
    mt.running.set(int(stats["running"]))
    pending = int(np.count_nonzero(states == L.SlotState.PREFILL_PENDING))
    mt.waiting.set(int(stats["waiting"]) + pending + queued)
    total = int(stats["kv_blocks_total"])
    mt.kv_usage.set(1.0 - int(stats["kv_blocks_free"]) / total if total else 0.0)
    mt.slots_in_use.set(int(np.count_nonzero(states != L.SlotState.EMPTY)))


async def metrics(request: web.Request) -> web.Response:
    refresh_gauges(request.app)
    body = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def openapi(request: web.Request) -> web.Response:
    app = request.app
    try:
        limits = engine_limits(app)
    except APIError:
        limits = None  # no engine now: the document without its bounds
    doc = openapi_document(app[CONFIG].served_model_name, DocLimits.of(limits, vocab_size(app)))
    return web.Response(body=msgspec.json.encode(doc), content_type="application/json")


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
