"""vLLM's request phases as the gateway observes them (``dpu_gateway/request_metrics.py``, ``shared/metrics.py``'s
``phase_times``): each phase is a span between two clocks of one machine, never between the gateway's clock and
the engine's. The engine's clock is another host's over RDMA (or the GPU's timer set to CLOCK_REALTIME): here it
runs an hour behind the gateway's, in step with it, or an hour ahead, and every phase comes out the same.

The slot's clocks travel as the token reader sends them: ``Tokens`` with token 0 and ``Finished``, through the
wire format of the reader's link.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from dpu_gateway.backend import RequestStream
from dpu_gateway.request_metrics import ChoiceGroup, RequestTally
from shared import messages as m
from shared import ring_layout as L
from shared.metrics import FrontendMetrics, phase_times

MODEL = "blink-test-model"
MS = 1_000_000
# the slot's clocks after the engine's claim (admit_ns): its first prompt chunk's step, its first and last token
SCHEDULED, FIRST, LAST = 30 * MS, 55 * MS, 95 * MS
RING_WAIT = 7 * MS  # the request's wait for a ring slot, on the gateway's clock


def wire(msg: m.Tokens | m.Finished) -> m.Tokens | m.Finished:
    """``msg`` as the gateway decodes it from the reader's link."""
    got = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=m.FromReader)
    assert isinstance(got, type(msg))
    return got


def observed(metrics: FrontendMetrics, name: str) -> tuple[float, float]:
    """(count, sum) of one of vLLM's histograms for engine 0."""
    labels = {"model_name": MODEL, "engine": "0"}
    count = metrics.registry.get_sample_value(f"{name}_count", labels) or 0.0
    return count, metrics.registry.get_sample_value(f"{name}_sum", labels) or 0.0


def finish_one(skew_s: int, *, placed: bool = True) -> FrontendMetrics:
    """One request through a ``RequestTally`` whose engine's clock is ``skew_s`` off the gateway's."""

    async def run() -> FrontendMetrics:
        metrics = FrontendMetrics(MODEL)
        stream = RequestStream(7)
        stream.submitted_ns = time.monotonic_ns()
        stream.placed_ns = stream.submitted_ns + RING_WAIT if placed else 0
        tally = RequestTally(metrics, stream, time.monotonic(), 5, 16, ChoiceGroup(1))
        admit = time.time_ns() + skew_s * 1_000_000_000  # the engine's clock when it claimed the slot
        first = wire(m.Tokens(7, [11], at=0, cached_tokens=0, clocks=(admit + SCHEDULED, admit + FIRST),
                              admit_ns=admit))
        assert isinstance(first, m.Tokens)
        tally.tokens(len(first.ids), 0, first.clocks, first.admit_ns)
        done = wire(m.Finished(7, L.FinishReason.LENGTH, 0, 3, 5, schedule_ns=admit + SCHEDULED,
                               first_token_ns=admit + FIRST, last_token_ns=admit + LAST, admit_ns=admit))
        assert isinstance(done, m.Finished)
        tally.finished("length", 3, 0, None, (done.admit_ns, done.schedule_ns, done.first_token_ns,
                                              done.last_token_ns))
        return metrics

    return asyncio.run(run())


@pytest.mark.parametrize("skew_s", [-3600, 0, 3600])
def test_each_phase_is_measured_on_one_clock(skew_s: int) -> None:
    metrics = finish_one(skew_s)
    assert observed(metrics, "vllm:request_queue_time_seconds") == (1, pytest.approx((SCHEDULED + RING_WAIT) / 1e9))
    assert observed(metrics, "vllm:request_prefill_time_seconds") == (1, pytest.approx((FIRST - SCHEDULED) / 1e9))
    assert observed(metrics, "vllm:request_decode_time_seconds") == (1, pytest.approx((LAST - FIRST) / 1e9))


def test_without_the_gateways_part_the_queue_time_is_the_engines() -> None:
    """A request with no ring-slot wait known (no Admitted seen) keeps the engine's part, on its own clock."""
    metrics = finish_one(-3600, placed=False)
    assert observed(metrics, "vllm:request_queue_time_seconds") == (1, pytest.approx(SCHEDULED / 1e9))


def test_phase_times_needs_both_ends_of_a_span() -> None:
    assert phase_times(0, 5 * MS, 6 * MS, 9 * MS, 0.002) == (None, pytest.approx(0.001), pytest.approx(0.003))
    assert phase_times(1 * MS, 5 * MS, 0, 0, None) == (pytest.approx(0.004), None, None)
