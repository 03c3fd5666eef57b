"""Packed batches over the paged cache: metadata, batch invariance, mixed prefill + decode steps."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpu_engine.kv_cache import KVCache
from gpu_engine.models import loader
from gpu_engine.models.attention import SeqStep, build_metadata
from gpu_engine.models.config import ModelConfig
from gpu_engine.models.decoder import CausalLM
from gpu_engine.models.loader import load_model
from gpu_engine.models.reference import greedy_generate

BLOCK = 4
TINY = {
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 211, "hidden_size": 48, "intermediate_size": 80,
    "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": True,
    "eos_token_id": [5, 6], "bos_token_id": 1,
}
PROMPTS = [[(7 * i + 3 * j) % 211 for j in range(n)] for i, n in enumerate([1, 9, 4, 17, 2, 12, 6, 23])]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[CausalLM, ModelConfig]:
    path = tmp_path_factory.mktemp("tiny")
    (path / "config.json").write_text(json.dumps(TINY))
    return load_model(path, random_weights=True, seed=3)


@pytest.fixture
def kv(tiny: tuple[CausalLM, ModelConfig]) -> Iterator[KVCache]:
    cache = KVCache(tiny[1], num_blocks=96, block_size=BLOCK)
    yield cache
    assert cache.allocator.num_free == cache.allocator.num_total


def test_build_metadata_layout() -> None:
    meta = build_metadata([SeqStep(0, 3, [7, 2]), (5, 1, [4, 9]), (2, 2, [1])], block_size=BLOCK)
    assert meta.positions.tolist() == [0, 1, 2, 5, 2, 3]
    assert meta.cu_seqlens_q.tolist() == [0, 3, 4, 6]
    assert meta.context_lens.tolist() == [3, 6, 4]
    assert meta.block_tables.tolist() == [[7, 2], [4, 9], [1, -1]]
    assert meta.slot_mapping.tolist() == [28, 29, 30, 37, 6, 7]
    assert (meta.positions.dtype, meta.cu_seqlens_q.dtype, meta.slot_mapping.dtype) == (
        torch.int64, torch.int32, torch.int64)
    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        build_metadata([(4, 5, [0, 1])], block_size=BLOCK)


def test_random_weights_are_seeded(tiny: tuple[CausalLM, ModelConfig], tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    again, _ = load_model(tmp_path, random_weights=True, seed=3)
    other, _ = load_model(tmp_path, random_weights=True, seed=4)
    w = tiny[0].layers[0].attn.qkv.weight
    assert torch.equal(again.layers[0].attn.qkv.weight, w)
    assert not torch.equal(other.layers[0].attn.qkv.weight, w)
    assert abs(float(w.std()) - 0.02) < 0.002
    assert torch.equal(tiny[0].norm.weight, torch.ones(48))
    assert tiny[0].lm_head.weight is tiny[0].embed.weight


def test_random_weights_of_a_small_model_come_from_one_stream(tiny: tuple[CausalLM, ModelConfig]) -> None:
    """Every test model's weights: one generator seeded by the seed, in parameter order, norms left out."""
    gen = torch.Generator().manual_seed(3)
    for name, param in tiny[0].named_parameters():
        if not name.endswith("norm.weight"):
            assert torch.equal(param, torch.randn(param.shape, generator=gen) * loader.INIT_STD), name


def test_random_weights_of_a_large_model_come_in_seeded_chunks(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    """Past `ONE_STREAM_PARAMS` values (here lowered to make the tiny model large), chunk c of parameter p comes
    from its own generator seeded by (seed, p, c): the same values whatever the number of threads, other values
    for another seed, every chunk different, norms ones."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    monkeypatch.setattr(loader, "ONE_STREAM_PARAMS", 1000)
    monkeypatch.setattr(loader, "CHUNK_VALUES", 1000)
    first, _ = load_model(tmp_path, random_weights=True, seed=3)
    monkeypatch.setattr(loader.os, "sched_getaffinity", lambda pid: {0})
    one_thread, _ = load_model(tmp_path, random_weights=True, seed=3)
    other, _ = load_model(tmp_path, random_weights=True, seed=4)
    for (name, a), b, c in zip(first.named_parameters(), one_thread.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b), name
        if name.endswith("norm.weight"):
            assert torch.equal(a, torch.ones_like(a)), name
        else:
            assert not torch.equal(a, c), name
    w = first.layers[0].attn.qkv.weight.view(-1)
    assert w.numel() > 2000 and not torch.equal(w[:1000], w[1000:2000])
    index = [n for n, _ in first.named_parameters()].index("layers.0.attn.qkv.weight")
    gen = torch.Generator().manual_seed(((3 * 1_000_003 + index) * 1_000_033 + 1) % 2**63)
    assert torch.equal(w[1000:2000], torch.randn(1000, generator=gen) * loader.INIT_STD)
    assert abs(float(w.std()) - 0.02) < 0.002


def test_batch_invariance(tiny: tuple[CausalLM, ModelConfig], kv: KVCache) -> None:
    model, _ = tiny
    together = greedy_generate(model, kv, PROMPTS, 10)
    for b, prompt in enumerate(PROMPTS):
        alone = greedy_generate(model, kv, [prompt], 10)
        assert alone.tokens[0] == together.tokens[b], f"sequence {b}"
        torch.testing.assert_close(alone.logits[:, 0], together.logits[:, b], rtol=1e-5, atol=1e-6)


def _staggered(model: CausalLM, kv: KVCache, steps: int) -> list[list[int]]:
    """Sequence i joins at step i, so most steps mix one prefill with several decodes."""
    tables: list[list[int]] = [[] for _ in PROMPTS]
    cached, pending = [0] * len(PROMPTS), [list(p) for p in PROMPTS]
    out: list[list[int]] = [[] for _ in PROMPTS]
    for step in range(steps + len(PROMPTS)):
        live = [b for b in range(len(PROMPTS)) if b <= step and len(out[b]) < steps]
        if not live:
            break
        for b in live:
            tables[b] += kv.allocator.allocate(kv.blocks_needed(cached[b] + len(pending[b])) - len(tables[b]))
        meta = build_metadata([(cached[b], len(pending[b]), tables[b]) for b in live], BLOCK)
        ids = torch.tensor([t for b in live for t in pending[b]])
        for b, tok in zip(live, model(ids, meta, kv).argmax(-1).tolist(), strict=True):
            cached[b] += len(pending[b])
            pending[b] = [tok]
            out[b].append(tok)
    for table in tables:
        kv.allocator.free(table)
    return out


def test_mixed_prefill_and_decode(tiny: tuple[CausalLM, ModelConfig], kv: KVCache) -> None:
    model, _ = tiny
    mixed = _staggered(model, kv, 8)
    together = greedy_generate(model, kv, PROMPTS, 8)
    assert mixed == together.tokens


def test_bf16_cache(tiny: tuple[CausalLM, ModelConfig], tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    model, config = load_model(tmp_path, random_weights=True, seed=3, dtype=torch.bfloat16)
    kv = KVCache(config, 32, BLOCK, dtype=torch.bfloat16)
    result = greedy_generate(model, kv, PROMPTS[:3], 3)
    assert result.logits.dtype == torch.float32 and torch.isfinite(result.logits).all()
    assert kv.allocator.num_free == 32
