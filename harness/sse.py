"""Reading OpenAI-style responses: one SSE line at a time, and the request body the harness sends."""

from __future__ import annotations

import json
from typing import Any

from harness.serve_proc import MODEL


def parse_event(line: bytes) -> dict | str | None:
    """One SSE line: its JSON payload, ``"[DONE]"``, or None for blank lines and comments."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if data == b"[DONE]":
        return "[DONE]"
    return json.loads(data)


def request_body(prompt: list[int], max_tokens: int, stream: bool, model: str = MODEL) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "logprobs": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body
