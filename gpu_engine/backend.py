"""What every engine backend hands to ``gpu_engine.serve``: the parts of an engine built before the ring.

The CPU backend (``gpu_engine.serve``) and the GPU backends (``gpu_engine.gpu.serve_gpu``) both build a
``Backend``; neither imports the other's module for it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable
from typing import Protocol

import torch

from gpu_engine.models.config import ModelConfig
from gpu_engine.policy import Policy
from gpu_engine.runner import Runner
from shared.config import DEFAULT_MAX_NUM_SEQS, EngineConfig, gpu_visible
from shared.log import get_logger
from shared.ring import Ring

log = get_logger("engine")

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
    prompt_logprobs: bool = True  # computes prompt log-probs: the ring gets their arenas


@dataclasses.dataclass(frozen=True, slots=True)
class CpuFormats:
    """How the CPU backend holds a model: ``packed`` linears (fp16 weights, fp32 arithmetic) or dense ones
    of ``weight_dtype``, and the KV cache's dtype. ``--dtype auto`` is packed with an fp16 cache;
    ``float32`` is every tensor dequantized to fp32 (the arithmetic of ``transformers`` on the same
    weights); ``bfloat16`` and ``float16``/``half`` are dense weights and cache of that type."""

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
        if dtype in ("float16", "half"):
            return cls(packed=False, weight_dtype=torch.float16, kv_dtype=torch.float16)
        raise ValueError(f"--dtype {dtype!r}: the CPU backend takes auto, float32, bfloat16, float16 or half")


def kv_blocks_for(cfg: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype) -> int:
    """KV cache blocks on the CPU: ``--kv-blocks``, else as many as ``CPU_KV_BYTES`` holds."""
    if cfg.kv_blocks:
        return cfg.kv_blocks
    per_token = 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim * dtype.itemsize
    return max(CPU_KV_BYTES // (per_token * cfg.block_size), 1)


def choose_backend(cuda: bool, capability: tuple[int, int] | None, nvcc: str | None) -> tuple[str, str]:
    """``--backend auto``: the backend and why. The persistent scheduler is built for sm_90 with nvcc."""
    if not cuda:
        return "cpu", "no CUDA GPU visible"
    if capability == (9, 0) and nvcc:
        return "persistent", f"sm_90 GPU and nvcc at {nvcc}"
    if capability != (9, 0):
        return "host", f"CUDA GPU of compute capability {capability}, not sm_90"
    return "host", "sm_90 GPU but no nvcc to build the persistent scheduler"


def find_nvcc() -> str | None:
    """nvcc on PATH, or under CUDA_HOME / /usr/local/cuda."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        path = os.path.join(root, "bin", "nvcc") if root else ""
        if path and os.access(path, os.X_OK):
            return path
    return None


def resolve_backend(cfg: EngineConfig) -> EngineConfig:
    """The config with ``backend`` resolved (a new object; ``auto`` is resolved once, here, and logged)."""
    if cfg.backend != "auto":
        return cfg
    cuda = torch.cuda.is_available()
    capability = torch.cuda.get_device_capability() if cuda else None
    backend, why = choose_backend(cuda, capability, find_nvcc() if cuda else None)
    log.info("backend chosen", backend=backend, reason=why)
    if backend == "cpu" and cfg.max_batch == DEFAULT_MAX_NUM_SEQS["gpu"] and gpu_visible():
        # the supervisor saw a GPU (its device nodes) and took a GPU's batch; torch sees none (a CPU build of torch)
        log.warning("a GPU's batch on the CPU backend", max_num_seqs=cfg.max_batch,
                    hint="a GPU is visible but torch sees none: give --backend cpu (the CPU's default batch, "
                         f"{DEFAULT_MAX_NUM_SEQS['cpu']}) or --max-num-seqs")
    return dataclasses.replace(cfg, backend=backend)  # a CPU pick with --gpu-memory-utilization raises here
