"""Run one admitted request and answer it: a JSON body, or an SSE stream of chunks.

The chat and completions endpoints differ only in how a piece of output is wrapped, which
``Shape`` says. A client that disconnects cancels the handler (aiohttp handler
cancellation); closing the delta generator then cancels the slot.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from dpu_gateway import openai_format as fmt
from dpu_gateway import sse
from dpu_gateway.errors import APIError
from dpu_gateway.generation import Delta, Generation, TokenLogprob
from dpu_gateway.textio import TextCodec


@dataclasses.dataclass(frozen=True, slots=True)
class Shape:
    """How one endpoint wraps output."""

    prefix: str          # id prefix: chatcmpl / cmpl
    chunk_object: str    # "object" of stream chunks
    chat: bool

    def logprobs(self, codec: TextCodec, entries: list[TokenLogprob] | None, offset: int) -> dict | None:
        if entries is None:
            return None
        if self.chat:
            return fmt.chat_logprobs(codec, entries)
        return fmt.completion_logprobs(codec, entries, offset)

    def chunk(self, env: fmt.Envelope, text: str | None, finish: str | None, logprobs: dict | None,
              with_usage: bool) -> dict:
        if self.chat:
            delta = {} if text is None else {"content": text}
            return fmt.chat_chunk(env, delta, finish, logprobs, with_usage)
        return fmt.completion_chunk(env, text or "", finish, logprobs, with_usage)

    def whole(self, env: fmt.Envelope, text: str, finish: str | None, logprobs: dict | None, usage: dict) -> dict:
        if self.chat:
            return fmt.chat_response(env, text, finish, logprobs, usage)
        return fmt.completion_response(env, text, finish, logprobs, usage)


CHAT = Shape("chatcmpl", "chat.completion.chunk", chat=True)
COMPLETION = Shape("cmpl", "text_completion", chat=False)


def merge_logprobs(shape: Shape, parts: list[dict]) -> dict | None:
    if not parts:
        return None
    if shape.chat:
        return {"content": [c for p in parts for c in p["content"]]}
    return {k: [v for p in parts for v in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs",
                                                          "text_offset")}


async def answer_whole(gen: Generation, shape: Shape, codec: TextCodec, model: str) -> web.Response:
    env = fmt.Envelope.new(shape.prefix, model)
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
    body = shape.whole(env, "".join(texts), gen.finish_reason, logprobs, gen.usage)
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


async def answer_stream(request: web.Request, gen: Generation, shape: Shape, codec: TextCodec, model: str,
                        include_usage: bool) -> web.StreamResponse:
    env = fmt.Envelope.new(shape.prefix, model)
    resp = await sse.open_stream(request)

    async def write(obj: dict) -> None:
        await resp.write(sse.event(obj))

    if shape.chat:
        await write(fmt.chat_chunk(env, {"role": "assistant", "content": ""}, with_usage=include_usage))
    try:
        await _stream_deltas(gen, shape, codec, env, include_usage, write)
        await write(shape.chunk(env, None if shape.chat else "", gen.finish_reason, None, include_usage))
        if include_usage:
            await write(fmt.usage_chunk(env, shape.chunk_object, gen.usage))
    except APIError as exc:
        await write(exc.body())
    await resp.write(sse.DONE)
    await resp.write_eof()
    return resp


async def _stream_deltas(gen: Generation, shape: Shape, codec: TextCodec, env: fmt.Envelope,
                         include_usage: bool, write: Callable[[dict], Awaitable[None]]) -> None:
    offset = 0
    async with contextlib.aclosing(gen.deltas()) as deltas:
        async for delta in deltas:
            await write(_delta_chunk(shape, codec, env, delta, offset, include_usage))
            offset += len(delta.text)


def _delta_chunk(shape: Shape, codec: TextCodec, env: fmt.Envelope, delta: Delta, offset: int,
                 include_usage: bool) -> dict:
    return shape.chunk(env, delta.text, None, shape.logprobs(codec, delta.logprobs, offset), include_usage)
