"""Per-token latency histograms are counted in the gateway and written out in batches: what a scrape shows is what
observing every token one by one would have shown."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from shared.metrics import TOKEN_GAP_BUCKETS, FrontendMetrics, TokenGaps

# gaps below, on and between bucket bounds, past the last finite one, and zero; with how many tokens each
GAPS = [(0.0, 1), (TOKEN_GAP_BUCKETS[0], 3), (TOKEN_GAP_BUCKETS[2] * 0.99, 2), (TOKEN_GAP_BUCKETS[2], 1),
        (TOKEN_GAP_BUCKETS[-1] * 10, 4), (0.0123, 7)]


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples if not s.name.endswith("_created")}


def test_batched_gaps_equal_gaps_observed_one_by_one() -> None:
    one_by_one, batched = CollectorRegistry(), CollectorRegistry()
    plain = Histogram("gaps", "g", buckets=TOKEN_GAP_BUCKETS, registry=one_by_one)
    tally = TokenGaps(Histogram("gaps", "g", buckets=TOKEN_GAP_BUCKETS, registry=batched))
    for gap, n in GAPS:
        for _ in range(n):
            plain.observe(gap)
        tally.observe(gap, n)
    assert samples(batched)[("gaps_count", ())] == 0  # counted, not yet written
    tally.flush()
    tally.flush()  # nothing left: nothing counted twice
    assert samples(batched) == pytest.approx(samples(one_by_one))
    assert samples(batched)[("gaps_count", ())] == sum(n for _, n in GAPS)


def test_a_scrape_shows_the_tokens_counted_since_the_last_write() -> None:
    metrics = FrontendMetrics("m", engines=2)
    for gap, n in GAPS:
        metrics.token_gaps(1, gap, n)
        metrics.generated(1, n)
    metrics.generated(0, 5)
    text = metrics.render().decode()
    total = sum(n for _, n in GAPS)
    assert f'blink:inter_token_latency_seconds_count{{model_name="m"}} {float(total)}' in text
    assert f'vllm:inter_token_latency_seconds_count{{engine="1",model_name="m"}} {float(total)}' in text
    assert f'vllm:generation_tokens_total{{engine="1",model_name="m"}} {float(total)}' in text
    assert 'vllm:generation_tokens_total{engine="0",model_name="m"} 5.0' in text
    metrics.flush_tokens()  # nothing left: nothing counted twice
    assert f'vllm:generation_tokens_total{{engine="1",model_name="m"}} {float(total)}' in metrics.render().decode()
