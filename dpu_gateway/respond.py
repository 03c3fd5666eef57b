"""Run one admitted request and answer it: a JSON body, or an SSE stream of chunks.

The chat and completions endpoints differ only in how a piece of output is wrapped, which
``Shape`` says. A client that disconnects cancels the handler (aiohttp handler
cancellation); closing the delta generator then cancels the slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from dpu_gateway import openai_format as fmt
from dpu_gateway import sse
from dpu_gateway.errors import APIError
from dpu_gateway.generation import Generation, TokenLogprob
from dpu_gateway.reasoning import Reasoning
from dpu_gateway.state import CLIENT_GONE
from dpu_gateway.textio import TokenNames
from dpu_gateway.tools import Call, parse_all


@dataclasses.dataclass(frozen=True, slots=True)
class Shape:
    """How one endpoint wraps output."""

    prefix: str          # id prefix: chatcmpl / cmpl
    chunk_object: str    # "object" of stream chunks
    chat: bool
    reasoning: Reasoning | None = None  # chat with --reasoning-parser: the request's (routes.chat_reasoning)

    def logprobs(self, codec: TokenNames, entries: list[TokenLogprob] | None, offset: int) -> dict | None:
        if entries is None:
            return None
        if self.chat:
            return fmt.chat_logprobs(codec, entries)
        return fmt.completion_logprobs(codec, entries, offset)

    def chunk(self, env: fmt.Envelope, index: int, text: str | None, finish: str | None, logprobs: dict | None,
              usage: Usage, stop_reason: fmt.StopReason = None) -> dict:
        if self.chat:
            delta = {} if text is None else {"content": text}
            return fmt.chat_chunk(env, delta, finish, logprobs, usage.include, index, usage.now(), stop_reason)
        return fmt.completion_chunk(env, text or "", finish, logprobs, usage.include, index, usage.now(), stop_reason)

    def choice(self, index: int, text: str, finish: str | None, logprobs: dict | None,
               stop_reason: fmt.StopReason = None) -> dict:
        if self.chat:
            return fmt.chat_choice(index, text, finish, logprobs, stop_reason=stop_reason)
        return fmt.completion_choice(index, text, finish, logprobs, stop_reason)

    def whole(self, env: fmt.Envelope, choices: list[dict], usage: dict) -> dict:
        return (fmt.chat_response if self.chat else fmt.completion_response)(env, choices, usage)


CHAT = Shape("chatcmpl", "chat.completion.chunk", chat=True)
COMPLETION = Shape("cmpl", "text_completion", chat=False)


@dataclasses.dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one response: every prompt once, every choice's output."""

    gens: list[Generation]
    prompt_tokens: int
    include: bool = False      # stream_options.include_usage
    continuous: bool = False   # stream_options.continuous_usage_stats: usage in every chunk

    def total(self) -> dict:
        done = sum(g.completion_tokens for g in self.gens)
        cached = sum(g.cached_tokens for g in self.gens if g.prompt_tokens)  # each prompt's first choice
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done, "prompt_tokens_details": {"cached_tokens": cached}}

    def now(self) -> dict | None:
        return self.total() if self.include and self.continuous else None


class StreamIds:
    """vLLM's ``return_token_ids`` in a stream: each chunk of a choice carries the token ids that came since its
    previous chunk (``token_ids``; together, the choice's ``token_ids`` of a whole answer), and a completion
    choice's first chunk its prompt's (``prompt_token_ids``; a chat stream's first chunk has them once)."""

    def __init__(self, gen: Generation, shape: Shape) -> None:
        self.gen, self.sent = gen, 0
        self.on = gen.plan.return_token_ids
        self.prompt = None if shape.chat else gen.prompt

    def tag(self, chunk: dict) -> dict:
        if self.on:
            choice = chunk["choices"][0]
            choice["token_ids"] = self.gen.token_ids[self.sent:]
            self.sent = len(self.gen.token_ids)
            if self.prompt is not None:
                choice["prompt_token_ids"], self.prompt = self.prompt, None
        return chunk


def merge_logprobs(shape: Shape, parts: list[dict]) -> dict | None:
    if not parts:
        return None
    if shape.chat:
        return {"content": [c for p in parts for c in p["content"]]}
    return {k: [v for p in parts for v in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs",
                                                          "text_offset")}


