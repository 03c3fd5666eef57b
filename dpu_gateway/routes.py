"""HTTP handlers: the OpenAI endpoints (chat, completions, responses, models), vLLM's /tokenize, /detokenize and
/version, /health, /metrics and /openapi.json."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from importlib import metadata

import msgspec
from aiohttp import web

from dpu_gateway import openai_format as fmt
from dpu_gateway import openapi as doc
from dpu_gateway.backend import RequestStream
from dpu_gateway.engines import engine_samples, engine_views, health_body, set_total_gauges, total_stats
from dpu_gateway.errors import APIError
from dpu_gateway.generation import Generation
from dpu_gateway.params import (
    Limits,
    Plan,
    check_constraint,
    completion_prompts,
    plan_chat,
    plan_completion,
    truncate,
)
from dpu_gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
    _Common,
    decode_chat,
    decode_completion,
    decode_detokenize,
    decode_responses,
    decode_tokenize,
    refuse,
)
from dpu_gateway.reasoning import Reasoning, plan_reasoning, template_kwargs
from dpu_gateway.respond import CHAT, COMPLETION, Shape, Usage, answer_stream, answer_whole
from dpu_gateway.responses import Reply, api_names, chat_request
from dpu_gateway.state import (
    BACKEND,
    CODEC,
    CONFIG,
    GRAMMARS,
    LIVE,
    METRICS,
    RECORD,
    RING,
    RequestRecord,
    engine_limits,
    engine_unavailable,
)
from dpu_gateway.structured import Constraint, constraint_of
from dpu_gateway.textio import Rendering, TokenIdNames, TokenNames, encode_parts, message_text
from dpu_gateway.tools import ToolPlan, parse_tools, plan_tools
from dpu_tokenizer.base import Tokenizer
from shared.metrics import EngineSample

STARTED = int(time.time())
try:
    VERSION = metadata.version("blink-serve")
except metadata.PackageNotFoundError:  # a checkout that is not installed
    VERSION = "0+unknown"


def check_model(app: web.Application, model: str) -> None:
    """404 unless ``model`` is the served name or one of its aliases."""
    name = app[CONFIG].served_model_name
    if model not in app[CONFIG].model_names:
        raise APIError(404, f"The model `{model}` does not exist. This server serves `{name}`.", param="model",
                       code="model_not_found")


@doc.documented("List the served model", answer=doc.ModelList)
async def models(request: web.Request) -> web.Response:
    return web.json_response(fmt.model_list(request.app[CONFIG].served_model_name, STARTED,
                                            max_model_len(request.app)))


@doc.documented("The served model's card", answer=doc.ModelCard, errors=(404,))
async def model(request: web.Request) -> web.Response:
    check_model(request.app, request.match_info["model"])
    return web.json_response(fmt.model_card(request.app[CONFIG].served_model_name, STARTED,
                                            max_model_len(request.app)))


def max_model_len(app: web.Application) -> int:
    """The context the engine accepts (prompt + output tokens), 0 while no engine has said."""
    ring = app[RING].current()
    return ring.header_load32("max_context") if ring is not None else 0


def json_body(request: web.Request) -> None:
    """415 for a body that is not JSON (as vLLM)."""
    if request.content_type != "application/json":
        raise APIError(415, f"Unsupported Media Type: Content-Type must be application/json, got "
                       f"{request.content_type!r}", code="unsupported_media_type")


def request_limits(app: web.Application) -> Limits:
    """The engine's limits with the vocabulary and the sampling features its backend implements."""
    limits = engine_limits(app)
    ring = app[RING].current()
    features = ring.header_load32("sampling_features") if ring is not None else 0
    arena = ring.header_load64("grammar_arena_bytes") if ring is not None else 0
    return dataclasses.replace(limits, vocab_size=vocab_size(app), features=features, grammar_arena_bytes=arena)


def stream_usage(req: _Common) -> tuple[bool, bool]:
    so = req.stream_options
    return bool(so and so.include_usage), bool(so and so.continuous_usage_stats)


def rendering(req: ChatCompletionRequest | TokenizeRequest) -> Rendering:
    """vLLM's chat-template fields of a request: ``continue_final_message`` and ``chat_template_kwargs``."""
    return Rendering(bool(req.continue_final_message), req.chat_template_kwargs)


def chat_echo(req: ChatCompletionRequest) -> str:
    """vLLM's chat ``echo``: the answer starts with the last message when it is the assistant's."""
    last = req.messages[-1]
    return message_text(last) if req.echo and last.role == "assistant" else ""


