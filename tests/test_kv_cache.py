"""BlockAllocator bookkeeping and KVCache layout."""

from __future__ import annotations

import pytest
import torch

from gpu_engine.kv_cache import BlockAllocator, KVCache, NoFreeBlocks
from gpu_engine.models.config import ModelConfig

CONFIG = ModelConfig(
    family="llama", vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=3, num_heads=4,
    num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None,
    max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=None, eos_token_ids=(),
)


def test_allocate_and_free_round_trip() -> None:
    alloc = BlockAllocator(8)
    a = alloc.allocate(3)
    b = alloc.allocate(5)
    assert sorted(a + b) == list(range(8))
    assert alloc.num_free == 0 and alloc.num_total == 8
    alloc.free(a)
    assert alloc.num_free == 3
    assert sorted(alloc.allocate(3)) == sorted(a)
    alloc.free(a)
    alloc.free(b)
    assert alloc.num_free == 8


def test_no_free_blocks_allocates_nothing() -> None:
    alloc = BlockAllocator(4)
    held = alloc.allocate(3)
    with pytest.raises(NoFreeBlocks, match="requested 2 blocks, 1 free of 4"):
        alloc.allocate(2)
    assert alloc.num_free == 1
    alloc.free(held)
    assert alloc.allocate(0) == [] and alloc.num_free == 4


@pytest.mark.parametrize("bad", [[0, 0], [5], [1, 2, 1]])
def test_double_or_bad_free_detected_and_atomic(bad: list[int]) -> None:
    alloc = BlockAllocator(4)
    held = alloc.allocate(3)  # ids 0, 1, 2
    with pytest.raises(ValueError, match="double free|out of range"):
        alloc.free(bad)
    assert alloc.num_free == 1  # nothing was freed by the failed call
    alloc.free(held)
    with pytest.raises(ValueError, match="double free of block 0"):
        alloc.free([0])
    assert alloc.num_free == 4


def test_kv_cache_layout() -> None:
    cache = KVCache(CONFIG, num_blocks=5, block_size=4, dtype=torch.bfloat16)
    assert len(cache.k) == len(cache.v) == 3
    assert cache.k[0].shape == (5, 4, 2, 8) and cache.v[2].dtype == torch.bfloat16
    assert cache.k[0].data_ptr() != cache.k[1].data_ptr()
    assert [cache.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert cache.allocator.num_total == 5
    with pytest.raises(ValueError):
        KVCache(CONFIG, num_blocks=0, block_size=4)
