"""The context limits are vLLM's: with no flags, what ``/v1/models`` reports as ``max_model_len`` is the engine's
context, and a prompt may have all of it but one token (room for one output token); one more token is refused
with vLLM's 400 wording. Here at the planning layer, with the limits the gateway builds from the ring the real
config makes (``blink serve`` with no flags, the embedded model); tests/test_long_prompt_serve.py sends such a
prompt through the gateway and the CPU engine."""

from __future__ import annotations

import re

import msgspec
import pytest

from blink.cli import build_parser
from dpu_gateway.errors import APIError
from dpu_gateway.params import Limits, plan_chat, plan_completion
from dpu_gateway.protocol import ChatCompletionRequest, CompletionRequest
from dpu_gateway.state import limits_of
from gpu_engine.models.loader import default_model_path
from shared.config import EngineConfig
from shared.model_context import model_context
from shared.ring import DEFAULT_MAX_MODEL_LEN

# vLLM's message for a prompt the context cannot take (clients match it)
VLLM_TOO_LONG = re.compile(r"This model's maximum context length is (\d+) tokens\. However, your request has (\d+) "
                           r"input tokens\. Please reduce the length of the input messages\.")


def served(*argv: str) -> tuple[EngineConfig, int, Limits]:
    """The engine config of ``blink serve ARGV``, the context its engine reports for the embedded model (the
    ring header's ``max_context``, /v1/models' ``max_model_len``), and the gateway's limits of that ring."""
    cfg = EngineConfig.from_namespace(build_parser().parse_args(["serve", *argv]))
    context = model_context(default_model_path())
    assert context is not None
    max_context = cfg.context_limit(context)
    return cfg, max_context, limits_of(cfg.geometry, max_context)


def completion(n: int, **fields: object) -> CompletionRequest:
    return msgspec.convert({"model": "m", "prompt": [7] * n, **fields}, CompletionRequest)


def chat(**fields: object) -> ChatCompletionRequest:
    return msgspec.convert({"model": "m", "messages": [{"role": "user", "content": "x"}], **fields},
                           ChatCompletionRequest)


def test_with_no_flags_a_prompt_may_fill_the_context_but_one_token() -> None:
    cfg, max_context, limits = served()
    assert max_context == DEFAULT_MAX_MODEL_LEN == 6144  # the embedded model's own context is 8,192
    assert cfg.geometry.max_prompt_tokens == limits.max_prompt_tokens == max_context - 1
    longest = max_context - 1
    assert plan_completion(completion(longest), longest, limits).sampling.max_new_tokens == 1
    assert plan_completion(completion(longest, max_tokens=1), longest, limits).sampling.max_new_tokens == 1
    assert plan_chat(chat(), longest, limits).sampling.max_new_tokens == 1
    for plan, request in ((plan_completion, completion(max_context)), (plan_chat, chat())):
        with pytest.raises(APIError) as refused:
            plan(request, max_context, limits)  # type: ignore[operator]
        err = refused.value
        assert (err.status, err.code) == (400, "context_length_exceeded")
        assert err.param in ("prompt", "messages")
        match = VLLM_TOO_LONG.fullmatch(err.message)
        assert match is not None, err.message
        assert match.groups() == (str(max_context), str(max_context))


def test_a_short_prompt_still_gets_the_whole_output_slot() -> None:
    _, max_context, limits = served()
    assert plan_chat(chat(), 10, limits).sampling.max_new_tokens == limits.max_output_tokens == 2048
    with pytest.raises(APIError, match="'max_tokens'|maximum context length"):
        plan_completion(completion(max_context - 10, max_tokens=11), max_context - 10, limits)


def test_max_model_len_sets_both() -> None:
    cfg, max_context, limits = served("--max-model-len", "3000")
    assert (max_context, limits.max_prompt_tokens) == (3000, 2999)
    assert plan_completion(completion(2999), 2999, limits).sampling.max_new_tokens == 1


def test_a_smaller_prompt_slot_is_named_after_vllms_words() -> None:
    """--max-prompt-tokens below the context: the prompt bound is the slot's, and the message says so."""
    _, max_context, limits = served("--max-prompt-tokens", "100", "--max-output-tokens", "50")
    assert (max_context, limits.max_prompt_tokens) == (150, 100)
    with pytest.raises(APIError) as refused:
        plan_completion(completion(101), 101, limits)
    assert VLLM_TOO_LONG.match(refused.value.message)
    assert refused.value.message.endswith("This server takes at most 100 prompt tokens (--max-prompt-tokens).")


def test_a_model_with_a_shorter_context() -> None:
    """The default context is capped by the model's, and the prompt limit follows it."""
    cfg = EngineConfig.from_namespace(build_parser().parse_args(["serve"]))
    limits = limits_of(cfg.geometry, cfg.context_limit(2048))
    assert (limits.max_context, limits.max_prompt_tokens) == (2048, 2047)
