"""The JSON objects of the OpenAI API: responses, stream chunks, logprobs, models.

Plain dicts in the key order OpenAI uses; ``msgspec.json`` encodes them compactly.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

from dpu_gateway.generation import PromptEntry, TokenLogprob
from dpu_gateway.textio import TokenNames


@dataclasses.dataclass(frozen=True, slots=True)
class Envelope:
    """What every object of one response shares."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, model: str, request_id: str | None = None) -> Envelope:
        """``request_id``: the client's (vLLM's ``request_id`` field or ``X-Request-Id``), else a random one."""
        return cls(f"{prefix}-{request_id or uuid.uuid4().hex}", int(time.time()), model)


def chat_logprobs(codec: TokenNames, entries: list[TokenLogprob]) -> dict:
    def one(token: int, logprob: float | None) -> dict:
        raw = codec.token_bytes(token)
        return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}

    return {"content": [
        {**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top or ()]} for e in entries
    ]}


def completion_logprobs(codec: TokenNames, entries: list[TokenLogprob], offset: int) -> dict:
    tokens = [codec.token_text(e.token) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [None if e.top is None else {codec.token_text(t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def prompt_logprobs(codec: TokenNames, entries: list[PromptEntry]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: null for the first prompt token, then per position its token and the top k,
    token id -> ``{logprob, rank, decoded_token}`` (the prompt's token first; the others ranked by position)."""
    def one(token: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": codec.token_text(token)}

    out: list[dict | None] = [None]
    for e in entries:
        step = {str(e.token): one(e.token, e.logprob, e.rank)}
        for r, (t, lp) in enumerate(e.top, 1):
            step.setdefault(str(t), one(t, lp, r))
        out.append(step)
    return out


StopReason = str | int | None  # vLLM's stop_reason: the stop string or stop token id that ended a choice


def chat_choice(index: int, text: str, finish: str | None, logprobs: dict | None,
                tool_calls: list[dict] | None = None, stop_reason: StopReason = None) -> dict:
    message: dict = {"role": "assistant", "content": text}
    if tool_calls:  # as OpenAI: content null when the answer is only calls
        message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish,
            "stop_reason": stop_reason}


def completion_choice(index: int, text: str, finish: str | None, logprobs: dict | None,
                      stop_reason: StopReason = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop_reason}


def chat_response(env: Envelope, choices: list[dict], usage: dict) -> dict:
    return {"id": env.id, "object": "chat.completion", "created": env.created, "model": env.model,
            "choices": choices, "usage": usage}


def completion_response(env: Envelope, choices: list[dict], usage: dict) -> dict:
    return {"id": env.id, "object": "text_completion", "created": env.created, "model": env.model,
            "choices": choices, "usage": usage}


def chat_chunk(env: Envelope, delta: dict, finish: str | None = None, logprobs: dict | None = None,
               with_usage: bool = False, index: int = 0, usage: dict | None = None,
               stop_reason: StopReason = None) -> dict:
    chunk = {
        "id": env.id, "object": "chat.completion.chunk", "created": env.created, "model": env.model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                     "stop_reason": stop_reason}],
    }
    if with_usage:
        chunk["usage"] = usage
    return chunk


def completion_chunk(env: Envelope, text: str, finish: str | None = None, logprobs: dict | None = None,
                     with_usage: bool = False, index: int = 0, usage: dict | None = None,
                     stop_reason: StopReason = None) -> dict:
    chunk = {
        "id": env.id, "object": "text_completion", "created": env.created, "model": env.model,
        "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                     "stop_reason": stop_reason}],
    }
    if with_usage:
        chunk["usage"] = usage
    return chunk


def usage_chunk(env: Envelope, obj: str, usage: dict) -> dict:
    return {"id": env.id, "object": obj, "created": env.created, "model": env.model, "choices": [],
            "usage": usage}


def model_card(model: str, created: int, max_context: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "blink", "root": model,
            "parent": None, "max_model_len": max_context}


def model_list(model: str, created: int, max_context: int) -> dict:
    return {"object": "list", "data": [model_card(model, created, max_context)]}