@doc.documented("Chat completion", body=ChatCompletionRequest, answer=doc.ChatCompletion, stream=True,
               errors=(404, 429, 503))
async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    app = request.app
    json_body(request)
    req = decode_chat(await request.read())
    check_model(app, req.model)
    rid = response_id(request, req)
    ids, plan, shape = await chat_job(app, req)
    return await run(request, shape, [(ids, plan)], req.stream, stream_usage(req), arrival, rid)


async def chat_job(app: web.Application, req: ChatCompletionRequest) -> tuple[list[int], Plan, Shape]:
    """A decoded chat request made ready to submit: its prompt's token ids, its plan (the grammar compiled) and
    how its output is read (reasoning, tool calls). The Responses API takes the same path (``responses``)."""
    limits = request_limits(app)
    cfg = app[CONFIG]
    tooling = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, cfg.tool_call_parser,
                         cfg.enable_auto_tool_choice)
    constraint = chat_constraint(req, tooling, app[CODEC].tokenizer)
    if constraint is not None:
        check_constraint(constraint, req, limits)
    how = rendering(req)
    how = dataclasses.replace(how, kwargs=template_kwargs(cfg.reasoning_parser, how.kwargs, app[CODEC].template))
    parts = app[CODEC].render_chat_parts(req.messages, req.add_generation_prompt, tooling.tools, tooling.fmt,
                                         req.split_special_tokens, how)
    ids = await encode_parts(app[CODEC], parts, app[BACKEND].encode, bool(req.add_special_tokens))
    ids = truncate(ids, req.truncate_prompt_tokens)
    reasoning = chat_reasoning(app, req, parts)
    if reasoning is not None:
        constraint = reasoning.constraint(constraint)
    gid = await grammar_id(app, constraint, limits)
    plan = plan_chat(req, len(ids), limits, chat_echo(req), gid, tooling.fmt, tuple(t.name for t in tooling.forced()))
    shape = CHAT if reasoning is None else dataclasses.replace(CHAT, reasoning=reasoning)
    return ids, plan, shape


@doc.documented("Create a response (OpenAI's Responses API, translated to a chat request)", body=ResponsesRequest,
               answer=doc.Response, stream=True, errors=(404, 429, 503))
