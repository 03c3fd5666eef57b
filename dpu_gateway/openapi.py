"""``/openapi.json`` (OpenAPI 3.1), generated from what the gateway serves.

- **Paths** are the routes of the app's router, every one of them: a route added to ``add_routes`` is in
  the document with its methods (aiohttp adds a HEAD route beside each GET route; it is listed too).
- **Bodies** are the JSON schemas of msgspec types (``msgspec.json.schema_components``): the request types
  of ``dpu_gateway/protocol.py``, which decode and validate every request, and the response types below.
  A handler names its types with ``@documented`` (``dpu_gateway/routes.py``); a field added to a type is
  in the document, with its type and range, without being described twice.
- **DocLimits**, a layer on top, narrows what the types allow to what this server serves: the served
  model's names, the running engine's bounds (output tokens, prompt tokens, token ids), the gateway's own
  checks (stop strings, ``logit_bias`` keys, a completion prompt being one prompt or a list of them, not a
  mix) and, for a field declared only to be refused (``protocol.REFUSED``), the values that are a no-op.
  A schema-valid request is then one the server can serve, and a request the document forbids is refused
  (tests/test_fuzz_openapi.py holds the server to both, and every answer to its response schema).

The response types are the document's alone (``dpu_gateway/openai_format.py`` builds the answers as
dicts): they state the fields every answer has, and leave the others open.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeVar

import msgspec
from aiohttp import web

from dpu_gateway import protocol
from dpu_gateway.params import MAX_STOP_CHARS, MAX_STOP_STRINGS, Limits
from shared.slots import MAX_LOGIT_BIAS

API_KEY_PREFIX = "/v1/"  # the paths --api-key guards (dpu_gateway/app.py's auth_middleware)
SCHEMAS = "#/components/schemas/"


# ---- response types ---------------------------------------------------------------------------------


class _Answer(msgspec.Struct, kw_only=True):
    """A response object: the fields listed are always there; others may be too."""


class ErrorDetail(_Answer):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Answer):
    """Every error (any status >= 400) of every route."""

    error: ErrorDetail


class CachedTokens(_Answer):
    cached_tokens: int


class Usage(_Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: CachedTokens | None = None


class AnswerMessage(_Answer):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[dict] | None = None
    reasoning_content: str | None = None  # with --reasoning-parser (dpu_gateway/reasoning.py)
    reasoning: str | None = None  # vLLM's newer name: the same text


class ChatChoice(_Answer):
    index: int
    message: AnswerMessage
    logprobs: dict | None
    finish_reason: str | None
    stop_reason: str | int | None  # the stop string or stop token id that ended it, else null (vLLM)


class ChatCompletion(_Answer):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(_Answer):
    index: int
    text: str
    logprobs: dict | None
    finish_reason: str | None
    stop_reason: str | int | None  # the stop string or stop token id that ended it, else null (vLLM)


class Completion(_Answer):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ResponseUsage(_Answer):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict
    output_tokens_details: dict


class Response(_Answer):
    """The Responses API's response object (``dpu_gateway/responses.py``)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict]
    usage: ResponseUsage | None


class ModelCard(_Answer):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int  # prompt plus output tokens; a prompt may have one less (0 while no engine has said)


class ModelList(_Answer):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Answer):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Answer):
    prompt: str


class VersionResponse(_Answer):
    version: str


class EngineHealth(_Answer):
    engine: int
    status: Literal["ok", "down"]


class HealthResponse(_Answer):
    """``engines`` and the counts only under data parallelism."""

    status: Literal["ok", "degraded"]
    engines: list[EngineHealth] | None = None


# ---- what a handler declares ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Operation:
    """What the document says of one handler."""

    summary: str
    body: type | None = None        # the request body's msgspec type
    answer: type | None = None      # the JSON answer's msgspec type (200)
    media: str = "application/json"  # the answer's media type when it is not typed (``answer`` None)
    stream: bool = False            # the answer may instead be a stream of server-sent events
    errors: tuple[int, ...] = ()    # statuses of this handler's own errors


H = TypeVar("H", bound=Callable[..., Any])


