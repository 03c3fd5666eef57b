"""The GPU engine's start when the device runs out of memory (`serve_gpu.memory_for`): a refused setting that names
the step and the settings that take the memory."""

from __future__ import annotations

import pytest
import torch

from shared.config import EngineConfig


def test_running_out_of_gpu_memory_at_the_start_is_a_refused_setting_naming_the_knobs() -> None:
    """The KV cache, the step buffers or the graphs' pool not fitting ends the start with a ValueError (printed,
    exit 2) that names the step and the settings that take the memory, not a traceback; other errors pass as they
    are."""
    from gpu_engine.gpu.serve_gpu import memory_for

    cfg = EngineConfig(backend="persistent", gpu_memory_utilization=0.95, max_batch=256)
    with pytest.raises(ValueError, match=r"ran out of memory capturing the graphs \(CUDA out of memory\. Tried .*"
                                         r"the KV cache is sized after the graphs: lower --max-num-seqs \(256\)"):
        with memory_for("capturing the graphs", cfg):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore lines")
    with pytest.raises(ValueError, match=r"allocating the KV cache \(.*holds 40000 blocks by "
                                         r"--gpu-memory-utilization 0\.95 of the memory free after the weights, the "
                                         r"step buffers and the graphs"):
        with memory_for("allocating the KV cache", cfg, 40000):
            raise torch.cuda.OutOfMemoryError("cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY")
    with pytest.raises(ValueError, match="by --kv-blocks 512"):
        with memory_for("allocating the KV cache", EngineConfig(backend="persistent", kv_blocks=512), 512):
            raise torch.cuda.OutOfMemoryError("")
    with pytest.raises(RuntimeError, match="other"):
        with memory_for("capturing the graphs", cfg, 1):
            raise RuntimeError("other")


def test_the_cache_takes_its_fraction_of_what_the_graphs_left_in_whole_granules() -> None:
    """`--gpu-memory-utilization` after the capture: the fraction of the free memory plus what the cache already
    holds (its first granules), split over its key and value tensors, each rounded down to whole 2-MiB granules so
    the memory backed never passes the fraction; a larger fraction never gives fewer blocks."""
    from gpu_engine.gpu.kv_memory import blocks_after_capture

    mib, tensors, per_block = 2**20, 96, 16 * 4 * 128 * 2  # Qwen3-30B-A3B: 48 layers, 4 KV heads, bf16
    free, backed = 12_400 * mib, tensors * 2 * mib
    blocks = blocks_after_capture(free, backed, 0.9, tensors, 2 * mib, per_block)
    per_tensor = blocks * per_block
    assert per_tensor % (2 * mib) == 0 and tensors * per_tensor <= 0.9 * (free + backed)
    assert tensors * (per_tensor + 2 * mib) > 0.9 * (free + backed)  # one granule more would pass it
    assert blocks == 7_552  # 118 MiB a tensor
    sizes = [blocks_after_capture(free, backed, f / 20, tensors, 2 * mib, per_block) for f in range(1, 21)]
    assert sizes == sorted(sizes) and sizes[-1] > sizes[0] > 0
    assert blocks_after_capture(100 * mib, 0, 1.0, tensors, 2 * mib, per_block) == 0  # not a granule a tensor