async def collect_choice(gen: Generation, shape: Shape, codec: TokenNames) -> dict:
    texts: list[str] = []
    lps: list[dict] = []
    offset = 0
    async with contextlib.aclosing(gen.deltas()) as deltas:
        async for delta in deltas:
            part = shape.logprobs(codec, delta.logprobs, offset)
            if part is not None:
                lps.append(part)
            texts.append(delta.text)
            offset += len(delta.text)
    logprobs = merge_logprobs(shape, lps) if gen.plan.sampling.logprobs else None
    fmt_ = gen.plan.tool_format
    text, thought = "".join(texts), ""
    if shape.reasoning is not None:  # the tool parser reads the content only
        thought, text = shape.reasoning.split(text, gen.plan.echo)
    if fmt_ is None:
        choice = shape.choice(gen.index, text, gen.finish_reason, logprobs, gen.stop_reason)
        if gen.plan.prompt_logprobs >= 0 and not shape.chat:  # chat's are the response's (one prompt)
            choice["prompt_logprobs"] = await asked_prompt_logprobs(gen, codec)
    else:
        content, calls = parse_all(fmt_, text)
        cut = cut_call(gen, content)
        if cut is not None:
            content, calls = "", [*calls, cut]
        calls = calls if gen.plan.parallel_tool_calls else calls[:1]
        choice = fmt.chat_choice(gen.index, content, tool_finish(gen, bool(calls)), logprobs,
                                 [c.openai() for c in calls], gen.stop_reason)
    if shape.reasoning is not None:
        message = choice["message"]
        message["content"] = message["content"] or None  # vLLM: null when nothing follows the reasoning
        message.update(shape.reasoning.message_fields(thought))
    if gen.plan.return_token_ids:  # vLLM's: the answer's ids, and a completion choice's prompt's
        choice["token_ids"] = gen.token_ids
        if not shape.chat:
            choice["prompt_token_ids"] = gen.prompt
    return choice


async def asked_prompt_logprobs(gen: Generation, codec: TokenNames) -> list[dict | None] | None:
    """The ``prompt_logprobs`` field of a choice that asked, with the alternatives it asked for."""
    entries = await gen.asked_prompt_entries()
    if entries is None:
        return None
    k = gen.plan.prompt_logprobs
    return fmt.prompt_logprobs(codec, [dataclasses.replace(e, top=e.top[:k]) for e in entries])


def cut_call(gen: Generation, unread: str) -> Call | None:
    """A forced call the token limit cut short (``length``), from the text the tool parser left unread: a call with
    the arguments written so far, as OpenAI answers one; None otherwise (the text stays content)."""
    fmt_ = gen.plan.tool_format
    if fmt_ is None or not gen.plan.forced_tools or gen.finish_reason != "length" or not unread.strip():
        return None
    return fmt_.partial_call(unread, gen.plan.forced_tools)


def tool_finish(gen: Generation, called: bool) -> str | None:
    """``tool_calls`` when the answer ended on its own after calls; ``length`` and the rest unchanged."""
    return "tool_calls" if called and gen.finish_reason == "stop" else gen.finish_reason


async def answer_whole(gens: list[Generation], shape: Shape, codec: TokenNames, model: str,
                       usage: Usage, request_id: str | None = None) -> web.Response:
    env = fmt.Envelope.new(shape.prefix, model, request_id)
    tasks = [asyncio.create_task(collect_choice(g, shape, codec)) for g in gens]
    try:  # a choice that fails (its engine error) must not leave its siblings waiting on forgotten streams
        choices = await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    body = shape.whole(env, list(choices), usage.total())
    if shape.chat and gens and gens[0].plan.prompt_logprobs >= 0:  # vLLM: one list for the one prompt
        body["prompt_logprobs"] = await asked_prompt_logprobs(gens[0], codec)
    if shape.chat and gens and gens[0].plan.return_token_ids:
        body["prompt_token_ids"] = gens[0].prompt
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


async def answer_stream(request: web.Request, gens: list[Generation], shape: Shape, codec: TokenNames, model: str,
                        usage: Usage, request_id: str | None = None) -> web.StreamResponse:
    env = fmt.Envelope.new(shape.prefix, model, request_id)
    resp = await sse.open_stream(request)

    async def write(obj: dict) -> None:
        await resp.write(sse.event(obj))

    try:
        try:
            if shape.chat:
                for g in gens:
                    first = fmt.chat_chunk(env, {"role": "assistant", "content": ""}, None, None, usage.include,
                                           g.index, usage.now())
                    if g.plan.return_token_ids and g is gens[0]:  # vLLM: the one prompt's ids in the first chunk
                        first["prompt_token_ids"] = g.prompt
                    await write(first)
            await stream_choices(gens, shape, codec, env, usage, write)
            if usage.include:
                await write(fmt.usage_chunk(env, shape.chunk_object, usage.total()))
        except APIError as exc:
            await write(exc.body())
        await resp.write(sse.DONE)
        await resp.write_eof()
    except ConnectionResetError:  # a write to a client that has just closed (before aiohttp cancelled this handler)
        request[CLIENT_GONE] = True  # the log middleware counts a 499, as for a disconnect that cancels
    return resp


