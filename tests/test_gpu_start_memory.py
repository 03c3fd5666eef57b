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
                                         r"holds 40000 blocks by --gpu-memory-utilization 0\.95 .* --max-num-seqs "
                                         r"\(256\)"):
        with memory_for("capturing the graphs", cfg, 40000):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore lines")
    with pytest.raises(ValueError, match="by --kv-blocks 512"):
        with memory_for("allocating the KV cache", EngineConfig(backend="persistent", kv_blocks=512), 512):
            raise torch.cuda.OutOfMemoryError("")
    with pytest.raises(RuntimeError, match="other"):
        with memory_for("capturing the graphs", cfg, 1):
            raise RuntimeError("other")
