"""Small building blocks: RMSNorm, the SiLU-gated product, and the dense gated MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_engine.kernels import cpu_fused


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, normalised in float32 and cast back before the scale."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fused = False  # the CPU serving form (``cpu_pack``): one C call on float32 [T, size] rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
            return cpu_fused.rms_norm(x, self.weight, self.eps)
        x32 = x.to(torch.float32)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where the last dim of ``gate_up`` is ``[gate | up]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class GatedMLP(nn.Module):
    """Dense SwiGLU MLP with the gate and up projections fused into one ``[2I, H]`` weight."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP of x; with ``residual`` (the CPU serving form's linears only) ``residual += mlp(x)`` in place,
        returned."""
        act = silu_mul(self.gate_up(x))
        return self.down(act) if residual is None else self.down(act, out=residual)