async def stream_choices(gens: list[Generation], shape: Shape, codec: TokenNames, env: fmt.Envelope, usage: Usage,
                         write: Callable[[dict], Awaitable[None]]) -> None:
    """Every choice's chunks as they come (one writer: chunks never interleave on the wire)."""
    lock = asyncio.Lock()

    async def one(gen: Generation) -> None:
        ids = StreamIds(gen, shape)
        if gen.plan.tool_format is not None:
            return await _stream_calls(gen, env, usage, lock, write, ids, shape.reasoning)
        reader = shape.reasoning.reader(gen.plan.echo) if shape.reasoning is not None else None
        offset = 0
        async with contextlib.aclosing(gen.deltas()) as deltas:
            async for delta in deltas:
                logprobs = shape.logprobs(codec, delta.logprobs, offset)
                if reader is None:
                    chunk: dict | None = shape.chunk(env, gen.index, delta.text, None, logprobs, usage)
                else:
                    chunk = _reasoning_chunk(shape, env, gen.index, reader.feed(delta.text), logprobs, usage)
                if chunk is not None:
                    async with lock:
                        await write(ids.tag(chunk))
                offset += len(delta.text)
        held = None if reader is None else _reasoning_chunk(shape, env, gen.index, reader.finish(), None, usage)
        async with lock:
            if held is not None:
                await write(ids.tag(held))
            await write(ids.tag(shape.chunk(env, gen.index, None if shape.chat else "", gen.finish_reason, None,
                                            usage, gen.stop_reason)))

    tasks = [asyncio.create_task(one(g)) for g in gens]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _reasoning_chunk(shape: Shape, env: fmt.Envelope, index: int, pieces: tuple[str, str], logprobs: dict | None,
                     usage: Usage) -> dict | None:
    """A chat chunk of the reasoning and content decided by a delta (None when it decided none and has no
    log-probs: the text is held back until a tag is known)."""
    assert shape.reasoning is not None
    delta = shape.reasoning.delta(*pieces)
    if not delta and logprobs is None:
        return None
    return fmt.chat_chunk(env, delta, None, logprobs, usage.include, index, usage.now())


async def _stream_calls(gen: Generation, env: fmt.Envelope, usage: Usage, lock: asyncio.Lock,
                        write: Callable[[dict], Awaitable[None]], ids: StreamIds,
                        reasoning: Reasoning | None = None) -> None:
    """One choice read as tool calls: content deltas as they are decided, each call as OpenAI streams one
    (a delta with its id, type and name, then one with its arguments), then the finish. With ``reasoning``
    (``--reasoning-parser``) the reasoning streams as it comes and the tool parser reads the content only."""
    assert gen.plan.tool_format is not None
    parser, calls = gen.plan.tool_format.parser(), 0

    async def send(events: list[str | Call]) -> None:
        nonlocal calls
        for e in events:
            deltas: list[dict] = []
            if isinstance(e, str):
                deltas = [{"content": e}] if e else []
            elif gen.plan.parallel_tool_calls or calls == 0:
                head = {"index": calls, "id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}}
                args = {"index": calls, "function": {"arguments": e.arguments}}
                deltas = [{"tool_calls": [head]}, {"tool_calls": [args]}]
                calls += 1
            for d in deltas:
                async with lock:
                    await write(ids.tag(fmt.chat_chunk(env, d, None, None, usage.include, gen.index, usage.now())))

    async def read(pieces: tuple[str, str]) -> None:
        thought, content = pieces
        if thought and reasoning is not None and reasoning.include:
            async with lock:
                await write(ids.tag(fmt.chat_chunk(env, reasoning.delta(thought, ""), None, None, usage.include,
                                                   gen.index, usage.now())))
        await send(parser.feed(content))

    reader = None if reasoning is None else reasoning.reader(gen.plan.echo)
    async with contextlib.aclosing(gen.deltas()) as deltas:
        async for delta in deltas:
            if reader is None:
                await send(parser.feed(delta.text))
            else:
                await read(reader.feed(delta.text))
    if reader is not None:
        await read(reader.finish())
    await send([(cut_call(gen, e) or e) if isinstance(e, str) else e for e in parser.finish()])
    async with lock:
        await write(ids.tag(fmt.chat_chunk(env, {}, tool_finish(gen, calls > 0), None, usage.include, gen.index,
                                           usage.now(), gen.stop_reason)))
