"""One request's output: token events in, text deltas out.

``Generation.deltas()`` reads the request's events from the token reader, detokenizes
incrementally (the detokenizer never splits a character and never lets a stop string out),
collects logprobs, observes latency metrics, and ends with ``finish_reason`` and the token
count set. Engine errors and lost streams raise ``APIError``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator

from dpu_gateway.backend import Backend, RequestStream
from dpu_gateway.errors import APIError
from dpu_gateway.params import Plan
from dpu_gateway.request_metrics import ChoiceGroup, RequestTally
from dpu_gateway.textio import TextCodec
from shared import messages as m
from shared import ring_layout as L
from shared.metrics import FrontendMetrics

F, E = L.FinishReason, L.ErrorCode
_REASONS = {F.EOS: "stop", F.STOP_ID: "stop", F.LENGTH: "length", F.CANCELLED: "abort"}


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: int
    logprob: float | None  # None: the first prompt token (echo), which has no distribution
    top: list[tuple[int, float]] | None


@dataclasses.dataclass(frozen=True, slots=True)
class PromptEntry:
    """One prompt position's log-prob (vLLM's ``prompt_logprobs``): its token's, with its rank, and the top k."""

    token: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclasses.dataclass(slots=True)
class Delta:
    text: str
    logprobs: list[TokenLogprob] | None = None


def engine_error(msg: m.Finished) -> APIError:
    if msg.error == E.PROMPT_TOO_LONG:
        return APIError(400, "the engine cannot hold this prompt plus the requested output tokens",
                        code="context_length_exceeded")
    if msg.error == E.BAD_PARAMS:
        return APIError(400, "the engine refused the sampling parameters", code="invalid_value")
    if msg.error == E.OUT_OF_MEMORY:
        return APIError(503, "the engine ran out of device memory computing this prompt's log-probs; retry later "
                        "or with a shorter prompt", code="out_of_memory")
    name = E(msg.error).name if msg.error in E._value2member_map_ else str(msg.error)
    return APIError(500, f"the engine failed this request ({name})", code="engine_error")


