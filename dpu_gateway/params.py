"""From a validated OpenAI request to what the ring needs: sampling fields and token limits.

Checks that msgspec types cannot express live here and raise 400 ``APIError`` naming the
parameter: n != 1, too many or too long stop strings, a prompt beyond the model's context.
"""

from __future__ import annotations

import dataclasses

from dpu_gateway.errors import APIError
from dpu_gateway.protocol import ChatCompletionRequest, CompletionRequest, _Common
from shared import messages as m

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256  # per stop string: the detokenizer holds back up to this much text


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """What the ring and the model allow one request (from the ring header)."""

    max_context: int
    max_prompt_tokens: int
    max_output_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """A request, ready to submit: its sampling record (what the tracker writes into the ring) and
    what only the gateway applies to the output (stop strings)."""

    sampling: m.Sampling
    stop: list[str]


def check_common(req: _Common) -> list[str]:
    """Shared checks; returns the stop strings."""
    if req.n != 1:
        raise APIError(400, f"n={req.n} is not supported: this server returns one choice (n=1)", param="n",
                       code="unsupported_value")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}", param="stop",
                       code="invalid_value")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise APIError(400, f"each stop string may be at most {MAX_STOP_CHARS} characters long", param="stop",
                       code="invalid_value")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise APIError(400, f"{name} is not supported (only 0)", param=name, code="unsupported_value")
    return [s for s in stop if s]


def max_new_tokens(requested: int | None, prompt_len: int, limits: Limits, param: str) -> int:
    """The output budget; 400 when the prompt (plus what was asked for) exceeds the context."""
    room = min(limits.max_context - prompt_len, limits.max_output_tokens)
    if prompt_len > limits.max_prompt_tokens or room < 1:
        raise APIError(
            400, f"This model's maximum context length is {limits.max_context} tokens (at most "
            f"{limits.max_prompt_tokens} in the prompt). However, your prompt has {prompt_len} tokens.",
            param="messages" if param == "max_completion_tokens" else "prompt", code="context_length_exceeded")
    if requested is None:
        return room
    if prompt_len + requested > limits.max_context or requested > limits.max_output_tokens:
        raise APIError(
            400, f"This model's maximum context length is {limits.max_context} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the completion); "
            f"at most {limits.max_output_tokens} output tokens per request.", param=param,
            code="context_length_exceeded")
    return requested


def top_k(requested: int | None) -> int:
    """0 (off) for None, -1 and any k no vocabulary reaches (the ring holds an int32)."""
    return requested if requested is not None and 0 < requested < 2**31 else 0


def sampling(req: _Common, budget: int, logprobs: bool, top: int) -> m.Sampling:
    """The request's sampling record, OpenAI's defaults filled in."""
    return m.Sampling(
        max_new_tokens=budget,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k(req.top_k), min_p=req.min_p or 0.0,
        seed=None if req.seed is None else req.seed & 0xFFFFFFFFFFFFFFFF,
        ignore_eos=req.ignore_eos, logprobs=logprobs, top_logprobs=top,
    )


def plan_chat(req: ChatCompletionRequest, prompt_len: int, limits: Limits) -> Plan:
    stop = check_common(req)
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs", code="invalid_value")
    if req.max_completion_tokens is not None and req.max_tokens is not None:
        max_new_tokens(req.max_tokens, prompt_len, limits, "max_tokens")  # the shadowed one is checked too
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    budget = max_new_tokens(asked, prompt_len, limits, param)
    return Plan(sampling(req, budget, req.logprobs, req.top_logprobs or 0), stop)


def plan_completion(req: CompletionRequest, prompt_len: int, limits: Limits) -> Plan:
    stop = check_common(req)
    if req.echo:
        raise APIError(400, "echo=true is not supported", param="echo", code="unsupported_value")
    if req.best_of not in (None, 1):
        raise APIError(400, f"best_of={req.best_of} is not supported (only 1)", param="best_of",
                       code="unsupported_value")
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix", code="unsupported_value")
    budget = max_new_tokens(req.max_tokens, prompt_len, limits, "max_tokens")
    if req.max_tokens is None:  # OpenAI's default of 16, within what the server allows
        budget = min(16, budget)
    return Plan(sampling(req, budget, req.logprobs is not None, req.logprobs or 0), stop)


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request (a list of several is refused)."""
    p = req.prompt
    if isinstance(p, str):
        return p
    if p and all(isinstance(x, int) for x in p):
        return [int(x) for x in p]  # type: ignore[arg-type]
    if len(p) == 1:
        only = p[0]
        if isinstance(only, str):
            return only
        if isinstance(only, list):
            return only
    raise APIError(400, "prompt must be one string or one list of token ids (batched prompts are not "
                   "supported)", param="prompt", code="invalid_value")
