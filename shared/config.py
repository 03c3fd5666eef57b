"""Frozen, validated configuration objects, one per process, built once at start-up."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from shared.ring import RingGeometry


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the engine process needs; ``blink engine`` builds it from its flags."""

    ring_name: str
    model: str | None = None          # HF directory or .gguf; None: the embedded default
    random_weights: bool = False
    backend: str = "cpu"              # cpu | host | persistent
    dtype: str = "auto"               # auto | float32 | bfloat16
    geometry: RingGeometry = RingGeometry()
    block_size: int = 16
    kv_blocks: int = 0                # 0: sized from memory
    max_batch: int = 64
    heartbeat_interval_s: float = 0.1
    seed: int = 0
    threads: int = 0                  # CPU backend's torch threads; 0: all cores this process may use but one

    @property
    def cpu_threads(self) -> int:
        """Threads for the CPU backend: one core is left to the frontend services, whose polling
        would otherwise fight OpenMP's spinning workers for the same cores."""
        if self.threads:
            return self.threads
        return max(1, len(os.sched_getaffinity(0)) - 1)

    def __post_init__(self) -> None:
        if self.backend not in ("cpu", "host", "persistent"):
            raise ValueError(f"backend must be cpu, host or persistent, got {self.backend!r}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.block_size < 1 or self.max_batch < 1 or self.kv_blocks < 0 or self.threads < 0:
            raise ValueError("block_size and max_batch must be >= 1, kv_blocks >= 0")
        if self.model is not None and not Path(self.model).exists():
            raise ValueError(f"model path {self.model} does not exist")
