"""Server-sent events exactly as OpenAI streams them: ``data: {json}\\n\\n`` ... ``data: [DONE]\\n\\n``; the
Responses API's events each with their type in an ``event:`` line, and no ``[DONE]``."""

from __future__ import annotations

import msgspec
from aiohttp import web

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


def event(obj: dict) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


def named_event(kind: str, obj: dict) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _encode(obj) + b"\n\n"


async def open_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={
        "Content-Type": "text/event-stream",
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",
    })
    await resp.prepare(request)
    return resp