def documented(summary: str, **fields: Any) -> Callable[[H], H]:
    """Mark a handler with its ``Operation`` (read when the document is made)."""
    def mark(handler: H) -> H:
        handler.openapi = Operation(summary, **fields)  # type: ignore[attr-defined]
        return handler
    return mark


def operation_of(handler: Callable[..., Any]) -> Operation:
    """The handler's ``Operation``; a handler that has none is listed with its docstring and no types."""
    declared = getattr(handler, "openapi", None)
    if isinstance(declared, Operation):
        return declared
    doc = (handler.__doc__ or handler.__name__).strip().splitlines()[0]
    return Operation(doc, media="application/octet-stream")


# ---- the limits layer -------------------------------------------------------------------------------


def _alternatives(schema: dict) -> list[dict]:
    """A schema's alternatives: its anyOf branches, else the schema itself."""
    return schema["anyOf"] if "anyOf" in schema else [schema]


def _narrow(schema: dict, kind: str, **keywords: Any) -> None:
    """Add ``keywords`` to each alternative of type ``kind``."""
    for alt in _alternatives(schema):
        if alt.get("type") == kind:
            alt.update(keywords)


# Values a field declared to be refused may still take, when they are a no-op (protocol.REFUSED decides).
_NOOP_CANDIDATES: tuple[Any, ...] = (None, False, True, 0, 1, "", "none", "auto", "default", "disabled", ["text"], [],
                                     {})


def noop_values(refused: Callable[[Any], bool], kind: Any) -> list[Any]:
    """The candidates that ``refused`` takes for a no-op and that decode as ``kind``."""
    out = []
    for value in _NOOP_CANDIDATES:
        if not refused(value):
            continue
        try:
            msgspec.convert(value, kind)
        except msgspec.ValidationError:
            continue
        out.append(value)
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class DocLimits:
    """What this server serves, beyond what the request types allow: the model's names, and while an
    engine runs its bounds (None: not known now, so not stated)."""

    models: tuple[str, ...]
    max_output: int | None = None
    max_prompt: int | None = None
    vocab_size: int = 0

    @classmethod
    def of(cls, models: Iterable[str], limits: Limits | None, vocab_size: int) -> DocLimits:
        if limits is None:
            return cls(tuple(models), vocab_size=vocab_size)
        return cls(tuple(models), limits.max_output_tokens, limits.max_prompt_tokens, vocab_size)

    def token_id(self, schema: dict) -> None:
        """Bound every integer of ``schema`` (a token id, or a list of them, at any depth)."""
        for alt in _alternatives(schema):
            if alt.get("type") == "integer":
                alt["minimum"] = 0
                if self.vocab_size:
                    alt["maximum"] = self.vocab_size - 1
            elif alt.get("type") == "array" and "items" in alt:
                self.token_id(alt["items"])

    def token_list(self, schema: dict) -> None:
        """One prompt as token ids: at least one, at most the engine's prompt bound."""
        schema["minItems"] = 1
        if self.max_prompt is not None:
            schema["maxItems"] = self.max_prompt
        self.token_id(schema["items"])

    def prompt(self, schema: dict) -> None:
        """A completion prompt: text, token ids, or a list of prompts; the type's list of "token ids or
        prompts" is split in two, since a list mixing token ids and prompts is refused."""
        branches = []
        for alt in _alternatives(schema):
            if alt.get("type") != "array":
                branches.append(alt)
                continue
            items = _alternatives(alt["items"])
            ids = [i for i in items if i.get("type") == "integer"]
            prompts = [i for i in items if i.get("type") != "integer"]
            for one in ids:
                branches.append(ids_branch := {"type": "array", "items": one})
                self.token_list(ids_branch)
            for one in prompts:
                if one.get("type") == "array":
                    self.token_list(one)
            if prompts:
                batch = prompts[0] if len(prompts) == 1 else {"anyOf": prompts}
                branches.append({"type": "array", "items": batch, "minItems": 1})
        schema.pop("type", None)
        schema["anyOf"] = branches

    def model(self, schema: dict) -> None:
        """The served names; where the field may be left out (null), also "", which stands for it too."""
        optional = any(alt.get("type") == "null" for alt in _alternatives(schema))
        _narrow(schema, "string", enum=[*self.models, *([""] if optional else [])])

    def request(self, name: str, schema: dict) -> None:
        """Narrow one request type's schema (``name``: its component name)."""
        props = schema.get("properties", {})
        for field, prop in props.items():
            if field == "model":
                self.model(prop)
            elif field in ("max_tokens", "max_completion_tokens", "max_output_tokens") and self.max_output is not None:
                _narrow(prop, "integer", maximum=self.max_output)
            elif field in ("stop_token_ids", "tokens"):
                self.token_id(prop)
            elif field == "logit_bias":
                _narrow(prop, "object", maxProperties=MAX_LOGIT_BIAS, propertyNames={"pattern": "^[0-9]+$"})
            elif field == "stop":
                _narrow(prop, "string", maxLength=MAX_STOP_CHARS)
                _narrow(prop, "array", maxItems=MAX_STOP_STRINGS)
                for alt in _alternatives(prop):
                    if alt.get("type") == "array":
                        _narrow(alt["items"], "string", maxLength=MAX_STOP_CHARS)
            elif field == "prompt" and name == "CompletionRequest":
                self.prompt(prop)
        if "stream_options" in props:  # protocol.check_refused: only with stream true
            schema.setdefault("allOf", []).append({
                "if": {"required": ["stream"], "properties": {"stream": {"const": True}}},
                "else": {"properties": {"stream_options": {"type": "null"}}}})
        if name == "TokenizeRequest":  # protocol.decode_tokenize's own checks
            schema["oneOf"] = [{"required": [one], "properties": {one: {"not": {"type": "null"}}}}
                               for one in ("prompt", "messages")]
            props["return_token_strs"] = {"enum": [None, False], "description": "token strings are not returned"}


