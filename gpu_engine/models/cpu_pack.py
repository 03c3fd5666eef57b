"""The CPU serving form of a loaded model: linears packed as fp16, the token table as group-int8.

``pack_for_cpu`` rewrites a float32 ``CausalLM`` in place, one module at a time (each fp32 weight is
freed as soon as its packed form exists): every ``nn.Linear`` becomes a ``PackedLinear`` (fp16 weights,
fp32 arithmetic), the embedding a ``GroupInt8Embedding``; norms, RoPE tables and MoE expert tensors stay
float32. A tied ``lm_head`` gets its own packed copy (the matmul and the lookup want different layouts).
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch
from torch import nn

from gpu_engine.kernels.cpu_linear import GroupInt8Embedding, Int4Linear, PackedLinear
from gpu_engine.models.decoder import CausalLM


def pack_for_cpu(model: CausalLM, int4_layers: bool = False) -> CausalLM:
    """Replace the float32 linears and embedding of ``model`` by their packed CPU forms; returns it."""
    for p in model.parameters():
        if p.device.type != "cpu" or p.dtype != torch.float32:
            raise ValueError(f"pack_for_cpu: needs a float32 CPU model, found {p.dtype} on {p.device}")
    if model.config.tie_word_embeddings:
        model.lm_head = PackedLinear(model.embed.weight)  # type: ignore[assignment]
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and not isinstance(module, PackedLinear):
            int4 = int4_layers and module.bias is None and name.startswith("layers.")
            _replace(model, name, Int4Linear(module.weight) if int4 else PackedLinear(module.weight, module.bias))
    model.embed = GroupInt8Embedding(model.embed.weight)  # type: ignore[assignment]
    _release_freed_memory()
    return model


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, attr, new)


def _release_freed_memory() -> None:
    """Hand the freed fp32 weights' pages back to the OS (glibc keeps freed heap memory otherwise)."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    trim = getattr(ctypes.CDLL(libc_name), "malloc_trim", None)
    if trim is not None:
        trim(0)
