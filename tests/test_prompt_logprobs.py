"""Prompt log-probs in the engine and the ring: the CPU engine's entries against ``transformers`` on the same
tiny random weights (whole prompts and prompts cut into chunks), vLLM's ranks, the feature bit, the ring's
minor-5 arenas (and a corrupt header's), what a ring of minor 4 says, and the gateway's part (n > 1, the
out-of-memory error)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from dpu_gateway.generation import engine_error
from dpu_gateway.params import Plan
from gpu_engine.engine import FEATURES, RingEngine, features
from gpu_engine.prompt_logprobs import score
from shared import ring_layout as L
from shared.messages import Finished, Sampling
from shared.ring import RingError, RingGeometry, attach_ring, local_ring, validate_header
from shared.slots import SlotRequest, SlotWriter

transformers = pytest.importorskip("transformers")

GEO = RingGeometry(4, 48, 8, 4, 40)
PROMPT = [5, 9, 13, 9, 5, 40, 41, 77, 3, 3, 3, 60, 12, 90, 1, 7, 22, 18, 64, 30]
Run = Callable[..., tuple[np.ndarray, np.ndarray, list[int]]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, str]:
    torch.manual_seed(5)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                   initializer_range=0.3, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    return model, str(path)


def engine_run(path: str, budget: int, prefix_caching: bool = False) -> Run:
    """One request at a time through the CPU engine over a local ring: (entries, alternatives, output)."""
    from gpu_engine.serve import build_cpu_backend  # noqa: PLC0415
    from shared.config import EngineConfig  # noqa: PLC0415

    backend = build_cpu_backend(EngineConfig(ring_name="local", model=path, geometry=GEO, kv_blocks=64, block_size=4,
                                             max_batch=4, dtype="float32", max_num_batched_tokens=budget,
                                             no_enable_prefix_caching=not prefix_caching))

    def run(prompt: list[int], k: int, max_new: int = 2) -> tuple[np.ndarray, np.ndarray, list[int]]:
        ring = local_ring(GEO)
        engine = RingEngine(ring, backend.runner, backend.policy, backend.eos_ids, backend.max_context,
                            backend.vocab_size)
        writer = SlotWriter(ring)
        seq = writer.try_reserve(0, 0)
        assert seq is not None
        writer.publish(0, seq, SlotRequest(5, np.array(prompt, np.int32),
                                           Sampling(max_new, ignore_eos=True, prompt_logprobs=k)))
        for _ in range(1000):
            if not engine.step() and not engine.by_slot:
                break
        slot = ring.slots[0]
        assert slot["state"] == L.SlotState.DECODE_COMPLETED and slot["error_code"] == L.ErrorCode.OK
        entries, tops = ring.read_prompt_logprobs(0, 1, len(prompt))
        return entries, tops, ring.output_tokens[0, : int(slot["generated"])].tolist()

    return run


def reference(model: object, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax [len(prompt) - 1, vocab] of the distributions predicting prompt tokens 1.."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()  # type: ignore[operator]
    return torch.log_softmax(logits, dim=-1)


def check(entries: np.ndarray, tops: np.ndarray, ref: torch.Tensor, prompt: list[int], k: int) -> None:
    actual = ref.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    assert np.allclose(entries["logprob"], actual.numpy(), atol=1e-4)
    lo = 1 + (ref > actual[:, None] + 1e-4).sum(1)  # ranks as transformers' numbers allow
    hi = 1 + (ref > actual[:, None] - 1e-4).sum(1)
    assert ((entries["rank"] >= lo.numpy()) & (entries["rank"] <= hi.numpy())).all()
    best, ids = torch.topk(ref, k, dim=-1)
    assert np.allclose(tops["logprob"][:, :k], best.numpy(), atol=1e-4)
    assert (np.diff(tops["logprob"][:, :k], axis=1) <= 0).all()  # best first
    assert (tops["token"][:, :k] == ids.numpy()).mean() > 0.95  # near-ties may swap


@pytest.mark.parametrize("budget", [256, 8])  # the whole prompt in one step; in chunks of 8, 4 (decodes), ...
def test_prompt_logprobs_match_transformers(tiny, budget: int) -> None:
    model, path = tiny
    run = engine_run(path, budget)
    entries, tops, out = run(PROMPT, 3)
    check(entries, tops, reference(model, PROMPT), PROMPT, 3)
    assert len(out) == 2
    assert run(PROMPT, -1)[2] == out  # the same tokens with and without prompt log-probs


def test_no_prefix_cache_lookup_for_prompt_logprobs(tiny) -> None:
    model, path = tiny
    run = engine_run(path, 256, prefix_caching=True)
    run(PROMPT, -1)  # caches the prompt's blocks
    entries, tops, _ = run(PROMPT, 2)
    check(entries, tops, reference(model, PROMPT), PROMPT, 2)


def test_score_ranks_and_top_k() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 0.0, 0.0, 1.0], [0.0, 3.0, 1.0, 3.0]])
    lp, rank, ids, top = score(logits, torch.tensor([2, 0, 1]), 2)
    # vLLM's rank: the tokens at least as likely, the token itself included (a tie counts against it)
    assert rank.tolist() == [3, 1, 2]
    assert ids[1].tolist() == [0, 3] and torch.allclose(lp, torch.log_softmax(logits, -1)[[0, 1, 2], [2, 0, 1]])
    assert (top[:, 0] >= top[:, 1]).all()


def test_prompt_logprobs_are_advertised_only_where_the_ring_has_rows() -> None:
    assert features(local_ring(GEO)) & L.SamplingFeatures.PROMPT_LOGPROBS
    assert features(local_ring(GEO)) == FEATURES
    none = features(local_ring(RingGeometry(4, 48, 8, 4, 0)))  # --max-prompt-logprobs-tokens 0
    assert none == FEATURES & ~L.SamplingFeatures.PROMPT_LOGPROBS


def test_ring_arenas_follow_the_minor_4_segment() -> None:
    ring = local_ring(GEO)
    h = ring.read_header()
    assert int(h["total_bytes"]) == GEO.total_bytes < GEO.segment_bytes == int(h["segment_bytes"])
    assert int(h["prompt_logprob_tokens"]) == 40 and GEO.prompt_logprob_arena_offset >= GEO.total_bytes
    assert attach_ring(ring.transport).geometry == GEO
    none = RingGeometry(4, 48, 8, 4, 0)
    assert none.segment_bytes == none.total_bytes  # no arenas: the segment of minor 4


def test_the_header_holds_the_rows_a_slot_has() -> None:
    """--max-prompt-logprobs-tokens above max_prompt_tokens: the header says R = max_prompt_tokens, as ring.fbs."""
    wide = RingGeometry(4, 48, 8, 4, 1024)
    ring = local_ring(wide)
    assert int(ring.read_header()["prompt_logprob_tokens"]) == 48 == wide.prompt_logprob_rows
    seen = attach_ring(ring.transport).geometry
    assert seen.prompt_logprob_rows == 48 and seen.segment_bytes == wide.segment_bytes


@pytest.mark.parametrize(("field", "delta", "message"), [
    ("prompt_logprob_arena_offset", 64, "prompt-logprob arenas"),
    ("prompt_top_logprob_arena_offset", -64, "prompt-logprob arenas"),
    ("segment_bytes", 64, "prompt-logprob arenas"),
    ("prompt_logprob_bytes", 4, "prompt-logprob arenas"),
])
def test_a_corrupt_prompt_logprob_header_is_refused(field: str, delta: int, message: str) -> None:
    ring = local_ring(GEO)
    h = ring.read_header()
    h[field] = int(h[field]) + delta
    with pytest.raises(RingError, match=f"corrupt header: .*{message}"):
        validate_header(h, ring.transport.size, "bad")


def test_a_minor_4_header_has_no_prompt_logprob_rows() -> None:
    ring = local_ring(RingGeometry(4, 48, 8, 4, 0))
    h = ring.read_header()
    h["schema_minor"], h["prompt_logprob_tokens"], h["segment_bytes"] = 4, 99, 0  # what minor 4 left reserved
    assert validate_header(h, ring.transport.size, "old").prompt_logprob_rows == 0


def test_the_writer_refuses_what_the_rows_cannot_hold() -> None:
    writer = SlotWriter(local_ring(GEO))
    with pytest.raises(ValueError, match="at most 40"):
        writer.check(SlotRequest(1, np.arange(41, dtype=np.int32), Sampling(2, prompt_logprobs=0)))
    with pytest.raises(ValueError, match="prompt_logprobs is 5"):
        writer.check(SlotRequest(1, np.arange(4, dtype=np.int32), Sampling(2, prompt_logprobs=5)))
    writer.check(SlotRequest(1, np.arange(41, dtype=np.int32), Sampling(2)))  # without them: the prompt row's 48


def test_only_the_first_choice_asks_for_prompt_logprobs() -> None:
    """n > 1: the siblings show the first choice's entries (dpu_gateway/generation.py) instead of computing them."""
    for seed in (None, 7):
        plan = Plan(Sampling(4, seed=seed, prompt_logprobs=2), [], n=3, prompt_logprobs=2)
        assert [c.prompt_logprobs for c in plan.choices()] == [2, -1, -1]
        assert [c.seed for c in plan.choices()][0] == seed


def test_out_of_memory_is_a_clear_error() -> None:
    err = engine_error(Finished(1, L.FinishReason.ERROR, L.ErrorCode.OUT_OF_MEMORY, 0, 5))
    assert err.status == 503 and err.code == "out_of_memory" and "prompt's log-probs" in err.message