class Generation:
    tally: RequestTally  # vLLM's per-request series of this choice

    def __init__(self, codec: TextCodec, plan: Plan, backend: Backend, stream: RequestStream,
                 metrics: FrontendMetrics, arrival: float, prompt_tokens: int, index: int = 0,
                 prompt: list[int] | None = None, source: Generation | None = None) -> None:
        self.codec, self.plan, self.backend, self.stream = codec, plan, backend, stream
        self.prompt = prompt or []  # the prompt's token ids: what its log-probs are of
        # positions 1.. of the prompt (position 0 has none), once token 0 brought them
        self.prompt_entries: list[PromptEntry] | None = None
        # the first choice of this prompt (n > 1): only its slot computes the prompt log-probs this one shows
        self.source = source
        self.prompt_settled = asyncio.Event()  # the entries came, or this choice ended without them
        self.index = index  # of the choice in the response
        self.metrics, self.arrival, self.prompt_tokens = metrics, arrival, prompt_tokens
        self.detok = codec.detokenizer(plan.stop, plan.skip_special_tokens)
        self.completion_tokens = 0
        self.token_ids: list[int] = []  # the answer's token ids, kept when the request asked (return_token_ids)
        self.cached_tokens = 0  # prompt tokens the engine's prefix cache held (usage.prompt_tokens_details)
        self.finish_reason: str | None = None
        # vLLM's stop_reason: the stop string that ended the answer, or the stop token id (not EOS); else None
        self.stop_reason: str | int | None = None
        self.first_at: float | None = None
        self.last_at = arrival
        # the choices of one prompt share the first one's group
        group = source.tally.group if source is not None else ChoiceGroup(plan.n)
        self.tally = RequestTally(metrics, stream, arrival, len(self.prompt), plan.sampling.max_new_tokens, group)

    async def deltas(self) -> AsyncGenerator[Delta, None]:
        try:
            echo_pending = bool(self.plan.echo)  # with logprobs the echo waits for token 0, which brings them
            if echo_pending and self.plan.echo_logprobs < 0:
                yield Delta(self.plan.echo)
                echo_pending = False
            while self.finish_reason is None:
                msg = await self.stream.events.get()
                if isinstance(msg, m.Tokens):
                    delta = self._tokens(msg)
                elif isinstance(msg, m.Finished):
                    delta = self._finished(msg)
                else:
                    raise APIError(msg.status, msg.message, code="engine_unavailable")
                if echo_pending:
                    yield Delta(self.plan.echo, await self._echo_logprobs())
                    echo_pending = False
                if delta.text or delta.logprobs:
                    yield delta
        except APIError as exc:
            self.tally.failed(exc.status, self.completion_tokens, self.cached_tokens)
            raise
        except BaseException:
            # The choice ends unfinished and unanswered: its client went away (the handler cancelled, the stream
            # closed), or a sibling choice failed. vLLM counts such a request as aborted.
            if not self.tally.done:
                self.finish_reason = "abort"
                self._account()
            raise
        finally:
            self.prompt_settled.set()
            self.backend.forget(self.stream, cancel=True)  # a no-op once the engine finished it

    def _tokens(self, msg: m.Tokens) -> Delta:
        self._observe(len(msg.ids))
        if msg.cached_tokens is not None:
            self.cached_tokens = msg.cached_tokens
        self.tally.tokens(len(msg.ids), self.cached_tokens, msg.clocks, msg.admit_ns)
        self._take_prompt(msg.prompt)
        if self.plan.echo_only:  # the token sampled for echo without generation is not part of the answer
            self.completion_tokens += len(msg.ids)
            return Delta("")
        text, kept = self._push(msg.ids)  # special tokens (EOS) add no text
        self.completion_tokens += kept
        if self.plan.return_token_ids:
            self.token_ids += msg.ids[:kept]
        if self.detok.stopped:
            self.finish_reason = "stop"
            self.stop_reason = self.detok.stop_string
            self._account()
            if self.plan.include_stop_str and self.detok.stop_string:
                text += self.detok.stop_string
        return Delta(text, self._logprobs(msg)[:kept] if self.plan.sampling.logprobs else None)

    def _push(self, ids: list[int]) -> tuple[str, int]:
        """``detok.push``, and how many of ``ids`` are the answer's: where a stop string may end it inside a message
        of several ids (the reader's, when it caught up with several steps), one at a time, so that the stops
        are looked for after each token whatever the messages (as vLLM), and the engine's ids past the one that
        completed a stop are not the answer's (its usage, log-probs and token ids)."""
        if not self.plan.stop or len(ids) == 1:
            return self.detok.push(ids), len(ids)
        parts = []
        for k, t in enumerate(ids, 1):
            parts.append(self.detok.push([t]))
            if self.detok.stopped:
                return "".join(parts), k
        return "".join(parts), len(ids)

    def _finished(self, msg: m.Finished) -> Delta:
        if msg.reason == F.ERROR:
            raise engine_error(msg)
        self._take_prompt(msg.prompt)
        self.completion_tokens = max(self.completion_tokens, msg.generated)
        self.finish_reason = _REASONS.get(F(msg.reason), "stop")
        self.tally.finished(self.finish_reason, self.completion_tokens, self.cached_tokens, None,
                            (msg.admit_ns, msg.schedule_ns, msg.first_token_ns, msg.last_token_ns))
        if msg.reason == F.STOP_ID:
            self.stop_reason = self._stop_id(msg.stop_token)
        self._account()
        return Delta(self.detok.finish())

    def _stop_id(self, reported: int) -> int | None:
        """The stop token id that ended the answer: the one the engine wrote into the slot (schema minor 6), else
        the request's only one (an engine of an earlier minor writes none); None when that leaves it unknown."""
        ids = self.plan.sampling.stop_ids
        if reported in ids:
            return reported
        return ids[0] if len(ids) == 1 else None

    def _take_prompt(self, entries: list[tuple[float, int, list[tuple[int, float]]]] | None) -> None:
        """The prompt log-probs the reader sent (with token 0, or with a finish that came before any token)."""
        if entries is not None:
            self.prompt_entries = [PromptEntry(t, lp, rank, list(top))
                                   for t, (lp, rank, top) in zip(self.prompt[1:], entries, strict=True)]
            self.prompt_settled.set()

    async def asked_prompt_entries(self) -> list[PromptEntry] | None:
        """The prompt log-probs this choice shows: its own, or its source's once they came. None for a request
        cancelled before its prompt was computed (finish ``abort``), a 500 for any other without them."""
        gen = self.source or self
        if gen is not self:
            await gen.prompt_settled.wait()
        if gen.prompt_entries is None and gen.finish_reason != "abort":
            raise APIError(500, "the engine returned no prompt log-probs", code="engine_error")
        return gen.prompt_entries

    async def _echo_logprobs(self) -> list[TokenLogprob] | None:
        """The echoed prompt's entries (completions' logprobs): none for its first token, then each
        position's with ``echo_logprobs`` alternatives."""
        entries = await self.asked_prompt_entries()
        if entries is None:
            return None
        k = self.plan.echo_logprobs
        rest = [TokenLogprob(e.token, e.logprob, e.top[:k]) for e in entries]
        return [TokenLogprob(self.prompt[0], None, None), *rest]

    def _logprobs(self, msg: m.Tokens) -> list[TokenLogprob]:
        lps = msg.logprobs or [0.0] * len(msg.ids)
        tops = msg.top or [[] for _ in msg.ids]
        return [TokenLogprob(t, lp, list(top)) for t, lp, top in zip(msg.ids, lps, tops, strict=False)]

    def _observe(self, n: int) -> None:
        now = time.monotonic()
        if self.first_at is None:
            self.first_at = now
            self.metrics.first_token(self.stream.engine, now - self.arrival)
        else:
            self.metrics.token_gaps(self.stream.engine, (now - self.last_at) / max(n, 1), n)
        self.last_at = now

    def _account(self) -> None:
        mt = self.metrics
        mt.e2e.observe(time.monotonic() - self.arrival)
        if self.first_at is not None and self.completion_tokens > 1:
            mt.tpot.observe((self.last_at - self.first_at) / (self.completion_tokens - 1))
        mt.prompt_tokens.inc(self.prompt_tokens)
        mt.generation_tokens.inc(self.completion_tokens)
        mt.finished(self.finish_reason or "stop")
        decode_s = None if self.first_at is None else self.last_at - self.first_at
        self.tally.finished(self.finish_reason or "stop", self.completion_tokens, self.cached_tokens, decode_s)
        mt.flush_tokens()  # its last tokens' gaps and counts, kept in the process until now
