"""The persistent backend's prompt log-probs, as far as the CPU can run them (Triton's interpreter, the graphs'
work run eagerly): a prefill with `RunnerLimits.score_rows` keeps every token's final hidden state and samples
what the runner without it samples, and the score graph's work (`score_positions`) gives, for any kept rows
and targets, the entries of the reference model's log-softmax. The device side (the scheduler staging the rows
and copying the entries to the ring) runs on the GPU: tests/persistent/test_persistent.py."""

from __future__ import annotations

import pytest
import torch

from gpu_engine.gpu.runner import GpuModelRunner, RunnerLimits
from gpu_engine.kv_cache import KVCache
from gpu_engine.models.attention import build_metadata
from gpu_engine.models.config import ModelConfig
from gpu_engine.models.loader import build_empty, init_random

CFG = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 64,
                           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                           "max_position_embeddings": 256})
PROMPTS = ([5, 9, 13, 9, 5, 40, 41, 77, 3], [8, 6, 4, 2, 11])
ROWS = 8


def prefill(runner: GpuModelRunner) -> None:
    """One prefill step of both prompts (blocks 0-2 and 3-4 of 4 tokens), sampled greedily."""
    meta = build_metadata([(0, len(PROMPTS[0]), [0, 1, 2]), (0, len(PROMPTS[1]), [3, 4])], 4)
    runner.stage(torch.tensor(PROMPTS[0] + PROMPTS[1]), meta)
    runner.forward(2, 16, False)


@pytest.fixture(scope="module")
def runners():
    model = build_empty(CFG, torch.float32, "cpu")
    init_random(model, 3)
    scored = GpuModelRunner(model, KVCache(CFG, 8, 4), RunnerLimits(2, 16, 4, num_top_logprobs=3, score_rows=ROWS))
    plain = GpuModelRunner(model, KVCache(CFG, 8, 4), RunnerLimits(2, 16, 4, num_top_logprobs=3))
    with torch.inference_mode():
        for r in (scored, plain):
            prefill(r)
    return scored, plain, model


def test_the_kept_hidden_states_change_nothing_sampled(runners) -> None:
    scored, plain, _ = runners
    assert torch.equal(scored.buffers.next_tokens[:2], plain.buffers.next_tokens[:2])
    assert torch.allclose(scored.buffers.logits[:2], plain.buffers.logits[:2], atol=1e-6)
    assert plain.buffers.hidden.numel() == 0 and plain.buffers.score_index.numel() == 0


def test_the_score_graph_gives_the_reference_entries(runners) -> None:
    scored, _, model = runners
    b, packed = scored.buffers, PROMPTS[0] + PROMPTS[1]
    # positions 1..8 of the first prompt (packed tokens 0..7), then 1..4 of the second (packed 9..12), in two
    # launches of ROWS, the second padded as the scheduler pads it (row 0 against token 0)
    index = list(range(8)) + list(range(9, 13))
    want = []
    for prompt in PROMPTS:
        meta = build_metadata([(0, len(prompt), list(range(3)))], 4)
        with torch.inference_mode():
            hidden = model.hidden_states(torch.tensor(prompt), meta, KVCache(CFG, 8, 4))
            ref = torch.log_softmax(model.logits_at(hidden, torch.arange(len(prompt) - 1)), dim=-1)
        want += [(ref[p - 1], prompt[p]) for p in range(1, len(prompt))]
    got = []
    for base in range(0, len(index), ROWS):
        rows = index[base : base + ROWS]
        b.score_index.copy_(torch.tensor(rows + [0] * (ROWS - len(rows)), dtype=torch.int32))
        b.score_targets.copy_(torch.tensor([packed[j + 1] for j in rows] + [0] * (ROWS - len(rows))))
        b.score_logprobs.fill_(float("nan"))  # poisoned: each launch must write every row
        with torch.inference_mode():
            scored.score_positions()
        got += [(float(b.score_logprobs[e]), int(b.score_ranks[e]), b.score_top_logprobs[e].clone(),
                 b.score_top_ids[e].clone()) for e in range(len(rows))]
    for (lp, rank, top_lp, top_ids), (ref, tok) in zip(got, want, strict=True):
        assert abs(lp - float(ref[tok])) < 1e-4
        assert rank == int((ref >= ref[tok]).sum())
        top = torch.topk(ref, 3)
        assert torch.allclose(top_lp, top.values, atol=1e-4) and torch.equal(top_ids, top.indices)


def test_score_rows_beyond_the_step_buffers_are_refused() -> None:
    with pytest.raises(ValueError, match="score_rows"):
        RunnerLimits(2, 16, 4, score_rows=17)
    model = build_empty(CFG, torch.float32, "cpu")
    runner = GpuModelRunner(model, KVCache(CFG, 8, 4), RunnerLimits(2, 16, 4))
    with pytest.raises(RuntimeError, match="score_rows"):
        runner.score_positions()
