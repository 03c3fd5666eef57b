"""OpenAI's Responses API (``POST /v1/responses``) as a translation of the chat path.

- **Request**: ``chat_request`` turns a decoded ``ResponsesRequest`` into the ``ChatCompletionRequest`` that asks
  for the same output: ``instructions`` and the ``input`` items become chat messages (an earlier call becomes the
  assistant's ``tool_calls``, its output a ``tool`` message, a reasoning item the next assistant turn's
  ``reasoning_content``), flat function tools become chat's, ``text.format`` becomes ``response_format``,
  ``max_output_tokens`` ``max_completion_tokens``. The chat handler's own code then plans, renders and submits it
  (``routes.chat_job``), so both endpoints serve a field alike; ``api_names`` renames the fields a chat 400 names
  to the Responses request's (``response_format`` is ``text.format``, ...).
- **Answer**: the chat choice (``respond.collect_choice``) becomes output items: a reasoning item (with
  ``--reasoning-parser``), a message with one ``output_text`` part, and a ``function_call`` item per parsed call.
- **Stream**: the chat stream's chunks (``respond.stream_choices``) are read by ``EventWriter``, which writes the
  Responses events: each item opened, its deltas, each item closed, then ``response.completed`` (or
  ``response.incomplete`` when the output budget ended it, ``response.failed`` on an engine error). There is no
  ``[DONE]`` line, as OpenAI sends none for this API.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import msgspec
from aiohttp import web

from dpu_gateway import openai_format as fmt
from dpu_gateway import sse
from dpu_gateway.errors import APIError
from dpu_gateway.generation import Generation
from dpu_gateway.protocol import (
    RESPONSES_PART_REFUSED,
    ChatCompletionRequest,
    ChatMessage,
    InputItem,
    OutputRefusal,
    Part,
    ReasoningText,
    ResponsesRequest,
    TextPart,
    refuse,
)
from dpu_gateway.respond import Shape, Usage, collect_choice, stream_choices
from dpu_gateway.state import CLIENT_GONE
from dpu_gateway.textio import TokenNames

LOGPROBS = "message.output_text.logprobs"  # the one ``include`` value served
TOOL_FIELDS = {"type", "name", "description", "parameters", "strict"}


def _bad(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", param=param, code="invalid_value")


# ---- the request -------------------------------------------------------------------------------------


def _text(parts: str | list | None, where: str) -> list[Part] | str:
    """A message's or an output's content as chat takes it: the string, or its text parts; other parts are
    400s (the served model takes text only)."""
    if parts is None:
        return ""
    if isinstance(parts, str):
        return parts
    out: list[Part] = []
    for j, part in enumerate(parts):
        kind = RESPONSES_PART_REFUSED.get(type(part))
        if kind is not None:
            raise refuse(f"{where}[{j}]", f"{kind} content parts are not supported (the served model takes text only)")
        if isinstance(part, OutputRefusal):
            continue  # an earlier answer's refusal: accepted in history, not rendered (as chat's refusal)
        if isinstance(part, ReasoningText):
            raise _bad(f"{where}[{j}]", "reasoning_text parts belong to reasoning items")
        out.append(TextPart(part.text))
    return out


def _arguments(text: str | None, where: str) -> str:
    try:
        value = json.loads(text or "")
    except ValueError:
        raise _bad(where, "must be the call's arguments as JSON text") from None
    if not isinstance(value, dict):
        raise _bad(where, "must be a JSON object (as text)")
    return text or ""


_ITEM_FIELDS = {  # what each input item type may carry besides its type (and id, status)
    "message": {"role", "content", "phase"},
    "function_call": {"call_id", "name", "arguments"},
    "function_call_output": {"call_id", "output"},
    "reasoning": {"content", "summary", "encrypted_content"},
}
_ITEM_DEFAULTS = InputItem()


def _check_item(i: int, item: InputItem) -> None:
    where = f"input[{i}]"
    allowed = _ITEM_FIELDS.get(item.type)
    if allowed is None:
        raise refuse(f"{where}.type", f"input items of type {item.type!r} are not served (served: message, "
                     "function_call, function_call_output, reasoning)")
    for name in ("role", "content", "phase", "call_id", "name", "arguments", "output", "summary",
                 "encrypted_content"):
        if name not in allowed and getattr(item, name) != getattr(_ITEM_DEFAULTS, name):
            raise _bad(f"{where}.{name}", f"is not a field of {item.type} items")
    needed = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
              "function_call_output": ("call_id", "output"), "reasoning": ()}[item.type]
    for name in needed:
        if getattr(item, name) is None:
            raise _bad(f"{where}.{name}", f"{item.type} items need it")


class _Messages:
    """Builds the chat history of ``input``: calls in a row join one assistant turn (after its text, if the turn
    began with a message), and a reasoning item's text goes to the assistant turn that follows it; one that no
    assistant message or call follows (an answer the budget cut while it reasoned, sent back as history) is an
    assistant turn of reasoning alone."""

    def __init__(self) -> None:
        self.out: list[ChatMessage] = []
        self.reasoning: tuple[int, str] | None = None  # (item index, text) waiting for its assistant turn
        self.names: dict[str, str] = {}  # call_id -> function name: a template may name a tool result's function

    def take_reasoning(self) -> str | None:
        held, self.reasoning = self.reasoning, None
        return None if held is None else held[1]

    def add(self, i: int, item: InputItem) -> None:
        where = f"input[{i}]"
        if self.reasoning is not None and not (item.type == "function_call" or item.role == "assistant"):
            self.reasoning_alone()
        if item.type == "message":
            text = _text(item.content, f"{where}.content")
            reasoning = self.take_reasoning() if item.role == "assistant" else None
            assert item.role is not None  # _check_item
            self.out.append(ChatMessage(role=item.role, content=text, reasoning_content=reasoning))
        elif item.type == "function_call":
            args = _arguments(item.arguments, f"{where}.arguments")
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": args}}
            self.names[item.call_id or ""] = item.name or ""
            last = self.out[-1] if self.out else None
            if last is not None and last.role == "assistant" and self.reasoning is None:
                last.tool_calls = [*(last.tool_calls or []), call]  # the turn's text, then its calls
            else:
                self.out.append(ChatMessage(role="assistant", content="", tool_calls=[call],
                                            reasoning_content=self.take_reasoning()))
        elif item.type == "function_call_output":
            text = _text(item.output, f"{where}.output")
            self.out.append(ChatMessage(role="tool", content=text, tool_call_id=item.call_id,
                                        name=self.names.get(item.call_id or "")))
        else:  # reasoning
            if item.encrypted_content is not None:
                raise refuse(f"{where}.encrypted_content", "encrypted reasoning is not produced here, so cannot be "
                             "read")
            if item.summary:
                raise refuse(f"{where}.summary", "reasoning summaries are not produced here, so cannot be rendered "
                             "as the model's reasoning (send its reasoning_text content instead)")
            parts = [p for p in item.content or [] if isinstance(p, ReasoningText)]
            if isinstance(item.content, str) or len(parts) != len(item.content or []):
                raise _bad(f"{where}.content", "must be a list of reasoning_text parts")
            self.reasoning = (i, "".join(p.text for p in parts))

    def reasoning_alone(self) -> None:
        self.out.append(ChatMessage(role="assistant", content="", reasoning_content=self.take_reasoning()))

    def done(self) -> list[ChatMessage]:
        if self.reasoning is not None:
            self.reasoning_alone()
        return self.out


def chat_messages(req: ResponsesRequest) -> list[ChatMessage]:
    """``instructions`` (a system message, first) and ``input`` as chat messages."""
    head = [ChatMessage(role="system", content=req.instructions)] if req.instructions is not None else []
    if isinstance(req.input, str):
        return [*head, ChatMessage(role="user", content=req.input)]
    if not req.input:
        raise _bad("input", "must be a string or a list of at least one item")
    built = _Messages()
    for i, item in enumerate(req.input):
        _check_item(i, item)
        built.add(i, item)
    return [*head, *built.done()]


def chat_tools(raw: list | None) -> list | None:
    """Responses' flat function tools as chat's ``{"type": "function", "function": {...}}``; any other tool type
    (web_search, file_search, mcp, ...) is a 400 naming ``tools[i].type``."""
    if raw is None:
        return None
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise _bad(f"tools[{i}]", 'must be a function tool {"type": "function", "name": ..., "parameters": ...}')
        if tool.get("type") != "function":
            raise refuse(f"tools[{i}].type", f"tools of type {tool.get('type')!r} are not served (only function "
                         "tools: the server runs no built-in tool)")
        unknown = sorted(set(tool) - TOOL_FIELDS)
        if unknown:
            raise _bad(f"tools[{i}].{unknown[0]}", "unknown field")
        fn = {k: v for k, v in tool.items() if k != "type" and not (k in ("parameters", "description") and v is None)}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(raw: Any) -> Any:
    """``auto`` / ``none`` / ``required`` as they are; ``{"type": "function", "name": N}`` as chat's named form."""
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function" and set(raw) <= {"type", "name"}:
        if not isinstance(raw.get("name"), str):
            raise _bad("tool_choice.name", "a function tool_choice names its function")
        return {"type": "function", "function": {"name": raw["name"]}}
    raise _bad("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "name": ...} (the '
               "server runs no built-in tool)")


