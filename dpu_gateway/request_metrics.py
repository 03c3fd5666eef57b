"""What vLLM's per-request series (``shared/metrics.py``) take from one request as it runs in the gateway.

A ``Generation`` (one choice) owns a ``RequestTally``: it is told of each batch of output tokens (the first
brings the slot's schedule and first-token clocks and the prompt tokens the prefix cache held), of the
request's end (with the slot's clocks, when the engine ended it) or of its failure, and turns them into the
``vllm:`` observations, under the engine whose ring held the request. The choices of one prompt share a
``ChoiceGroup``, which observes ``n`` and the most tokens one choice generated once every choice ended.
"""

from __future__ import annotations

import time

from dpu_gateway.backend import RequestStream
from shared.metrics import FinishedRequest, FrontendMetrics, phase_times


class ChoiceGroup:
    """The ``n`` choices of one prompt (vLLM's parent request)."""

    def __init__(self, n: int) -> None:
        self.n, self.left, self.most = n, n, 0

    def ended(self, generated: int) -> bool:
        """One choice ended with ``generated`` tokens; True when it was the last."""
        self.left -= 1
        self.most = max(self.most, generated)
        return self.left == 0


class RequestTally:
    def __init__(self, metrics: FrontendMetrics, stream: RequestStream, arrival: float, prompt_tokens: int,
                 max_tokens: int, group: ChoiceGroup) -> None:
        self.metrics, self.stream, self.arrival, self.group = metrics, stream, arrival, group
        self.prompt_tokens, self.max_tokens = prompt_tokens, max_tokens
        self.admit_ns = self.schedule_ns = self.first_token_ns = 0  # the slot's clocks (the engine's)
        self.prefilled = False
        self.counted = 0  # output tokens counted in vllm:generation_tokens
        self.done = False

    @property
    def engine(self) -> int:
        return self.stream.engine

    def tokens(self, n: int, cached_tokens: int, clocks: tuple[int, int] | None, admit_ns: int = 0) -> None:
        """``n`` output tokens came (the first batch with the slot's clocks: (schedule_ns, first_token_ns) and
        ``admit_ns``)."""
        if clocks is not None:
            self.schedule_ns, self.first_token_ns = clocks
            self.admit_ns = admit_ns
        if not self.prefilled:
            self._prefill(cached_tokens)
        self.metrics.generated(self.engine, n)
        self.counted += n

    def _prefill(self, cached_tokens: int) -> None:
        self.prefilled = True
        self.metrics.prefilled(self.engine, self.prompt_tokens, cached_tokens)

    def finished(self, reason: str, generated: int, cached_tokens: int, decode_at_gateway_s: float | None,
                 clocks: tuple[int, int, int, int] | None = None) -> None:
        """The request ended with vLLM's ``reason`` and ``generated`` output tokens. ``clocks``: the slot's
        (admit_ns, schedule_ns, first_token_ns, last_token_ns) when the engine ended it; without them (the gateway
        ended it at a stop string) the decode time is ``decode_at_gateway_s``, its tokens' arrivals at the
        gateway."""
        if self.done:
            return
        self.done = True
        last_ns = 0
        if clocks is not None:
            admit_ns, schedule_ns, first_ns, last_ns = clocks
            self.admit_ns = self.admit_ns or admit_ns
            self.schedule_ns = self.schedule_ns or schedule_ns
            self.first_token_ns = self.first_token_ns or first_ns
        if not self.prefilled and reason in ("stop", "length"):  # its prompt was computed: it ended on token 0
            self._prefill(cached_tokens)
        self.metrics.generated(self.engine, generated - self.counted)
        sent, placed = self.stream.submitted_ns, self.stream.placed_ns
        ring_wait_s = (placed - sent) / 1e9 if sent and placed else None  # the gateway's clock
        queue_s, prefill_s, decode_s = phase_times(self.admit_ns, self.schedule_ns, self.first_token_ns, last_ns,
                                                   ring_wait_s)
        if decode_s is None and self.first_token_ns:
            decode_s = decode_at_gateway_s
        self.metrics.request_finished(FinishedRequest(
            self.engine, reason, time.monotonic() - self.arrival, self.prompt_tokens, cached_tokens, generated,
            self.max_tokens, queue_s, prefill_s, decode_s))
        if self.group.ended(generated):
            self.metrics.choices_finished(self.engine, self.group.n, self.group.most)

    def failed(self, status: int, generated: int, cached_tokens: int) -> None:
        """The request was answered with ``status``: an engine failure (5xx) is vLLM's ``error`` finish."""
        if status >= 500:
            self.finished("error", generated, cached_tokens, None)
