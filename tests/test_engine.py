"""The CPU engine through a ring: continuous batching, preemption, seeds, cancellation, limits."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers.ring_engine import RingHarness

from shared import ring_layout as L
from shared.config import EngineConfig
from shared.ring import RingGeometry

transformers = pytest.importorskip("transformers")
S, F = L.SlotState, L.FinishReason
GEO = RingGeometry(16, 64, 64, 4)
PROMPTS = [list(np.random.default_rng(k).integers(3, 200, size=3 + 5 * k)) for k in range(8)]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(7)
    cfg = transformers.LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   initializer_range=0.3, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("tiny_llama")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


class Harness(RingHarness):
    """The CPU engine over the tiny model, through a private ring."""

    def __init__(self, model: Path, kv_blocks: int, max_batch: int = 16, block_size: int = 4) -> None:
        super().__init__(EngineConfig(ring_name="local", model=str(model), geometry=GEO, kv_blocks=kv_blocks,
                                      block_size=block_size, max_batch=max_batch))


def run_alone(h: Harness, prompt: list[int], max_new: int, **kw: Any) -> list[int]:
    h.submit(0, prompt, max_new, **kw)
    h.run()
    return h.result(0)[0]


def run_together(h: Harness, prompts: list[list[int]], max_new: int, **kw: Any) -> list[list[int]]:
    for i, p in enumerate(prompts):
        h.submit(i, p, max_new, **kw)
    h.run()
    return [h.result(i)[0] for i in range(len(prompts))]


def test_batch_invariance_greedy(tiny_llama: Path) -> None:
    h = Harness(tiny_llama, kv_blocks=256)
    alone = [run_alone(h, p, 20, ignore_eos=True) for p in PROMPTS]
    assert run_together(h, PROMPTS, 20, ignore_eos=True) == alone
    assert all(len(a) == 20 for a in alone)
    h.check_blocks_returned()


def test_preemption_and_resume_give_identical_tokens(tiny_llama: Path) -> None:
    h = Harness(tiny_llama, kv_blocks=40)  # 160 token slots for 8 requests needing up to 58 each
    alone = [run_alone(h, p, 20, ignore_eos=True) for p in PROMPTS]
    together = run_together(h, PROMPTS, 20, ignore_eos=True)
    assert h.backend.policy.preemptions > 0
    assert together == alone
    h.check_blocks_returned()


def test_same_seed_same_tokens_alone_and_in_batch(tiny_llama: Path) -> None:
    h = Harness(tiny_llama, kv_blocks=256)
    kw = dict(temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = run_alone(h, PROMPTS[3], 16, **kw)
    assert run_alone(h, PROMPTS[3], 16, **kw) == alone
    together = run_together(h, [PROMPTS[3]] + PROMPTS[:5], 16, **kw)
    assert together[0] == alone
    other_seed = run_alone(h, PROMPTS[3], 16, **{**kw, "seed": 99})
    assert other_seed != alone
    h.check_blocks_returned()


def test_cancellation_frees_blocks(tiny_llama: Path) -> None:
    h = Harness(tiny_llama, kv_blocks=256)
    h.submit(0, PROMPTS[2], 60, ignore_eos=True)
    h.submit(1, PROMPTS[1], 10, ignore_eos=True)
    for _ in range(4):
        h.engine.step()
    assert h.writer.cancel(0, h.seqs[0])
    h.run()
    out0, why0 = h.result(0)
    out1, why1 = h.result(1)
    assert why0 == F.CANCELLED and 0 < len(out0) < 60
    assert why1 == F.LENGTH and len(out1) == 10
    h.check_blocks_returned()


def test_cancel_before_claim(tiny_llama: Path) -> None:
    h = Harness(tiny_llama, kv_blocks=256)
    h.submit(0, PROMPTS[0], 10)
    h.writer.cancel(0, h.seqs[0])
    h.run()
    assert h.result(0) == ([], F.CANCELLED)
    h.check_blocks_returned()


def test_request_larger_than_cache_is_refused(tiny_llama: Path) -> None:
    h = Harness(tiny_llama, kv_blocks=8)  # 32 tokens of cache
    h.submit(0, PROMPTS[4], 30)
    h.run()
    assert h.result(0) == ([], F.ERROR)
    assert int(h.ring.slots[0]["error_code"]) == L.ErrorCode.NO_CAPACITY
    h.check_blocks_returned()


def test_stop_id_and_max_tokens(tiny_llama: Path) -> None:
    h = Harness(tiny_llama, kv_blocks=256)
    free = run_alone(h, PROMPTS[5], 12, ignore_eos=True)
    stop = free[5]
    first = free.index(stop)
    h.submit(0, PROMPTS[5], 12, ignore_eos=True, stop_ids=(stop,))
    h.run()
    out, why = h.result(0)
    assert why == F.STOP_ID and out == free[:first]  # the stop token itself is not emitted
    h.check_blocks_returned()


def test_logprobs_published(tiny_llama: Path) -> None:
    h = Harness(tiny_llama, kv_blocks=256)
    h.submit(0, PROMPTS[1], 6, ignore_eos=True, logprobs=True, top_logprobs=3)
    h.run()
    out, _ = h.result(0)
    lps = h.ring.logprobs[0, :6]
    tops = h.ring.top_logprobs[0, :6, :3]
    assert (lps <= 0).all() and (lps > -50).all()
    assert tops["token"][:, 0].tolist() == out  # greedy: the chosen token is the most likely one
    np.testing.assert_allclose(tops["logprob"][:, 0], lps, rtol=1e-5)
    assert (np.diff(tops["logprob"], axis=1) <= 0).all()
    h.check_blocks_returned()


@pytest.fixture(autouse=True)
def _fresh_seed() -> Iterator[None]:
    torch.manual_seed(0)
    yield


def test_prompt_ids_outside_the_vocabulary_are_refused(tiny_llama: Path) -> None:
    h = Harness(tiny_llama, kv_blocks=64)
    h.submit(0, [5, 6, 211], 4)  # vocab is 211: id 211 does not exist
    h.submit(1, [5, 6, 7], 4, ignore_eos=True)
    h.run()
    assert h.result(0) == ([], F.ERROR)
    assert int(h.ring.slots[0]["error_code"]) == L.ErrorCode.BAD_PARAMS
    assert len(h.result(1)[0]) == 4  # the engine keeps serving
    h.check_blocks_returned()
