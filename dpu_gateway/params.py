"""From a validated OpenAI request to what the ring needs: sampling fields and token limits.

Checks that msgspec types cannot express live here and raise 400 ``APIError`` naming the
parameter: too many or too long stop strings, a prompt beyond the model's context, logit_bias
keys that are not token ids, a field the serving engine backend does not implement (the ring
header's ``sampling_features``), prompt log-probs of a prompt longer than the ring's rows hold.
"""

from __future__ import annotations

import dataclasses
import hashlib

import msgspec

from dpu_gateway.errors import APIError
from dpu_gateway.protocol import ChatCompletionRequest, CompletionRequest, _Common
from dpu_gateway.structured import Constraint
from dpu_gateway.tools import Format
from shared import messages as m
from shared import ring_layout as L
from shared.ring import MAX_STOP_IDS
from shared.seeds import SEED_STEP
from shared.slots import MAX_LOGIT_BIAS

# Stop strings (vLLM sets no bound). The detokenizer holds back at most the longest one's bytes less one, and
# matches them all in one automaton (dpu_tokenizer/detok.py) whose size is their total length: built in well
# under 20 ms of a core for the largest set allowed, and about 11 bytes a UTF-8 byte of them.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 256  # per stop string
MAX_STOP_TOTAL_CHARS = 4096  # all of a request's stop strings together
Feature = L.SamplingFeatures


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """What the ring and the model allow one request (from the ring header)."""

    max_context: int
    max_prompt_tokens: int
    max_output_tokens: int
    vocab_size: int = 0  # 0: not known (no check)
    features: int = 0  # SamplingFeatures the serving engine implements
    max_prompt_logprobs_tokens: int = 0  # longest prompt whose log-probs a slot returns
    top_logprobs: int = 20  # alternatives per position a slot returns
    grammar_arena_bytes: int = 0  # the device arena a grammar's tables must fit (0: the engine has no such limit)


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """A request, ready to submit: its sampling record (what the tracker writes into the ring) and
    what only the gateway applies to the output (stop strings, echo, n)."""

    sampling: m.Sampling
    stop: list[str]
    include_stop_str: bool = False
    n: int = 1
    echo: str = ""  # text the answer starts with (echo)
    tool_format: Format | None = None  # read tool calls out of the answer in this format
    parallel_tool_calls: bool = True   # False: only the first call is answered
    forced_tools: tuple[str, ...] = ()  # a forced call's possible names (tool_choice required or named)
    echo_logprobs: int = -1  # completions' echo with logprobs: alternatives of the prompt's entries (-1: none)
    echo_only: bool = False  # max_tokens 0 with echo: the answer is the prompt (the one token sampled is dropped)
    prompt_logprobs: int = -1  # vLLM's prompt_logprobs field: alternatives per position (-1: not asked)
    token_ids_as_text: bool = False  # vLLM's return_tokens_as_token_ids: log-prob entries name tokens token_id:N
    skip_special_tokens: bool = True  # False: special tokens' text is part of the answer (and of what stops match)
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids in the answer

    def choices(self) -> list[m.Sampling]:
        """One sampling record per choice: a seeded request's choices draw from seeds derived from it. Only the
        first asks for prompt log-probs: its siblings, of the same prompt, show its entries (and may reuse the
        prefix cache, which a request that asks does not)."""
        s, mask = self.sampling, 0xFFFFFFFFFFFFFFFF
        sibling = msgspec.structs.replace(s, prompt_logprobs=-1)
        if s.seed is None:
            return [s, *[sibling] * (self.n - 1)]  # each slot's seed comes from its own request id
        return [msgspec.structs.replace(s if i == 0 else sibling, seed=(s.seed + i * SEED_STEP) & mask)
                for i in range(self.n)]


