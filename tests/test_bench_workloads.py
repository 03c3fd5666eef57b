"""Workloads: exact prompt lengths with the real SmolLM2 tokenizer, means on target, limits respected."""

from __future__ import annotations

import numpy as np
import pytest

from bench.workloads import WORKLOADS, Limits, PromptMaker, build_requests, draw_lengths, sample_lengths, summary


@pytest.fixture(scope="module")
def tokenizer():
    from dpu_tokenizer.loader import load_tokenizer

    return load_tokenizer(None)  # the embedded SmolLM2 GGUF


@pytest.mark.parametrize("name", sorted(n for n, w in WORKLOADS.items() if w.conversations is None))
def test_means_on_target(name: str) -> None:
    w = WORKLOADS[name]
    pairs = draw_lengths(w, 500, Limits(), seed=7)
    p, o = np.array(pairs).T
    assert p.mean() == pytest.approx(w.prompt_mean, rel=0.02)
    assert o.mean() == pytest.approx(w.output_mean, rel=0.02)
    if w.prompt_sigma:
        assert p.std() > 0.3 * p.mean() and np.median(p) < p.mean()  # log-normal: right-skewed
    else:
        assert set(p) == {1024} and set(o) == {512}


def test_limits_clip_every_request() -> None:
    pairs = draw_lengths(WORKLOADS["paper"], 1000, Limits(max_prompt=1500, max_output=600, max_context=1800), seed=1)
    assert all(1 <= p <= 1500 and 1 <= o <= 600 and p + o <= 1800 for p, o in pairs)
    assert np.mean([o for _, o in pairs]) == pytest.approx(463, rel=0.03)  # the mean survives clipping
    assert sample_lengths(50.0, 0.8, 10, 20, np.random.default_rng(0)).max() <= 20  # unreachable mean: saturates


def test_prompts_have_exact_token_lengths(tokenizer) -> None:
    reqs = build_requests(WORKLOADS["vllm"], 200, tokenizer, seed=3)
    assert all(len(r.prompt) == r.prompt_len for r in reqs)
    s = summary(reqs)
    assert s["prompt_mean"] == pytest.approx(200, rel=0.03) and s["output_mean"] == pytest.approx(180, rel=0.03)
    text = tokenizer.decode(reqs[0].prompt)
    assert sum(c.isalpha() for c in text) > 0.5 * len(text)  # real text, not noise
    assert len({tuple(r.prompt[:16]) for r in reqs}) > 150  # different places of the corpus


def test_text_prompts_encode_to_exact_length(tokenizer) -> None:
    reqs = build_requests(WORKLOADS["vllm"].scaled(64, 32), 60, tokenizer, seed=5, as_text=True)
    texts = [r for r in reqs if isinstance(r.prompt, str)]
    assert len(texts) >= 55
    assert all(len(tokenizer.encode(r.prompt)) == r.prompt_len for r in texts)


def test_long_prompts_repeat_the_corpus(tokenizer) -> None:
    maker = PromptMaker(tokenizer, seed=0)
    ids = maker.ids_of_length(len(maker.ids) + 500)
    assert len(ids) == len(maker.ids) + 500
