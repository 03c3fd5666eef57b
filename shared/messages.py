"""Messages between the frontend services: one tagged union per link.

Links (each a Unix socket in the run directory, see ``shared/ipc.py``):

  gateway -> tokenizer   ``ToTokenizer``        tokenizer -> gateway ``FromTokenizer``
  gateway -> tracker     ``ToTracker``          tracker -> gateway   ``FromTracker``
  gateway, tracker -> reader ``ToReader``       reader -> gateway    ``FromReader``

Request ids are chosen by the gateway (its id in the high bits) and are the ring's
``request_id`` too. The tracker tells the reader who owns a slot when it publishes it
(``Track``); the reader routes the slot's tokens to that gateway.

A stream outlives the reader that carried it: a gateway whose reader link drops keeps its streams,
and its ``GatewayHello`` to the next reader names each one with the number of tokens it received
(``Resume``); that reader finds the slot by request id in the rings (which hold every token) and goes
on from there. ``Tokens.at`` says where its ids start, so a gateway drops what it already has.
"""

from __future__ import annotations

import msgspec


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, tag_field="t"):
    pass


# ---------------------------------------------------------------- gateway <-> tokenizer
class Encode(_Msg, tag="enc"):
    req_id: int
    text: str
    add_special: bool = True


class Encoded(_Msg, tag="ids"):
    req_id: int
    ids: list[int]


class EncodeFailed(_Msg, tag="encfail"):
    req_id: int
    message: str


ToTokenizer = Encode
FromTokenizer = Encoded | EncodeFailed


# ---------------------------------------------------------------- gateway <-> tracker
class Sampling(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """One request's sampling parameters: the frontend's only record of them.

    The gateway plans it (``dpu_gateway/params.py``), the tracker writes it into the ring as is
    (``shared/slots.SlotRequest.sampling_record``), the engine decodes the ring copy once
    (``gpu_engine/sampling.SamplingSpec.from_ring``). ``top_logprobs`` is the number of
    alternatives per token (OpenAI's name; the ring's ``num_top_logprobs``). The penalties
    are OpenAI's (``presence_penalty``, ``frequency_penalty``: over output tokens) and vLLM's
    (``repetition_penalty``: over prompt and output tokens, 1 = off); ``min_tokens`` suppresses the
    stop ids and EOS until that many tokens were generated.

    Names along the route: a field keeps its name from here to the ring (``Slot`` in ``schema/ring.fbs``),
    the Python engine (``SamplingSpec``, ``Request``) and the CUDA scheduler (``ReqInfo`` in
    ``gpu_engine/csrc/sched_state.cuh``). Where a name changes, it changes at the API, for a reason:
    ``max_new_tokens`` is what is left of OpenAI's ``max_tokens`` or ``max_completion_tokens`` once the
    gateway has cut it to the server's limits (``dpu_gateway/params.max_new_tokens``), a different
    value; ``top_logprobs`` is the ring's ``num_top_logprobs`` and ``prompt_logprobs`` its
    ``num_prompt_logprobs`` (the ring's counts are unsigned, with a flag for "none"); the penalties are
    ``rep``, ``freq``, ``pres`` inside the CUDA scheduler only.
    """

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    stop_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), token ids ascending
    grammar_id: int = 0  # a token DFA in the ring's grammar store (shared/token_dfa.py); 0: none
    cache_salt: int = 0  # the prefix cache's salt (a hash of the request's cache_salt); 0: none
    prompt_logprobs: int = -1  # alternatives per prompt position with each prompt token's log-prob; -1: none


class Submit(_Msg, tag="sub"):
    req_id: int
    gateway_id: int
    prompt: list[int]
    sampling: Sampling


class Cancel(_Msg, tag="cancel"):
    req_id: int


class Admitted(_Msg, tag="adm"):
    """The request sits in ``slot`` of engine ``engine``'s ring (0 from a tracker of an earlier build)."""

    req_id: int
    slot: int
    engine: int = 0


