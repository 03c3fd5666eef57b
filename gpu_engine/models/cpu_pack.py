"""The CPU serving form of a loaded model: quantized weights kept quantized, the rest packed as fp16.

``pack_for_cpu`` rewrites a float32 ``CausalLM`` in place, one module at a time (each fp32 weight is
freed as soon as its packed form exists). Every ``nn.Linear`` whose weight is exactly a GGUF Q4_1
tensor's dequantized values becomes a ``Q4Linear`` (those Q4_1 groups, fp32 arithmetic: every weight
exact), any other a ``PackedLinear`` (fp16 weights, fp32 arithmetic); ``int4_layers`` makes the decoder
layers' linears ``Int4Linear`` instead (bf16 activations). The embedding becomes a ``GroupInt8Embedding``;
a tied ``lm_head`` multiplies over that table's own int8 codes (``Q8Head``) when the table holds them
losslessly (a Q8_0 GGUF table), else gets a packed fp16 copy. Norms, RoPE tables and MoE expert tensors
stay float32. Without the quantized kernels (``quant_kernels_available``) everything packs as fp16. With
them, the layers' small ops run fused in C (``fuse_small_ops``), except with ``int4_layers``; where every
layer's linears are ``Q4Linear`` (a Q4_1 GGUF), a decode step runs the whole layer stack in one C call
(``DecodeStack``); with a ``Q8Head``, the greedy rows of a step take their tokens from one C call after the
layers (``GreedyHead``: the final norm, the head and the argmax).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import mmap
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from gpu_engine.kernels import cpu_fused
from gpu_engine.kernels.cpu_linear import (
    GroupInt8Embedding,
    Int4Linear,
    KernelThreads,
    PackedLinear,
    Q4Linear,
    Q8Head,
    quant_kernels_available,
)
from gpu_engine.models.config import ModelConfig
from gpu_engine.models.decoder import CausalLM, DecoderLayer
from gpu_engine.models.layers import GatedMLP

if TYPE_CHECKING:
    from gpu_engine.kv_cache import KVCache
    from gpu_engine.models.attention import AttentionMetadata


def pack_for_cpu(model: CausalLM, int4_layers: bool = False, keep_quantized: bool = True,
                 int8_activations: bool = False, blocks: Mapping[str, torch.Tensor] | None = None,
                 huge_pages: bool = True) -> CausalLM:
    """Replace the float32 linears and embedding of ``model`` by their packed CPU forms; returns it.
    ``keep_quantized=False``: no ``Q4Linear`` or ``Q8Head``, every other linear fp16-packed;
    ``int8_activations``: those two quantize their input to int8 per group of 32 (llama.cpp's arithmetic);
    ``blocks``: the file's own Q4_1 blocks of linears by parameter name (``GGUFSource.q4_1_linears``), taken as
    they are instead of recovered from the dequantized weights (the same blocks, without the search); those
    linears' weights are not read (``load_model``'s placeholders leave them unset); ``huge_pages=False``: the
    quantized buffers stay where they are (``move_to_huge_pages`` not called: for weights shared next)."""
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
            int4 = int4_layers and name.startswith("layers.")
            given = (blocks or {}).get(f"{name}.weight") if keep_quantized and not int4 else None
            if given is not None and module.bias is not None:  # its weight may be a loader's placeholder
                raise ValueError(f"pack_for_cpu: {name} has a bias, which Q4Linear blocks cannot carry")
            packed = Q4Linear(given) if given is not None else None
            if packed is not None and (packed.out_features, packed.in_features) != tuple(module.weight.shape):
                raise ValueError(f"pack_for_cpu: the blocks of {name} are {packed.out_features} x "
                                 f"{packed.in_features}, the weight {tuple(module.weight.shape)}")
            _replace(model, name, packed or _packed_linear(module, int4, keep_quantized))
    model.embed = embed  # type: ignore[assignment]
    for module in model.modules():
        if isinstance(module, (Q4Linear, Q8Head)):
            module.int8_activations = int8_activations
    if quant_kernels_available() and not int4_layers:  # int4 keeps the torch forms its stated bound was measured on
        fuse_small_ops(model)
    if huge_pages:
        move_to_huge_pages(model)
    release_freed_memory()
    return model


HUGE_PAGE = 2 << 20


def move_to_huge_pages(model: nn.Module) -> int:
    """Copy the buffers of the quantized forms (``Q4Linear`` blocks, the token table's codes and scales) into one
    anonymous mapping marked for transparent huge pages, each buffer a view of it (64-byte aligned): a decode
    step streams all of them, and on 4 KB pages it takes a TLB miss, and a restart of the hardware prefetcher,
    every 4 KB (measured: the layers' products 12-15% faster on 2 MB pages). The same values; where the system
    offers no huge pages the mapping is plain memory. Returns the bytes moved (0: nothing to move, or no
    madvise here)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return 0
    owners = [(module, name) for module in model.modules() if isinstance(module, (Q4Linear, GroupInt8Embedding))
              for name, buf in module.named_buffers(recurse=False) if buf is not None and buf.device.type == "cpu"]
    sizes = [(getattr(m, n).numel() * getattr(m, n).element_size() + 63) // 64 * 64 for m, n in owners]
    if not sum(sizes):
        return 0
    area = mmap.mmap(-1, sum(sizes) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        area.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: plain pages, as before
        area.close()
        return 0
    arena = torch.frombuffer(area, dtype=torch.uint8)  # the tensor keeps the mapping alive
    offset = (-arena.data_ptr()) % HUGE_PAGE
    for (module, name), size in zip(owners, sizes, strict=True):
        old = getattr(module, name)
        view = arena[offset : offset + old.numel() * old.element_size()].view(old.dtype).view(old.shape)
        view.copy_(old)
        setattr(module, name, view)
        offset += size
    stack = getattr(model, "decode_stack", None)
    if isinstance(stack, DecodeStack):
        stack.forget_plan()  # it holds the old buffers' addresses
    return sum(sizes)


def fuse_small_ops(model: CausalLM, on: bool = True) -> None:
    """Switch the packed model's fused C forms (``kernels.cpu_fused``) on or off: the token table's lookup,
    RMSNorm, RoPE with the cache write and decode attention where the layer has no QK norm and rotates whole
    heads, and the output projections adding into the residual stream; and the ``DecodeStack`` and the
    ``GreedyHead`` where they apply."""
    cfg = model.config
    attention_ok = not cfg.qk_norm and cfg.rotary_dim == cfg.head_dim and cfg.head_dim % 16 == 0
    model.norm.fused = on
    if isinstance(model.embed, GroupInt8Embedding):
        model.embed.fused = on
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        layer.attn_norm.fused = layer.mlp_norm.fused = on
        layer.attn.fused = on and attention_ok
        layer.residual_in_place = on and isinstance(layer.mlp, GatedMLP)
    model.decode_stack = DecodeStack.build(model) if on and attention_ok else None
    head = model.lm_head
    model.greedy_head = GreedyHead(model.norm.weight, head, model.norm.eps) if on and isinstance(head, Q8Head) \
        else None


class DecodeStack:
    """A decode step's layers as one C call (``cpu_fused.decode_stack``) for a packed model whose every layer is
    a dense gated MLP and attention with all four linears ``Q4Linear``: the same ops as the layers' fused forms,
    in the same order, without Python between them. ``CausalLM.forward`` calls it for decode steps over an fp16
    cache."""

    def __init__(self, config: ModelConfig, layers: list[StackLayer]) -> None:
        self.layers = layers
        self.shape = cpu_fused.StackShape(config.hidden_size, config.intermediate_size, config.num_heads,
                                          config.num_kv_heads, config.head_dim, 0, config.sliding_window or 0,
                                          config.rms_norm_eps)
        # (the cache it points into, held so that no other cache can take its place at its addresses; the plan)
        self._plan: tuple[KVCache, torch.Tensor] | None = None
        self._shapes: dict[int, cpu_fused.StackShape] = {}  # by the cache's block size

    @classmethod
    def build(cls, model: CausalLM) -> DecodeStack | None:
        """The stack of ``model``, or None where a layer is not of that form."""
        layers = [_stack_layer(layer) for layer in model.layers]
        found = [layer for layer in layers if layer is not None]
        return cls(model.config, found) if len(found) == len(layers) else None

    def runs(self, meta: AttentionMetadata, kv_cache: KVCache, tokens: int) -> bool:
        """Whether this step is one the stack computes: one new token per sequence, an fp16 cache."""
        return tokens == meta.context_lens.numel() and kv_cache.dtype == torch.float16

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                 kv_cache: KVCache) -> torch.Tensor:
        """The residual stream x [B, hidden] after every layer (x itself, updated in place)."""
        shape = self._shapes.get(kv_cache.block_size)
        if shape is None:
            shape = self._shapes[kv_cache.block_size] = dataclasses.replace(self.shape, block_size=kv_cache.block_size)
        int8_x = self.layers[0].linears[0].int8_activations
        cpu_fused.decode_stack(x, self._plan_for(kv_cache), shape, cos.contiguous(), sin.contiguous(),
                               meta.slot_mapping.contiguous(), meta.block_tables.to(torch.int32).contiguous(),
                               meta.context_lens.to(torch.int32).contiguous(), KernelThreads.get(), int8_x)
        return x

    def forget_plan(self) -> None:
        """Drop the plan (its weight addresses): the next step makes it anew, from the layers' buffers then."""
        self._plan = None

    def _plan_for(self, kv_cache: KVCache) -> torch.Tensor:
        if self._plan is None or self._plan[0] is not kv_cache:
            rows = []
            for i, layer in enumerate(self.layers):
                qkv, o, gate_up, down = layer.linears
                rows.append([layer.attn_norm.data_ptr(), qkv.blocks.data_ptr(), o.blocks.data_ptr(),
                             layer.mlp_norm.data_ptr(), gate_up.blocks.data_ptr(), down.blocks.data_ptr(),
                             kv_cache.k[i].data_ptr(), kv_cache.v[i].data_ptr()])
            self._plan = (kv_cache, torch.tensor(rows, dtype=torch.int64))
        return self._plan[1]


class GreedyHead:
    """The final RMSNorm, a tied ``Q8Head`` and the argmax as one C call (``cpu_fused.greedy_head``) for the rows
    of a step that sample greedily and ask for nothing else: the same arithmetic as ``CausalLM.logits_at`` (the
    fused norm, the head's q8 product) and ``torch.argmax``, so the same tokens, without the torch ops."""

    def __init__(self, norm_weight: torch.Tensor, head: Q8Head, eps: float) -> None:
        self.norm_weight, self.head, self.eps = norm_weight, head, eps
        self._logits = torch.empty(0)  # the scratch, kept between steps

    def __call__(self, hidden: torch.Tensor, rows: list[int] | None) -> list[int]:
        n = hidden.shape[0] if rows is None else len(rows)
        vocab = self.head.out_features
        if self._logits.numel() < n * vocab:
            self._logits = torch.empty(n * vocab)
        embed = self.head.embed[0]
        index = None if rows is None else torch.tensor(rows, dtype=torch.int64)
        return cpu_fused.greedy_head(hidden.contiguous(), index, self.norm_weight, embed.codes, embed.scales,
                                     self.eps, KernelThreads.get(), self.head.int8_activations, self._logits).tolist()


class StackLayer(NamedTuple):
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    linears: tuple[Q4Linear, Q4Linear, Q4Linear, Q4Linear]  # qkv, o, gate_up, down


def _stack_layer(layer: nn.Module) -> StackLayer | None:
    """A layer's parts for the stack, when it is a dense layer whose four linears are ``Q4Linear``."""
    if not isinstance(layer, DecoderLayer) or not isinstance(layer.mlp, GatedMLP):
        return None
    qkv, o, gate_up, down = layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down
    if not (isinstance(qkv, Q4Linear) and isinstance(o, Q4Linear) and isinstance(gate_up, Q4Linear)
            and isinstance(down, Q4Linear)):
        return None
    return StackLayer(layer.attn_norm.weight, layer.mlp_norm.weight, (qkv, o, gate_up, down))


def _packed_linear(module: nn.Linear, int4: bool, keep_quantized: bool) -> nn.Module:
    if int4 and module.bias is None:
        return Int4Linear(module.weight)
    q4 = Q4Linear.from_weight(module.weight) if keep_quantized and module.bias is None else None
    return q4 if q4 is not None else PackedLinear(module.weight, module.bias)


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, attr, new)


def release_freed_memory() -> None:
    """Hand the freed fp32 weights' pages back to the OS (glibc keeps freed heap memory otherwise)."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    trim = getattr(ctypes.CDLL(libc_name), "malloc_trim", None)
    if trim is not None:
        trim(0)