@functools.cache
def _refused_fields(body: type) -> dict[str, tuple[list[Any], str]]:
    """Of a request type, each field declared to be refused: its no-op values and why others are refused."""
    kinds = {f.name: f.type for f in msgspec.structs.fields(body)}
    return {name: (noop_values(noop, kinds[name]), why) for name, (noop, why) in protocol.refused_fields(body).items()
            if name in kinds}


def _refusals(comps: dict, bodies: Iterable[type]) -> None:
    """Fields declared only to be refused take their no-op values; refused message fields and content parts
    are left out."""
    for body in bodies:
        props = comps[body.__name__].get("properties", {})
        for name, (values, why) in _refused_fields(body).items():
            props[name] = {"enum": values, "description": f"only a no-op value is taken: {why}"}
    message = comps.get(protocol.ChatMessage.__name__)
    if message is None:
        return
    kinds = {f.name: f.type for f in msgspec.structs.fields(protocol.ChatMessage)}
    for name, why in protocol._MESSAGE_REFUSED.items():
        message["properties"][name] = {"enum": noop_values(protocol._off, kinds[name]),
                                       "description": f"only a no-op value is taken: {why}"}
    # what protocol._check_message asks of a message beyond its type: a tool result names the call it answers,
    # and only the assistant's messages hold tool calls
    message["allOf"] = [
        {"if": {"properties": {"role": {"const": "tool"}}},
         "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}}},
        {"if": {"properties": {"role": {"not": {"const": "assistant"}}}},
         "then": {"properties": {"tool_calls": {"enum": [None, []]}}}},
    ]
    refused_parts = {SCHEMAS + part.__name__ for part in protocol._PART_REFUSED}
    for alt in _alternatives(message["properties"]["content"]):
        if alt.get("type") != "array":
            continue
        items = alt["items"]
        items["anyOf"] = [p for p in items["anyOf"] if p.get("$ref") not in refused_parts]
        mapping = items.get("discriminator", {}).get("mapping", {})
        for tag in [t for t, ref in mapping.items() if ref in refused_parts]:
            del mapping[tag]
    for ref in refused_parts:
        comps.pop(ref.removeprefix(SCHEMAS), None)


# ---- the document -----------------------------------------------------------------------------------


def _ref(t: type) -> dict:
    return {"$ref": SCHEMAS + t.__name__}


_REASONS = {400: "Invalid request", 401: "Missing or wrong API key", 404: "Unknown model",
            408: "The body came too slowly", 413: "Body too large", 415: "The body is not JSON",
            429: "Ring and wait queue full (see Retry-After)", 503: "Engine down, or the server draining"}
# OpenAPI 3.1 reads the schema of an event stream as that of each event.
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a JSON chunk (or an error object), and last `[DONE]`"},
    "event": {"type": "string"}}}