def check_common(req: _Common, limits: Limits) -> list[str]:
    """Shared checks; returns the stop strings."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}", param="stop",
                       code="invalid_value")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise APIError(400, f"each stop string may be at most {MAX_STOP_CHARS} characters long", param="stop",
                       code="invalid_value")
    if sum(map(len, stop)) > MAX_STOP_TOTAL_CHARS:
        raise APIError(400, f"the stop strings may hold at most {MAX_STOP_TOTAL_CHARS} characters in all, got "
                       f"{sum(map(len, stop))}", param="stop", code="invalid_value")
    if len(set(req.stop_token_ids or ())) > MAX_STOP_IDS:  # repeats are merged before they reach the ring
        raise APIError(400, f"stop_token_ids may hold at most {MAX_STOP_IDS} ids", param="stop_token_ids",
                       code="invalid_value")
    if req.include_stop_str_in_output and req.stop_token_ids:
        raise APIError(400, "include_stop_str_in_output applies to stop strings only: a stop token id is never "
                       "emitted", param="include_stop_str_in_output", code="unsupported_value")
    if limits.vocab_size and any(t >= limits.vocab_size for t in req.stop_token_ids or ()):
        raise APIError(400, f"stop_token_ids must be token ids in [0, {limits.vocab_size})",
                       param="stop_token_ids", code="invalid_value")
    check_features(req, limits)
    return [s for s in stop if s]


def check_features(req: _Common, limits: Limits) -> None:
    """400 naming a field whose device support the serving engine does not advertise."""
    used = {
        "presence_penalty": (bool(req.presence_penalty), Feature.PENALTIES),
        "frequency_penalty": (bool(req.frequency_penalty), Feature.PENALTIES),
        "repetition_penalty": (req.repetition_penalty not in (None, 1.0), Feature.PENALTIES),
        "logit_bias": (bool(req.logit_bias), Feature.LOGIT_BIAS),
        "min_tokens": (req.min_tokens > 0, Feature.MIN_TOKENS),
    }
    for name, (on, bit) in used.items():
        if on and not limits.features & bit:
            raise APIError(400, f"{name} is not implemented by the engine backend serving this model",
                           param=name, code="unsupported_parameter")


def check_constraint(c: Constraint, req: _Common, limits: Limits) -> None:
    """400 when the output constraint cannot be enforced here, or with fields that would break it."""
    if not limits.features & Feature.GRAMMAR:
        raise APIError(400, f"{c.param}: constrained decoding is not implemented by the engine backend serving "
                       "this model", param=c.param, code="unsupported_parameter")
    if c.ends_anywhere:
        return
    if req.min_tokens > 0:
        raise APIError(400, f"min_tokens cannot be combined with {c.param} (it could forbid the only token that "
                       "ends a complete answer)", param="min_tokens", code="unsupported_value")
    if req.ignore_eos:
        raise APIError(400, f"ignore_eos cannot be combined with {c.param} (a complete answer ends with EOS)",
                       param="ignore_eos", code="unsupported_value")


def check_prompt_logprobs(param: str, prompt_len: int, k: int, limits: Limits) -> None:
    """400 naming ``param`` when the engine cannot return the prompt's log-probs with ``k`` alternatives."""
    if not limits.features & Feature.PROMPT_LOGPROBS:
        raise APIError(400, f"{param}: the engine backend serving this model does not compute prompt log-probs",
                       param=param, code="unsupported_parameter")
    if k > limits.top_logprobs:
        raise APIError(400, f"{param}: at most {limits.top_logprobs} alternatives per prompt token are returned "
                       f"by this server, got {k}", param=param, code="invalid_value")
    if prompt_len > limits.max_prompt_logprobs_tokens:
        raise APIError(400, f"{param}: prompt log-probs are returned for prompts of at most "
                       f"{limits.max_prompt_logprobs_tokens} tokens (--max-prompt-logprobs-tokens); this prompt has "
                       f"{prompt_len}", param=param, code="context_length_exceeded")


