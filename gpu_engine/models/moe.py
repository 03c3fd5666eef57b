"""Mixture-of-experts MLP: softmax router, top-k experts per token, optionally renormalised weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_engine.models.layers import silu_mul


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``top_k`` experts per token; returns (weights [T, k] float32, expert ids [T, k] int64).

    Weights are the softmax probabilities (computed in float32) of the chosen experts,
    divided by their sum when ``normalize`` is set.
    """
    probs = torch.softmax(router_logits.to(torch.float32), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class MoEMLP(nn.Module):
    """Experts stored stacked: ``gate_up`` [E, 2I, H] (gate rows first) and ``down`` [E, H, I]."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 normalize: bool) -> None:
        super().__init__()
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.top_k = top_k
        self.normalize = normalize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.router(x), self.top_k, self.normalize)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for expert in torch.unique(experts).tolist():
            token_idx, slot = torch.nonzero(experts == expert, as_tuple=True)
            h = silu_mul(F.linear(x[token_idx], self.gate_up[expert]))
            h = F.linear(h, self.down[expert]) * weights[token_idx, slot, None]
            out.index_add_(0, token_idx, h)
        return out
