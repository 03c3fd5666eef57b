"""Weights whose values are exactly what GGUF's Q4_1 dequantizer gives, for the quantized CPU forms' tests."""

from __future__ import annotations

import torch


def q4_1_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Values as GGUF's Q4_1 dequantizer gives them: fl(d * q + m), fp16 d and m, each group using 0 and 15."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols // 32, 32), generator=gen).float()
    codes[..., 3], codes[..., 17] = 0, 15
    d = (torch.rand(rows, cols // 32, 1, generator=gen) * 0.02).half().float()
    m = (-torch.rand(rows, cols // 32, 1, generator=gen) * 0.15).half().float()
    return (d * codes + m).reshape(rows, cols)
