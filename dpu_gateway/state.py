"""The gateway's configuration and its typed application state (``web.AppKey``s)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from aiohttp import web

from dpu_gateway.backend import Backend, RequestStream
from dpu_gateway.constrain import GrammarCompiler
from dpu_gateway.engines import RingSet
from dpu_gateway.errors import APIError
from dpu_gateway.params import Limits
from dpu_gateway.reasoning import PARSERS as REASONING_PARSERS
from dpu_gateway.textio import TextCodec
from dpu_gateway.tools import PARSERS
from shared.env import HEARTBEAT_TIMEOUT_S
from shared.frontend_flags import GATEWAY
from shared.log import admit_repeat, get_logger
from shared.metrics import FrontendMetrics
from shared.ring import RingGeometry


@dataclasses.dataclass(frozen=True, slots=True)
class GatewayConfig:
    run_dir: Path
    ring_name: str
    model: str                       # path of the served model's files (for the tokenizer)
    served_model_name: str           # reported in responses
    model_aliases: tuple[str, ...] = ()  # other names a request's `model` may use
    chat_template: str | None = None  # --chat-template: a file or the Jinja text (default: the tokenizer's)
    log_requests: bool = True         # one log line per answered request
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice: tool_choice "auto" is served
    tool_call_parser: str | None = None    # --tool-call-parser: the format tool calls are read in
    reasoning_parser: str | None = None    # --reasoning-parser: <think> text goes to reasoning_content (reasoning.py)
    api_key: str | None = None
    max_body_bytes: int = GATEWAY.max_body_bytes
    grammar_store_mb: int = GATEWAY.grammar_store_mb  # the compiled grammars kept in shared memory (0: unbounded)
    drain_timeout_s: float = GATEWAY.drain_timeout
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S
    gateway_id: int | None = None    # default: the pid, distinct per PID namespace (backend.default_gateway_id)
    data_parallel_size: int = 1      # engines, each with its own ring (shared/data_parallel.py names them)
    # connection limits (see dpu_gateway/connguard.py)
    max_connections: int = GATEWAY.max_connections      # open connections of this gateway; more get a quick 503
    header_timeout_s: float = GATEWAY.header_timeout    # a request head must be complete this long after its first byte
    body_timeout_s: float = GATEWAY.body_timeout        # and its body this long after the head
    keepalive_timeout_s: float = GATEWAY.keepalive_timeout  # a connection with no request in progress closes after this

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.model_aliases)

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got "
                             f"{self.reasoning_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.grammar_store_mb < 0:
            raise ValueError(f"--grammar-store-mb must be >= 0, got {self.grammar_store_mb}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


log = get_logger("gateway")
CONFIG = web.AppKey("config", GatewayConfig)
CODEC = web.AppKey("codec", TextCodec)
BACKEND = web.AppKey("backend", Backend)
RING = web.AppKey("ring", RingSet)  # every engine's ring (one without --data-parallel-size)
METRICS = web.AppKey("metrics", FrontendMetrics)
GRAMMARS = web.AppKey("grammars", GrammarCompiler)
LIVE = web.AppKey("live", set[RequestStream])
BEATS = web.AppKey("beats", asyncio.Task)  # RingSet.follow_beats
TOKEN_FLUSH = web.AppKey("token_flush", asyncio.Task)  # app.flush_token_metrics
GRAMMAR_REFRESH = web.AppKey("grammar_refresh", asyncio.Task)  # constrain.GrammarCompiler.refresh
DRAINING = web.AppKey("draining", asyncio.Event)  # set at SIGTERM: new requests are refused (app.drain_middleware)


@dataclasses.dataclass(slots=True)
class RequestRecord:
    """What a request's log line says beyond its route and status; set by the handler that answers it."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    finish_reasons: tuple[str, ...] = ()


RECORD = "blink_record"  # the request's RequestRecord, in request[RECORD]
# True in request[CLIENT_GONE] when a stream's client closed as its answer was written (respond.answer_stream)
CLIENT_GONE = web.RequestKey("client_gone", bool)


def engine_unavailable(watch: RingSet) -> APIError:
    """503 while no engine serves, logged with each engine's reason (its state, or the silence this gateway
    observed). "The model is loading" until this gateway first saw one of this server's engines serve: a ring
    left by a crashed server (its counter never moves) is not taken for this server's engine."""
    loading = not watch.served
    if (repeated := admit_repeat("engine unavailable", loading)) is not None:
        log.warning("engine unavailable: 503", loading=loading, timeout_s=watch.timeout_s, repeated=repeated,
                    engines={str(i): p for i, p in watch.problems().items()})
    if loading:
        return APIError(503, "the model is loading", code="model_loading", retry_after_s=1)
    return APIError(503, "the engine is not running (no ring, or its heartbeat is stale)",
                    code="engine_unavailable", retry_after_s=1)


def engine_limits(app: web.Application) -> Limits:
    """The ring's limits, or 503 when the engine is not serving."""
    watch = app[RING]
    ring = watch.current()
    if ring is None or not ring.engine_serving(watch.timeout_s):
        raise engine_unavailable(watch)
    if not app[BACKEND].linked():
        raise APIError(503, "frontend services are starting", code="service_unavailable", retry_after_s=1)
    g = ring.geometry
    return limits_of(g, ring.header_load32("max_context") or g.max_prompt_tokens + g.max_output_tokens)


def limits_of(g: RingGeometry, max_context: int) -> Limits:
    """A request's limits from the ring's geometry and the engine's context (its header's ``max_context``): a
    prompt may have up to ``max_context - 1`` tokens, as vLLM's, where the prompt slot holds that many."""
    return Limits(max_context, min(g.max_prompt_tokens, max_context - 1), g.max_output_tokens,
                  max_prompt_logprobs_tokens=g.prompt_logprob_rows, top_logprobs=g.top_logprobs)
