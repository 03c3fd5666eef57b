"""The KV cache sized after the graphs (`gpu_engine.gpu.kv_memory`): a graph captured while the cache holds a granule
of blocks writes and reads blocks backed after the capture, at the addresses it holds; what was written before a
growth stays; the backed memory follows the blocks; closing gives it back."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPE = SimpleNamespace(num_layers=3, num_kv_heads=4, head_dim=128)


def _cache(dtype: torch.dtype = torch.bfloat16, reserve: int = 1 << 30):
    from gpu_engine.gpu.kv_memory import GrowableKVCache

    torch.cuda.init()
    torch.empty(1, device="cuda")  # the context current on this thread before the driver calls
    return GrowableKVCache(SHAPE, 16, dtype, reserve)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_graph_captured_before_growth_writes_grown_blocks(dtype: torch.dtype) -> None:
    from gpu_engine.kernels.kv_cache import write_kv

    kv = _cache(dtype)
    first = kv.num_blocks
    assert first >= 1 and kv.k[0].shape == (first, 16, 4, 128) and kv.k[0].dtype == dtype
    assert all(int(t.view(torch.uint8).count_nonzero()) == 0 for t in kv.k + kv.v)  # backed memory reads as zero
    act = torch.bfloat16
    k = torch.randn(2, 4, 128, device="cuda", dtype=act)
    v = torch.randn(2, 4, 128, device="cuda", dtype=act)
    slots = torch.tensor([3, 5], device="cuda", dtype=torch.int64)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(SHAPE.num_layers):
            write_kv(k, v, kv.k[i], kv.v[i], slots)
    graph.replay()  # slots 3 and 5 of block 0, before the growth
    torch.cuda.synchronize()
    before = kv.k[2][0, 3].float().clone()
    kv.grow_to(kv.max_blocks // 2)
    assert kv.num_blocks == kv.max_blocks // 2 > first and kv.allocator.num_free == kv.num_blocks
    last = kv.num_blocks * 16 - 1
    slots.copy_(torch.tensor([last, last - 17], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    for i in range(SHAPE.num_layers):
        assert torch.equal(kv.k[i][-1, 15].float(), k[0].to(dtype).float())
        assert torch.equal(kv.v[i][-2, 14].float(), v[1].to(dtype).float())
    assert torch.equal(kv.k[2][0, 3].float(), before)  # written before the growth: kept
    assert int(kv.k[1][first:-2].view(torch.uint8).count_nonzero()) == 0  # the new blocks read as zero
    kv.close()


def test_backed_memory_follows_the_blocks_and_close_gives_it_back() -> None:
    kv = _cache(reserve=4 << 30)
    free0 = torch.cuda.mem_get_info()[0]
    blocks = kv.blocks_for(0.5, free0)
    want = min(blocks, kv.max_blocks)
    kv.grow_to(want)
    held = kv.backed_bytes
    assert want * kv.block_bytes <= held < want * kv.block_bytes + 2 * SHAPE.num_layers * kv.space.granule
    assert free0 - torch.cuda.mem_get_info()[0] >= held - 2 * SHAPE.num_layers * kv.space.granule
    kv.close()
    assert torch.cuda.mem_get_info()[0] >= free0  # the granules backed at the start came back too
    with pytest.raises(ValueError, match="reserved ranges hold"):
        _cache(reserve=64 << 20).grow_to(10**9)
