"""A model is allocated in the dtype it is served in: never first in float32 and converted, which held twice a
bf16 model's bytes at once and, on a GPU, left them in torch's cache, out of the KV cache's sizing."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpu_engine.models.config import ModelConfig
from gpu_engine.models.loader import build_empty, init_random

CONFIG = ModelConfig.from_hf({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 32, "eos_token_id": 2,
})


class Allocations(TorchDispatchMode):
    """The bytes of every tensor an operator made, by dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[torch.dtype, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.bytes[t.dtype] = self.bytes.get(t.dtype, 0) + t.numel() * t.element_size()
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_is_never_allocated_in_float32(dtype: torch.dtype) -> None:
    with Allocations() as seen:
        model = build_empty(CONFIG, dtype, "cpu")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert seen.bytes.get(dtype, 0) >= weights
    # the rotary tables are float32 by design: a few KiB here, not a float32 copy of the weights
    assert seen.bytes.get(torch.float32, 0) < weights // 10, seen.bytes


def test_the_model_built_in_its_dtype_draws_the_same_weights() -> None:
    """Random weights are drawn in float32 and rounded once, as before: bf16 equals the float32 model rounded."""
    full, half = build_empty(CONFIG, torch.float32, "cpu"), build_empty(CONFIG, torch.bfloat16, "cpu")
    init_random(full, seed=3)
    init_random(half, seed=3)
    for (name, a), (_, b) in zip(full.named_parameters(), half.named_parameters(), strict=True):
        assert torch.equal(a.to(torch.bfloat16), b), name
    assert half.rope.inv_freq.dtype == torch.float32