async def responses(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses``: the request translated into a chat request (``dpu_gateway/responses.py``) and served
    by the chat path, answered as a response object or the Responses API's events."""
    arrival = time.monotonic()
    app = request.app
    json_body(request)
    req = decode_responses(await request.read())
    check_model(app, req.model)
    with api_names():  # a 400 of the chat path names the Responses field
        chat = chat_request(req)
        rid = response_id(request, chat)
        ids, plan, shape = await chat_job(app, chat)
    reply = Reply.of(req, app[CONFIG].served_model_name, rid)

    async def answer(gens: list[Generation], counts: Usage, names: TokenNames) -> web.StreamResponse:
        if req.stream:
            return await reply.stream(request, gens[0], shape, names, counts)
        return await reply.whole(gens[0], shape, names, counts)

    return await serve_jobs(request, [(ids, plan)], (False, False), arrival, answer)


def chat_reasoning(app: web.Application, req: ChatCompletionRequest, parts: list[tuple[str, bool]]) -> Reasoning | None:
    """How the answer's reasoning is read (``--reasoning-parser``; None without one): whether the rendered prompt
    leaves the output inside the reasoning, and ``include_reasoning``."""
    parser = app[CONFIG].reasoning_parser
    if parser is None:
        if req.include_reasoning is False:
            raise refuse("include_reasoning", "false needs the server started with --reasoning-parser (without one "
                         "the model's reasoning text, if any, is part of content)")
        return None
    prompt = "".join(text for text, _ in parts)
    return plan_reasoning(parser, prompt, app[CODEC].special_re, req.chat_template_kwargs, req.include_reasoning)


def chat_constraint(req: ChatCompletionRequest, tooling: ToolPlan, tok: Tokenizer) -> Constraint | None:
    """A forced tool call's grammar, or the response format's; never both."""
    asked = request_constraint(req, tok)
    if not tooling.forced():
        return asked
    if asked is not None:
        raise APIError(400, f"{asked.param} cannot be combined with a forced tool call (tool_choice "
                       f"{tooling.choice.mode!r})", param=asked.param, code="unsupported_value")
    kind, value = tooling.pattern_key()
    return Constraint(msgspec.json.encode([kind, value]).decode(), "tool_choice")


def request_constraint(req: ChatCompletionRequest | CompletionRequest, tok: Tokenizer) -> Constraint | None:
    """The request's output constraint, with the served tokenizer's EOS ids and words' token ids at hand."""
    return constraint_of(req, tok.eos_token_ids, lambda text: tok.encode(text, add_special_tokens=False))


async def grammar_id(app: web.Application, constraint: Constraint | None, limits: Limits) -> int:
    if constraint is None:
        return 0
    return await app[GRAMMARS].compile(constraint.key, limits.vocab_size, constraint.param,
                                       limits.grammar_arena_bytes)


@doc.documented("Text completion", body=CompletionRequest, answer=doc.Completion, stream=True,
               errors=(404, 429, 503))
async def completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    app = request.app
    json_body(request)
    req = decode_completion(await request.read())
    check_model(app, req.model)
    rid = response_id(request, req)
    limits = request_limits(app)
    constraint = request_constraint(req, app[CODEC].tokenizer)
    if constraint is not None:
        check_constraint(constraint, req, limits)
    gid = await grammar_id(app, constraint, limits)
    add_special = True if req.add_special_tokens is None else req.add_special_tokens
    jobs = []
    for prompt in completion_prompts(req):
        ids = prompt if isinstance(prompt, list) else await app[BACKEND].encode(prompt, add_special=add_special)
        check_token_ids(app, ids)
        ids = truncate(ids, req.truncate_prompt_tokens)
        echo = "" if not req.echo else prompt if isinstance(prompt, str) else app[CODEC].decode(ids)
        jobs.append((ids, plan_completion(req, len(ids), limits, echo, gid)))
    return await run(request, COMPLETION, jobs, req.stream, stream_usage(req), arrival, rid)


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


MAX_REQUEST_ID = 256


def response_id(request: web.Request, req: ChatCompletionRequest | CompletionRequest) -> str | None:
    """What names the response (``chatcmpl-ID``), as vLLM: the ``X-Request-Id`` header, else the body's
    ``request_id``, else None (a random one)."""
    given = request.headers.get("X-Request-Id") or req.request_id
    if given is None:
        return None
    if not given or len(given) > MAX_REQUEST_ID or not given.isprintable():
        param = "request_id" if req.request_id == given else "X-Request-Id"
        raise APIError(400, f"{param} must be 1 to {MAX_REQUEST_ID} printable characters", param=param,
                       code="invalid_value")
    return given


Answer = Callable[[list[Generation], Usage, TokenNames], Awaitable[web.StreamResponse]]


async def run(request: web.Request, shape: Shape, jobs: list[tuple[list[int], Plan]], stream: bool,
              usage: tuple[bool, bool], arrival: float, rid: str | None = None) -> web.StreamResponse:
    """Submit every choice of every prompt (choice index = prompt index * n + i), then answer in chat's or
    completions' shape."""
    model = request.app[CONFIG].served_model_name

    async def answer(gens: list[Generation], counts: Usage, names: TokenNames) -> web.StreamResponse:
        if stream:
            return await answer_stream(request, gens, shape, names, model, counts, rid)
        return await answer_whole(gens, shape, names, model, counts, rid)

    return await serve_jobs(request, jobs, usage, arrival, answer)


async def serve_jobs(request: web.Request, jobs: list[tuple[list[int], Plan]], usage: tuple[bool, bool],
                     arrival: float, answer: Answer) -> web.StreamResponse:
    """Submit every choice of every prompt, answer with ``answer``, and cancel whatever is left once it returned
    (a client gone, an error): every endpoint's slots are handled here alike."""
    app = request.app
    backend, codec = app[BACKEND], app[CODEC]
    handles: list[RequestStream] = []
    gens: list[Generation] = []
    try:
        for p, (ids, plan) in enumerate(jobs):
            for i, sampling in enumerate(plan.choices()):
                handle = await backend.submit(ids, sampling)
                handles.append(handle)
                app[LIVE].add(handle)
                prompt_tokens = len(ids) if i == 0 else 0  # the metrics count each prompt once
                source = gens[-i] if i else None  # the prompt's first choice: its slot alone asks for prompt log-probs
                gens.append(Generation(codec, plan, backend, handle, app[METRICS], arrival, prompt_tokens,
                                       p * plan.n + i, ids, source))
        counts = Usage(gens, sum(len(ids) for ids, _ in jobs), *usage)
        request[RECORD] = RequestRecord(prompt_tokens=counts.prompt_tokens)
        names = TokenIdNames() if jobs and jobs[0][1].token_ids_as_text else codec  # of the log-prob entries
        return await answer(gens, counts, names)
    finally:
        record_outcome(request, gens)
        for handle in handles:
            app[LIVE].discard(handle)
            backend.forget(handle, cancel=True)


def record_outcome(request: web.Request, gens: list[Generation]) -> None:
    """Output tokens, time to first token and finish reasons of the request's choices, for its log line."""
    record = request.get(RECORD)
    if record is None:
        return
    record.output_tokens = sum(g.completion_tokens for g in gens)
    firsts = [g.first_at - g.arrival for g in gens if g.first_at is not None]
    record.ttft_s = min(firsts) if firsts else None
    record.finish_reasons = tuple(g.finish_reason or "none" for g in gens)


@doc.documented("Tokenize a prompt or chat messages (vLLM)", body=TokenizeRequest, answer=doc.TokenizeResponse,
               errors=(404,))
async def tokenize(request: web.Request) -> web.Response:
    """vLLM's ``POST /tokenize``: a prompt or chat messages to ``{"count", "max_model_len", "tokens"}``."""
    app = request.app
    json_body(request)
    req = decode_tokenize(await request.read())
    check_model(app, req.model or app[CONFIG].served_model_name)
    if req.messages is not None:
        tools = parse_tools(req.tools)
        parts = app[CODEC].render_chat_parts(req.messages, req.add_generation_prompt, tools,
                                             split_special=req.split_special_tokens, how=rendering(req))
        special = False
    else:
        parts, special = [(req.prompt or "", False)], True
    add = special if req.add_special_tokens is None else req.add_special_tokens
    ids = await encode_parts(app[CODEC], parts, app[BACKEND].encode, add)
    return web.json_response({"count": len(ids), "max_model_len": max_model_len(app), "tokens": ids})


@doc.documented("Token ids to text (vLLM)", body=DetokenizeRequest, answer=doc.DetokenizeResponse,
               errors=(404,))
async def detokenize(request: web.Request) -> web.Response:
    """vLLM's ``POST /detokenize``: ``{"tokens"}`` to ``{"prompt"}``."""
    app = request.app
    json_body(request)
    req = decode_detokenize(await request.read())
    check_model(app, req.model or app[CONFIG].served_model_name)
    vocab = vocab_size(app)
    if vocab and not all(0 <= t < vocab for t in req.tokens):
        raise APIError(400, f"tokens must be in [0, {vocab})", param="tokens", code="invalid_value")
    # vLLM's answer is the tokenizer's decode, special tokens kept: /tokenize's ids give back their text
    return web.json_response({"prompt": app[CODEC].decode(req.tokens, skip_special_tokens=False)})


@doc.documented("The server's version", answer=doc.VersionResponse)
async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": VERSION})


@doc.documented("200 while an engine serves", answer=doc.HealthResponse)
async def health(request: web.Request) -> web.Response:
    """200 while an engine serves (``degraded`` naming the others when some do not), 503 when none does."""
    rings = request.app[RING]
    if not rings.alive():
        raise engine_unavailable(rings)
    if not request.app[BACKEND].linked():
        raise APIError(503, "frontend services are not all connected", code="service_unavailable")
    return web.json_response(health_body(engine_views(rings)))


def refresh_gauges(app: web.Application) -> tuple[dict | None, list[EngineSample]]:
    """Set the gauges from the rings; the engines' stats summed (None without an engine) and per engine."""
    views = engine_views(app[RING], with_slots=True)
    queued = sum(1 for s in app[BACKEND].streams.values() if not s.admitted.done())
    samples = engine_samples(views, queued)
    set_total_gauges(app[METRICS], samples, views, queued)
    return total_stats(views), samples


@doc.documented("Prometheus metrics", media="text/plain")
async def metrics(request: web.Request) -> web.Response:
    stats, per_engine = refresh_gauges(request.app)
    body = request.app[METRICS].render(stats, per_engine)
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


@doc.documented("This document", media="application/json")
async def openapi(request: web.Request) -> web.Response:
    app = request.app
    try:
        limits = engine_limits(app)
    except APIError:
        limits = None  # no engine now: the document without its bounds
    bounds = doc.DocLimits.of(app[CONFIG].model_names, limits, vocab_size(app))
    body = doc.openapi_document(app.router.routes(), bounds)
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