class Rejected(_Msg, tag="rej"):
    """The request never reached the ring; ``status`` is the HTTP status to answer."""

    req_id: int
    status: int
    message: str
    retry_after_s: float = 0.0


ToTracker = Submit | Cancel
FromTracker = Admitted | Rejected


# ---------------------------------------------------------------- -> reader -> gateway
class Resume(msgspec.Struct, array_like=True, frozen=True):
    """A stream the gateway had on an earlier reader link: ``received`` of its tokens reached it."""

    req_id: int
    received: int


class GatewayHello(_Msg, tag="hello"):
    """First message of a gateway on the reader link: where its requests' tokens go, and the streams
    it already had (``resume``: the reader re-attaches them from the rings and sends the rest). A
    reader of an earlier build ignores ``resume`` (msgspec drops unknown trailing fields)."""

    gateway_id: int
    resume: list[Resume] = msgspec.field(default_factory=list)


class Track(_Msg, tag="track"):
    """Sent by the tracker right after it publishes ``slot`` with ``seq`` in the ring of engine
    ``engine`` (its index under ``--data-parallel-size``; 0 for a single engine); the logprob fields
    are the request's ``Sampling.logprobs`` / ``Sampling.top_logprobs`` / ``Sampling.prompt_logprobs``."""

    req_id: int
    gateway_id: int
    slot: int
    seq: int
    logprobs: bool = False
    top_logprobs: int = 0
    engine: int = 0
    prompt_logprobs: int = -1


# Track.gateway_id of a slot whose client is gone already (told it failed): the reader stops and releases it
NO_GATEWAY = -1

ToReader = GatewayHello | Track


class Tokens(_Msg, tag="tok"):
    """``ids`` are the request's output tokens from position ``at`` on. ``at`` is -1 from a reader of an
    earlier build: its ids follow the previous ``Tokens`` of the same link, the first starting at 0."""

    req_id: int
    ids: list[int]
    logprobs: list[float] | None = None
    top: list[list[tuple[int, float]]] | None = None  # per token: (id, logprob) best first
    at: int = -1
    cached_tokens: int | None = None  # with token 0: prompt tokens the engine found in its prefix cache
    # with token 0, when the request asked: per prompt position from 1, (log-prob, rank, alternatives best first)
    prompt: list[tuple[float, int, list[tuple[int, float]]]] | None = None
    # with token 0: the slot's schedule_ns and first_token_ns (the engine's clock), for the phase metrics
    clocks: tuple[int, int] | None = None
    # with token 0: the slot's admit_ns (the engine's clock, when it claimed the request): the start of the queue
    # time the engine measured; 0 where the reader sent none
    admit_ns: int = 0


class Finished(_Msg, tag="fin"):
    """The slot completed and every token was sent; ``reason``/``error`` are ring enums. ``prompt``: the prompt
    log-probs (as in ``Tokens``) of a request that asked and ended before any output token (EOS or a stop id)."""

    req_id: int
    reason: int
    error: int
    generated: int
    prompt_len: int
    prompt: list[tuple[float, int, list[tuple[int, float]]]] | None = None
    # With reason STOP_ID: the stop token id that ended the request (the slot's stop_token, schema minor 6); -1
    # where the engine wrote none.
    stop_token: int = -1
    # The slot's clocks (ns, the engine's; schema/OWNERSHIP.md), for the request's phase metrics: 0 where the
    # engine wrote none (schedule_ns before schema minor 6, first_token_ns with no token) or the reader sent none.
    schedule_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0
    admit_ns: int = 0  # when the engine claimed it (its clock, as the three above)


class Failed(_Msg, tag="fail"):
    """The request cannot finish (engine down, ring replaced); ``status`` for the client."""

    req_id: int
    status: int
    message: str


FromReader = Tokens | Finished | Failed