def _statuses(path: str, op: Operation) -> list[int]:
    """The error statuses of a route: its handler's, the body's (400, 408 slow, 413 large, 415 not JSON),
    the API key's and the draining server's (every route)."""
    codes = set(op.errors) | {503}
    if op.body is not None:
        codes |= {400, 408, 413, 415}
    if path.startswith(API_KEY_PREFIX):
        codes.add(401)
    return sorted(codes)


def _operation(method: str, path: str, op: Operation, limits: DocLimits) -> dict:
    head = method == "HEAD"
    if head:
        ok: dict = {"description": "The GET answer's status and headers, no body"}
    elif op.answer is not None:
        ok = {"description": "OK", "content": {"application/json": {"schema": _ref(op.answer)}}}
    else:
        ok = {"description": "OK", "content": {op.media: {"schema": {"type": "string"} if op.media.startswith(
            "text/") else {}}}}
    if op.stream:
        ok["description"] = "The answer (JSON), or with stream=true server-sent events"
        ok["content"]["text/event-stream"] = {"schema": _SSE_EVENT}
    error = {"content": {"application/json": {"schema": _ref(ErrorResponse)}}} if not head else {}
    out: dict = {"summary": f"Headers of: {op.summary}" if head else op.summary,
                 "responses": {"200": ok, **{str(c): {"description": _REASONS.get(c, "Error"), **error}
                                             for c in _statuses(path, op)}}}
    if path.startswith(API_KEY_PREFIX):
        out["security"] = [{"bearer": []}, {}]  # {}: the key is required only when the server has one
    params = re.findall(r"\{(\w+)\}", path)
    if params:
        out["parameters"] = []
        for name in params:
            schema = {"type": "string"}
            if name == "model":
                limits.model(schema)
            out["parameters"].append({"name": name, "in": "path", "required": True, "schema": schema})
    if op.body is not None and not head:
        out["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(op.body)}}}
    return out


@functools.cache
def _components(types: tuple[type, ...]) -> dict:
    _, comps = msgspec.json.schema_components(types, ref_template=SCHEMAS + "{name}")
    return comps


def openapi_document(routes: Iterable[web.AbstractRoute], limits: DocLimits) -> dict:
    """The document of ``routes`` (an app's ``router.routes()``), with ``limits`` layered on the types."""
    ops: dict[str, dict[str, Operation]] = {}
    for route in routes:
        path = route.resource.canonical if route.resource is not None else ""
        if route.method == "*" or not path:
            continue
        ops.setdefault(path, {})[route.method] = operation_of(route.handler)
    declared = [op for methods in ops.values() for op in methods.values()]
    bodies = sorted({op.body for op in declared if op.body is not None}, key=lambda t: t.__name__)
    answers = {op.answer for op in declared if op.answer is not None}
    types = tuple(sorted({*bodies, *answers, ErrorResponse}, key=lambda t: t.__name__))
    comps = copy.deepcopy(_components(types))
    _refusals(comps, bodies)
    for body in bodies:
        limits.request(body.__name__, comps[body.__name__])
    paths = {path: {method.lower(): _operation(method, path, op, limits) for method, op in methods.items()}
             for path, methods in ops.items()}
    return {
        "openapi": "3.1.0",
        "info": {"title": "Blink OpenAI-compatible API", "version": "1",
                 "description": f"Serving `{limits.models[0]}`." if limits.models else "Blink"},
        "paths": paths,
        "components": {"schemas": comps, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