def prompt_logprobs(req: _Common, prompt_len: int, limits: Limits, echo_k: int = -1) -> int:
    """Alternatives per prompt position the engine computes (-1: none): for ``prompt_logprobs``, and for
    ``echo_k`` (completions' echo with logprobs)."""
    asked = -1 if req.prompt_logprobs is None else req.prompt_logprobs
    if asked >= 0 and req.stream:
        raise APIError(400, "prompt_logprobs are not returned when streaming (as vLLM); use echo with logprobs",
                       param="prompt_logprobs", code="unsupported_value")
    k = max(asked, echo_k)
    if k >= 0:
        check_prompt_logprobs("prompt_logprobs" if asked >= 0 else "echo", prompt_len, k, limits)
    return k


def logit_bias(req: _Common, limits: Limits) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` as (id, bias) pairs, ids ascending."""
    raw = req.logit_bias or {}
    if len(raw) > MAX_LOGIT_BIAS:
        raise APIError(400, f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(raw)}",
                       param="logit_bias", code="invalid_value")
    out: dict[int, float] = {}
    for key, bias in raw.items():
        tok = int(key) if key.isascii() and key.isdigit() else -1  # int() would also take '１２' or ' 12'
        if tok < 0 or (limits.vocab_size and tok >= limits.vocab_size):
            bound = f" in [0, {limits.vocab_size})" if limits.vocab_size else ""
            raise APIError(400, f"logit_bias keys must be token ids{bound}, got {key!r}", param="logit_bias",
                           code="invalid_value")
        out[tok] = float(bias)
    return tuple(sorted(out.items()))


def max_new_tokens(requested: int | None, prompt_len: int, limits: Limits, param: str) -> int:
    """The output budget; 400 when the prompt (plus what was asked for) exceeds the context."""
    room = min(limits.max_context - prompt_len, limits.max_output_tokens)
    if prompt_len > limits.max_prompt_tokens or room < 1:
        # vLLM's words, which clients match; then this server's prompt bound where it is below the context's
        bound = "" if limits.max_prompt_tokens >= limits.max_context - 1 else (
            f" This server takes at most {limits.max_prompt_tokens} prompt tokens (--max-prompt-tokens).")
        raise APIError(
            400, f"This model's maximum context length is {limits.max_context} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input messages.{bound}",
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


def check_bias_room(bias: tuple, prompt_len: int, limits: Limits) -> None:
    """The bias table travels in the tail of the slot's prompt row (two words an entry)."""
    if bias and prompt_len + 2 * len(bias) > limits.max_prompt_tokens:
        raise APIError(400, f"a prompt of {prompt_len} tokens leaves room for "
                       f"{max(0, (limits.max_prompt_tokens - prompt_len) // 2)} logit_bias entries, got {len(bias)}",
                       param="logit_bias", code="context_length_exceeded")


def top_k(requested: int | None) -> int:
    """0 (off) for None, -1 and any k no vocabulary reaches (the ring holds an int32)."""
    return requested if requested is not None and 0 < requested < 2**31 else 0


def sampling(req: _Common, budget: int, logprobs: bool, top: int, bias: tuple, grammar_id: int = 0,
             prompt_k: int = -1) -> m.Sampling:
    """The request's sampling record, OpenAI's defaults filled in."""
    if req.min_tokens > budget:
        raise APIError(400, f"min_tokens ({req.min_tokens}) must not exceed the output budget ({budget})",
                       param="min_tokens", code="invalid_value")
    return m.Sampling(
        max_new_tokens=budget,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k(req.top_k), min_p=req.min_p or 0.0,
        seed=None if req.seed is None else req.seed & 0xFFFFFFFFFFFFFFFF,
        ignore_eos=req.ignore_eos, logprobs=logprobs, top_logprobs=top,
        stop_ids=tuple(dict.fromkeys(req.stop_token_ids or ())),
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_tokens=req.min_tokens, logit_bias=bias, grammar_id=grammar_id, cache_salt=cache_salt(req.cache_salt),
        prompt_logprobs=prompt_k,
    )


def cache_salt(salt: str | None) -> int:
    """The ring's 64-bit salt of vLLM's ``cache_salt`` field (0: none, so an unsalted request shares with
    every other unsalted one): the first 8 bytes of its BLAKE2b digest, never 0."""
    if salt is None:
        return 0
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little") or 1


def plan_chat(req: ChatCompletionRequest, prompt_len: int, limits: Limits, echo: str = "", grammar_id: int = 0,
              tool_format: Format | None = None, forced_tools: tuple[str, ...] = ()) -> Plan:
    stop = check_common(req, limits)
    if tool_format is not None and req.logprobs:
        raise APIError(400, "logprobs are not returned for answers read as tool calls", param="logprobs",
                       code="unsupported_value")
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs", code="invalid_value")
    if req.max_completion_tokens is not None and req.max_tokens is not None:
        max_new_tokens(req.max_tokens, prompt_len, limits, "max_tokens")  # the shadowed one is checked too
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    budget = max_new_tokens(asked, prompt_len, limits, param)
    bias = logit_bias(req, limits)
    check_bias_room(bias, prompt_len, limits)
    prompt_k = prompt_logprobs(req, prompt_len, limits)
    return Plan(sampling(req, budget, req.logprobs, req.top_logprobs or 0, bias, grammar_id, prompt_k), stop,
                req.include_stop_str_in_output, req.n, echo, tool_format, req.parallel_tool_calls is not False,
                forced_tools, prompt_logprobs=prompt_k, token_ids_as_text=bool(req.return_tokens_as_token_ids),
                skip_special_tokens=req.skip_special_tokens is not False, return_token_ids=bool(req.return_token_ids))


def plan_completion(req: CompletionRequest, prompt_len: int, limits: Limits, echo: str = "",
                    grammar_id: int = 0) -> Plan:
    stop = check_common(req, limits)
    echo_only = req.echo and req.max_tokens == 0
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens must be at least 1 (0 is served with echo: the prompt only)",
                       param="max_tokens", code="invalid_value")
    # echo without generation still samples one token (the ring's least), dropped from the answer, as vLLM
    budget = max_new_tokens(1 if echo_only else req.max_tokens, prompt_len, limits, "max_tokens")
    if req.max_tokens is None:  # OpenAI's default of 16, within what the server allows
        budget = min(16, budget)
    bias = logit_bias(req, limits)
    check_bias_room(bias, prompt_len, limits)
    echo_k = req.logprobs if req.echo and req.logprobs is not None else -1
    prompt_k = prompt_logprobs(req, prompt_len, limits, echo_k)
    return Plan(sampling(req, budget, req.logprobs is not None, req.logprobs or 0, bias, grammar_id, prompt_k), stop,
                req.include_stop_str_in_output, req.n, echo, echo_logprobs=echo_k, echo_only=echo_only,
                prompt_logprobs=-1 if req.prompt_logprobs is None else req.prompt_logprobs,
                token_ids_as_text=bool(req.return_tokens_as_token_ids),
                skip_special_tokens=req.skip_special_tokens is not False, return_token_ids=bool(req.return_token_ids))


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request: one string, one token list, or a list of either."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise APIError(400, "the prompt is empty", param="prompt", code="invalid_value")
    if all(isinstance(x, int) for x in p):
        return [[int(x) for x in p]]  # type: ignore[arg-type]
    if any(isinstance(x, int) for x in p):
        raise APIError(400, "prompt must be a string, a list of token ids, or a list of either (not a mix)",
                       param="prompt", code="invalid_value")
    return list(p)  # type: ignore[arg-type]


def truncate(ids: list[int], keep: int | None) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: keep the last ``keep`` prompt tokens."""
    return ids if keep is None or len(ids) <= keep else ids[-keep:]