def text_format(raw: dict | None) -> dict | None:
    """``text.format`` as chat's ``response_format``: ``text``, ``json_object``, or ``json_schema`` whose name,
    schema, description and strict sit in the format itself."""
    if raw is None:
        return None
    kind = raw.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise _bad("text.format.type", 'must be "text", "json_object" or "json_schema"')
    if kind == "json_schema":
        for member in ("name", "schema"):  # OpenAI's json_schema format needs both
            if member not in raw:
                raise _bad(f"text.format.{member}", "a json_schema format needs it")
        spec = {k: v for k, v in raw.items() if k != "type"}
        return {"type": "json_schema", "json_schema": spec}
    return raw


def check_include(req: ResponsesRequest) -> bool:
    """Whether the answer's log-probs are asked for (``include`` of ``message.output_text.logprobs``)."""
    include = req.include or []
    for i, value in enumerate(include):
        if value != LOGPROBS:
            raise refuse(f"include[{i}]", f"{value!r} is not served (only {LOGPROBS!r}: no built-in tool runs, "
                         "and no reasoning is encrypted)")
    asked = LOGPROBS in include
    if req.top_logprobs and not asked:
        raise _bad("top_logprobs", f"needs include [{LOGPROBS!r}] (the log-probs are returned only when asked)")
    return asked


