"""What every engine backend hands to ``gpu_engine.serve``: the parts of an engine built before the ring.

The CPU backend (``gpu_engine.serve``) and the GPU backends (``gpu_engine.gpu.serve_gpu``) both build a
``Backend``; neither imports the other's module for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import torch

from gpu_engine.models.config import ModelConfig
from gpu_engine.policy import Policy
from gpu_engine.runner import Runner
from shared.config import EngineConfig
from shared.ring import Ring

CPU_KV_BYTES = 1 << 30  # KV budget on the CPU backend when --kv-blocks is not given


class Servable(Protocol):
    def serve(self) -> None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Backend:
    """Everything a RingEngine needs besides the ring, built before the ring exists."""

    runner: Runner | None
    policy: Policy
    eos_ids: tuple[int, ...]
    max_context: int
    vocab_size: int
    make_engine: Callable[[Ring], Servable] | None = None  # persistent mode: its own engine


@dataclasses.dataclass(frozen=True, slots=True)
class CpuFormats:
    """How the CPU backend holds a model: ``packed`` linears (fp16 weights, fp32 arithmetic) or dense ones
    of ``weight_dtype``, and the KV cache's dtype. ``--dtype auto`` is packed with an fp16 cache;
    ``float32`` is every tensor dequantized to fp32 (the arithmetic of ``transformers`` on the same
    weights); ``bfloat16`` is dense bf16 weights and cache."""

    packed: bool
    weight_dtype: torch.dtype
    kv_dtype: torch.dtype

    @classmethod
    def for_dtype(cls, dtype: str) -> CpuFormats:
        if dtype == "auto":
            return cls(packed=True, weight_dtype=torch.float32, kv_dtype=torch.float16)
        if dtype == "float32":
            return cls(packed=False, weight_dtype=torch.float32, kv_dtype=torch.float32)
        if dtype == "bfloat16":
            return cls(packed=False, weight_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
        raise ValueError(f"--dtype {dtype!r}: the CPU backend takes auto, float32 or bfloat16")


def kv_blocks_for(cfg: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype) -> int:
    """KV cache blocks on the CPU: ``--kv-blocks``, else as many as ``CPU_KV_BYTES`` holds."""
    if cfg.kv_blocks:
        return cfg.kv_blocks
    per_token = 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim * dtype.itemsize
    return max(CPU_KV_BYTES // (per_token * cfg.block_size), 1)
