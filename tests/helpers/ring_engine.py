"""A CPU ``RingEngine`` over a private ring, stepped by hand, with a frontend-side writer: what the
engine tests drive (submit a slot, step until idle, read a slot's result)."""

from __future__ import annotations

from typing import Any

import numpy as np

from gpu_engine.engine import RingEngine
from gpu_engine.policy import Policy
from gpu_engine.serve import build_cpu_backend
from shared import ring_layout as L
from shared.config import EngineConfig
from shared.messages import Sampling
from shared.ring import Ring, local_ring
from shared.slots import SlotRequest, SlotWriter


class RingHarness:
    def __init__(self, cfg: EngineConfig) -> None:
        self.backend = b = build_cpu_backend(cfg)
        self.ring: Ring = local_ring(cfg.geometry)
        self.engine = RingEngine(self.ring, b.runner, b.policy, b.eos_ids, b.max_context, b.vocab_size)
        self.policy: Policy = b.policy
        self.writer = SlotWriter(self.ring)
        self.seqs: dict[int, int] = {}
        self.free_at_start = self.policy.alloc.num_free

    def submit(self, idx: int, prompt: list[int], max_new: int, **kw: Any) -> None:
        seq = self.writer.try_reserve(idx, int(self.ring.slots[idx]["seq"]))
        assert seq is not None
        self.writer.publish(idx, seq, SlotRequest(idx + 100, np.array(prompt, np.int32), Sampling(max_new, **kw)))
        self.seqs[idx] = seq

    def run(self, max_steps: int = 20_000) -> None:
        for _ in range(max_steps):
            if not self.engine.step() and not self.engine.by_slot:
                return
        raise AssertionError("engine did not finish")

    def result(self, idx: int) -> tuple[list[int], int]:
        s = self.ring.slots[idx]
        assert s["state"] == L.SlotState.DECODE_COMPLETED
        out = self.ring.output_tokens[idx, : int(s["generated"])].tolist()
        assert self.writer.release(idx, self.seqs[idx])
        return out, int(s["finish_reason"])

    def check_blocks_returned(self) -> None:
        assert self.policy.alloc.num_free == self.free_at_start