def check_options(req: ResponsesRequest) -> None:
    """400s for the members of ``reasoning`` and ``text`` that are not served."""
    r = req.reasoning
    if r is not None and r.effort is not None:
        raise refuse("reasoning.effort", "no served chat template takes a reasoning effort (as chat's "
                     "reasoning_effort)")
    if r is not None and (r.summary is not None or r.generate_summary is not None):
        param = "reasoning.summary" if r.summary is not None else "reasoning.generate_summary"
        raise refuse(param, "reasoning summaries are not produced (with --reasoning-parser the reasoning text "
                     "itself is returned)")
    if req.text is not None and req.text.verbosity is not None:
        raise refuse("text.verbosity", "verbosity is not supported")


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that asks for the same output as ``req`` (its checks are the chat path's)."""
    check_options(req)
    logprobs = check_include(req)
    return ChatCompletionRequest(
        model=req.model, messages=chat_messages(req), max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, stream=req.stream, stop=req.stop, seed=req.seed,
        user=req.user, top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
        request_id=req.request_id, cache_salt=req.cache_salt, logprobs=logprobs,
        top_logprobs=req.top_logprobs if logprobs else None, tools=chat_tools(req.tools),
        tool_choice=chat_tool_choice(req.tool_choice), parallel_tool_calls=req.parallel_tool_calls,
        response_format=text_format(req.text.format if req.text is not None else None),
        metadata=req.metadata, safety_identifier=req.safety_identifier, prompt_cache_key=req.prompt_cache_key)


# chat field (as a 400 names it) -> the Responses field that asked for it
_RENAMES = [
    (re.compile(r"^response_format\.json_schema\b"), "text.format"),
    (re.compile(r"^response_format\b"), "text.format"),
    (re.compile(r"^max_completion_tokens\b"), "max_output_tokens"),
    (re.compile(r"^logprobs\b"), "include"),
    (re.compile(r"^messages\b.*"), "input"),  # the chat messages are not input's items one for one
    (re.compile(r"^(tools\[\d+\])\.function\b"), r"\1"),
]


def api_name(param: str) -> str:
    """A chat request's field as the Responses request names it."""
    for pattern, name in _RENAMES:
        renamed = pattern.sub(name, param, count=1)
        if renamed != param:
            return renamed
    return param


@contextlib.contextmanager
def api_names() -> Iterator[None]:
    """A 400 of the chat path, its ``param`` (and the message's leading mention of it) renamed to the field of
    the Responses request that asked for it."""
    try:
        yield
    except APIError as exc:
        if exc.param is None or api_name(exc.param) == exc.param:
            raise
        new = api_name(exc.param)
        # a message that begins by naming the field ("response_format.json_schema.x: ...") names the asked one
        lead = exc.param + ":"
        message = new + exc.message[len(exc.param):] if exc.message.startswith(lead) else exc.message
        raise APIError(exc.status, message, param=new, code=exc.code, retry_after_s=exc.retry_after_s,
                       close=exc.close) from None


# ---- the answer --------------------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_of(total: dict) -> dict:
    """Chat's usage in the Responses API's names. Reasoning tokens are not counted apart (0): the reasoning is
    split from the content by its text, not by its tokens; no cache write is counted either (0)."""
    cached = (total.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": total["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": total["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": total["total_tokens"]}


def message_item(text: str, logprobs: list[dict] | None, status: str = "completed", item_id: str = "") -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {"type": "message", "id": item_id or _id("msg"), "status": status, "role": "assistant",
            "content": [part]}


def reasoning_item(text: str, status: str = "completed", item_id: str = "") -> dict:
    return {"type": "reasoning", "id": item_id or _id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None, "status": status}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed", item_id: str = "") -> dict:
    return {"type": "function_call", "id": item_id or _id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(choice: dict) -> list[dict]:
    """A chat choice as output items: its reasoning, its text (with the log-probs of every output token, the
    reasoning's included, as chat's), its calls. The last item is ``incomplete`` when the output budget ended
    the answer."""
    message = choice["message"]
    items = []
    if message.get("reasoning"):
        items.append(reasoning_item(message["reasoning"]))
    logprobs = (choice.get("logprobs") or {}).get("content")
    calls = message.get("tool_calls") or []
    if message.get("content") or logprobs or not (items or calls):
        items.append(message_item(message.get("content") or "", logprobs))
    items += [call_item(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
    if choice["finish_reason"] == "length" and items[-1]["type"] != "function_call":
        items[-1]["status"] = "incomplete"
    return items


@dataclasses.dataclass(frozen=True, slots=True)
class Reply:
    """What every response object of one request shares: its id, its start, the model and the request's fields
    that OpenAI echoes back."""

    id: str
    created_at: int
    model: str
    echo: dict

    @classmethod
    def of(cls, req: ResponsesRequest, model: str, request_id: str | None) -> Reply:
        tools = [dict(t) for t in req.tools or []]
        default_choice = "auto" if tools else "none"
        echo = {
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p, "tools": tools,
            "tool_choice": default_choice if req.tool_choice is None else req.tool_choice,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": {"format": (req.text.format if req.text is not None else None) or {"type": "text"}},
            "truncation": req.truncation or "disabled", "metadata": req.metadata or {},
            "top_logprobs": req.top_logprobs, "user": req.user, "service_tier": req.service_tier or "default",
            "reasoning": None, "previous_response_id": None, "store": False, "background": False,
        }
        return cls(f"resp_{request_id or uuid.uuid4().hex}", int(time.time()), model, echo)

    def response(self, status: str, output: list[dict], usage: dict | None, error: dict | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": error, "incomplete_details": incomplete, "model": self.model, "output": output,
                **self.echo, "usage": usage}

    def finished(self, output: list[dict], finish: str | None, usage: dict) -> dict:
        """The last response object: ``incomplete`` when the output budget ended the answer, ``failed`` when the
        engine cancelled it (chat's ``abort``: an engine that shuts down ends what it still runs), else
        ``completed``."""
        if finish == "abort":
            error = {"code": "server_error", "message": "the engine cancelled the request before it finished (the "
                     "engine is shutting down); send it again"}
            return self.response("failed", output, usage, error=error)
        return self.response("incomplete" if finish == "length" else "completed", output, usage)

    async def whole(self, gen: Generation, shape: Shape, codec: TokenNames, usage: Usage) -> web.Response:
        choice = await collect_choice(gen, shape, codec)
        body = self.finished(output_items(choice), choice["finish_reason"], usage_of(usage.total()))
        return web.Response(body=msgspec.json.encode(body), content_type="application/json")

    async def stream(self, request: web.Request, gen: Generation, shape: Shape, codec: TokenNames,
                     usage: Usage) -> web.StreamResponse:
        resp = await sse.open_stream(request)
        events = EventWriter(self, lambda kind, obj: resp.write(sse.named_event(kind, obj)),
                             trim=gen.plan.tool_format is not None)
        try:
            await events.start()
            try:
                await stream_choices([gen], shape, codec, fmt.Envelope(self.id, self.created_at, self.model), usage,
                                     events.chunk)
                await events.finish(usage_of(usage.total()))
            except APIError as exc:
                await events.failed(exc)
            await resp.write_eof()
        except ConnectionResetError:  # a client that has just closed (before aiohttp cancelled this handler)
            request[CLIENT_GONE] = True
        return resp


def _error_code(exc: APIError) -> str:
    """An engine error as the Responses API's ``error.code`` (a closed list)."""
    if exc.status == 429:
        return "rate_limit_exceeded"
    return "invalid_prompt" if exc.status == 400 else "server_error"


class EventWriter:
    """The chat stream's chunks of one choice in, the Responses API's events out, each with its
    ``sequence_number``; the items are opened as their first piece comes and closed when another begins."""

    def __init__(self, reply: Reply, write: Callable[[str, dict], Awaitable[Any]], trim: bool = False) -> None:
        self.reply, self.write = reply, write
        # an answer read as tool calls: its text without the white space around it, as the whole answer's
        # (tools.parse_all); what may end it is held until more text follows
        self.trim, self.space = trim, ""
        self.seq = 0
        self.output: list[dict] = []     # the items closed, in order
        self.open: dict | None = None    # the item being written
        self.text = ""                   # its text so far (a message's or a reasoning's)
        self.logprobs: list[dict] = []   # a message's log-prob entries so far
        self.held: list[dict] = []       # entries of tokens not in the text (reasoning), for the next message
        self.finish_reason: str | None = None

    async def emit(self, kind: str, **fields: Any) -> None:
        await self.write(kind, {"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1

    async def start(self) -> None:
        head = self.reply.response("in_progress", [], None)
        await self.emit("response.created", response=head)
        await self.emit("response.in_progress", response=head)

    def _where(self) -> dict:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output)}

    async def _open_with_part(self, item: dict) -> None:
        """Open a message or reasoning item: added with no content, then its one part, empty."""
        part, item["content"] = item["content"][0], []
        await self._open(item, part)

    async def _open(self, item: dict, part: dict | None) -> None:
        await self.close()
        self.open, self.text, self.logprobs = item, "", []
        await self.emit("response.output_item.added", output_index=len(self.output), item=item)
        if part is not None:
            await self.emit("response.content_part.added", **self._where(), content_index=0, part=part)

    async def close(self, last: bool = False) -> None:
        """Close the open item (``last``: the answer's last, ``incomplete`` when the budget ended it)."""
        item = self.open
        if item is None:
            return
        status = "incomplete" if last and self.finish_reason == "length" else "completed"
        where = self._where()
        if item["type"] == "message":
            done = message_item(self.text, self.logprobs, status, item["id"])
            await self.emit("response.output_text.done", **where, content_index=0, text=self.text,
                            logprobs=self.logprobs)
            await self.emit("response.content_part.done", **where, content_index=0, part=done["content"][0])
        elif item["type"] == "reasoning":
            done = reasoning_item(self.text, status, item["id"])
            await self.emit("response.reasoning_text.done", **where, content_index=0, text=self.text)
            await self.emit("response.content_part.done", **where, content_index=0, part=done["content"][0])
        else:
            done = {**item, "status": "completed"}
        await self.emit("response.output_item.done", output_index=len(self.output), item=done)
        self.output.append(done)
        self.open, self.space = None, ""

    async def _reasoning(self, text: str) -> None:
        if self.open is None or self.open["type"] != "reasoning":
            await self._open_with_part(reasoning_item("", "in_progress"))
        self.text += text
        await self.emit("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)

    async def _message(self, text: str, logprobs: list[dict]) -> None:
        opened = self.open is not None and self.open["type"] == "message"
        if self.trim:
            text = self.space + text if opened else text.lstrip()
            kept = text.rstrip()
            text, self.space = kept, text[len(kept):]
            if not text and not logprobs and not self.held:
                return
        if not opened:
            await self._open_with_part(message_item("", [], "in_progress"))
        logprobs, self.held = self.held + logprobs, []
        self.text += text
        self.logprobs += logprobs
        await self.emit("response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=logprobs)

    async def _call(self, call: dict) -> None:
        fn = call.get("function", {})
        if "id" in call:  # a call's head: its id and name; its arguments follow
            await self._open(call_item(call["id"], fn["name"], "", "in_progress", _id("fc")), None)
            return
        assert self.open is not None and self.open["type"] == "function_call"
        self.open["arguments"] = fn["arguments"]
        await self.emit("response.function_call_arguments.delta", **self._where(), delta=fn["arguments"])
        await self.emit("response.function_call_arguments.done", **self._where(), arguments=fn["arguments"])
        await self.close()

    async def chunk(self, chunk: dict) -> None:
        """One chat chunk: reasoning, then text (or log-probs alone), then calls, then the finish."""
        choice = chunk["choices"][0]
        delta = choice["delta"]
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        if delta.get("reasoning"):
            await self._reasoning(delta["reasoning"])
        if delta.get("content"):
            await self._message(delta["content"], logprobs)
        else:
            self.held += logprobs
        for call in delta.get("tool_calls") or []:
            await self._call(call)
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]

    async def finish(self, usage: dict) -> None:
        if not (self.output or self.open):  # an answer of no text still has its message, as the whole answer's
            await self._open_with_part(message_item("", [], "in_progress"))
        if self.held:  # log-probs of tokens with no text (a stop's, the reasoning's): on the message's last delta
            await self._message("", [])
        await self.close(last=True)
        body = self.reply.finished(self.output, self.finish_reason, usage)
        await self.emit(f"response.{body['status']}", response=body)

    async def failed(self, exc: APIError) -> None:
        """The engine failed the request mid-answer: ``response.failed`` with the error, the items so far."""
        error = {"code": _error_code(exc), "message": exc.message}
        await self.emit("response.failed", response=self.reply.response("failed", self.output, None, error=error))
