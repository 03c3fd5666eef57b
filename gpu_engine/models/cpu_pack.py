"""The CPU serving form of a loaded model: quantized weights kept quantized, the rest packed as fp16.

``pack_for_cpu`` rewrites a float32 ``CausalLM`` in place, one module at a time (each fp32 weight is
freed as soon as its packed form exists). Every ``nn.Linear`` whose weight is exactly a GGUF Q4_1
tensor's dequantized values becomes a ``Q4Linear`` (those Q4_1 groups, fp32 arithmetic: every weight
exact), any other a ``PackedLinear`` (fp16 weights, fp32 arithmetic); ``int4_layers`` makes the decoder
layers' linears ``Int4Linear`` instead (bf16 activations). The embedding becomes a ``GroupInt8Embedding``;
a tied ``lm_head`` multiplies over that table's own int8 codes (``Q8Head``) when the table holds them
losslessly (a Q8_0 GGUF table), else gets a packed fp16 copy. Norms, RoPE tables and MoE expert tensors
stay float32. Without the quantized kernels (``quant_kernels_available``) everything packs as fp16. With
them, the layers' small ops run fused in C (``fuse_small_ops``), except with ``int4_layers``.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch
from torch import nn

from gpu_engine.kernels.cpu_linear import (
    GroupInt8Embedding,
    Int4Linear,
    PackedLinear,
    Q4Linear,
    Q8Head,
    quant_kernels_available,
)
from gpu_engine.models.decoder import CausalLM, DecoderLayer
from gpu_engine.models.layers import GatedMLP


def pack_for_cpu(model: CausalLM, int4_layers: bool = False, keep_quantized: bool = True,
                 int8_activations: bool = False) -> CausalLM:
    """Replace the float32 linears and embedding of ``model`` by their packed CPU forms; returns it.
    ``keep_quantized=False``: no ``Q4Linear`` or ``Q8Head``, every other linear fp16-packed;
    ``int8_activations``: those two quantize their input to int8 per group of 32 (llama.cpp's arithmetic)."""
    keep_quantized = keep_quantized and quant_kernels_available()
    for p in model.parameters():
        if p.device.type != "cpu" or p.dtype != torch.float32:
            raise ValueError(f"pack_for_cpu: needs a float32 CPU model, found {p.dtype} on {p.device}")
    embed = GroupInt8Embedding(model.embed.weight)
    if model.config.tie_word_embeddings:
        lossless = keep_quantized and torch.equal(embed.reference_weight(), model.embed.weight)
        model.lm_head = Q8Head(embed) if lossless else PackedLinear(model.embed.weight)  # type: ignore[assignment]
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and not isinstance(module, PackedLinear):
            _replace(model, name, _packed_linear(module, int4_layers and name.startswith("layers."),
                                                     keep_quantized))
    model.embed = embed  # type: ignore[assignment]
    for module in model.modules():
        if isinstance(module, (Q4Linear, Q8Head)):
            module.int8_activations = int8_activations
    if quant_kernels_available() and not int4_layers:  # int4 keeps the torch forms its stated bound was measured on
        fuse_small_ops(model)
    _release_freed_memory()
    return model


def fuse_small_ops(model: CausalLM, on: bool = True) -> None:
    """Switch the packed model's fused C forms (``kernels.cpu_fused``) on or off: RMSNorm, RoPE with the
    cache write and decode attention where the layer has no QK norm and rotates whole heads, and the output
    projections adding into the residual stream."""
    cfg = model.config
    attention_ok = not cfg.qk_norm and cfg.rotary_dim == cfg.head_dim and cfg.head_dim % 16 == 0
    model.norm.fused = on
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        layer.attn_norm.fused = layer.mlp_norm.fused = on
        layer.attn.fused = on and attention_ok
        layer.residual_in_place = on and isinstance(layer.mlp, GatedMLP)


def _packed_linear(module: nn.Linear, int4: bool, keep_quantized: bool) -> nn.Module:
    if int4 and module.bias is None:
        return Int4Linear(module.weight)
    q4 = Q4Linear.from_weight(module.weight) if keep_quantized and module.bias is None else None
    return q4 if q4 is not None else PackedLinear(module.weight, module.bias)


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
