"""The GPU forward pass for every supported family, reading and writing only static buffers.

A step is described entirely by the static buffers (`StepBuffers`): the first `tokens` rows of
the token-indexed ones and the first `batch` rows of the sequence-indexed ones. Rows past those
must hold padding (`pad_step` writes it): slot -1 (no cache write), context length 0, and for
sequences past the real batch an empty query range. `forward(batch, tokens, decode, filtered)`
launches only device work with shapes fixed by its arguments, so it can be captured in a CUDA graph
and replayed for any step that fits. `filtered=False` samples without the top-k / top-p / min-p
filter (no vocabulary sort): exact only for steps where no row uses them.

A prefill step may mix rows (chunked prefill): the running decodes (one token each) first, then
prompt chunks with a cached prefix. The leading run of one-token rows attends through the decode
kernel (`decode_ctx`: their context lengths, 0 for the other rows) and the rest through the prefill
kernel (`cu_chunks`: the query bounds with those rows made empty), so a decode row costs the same in
a mixed step as in a decode step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F

from gpu_engine.gpu.sched_structs import GRAM_COLS, PROC_COLS
from gpu_engine.kernels.activation import silu_and_mul
from gpu_engine.kernels.attention import LAST_FOLD_ROWS, decode_attention, decode_partition, prefill_attention
from gpu_engine.kernels.fp8_gemv import fp8_config, fp8_gemv, fp8_gemv_scratch
from gpu_engine.kernels.fp8_linear import fp8_linear
from gpu_engine.kernels.grammar import DeviceGrammar
from gpu_engine.kernels.kv_cache import FP8_KV
from gpu_engine.kernels.moe import SMALL_PAIRS, fused_moe, small_path
from gpu_engine.kernels.plan import PLANS, KernelPlan
from gpu_engine.kernels.processors import BIAS_MASK, MAX_COUNT, DeviceProcessors
from gpu_engine.kernels.q8_linear import q8_linear
from gpu_engine.kernels.qkv_prep import qkv_prep
from gpu_engine.kernels.rmsnorm import rms_norm
from gpu_engine.kernels.rope import cache_from_cos_sin
from gpu_engine.kernels.sampling import Processors, sample
from gpu_engine.kernels.tiled_linear import Heads, TiledConfig, tiled_linear, tiled_scratch
from gpu_engine.kv_cache import KVCache
from gpu_engine.models.config import ModelConfig
from gpu_engine.models.decoder import CausalLM
from gpu_engine.models.fp8_weight import Fp8Weight
from gpu_engine.models.q8_weight import GROUP, Q8Weight
from gpu_engine.prompt_logprobs import score
from shared.slots import MAX_LOGIT_BIAS


@dataclass(frozen=True, slots=True)
class DeviceTables:
    """The persistent scheduler's slot-indexed tables that the graphs read (`kernels.processors`): every ring
    slot's token history (`max_context` wide, the scheduler's own) and logit-bias table (`max_bias` entries)."""

    num_slots: int
    max_context: int
    max_bias: int = MAX_LOGIT_BIAS
    # the grammar arena (`kernels.grammar`, `gpu.grammar_arena`): bytes of device memory for the tables of the
    # resident grammars; 0: the graphs apply no grammar (the scheduler refuses a request with one)
    grammar_bytes: int = 0

    def __post_init__(self) -> None:
        if min(self.num_slots, self.max_context, self.max_bias) <= 0 or self.grammar_bytes < 0:
            raise ValueError(f"invalid device tables {self}")
        if self.max_context > MAX_COUNT or self.max_bias >= BIAS_MASK:
            raise ValueError(f"device tables {self}: at most {MAX_COUNT} tokens and {BIAS_MASK - 1} bias entries")


@dataclass(frozen=True, slots=True)
class RunnerLimits:
    """Sizes of the static buffers: the largest step any graph will run."""

    max_batch: int
    max_tokens: int
    max_blocks_per_seq: int
    num_top_logprobs: int = 5
    # the logits processors (penalties, logit_bias, min_tokens) in every graph from dense columns the host stages:
    # [max_batch, vocab] x 3 and a pass over them per step (the host-driven backend)
    processors: bool = False
    # the same processors from the persistent scheduler's device state (`kernels.processors`), a masked path:
    # a row without any costs one load; a [max_batch, vocab] int32 scratch and the tables below
    device_tables: DeviceTables | None = None
    # prompt log-probs through a score graph (`GpuModelRunner.score_positions`, the persistent scheduler): every
    # prefill graph keeps each token's final hidden state in a static [max_tokens, hidden] buffer, and the score
    # graph scores `score_rows` of them per launch (a [score_rows, vocab] float32 temporary); 0: neither
    score_rows: int = 0

    def __post_init__(self) -> None:
        if min(self.max_batch, self.max_tokens, self.max_blocks_per_seq) <= 0 or self.num_top_logprobs < 0:
            raise ValueError(f"invalid runner limits {self}")
        if not 0 <= self.score_rows <= self.max_tokens:
            raise ValueError(f"runner limits {self}: score_rows must be in 0..max_tokens")
        if self.max_tokens < self.max_batch:
            raise ValueError("max_tokens must be >= max_batch (a decode step has one token per sequence)")


@dataclass(slots=True)
class StepBuffers:
    """Static inputs (written before a step) and outputs (read after it); one set for every graph."""

    input_ids: torch.Tensor  # [max_tokens] int64
    positions: torch.Tensor  # [max_tokens] int64
    slot_mapping: torch.Tensor  # [max_tokens] int64, -1 = padding
    cu_seqlens_q: torch.Tensor  # [max_batch + 1] int32
    context_lens: torch.Tensor  # [max_batch] int32, after this step
    decode_ctx: torch.Tensor  # [max_batch] int32, context_lens of the leading one-token rows, else 0
    cu_chunks: torch.Tensor  # [max_batch + 1] int32, cu_seqlens_q with the leading one-token rows empty
    block_tables: torch.Tensor  # [max_batch, max_blocks] int32, -1 padded
    temperature: torch.Tensor  # [max_batch] f32, 0 = greedy
    top_k: torch.Tensor  # [max_batch] int32, 0 = off
    top_p: torch.Tensor  # [max_batch] f32, 1 = off
    min_p: torch.Tensor  # [max_batch] f32, 0 = off
    seeds: torch.Tensor  # [max_batch] int64
    sample_index: torch.Tensor  # [max_batch] int64, index of the token being sampled (RNG counter)
    # [max_batch] int32: 1 = compute this row's log-probs, 0 = zeros; allocated all 1 for a writer that stages none
    want_logprobs: torch.Tensor
    logits: torch.Tensor  # [max_batch, vocab] f32
    next_tokens: torch.Tensor  # [max_batch] int64
    token_logprobs: torch.Tensor  # [max_batch] f32
    top_ids: torch.Tensor  # [max_batch, num_top] int64
    top_logprobs: torch.Tensor  # [max_batch, num_top] f32
    # logits processors (`kernels.sampling.Processors`); [0, vocab] when RunnerLimits.processors is off
    logit_add: torch.Tensor  # [max_batch, vocab] f32
    pen_counts: torch.Tensor  # [max_batch, vocab] f32
    pen_seen: torch.Tensor  # [max_batch, vocab] f32
    repetition: torch.Tensor  # [max_batch] f32, 1 = off
    frequency: torch.Tensor  # [max_batch] f32
    presence: torch.Tensor  # [max_batch] f32
    # logits processors from device state (`kernels.processors.DeviceProcessors`); the tables are [0, ...]
    # when RunnerLimits.device_tables is off. The rows stay all -1 (off) unless a scheduler stages them.
    proc_rows: torch.Tensor  # [max_batch, PROC_COLS] int32
    proc_penalties: torch.Tensor  # [max_batch, 3] f32
    history: torch.Tensor  # [num_slots, max_context] int32
    bias_tokens: torch.Tensor  # [num_slots, max_bias] int32
    bias_values: torch.Tensor  # [num_slots, max_bias] f32
    proc_scratch: torch.Tensor  # [max_batch, vocab] int32, zero at rest
    # grammar masks from device state (`kernels.grammar.DeviceGrammar`); [0] / [0, ...] without the arena. The
    # rows stay all -1 (no grammar) unless a scheduler stages them.
    gram_bits: torch.Tensor  # [max_batch] int64
    gram_ends: torch.Tensor  # [max_batch, GRAM_COLS] int32
    gram_arena: torch.Tensor  # [DeviceTables.grammar_bytes] uint8
    # prompt log-probs (RunnerLimits.score_rows; [0, ...] when off): every prefill token's final hidden state,
    # written by the prefill graphs; the score graph's inputs (which kept rows, the prompt tokens they predict)
    # and outputs (`prompt_logprobs.score` of them)
    hidden: torch.Tensor  # [max_tokens, hidden_size] model dtype
    score_index: torch.Tensor  # [score_rows] int32, a row of `hidden`
    score_targets: torch.Tensor  # [score_rows] int64
    score_logprobs: torch.Tensor  # [score_rows] f32
    score_ranks: torch.Tensor  # [score_rows] int32
    score_top_ids: torch.Tensor  # [score_rows, num_top] int64
    score_top_logprobs: torch.Tensor  # [score_rows, num_top] f32

    @classmethod
    def allocate(cls, limits: RunnerLimits, vocab: int, device, hidden: tuple[int, torch.dtype] = (0, torch.float32),
                 ) -> StepBuffers:
        """``hidden``: the model's hidden size and dtype (the kept hidden states, with ``limits.score_rows``)."""
        B, T, K = limits.max_batch, limits.max_tokens, max(1, limits.num_top_logprobs)
        R = limits.score_rows
        PB = B if limits.processors else 0
        dt = limits.device_tables
        slots, width, nbias = (dt.num_slots, dt.max_context, dt.max_bias) if dt else (0, 0, 0)
        GB = dt.grammar_bytes if dt else 0

        def z(*shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            input_ids=z(T, dtype=torch.int64), positions=z(T, dtype=torch.int64),
            slot_mapping=torch.full((T,), -1, dtype=torch.int64, device=device),
            cu_seqlens_q=z(B + 1, dtype=torch.int32), context_lens=z(B, dtype=torch.int32),
            decode_ctx=z(B, dtype=torch.int32), cu_chunks=z(B + 1, dtype=torch.int32),
            block_tables=torch.full((B, limits.max_blocks_per_seq), -1, dtype=torch.int32, device=device),
            temperature=z(B, dtype=torch.float32), top_k=z(B, dtype=torch.int32),
            top_p=torch.ones(B, dtype=torch.float32, device=device), min_p=z(B, dtype=torch.float32),
            seeds=z(B, dtype=torch.int64), sample_index=z(B, dtype=torch.int64),
            want_logprobs=torch.ones(B, dtype=torch.int32, device=device),
            logits=z(B, vocab, dtype=torch.float32), next_tokens=z(B, dtype=torch.int64),
            token_logprobs=z(B, dtype=torch.float32), top_ids=z(B, K, dtype=torch.int64),
            top_logprobs=z(B, K, dtype=torch.float32),
            logit_add=z(PB, vocab, dtype=torch.float32), pen_counts=z(PB, vocab, dtype=torch.float32),
            pen_seen=z(PB, vocab, dtype=torch.float32),
            repetition=torch.ones(B, dtype=torch.float32, device=device), frequency=z(B, dtype=torch.float32),
            presence=z(B, dtype=torch.float32),
            proc_rows=torch.full((B, PROC_COLS), -1, dtype=torch.int32, device=device),
            proc_penalties=z(B, 3, dtype=torch.float32),
            history=z(slots, width, dtype=torch.int32), bias_tokens=z(slots, nbias, dtype=torch.int32),
            bias_values=z(slots, nbias, dtype=torch.float32),
            proc_scratch=z(B if dt else 0, vocab, dtype=torch.int32),
            gram_bits=torch.full((B if GB else 0,), -1, dtype=torch.int64, device=device),
            gram_ends=z(B if GB else 0, GRAM_COLS, dtype=torch.int32), gram_arena=z(GB, dtype=torch.uint8),
            hidden=z(T if R else 0, hidden[0], dtype=hidden[1]), score_index=z(R, dtype=torch.int32),
            score_targets=z(R, dtype=torch.int64), score_logprobs=z(R, dtype=torch.float32),
            score_ranks=z(R, dtype=torch.int32), score_top_ids=z(R, K, dtype=torch.int64),
            score_top_logprobs=z(R, K, dtype=torch.float32),
        )

    def processors(self, batch: int) -> Processors:
        return Processors(self.logit_add[:batch], self.pen_counts[:batch], self.pen_seen[:batch],
                          self.repetition[:batch], self.frequency[:batch], self.presence[:batch])

    def device_processors(self, batch: int) -> DeviceProcessors:
        return DeviceProcessors(self.proc_rows[:batch], self.proc_penalties[:batch], self.history, self.bias_tokens,
                                self.bias_values, self.proc_scratch)

    def device_grammar(self, batch: int) -> DeviceGrammar | None:
        return DeviceGrammar(self.gram_bits[:batch], self.gram_ends[:batch], self.gram_arena) if len(
            self.gram_arena) else None

    def pointers(self) -> dict[str, int]:
        """Device addresses of every buffer, for a C++ scheduler."""
        return {f.name: getattr(self, f.name).data_ptr() for f in fields(self)}


# a dense weight [N, K] or one kept as Q8_0 (`kernels.q8_linear`) or FP8 (`kernels.fp8_linear`)
Linear = torch.Tensor | Q8Weight | Fp8Weight


@dataclass(frozen=True, slots=True)
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear  # dense [2I, H] or experts [E, 2I, H]
    down: Linear  # dense [H, I] or experts [E, H, I]
    router: torch.Tensor | None  # [E, H] for MoE layers


def _tensor(module: object, *path: str) -> torch.Tensor:
    """``module.a.b...``: a parameter of the model, checked to be a tensor."""
    value = module
    for name in path:
        value = getattr(value, name)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{'.'.join(path)} is a {type(value).__name__}, not a tensor")
    return value


def _optional_weight(module: object, name: str) -> torch.Tensor | None:
    """The weight of an optional submodule (a QK norm), or None where the model has none."""
    return None if getattr(module, name) is None else _tensor(module, name, "weight")


def layer_weights(model: CausalLM, quantized: Mapping[str, Q8Weight | Fp8Weight] | None = None) -> list[LayerWeights]:
    """Views of the model's parameters, per layer (no copies); a linear named in ``quantized`` (by parameter
    name, e.g. ``layers.0.attn.qkv.weight``) is taken from there instead."""
    q = quantized or {}

    def linear(i: int, module: object, *path: str) -> Linear:
        return q.get(f"layers.{i}.{'.'.join(path)}.weight") or _tensor(module, *path[1:], "weight")

    out = []
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.attn, layer.mlp
        moe = hasattr(mlp, "router")
        out.append(LayerWeights(
            attn_norm=_tensor(layer, "attn_norm", "weight"), qkv=linear(i, attn, "attn", "qkv"),
            q_norm=_optional_weight(attn, "q_norm"), k_norm=_optional_weight(attn, "k_norm"),
            o=linear(i, attn, "attn", "o"), mlp_norm=_tensor(layer, "mlp_norm", "weight"),
            gate_up=_tensor(mlp, "gate_up") if moe else linear(i, mlp, "mlp", "gate_up"),
            down=_tensor(mlp, "down") if moe else linear(i, mlp, "mlp", "down"),
            router=_tensor(mlp, "router", "weight") if moe else None,
        ))
    return out


def _silu_apart(matmul: Callable[..., torch.Tensor], x: torch.Tensor, w: torch.Tensor, act: str | None = None,
                **fused) -> torch.Tensor:
    """`matmul`(x, w) with a SiLU-and-multiply of x run before it by its own kernel (the tiled linear's on its x
    tiles is the slower; `kernels.tiled_linear`); the other forms (`act="glu"`, `norm`, `residual`) passed on."""
    if act == "silu_mul":
        x, act = silu_and_mul(x), None
    return matmul(x, w, act=act, **fused)


class GpuModelRunner:
    """Runs `CausalLM` weights with the Triton kernels over a paged `KVCache`, through `StepBuffers`, taking each
    product where its `KernelPlan` says (`kernels.plan`; cuBLAS for every product by default)."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, limits: RunnerLimits, plan: KernelPlan = PLANS["cublas"],
                 quantized: Mapping[str, Q8Weight | Fp8Weight] | None = None, max_positions: int | None = None) -> None:
        """`quantized`: linears kept as Q8_0 by parameter name (`GGUFSource.q8_0_linears`, on the model's device),
        used instead of the model's (empty) ones. `max_positions`: the RoPE table's length (default: the cache's)."""
        cfg: ModelConfig = model.config
        self.config, self.limits, self.kv, self.plan = cfg, limits, kv_cache, plan
        self.device, self.dtype = model.embed.weight.device, model.embed.weight.dtype
        if kv_cache.dtype not in (self.dtype, FP8_KV) or kv_cache.k[0].device != self.device:
            raise ValueError(f"KV cache is {kv_cache.dtype} on {kv_cache.k[0].device}, "
                             f"model is {self.dtype} on {self.device} (the cache takes its dtype or FP8)")
        self._take_weights(model, dict(quantized or {}))
        self.tiled = self._bind_linears()
        self.fp8_scratch = self._fp8_scratch()
        n_pos = max_positions or limits.max_blocks_per_seq * kv_cache.block_size
        cos, sin = model.rope.cos_sin(torch.arange(n_pos, device=self.device))
        self.rope_cache = cache_from_cos_sin(cos, sin)
        self.buffers = StepBuffers.allocate(limits, cfg.vocab_size, self.device, (cfg.hidden_size, self.dtype))
        self.scale = cfg.head_dim ** -0.5
        # the decode attention's per-(row, KV head) counts for its "last" form (fused), zero at rest
        self.attn_counters = torch.zeros(limits.max_batch * cfg.num_kv_heads if plan.fused else 0,
                                         dtype=torch.int32, device=self.device)
        # the fused MoE router's per-token counts (`kernels.moe.moe_router`), zero at rest
        self.route_counters = torch.zeros(SMALL_PAIRS if plan.fused else 0, dtype=torch.int32, device=self.device)
        self._processors_staged = False  # the processor buffers hold something other than identity
        self.kept_hidden = torch.empty(0, cfg.hidden_size, dtype=self.dtype, device=self.device)

    def _take_weights(self, model: CausalLM, q: dict[str, Q8Weight | Fp8Weight]) -> None:
        """The model's weights as the step reads them: the embedding, LM head and each layer's, a Q8_0 one where
        `q` names it (checked: on the model's device, and a path that has a linear)."""
        for name, w in q.items():
            if w.device != self.device:
                raise ValueError(f"{name}: Q8_0 weight on {w.device}, model on {self.device}")
        self.final_norm = model.norm.weight
        self.embed: Linear = q.pop("embed.weight", None) or model.embed.weight
        tied = model.lm_head.weight is model.embed.weight
        self.lm_head: Linear = q.pop("lm_head.weight", None) or (self.embed if tied else model.lm_head.weight)
        self.layers = layer_weights(model, q)
        dense_mlp = ("mlp.gate_up", "mlp.down")
        paths = {f"layers.{i}.{p}.weight" for i, layer in enumerate(model.layers)
                 for p in ("attn.qkv", "attn.o") + (() if hasattr(layer.mlp, "router") else dense_mlp)}
        if set(q) - paths:
            raise ValueError(f"no Q8_0 path for {sorted(set(q) - paths)}")

    def _bind_linears(self) -> dict[TiledConfig, Callable[..., torch.Tensor]]:
        """The plan's tiled launchers by configuration, each bound once, all sharing one scratch sized for this
        model's weights (`matmul_for` picks one by the weight's shape and the step's rows)."""
        if not self.plan.linears:
            return {}
        shapes = sorted({(int(w.shape[0]), int(w.shape[1])) for layer in self.layers
                         for w in (layer.qkv, layer.o, layer.gate_up, layer.down, self.lm_head)
                         if isinstance(w, torch.Tensor) and w.dim() == 2})  # not Q8_0 weights, nor MoE experts
        configs = self.plan.configs()
        if self.plan.fused:  # qkv with its heads out: a tile a head
            configs += [c._replace(block_n=self.config.head_dim) for c in configs]
        scratch = tiled_scratch(shapes, configs, self.device)
        return {config: functools.partial(_silu_apart, functools.partial(
            tiled_linear, **config._asdict(), scratch=scratch)) for config in self.plan.configs()}

    def _fp8_scratch(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One workspace for the FP8 GEMV's launches over this model's FP8 weights, where the plan sends steps to it
        (`KernelPlan.fp8_gemv_rows`)."""
        rows = self.plan.fp8_gemv_rows
        shapes = sorted({(int(w.weight.shape[0]), int(w.weight.shape[1])) for layer in self.layers
                         for w in (layer.qkv, layer.o, layer.gate_up, layer.down) if isinstance(w, Fp8Weight)})
        if not rows or not shapes:
            return None
        return fp8_gemv_scratch(shapes, {fp8_config(r) for r in range(1, rows + 1)}, self.device)

    # One step: the whole device-side work, capturable.
    def forward(self, batch: int, tokens: int, decode: bool, filtered: bool = True, keep_hidden: bool = False) -> None:
        """Run the model on the first `tokens` tokens / `batch` sequences and sample one token per sequence.

        `filtered=False` skips the sampling filter; use it only when no row needs it
        (`gpu_engine.policy.needs_filter`), the tokens are then the same. `keep_hidden` (not for capture: it
        allocates) keeps every token's final hidden state in `kept_hidden`, for `logits_at` (prompt log-probs),
        until `drop_hidden`.
        """
        if decode and batch != tokens:
            raise ValueError("a decode step has exactly one token per sequence")
        if batch > self.limits.max_batch or tokens > self.limits.max_tokens:
            raise ValueError(f"step ({batch}, {tokens}) exceeds limits {self.limits}")
        # the residual stream, and the sublayer output still to be added into it (None where a fused linear added
        # it already): the add happens in the RMSNorm that reads the stream next
        residual = self._embedding(self.buffers.input_ids[:tokens])
        pending = None
        for i, w in enumerate(self.layers):
            pending = self._attention(i, w, residual, pending, batch, tokens, decode)
            pending = self._mlp(w, residual, pending)
        if keep_hidden:
            self.kept_hidden = self._normed(residual.clone(), pending, self.final_norm)
        self._head(pending, residual, batch, tokens, decode)
        self._sample(batch, filtered)

    def score_positions(self) -> None:
        """The score graph's work (capturable): the log-prob, rank and top alternatives of each `score_targets`
        token under the logits of kept hidden state `score_index` (rows the last prefill graphs wrote), as
        `prompt_logprobs.score` computes them for the Python-driven backends."""
        b, lim = self.buffers, self.limits
        if not lim.score_rows:
            raise RuntimeError("this runner keeps no hidden states (RunnerLimits.score_rows is 0)")
        rows = b.hidden.index_select(0, b.score_index.clamp(0, lim.max_tokens - 1))
        logprobs, ranks, top_ids, top_logprobs = score(self._linear(rows, self.lm_head), b.score_targets,
                                                       max(1, lim.num_top_logprobs))
        b.score_logprobs.copy_(logprobs)
        b.score_ranks.copy_(ranks)
        b.score_top_ids.copy_(top_ids)
        b.score_top_logprobs.copy_(top_logprobs)

    def logits_at(self, first: int, n: int) -> torch.Tensor:
        """float32 logits [n, vocab] of tokens `first .. first + n` of the last `forward(keep_hidden=True)`
        (a slice: no index tensor to copy to the device, so no synchronization)."""
        return self._linear(self.kept_hidden[first : first + n], self.lm_head).float()

    def drop_hidden(self) -> None:
        """Free the kept hidden states ([tokens, hidden], outside the graph pool) once the step's scoring is
        enqueued: the allocator reuses them in stream order."""
        self.kept_hidden = self.kept_hidden.new_empty(0, self.config.hidden_size)  # not a view: the storage goes

    def _attention(self, i: int, w: LayerWeights, residual: torch.Tensor, pending: torch.Tensor | None, batch: int,
                   tokens: int, decode: bool) -> torch.Tensor | None:
        """Layer i's attention sublayer on the stream (`residual` + `pending`); returns its output still to be added,
        or None where the o projection added it."""
        cfg, buf = self.config, self.buffers
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kc, vc = self.kv.k[i], self.kv.v[i]
        heads = self.qkv_heads(i, w, tokens)
        qkv = self._norm_linear(residual, pending, w.attn_norm, w.qkv, heads=heads)  # [T, (hq + 2 hkv) d]
        q = qkv[:, : hq * d].view(tokens, hq, d)
        k = qkv[:, hq * d: (hq + hkv) * d].view(tokens, hkv, d)
        v = qkv[:, (hq + hkv) * d:].view(tokens, hkv, d)
        if heads is None:  # with `heads` the product did it: q normalised and rotated in place, k and v in the caches
            qkv_prep(q, k, v, buf.positions[:tokens], self.rope_cache, kc, vc, buf.slot_mapping[:tokens],
                     w.q_norm, w.k_norm, cfg.rms_norm_eps, kv_scale=self.kv.kv_scale(i))
        tables, ctx = buf.block_tables[:batch], buf.context_lens[:batch]
        how = self.decode_form(batch) | {"kv_scale": self.kv.kv_scale(i)}
        if decode:
            out = decode_attention(q, kc, vc, tables, ctx, self.scale, **how)
        else:  # the decode rows of a mixed step first (they write rows :batch), then the chunks over them
            out = torch.empty_like(q)
            decode_attention(q[:batch], kc, vc, tables, buf.decode_ctx[:batch], self.scale, out=out[:batch], **how)
            prefill_attention(q, kc, vc, tables, ctx, buf.cu_chunks[: batch + 1], self.scale, out=out,
                              kv_scale=how["kv_scale"])
        return self._add_linear(out.view(tokens, hq * d), w.o, residual)

    def _mlp(self, w: LayerWeights, residual: torch.Tensor, pending: torch.Tensor | None) -> torch.Tensor | None:
        """The MLP sublayer on the stream, as `_attention`."""
        if w.router is not None:
            cfg, rows = self.config, residual.shape[0]
            # fused, a small step's MoE routes in one launch, takes the norm in its router and gate_up kernels
            # (nothing pending) and adds its output into the stream (`kernels.moe.fused_moe`)
            fuse = self.plan.fused and small_path(rows, cfg.num_experts_per_tok)
            if fuse and pending is None and self._norm_fuses():
                x, norm = residual, (w.mlp_norm, cfg.rms_norm_eps)
            else:
                x, norm = self._normed(residual, pending, w.mlp_norm), None
            out = fused_moe(x, w.router, w.gate_up, w.down, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                            residual=residual if fuse else None, counters=self.route_counters if fuse else None,
                            norm=norm)
            return None if fuse else out
        glu = self.fused_for(residual.shape[0], w.gate_up) is not None
        h = self._norm_linear(residual, pending, w.mlp_norm, w.gate_up, act="glu" if glu else None)
        return self._add_linear(h, w.down, residual, silu_mul=not glu)

    def _normed(self, residual: torch.Tensor, pending: torch.Tensor | None, weight: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm(residual + pending) * weight, the sum written into `residual` (`kernels.rmsnorm`); of the
        stream as it is where nothing is pending."""
        eps = self.config.rms_norm_eps
        if pending is None:
            return rms_norm(residual, weight, eps, out=out)
        return rms_norm(pending, weight, eps, residual=residual, out=out)

    def decode_form(self, batch: int) -> dict[str, Any]:
        """How the decode attention of a step with `batch` decode rows runs (`decode_attention`'s keywords): its
        split size, and whether it folds in the split launch (a fused plan's one-row steps, `LAST_FOLD_ROWS`). Every
        choice gives the same bits."""
        fold_here = self.plan.fused and batch <= LAST_FOLD_ROWS
        return {"partition_size": decode_partition(batch, self.config.num_kv_heads),
                "form": "last" if fold_here else "split", "counters": self.attn_counters if fold_here else None}

    def qkv_heads(self, i: int, w: LayerWeights, tokens: int) -> Heads | None:
        """Where layer i's q/k norms, RoPE and KV cache write go into its qkv product for a step of `tokens` rows (a
        fused runner whose plan gives qkv to the tiled linear there, with the fused q/k/v preparation), the
        `Heads` that says so; else None (the preparation runs on its own)."""
        if self.fused_for(tokens, w.qkv) is None:
            return None
        cfg, buf = self.config, self.buffers
        return Heads(cfg.num_heads, cfg.num_kv_heads, buf.positions[:tokens], self.rope_cache, self.kv.k[i],
                     self.kv.v[i], buf.slot_mapping[:tokens], w.q_norm, w.k_norm, cfg.rms_norm_eps,
                     self.kv.kv_scale(i))

    def _norm_fuses(self) -> bool:
        """Whether a norm goes into the product after it (a fused plan; not for an fp16 model, whose un-normalised x
        times the norm's weight could pass fp16's range: `tiled_linear`)."""
        return self.plan.fused and self.dtype != torch.float16

    def fused_for(self, rows: int, w: Linear) -> Callable[..., torch.Tensor] | None:
        """The tiled launcher that takes the product of a `rows`-row step with `w` in the fused forms (a fused plan
        gives this step and weight to the tiled linear), else None."""
        if not self.plan.fused or not isinstance(w, torch.Tensor) or w.dim() != 2:
            return None
        return self.matmul_for(rows, (w.shape[0], w.shape[1]))

    def _norm_linear(self, residual: torch.Tensor, pending: torch.Tensor | None, weight: torch.Tensor, w: Linear,
                     act: str | None = None, heads: Heads | None = None) -> torch.Tensor:
        """linear(RMSNorm(residual + pending) * weight, w): the norm in the tiled linear's x tiles where the fusion
        takes this step (nothing pending), else its own kernel first. `act="glu"`
        (gate_up) returns silu(gate) * up, and `heads` (qkv) applies `qkv_prep` to the product, both only where
        `fused_for` gives a launcher."""
        rows = residual.shape[0]
        launch = self.fused_for(rows, w)
        fused = {"act": act, "heads": heads} if heads is not None else {"act": act}
        if launch is not None and pending is None and self._norm_fuses():
            return launch(residual, w, norm=(weight, self.config.rms_norm_eps), **fused)
        x = self._normed(residual, pending, weight)
        if act is not None or heads is not None:
            if launch is None:
                raise ValueError(f"no fused launcher takes a {rows}-row step with a {tuple(w.shape)} weight")
            return launch(x, w, **fused)
        return self._linear(x, w)

    def _add_linear(self, x: torch.Tensor, w: Linear, residual: torch.Tensor,
                    silu_mul: bool = False) -> torch.Tensor | None:
        """linear(x, w) (of silu(gate) * up when `silu_mul`) added into the residual stream by the tiled linear
        where the fusion takes this step (returns None), else returned to be added by the next norm."""
        launch = self.fused_for(x.shape[0], w)
        if launch is not None:
            launch(x, w, act="silu_mul" if silu_mul else None, residual=residual)
            return None
        return self._linear(x, w, silu_mul=silu_mul)

    def _embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The token table's rows; a Q8_0 table's rows dequantized (in fp32, then rounded to the model's dtype,
        as the dense load rounds them)."""
        if isinstance(self.embed, torch.Tensor):
            return F.embedding(ids, self.embed)
        if not isinstance(self.embed, Q8Weight):
            raise TypeError(f"a token table kept as {type(self.embed).__name__} has no embedding lookup")
        codes, scales = self.embed.codes.index_select(0, ids), self.embed.scales.index_select(0, ids)
        rows = codes.view(len(ids), -1, GROUP).float() * scales.float().unsqueeze(-1)
        return rows.view(len(ids), -1).to(self.dtype)

    def matmul_for(self, rows: int, shape: tuple[int, int]) -> Callable[..., torch.Tensor] | None:
        """The tiled launcher a dense weight of `shape` ([N, K]) goes through in a step of `rows` rows by the plan,
        its configuration bound (it takes x, w and act, the SiLU-and-multiply included), or None for cuBLAS."""
        config = self.plan.config_for(rows, shape)
        return None if config is None else self.tiled[config]

    def _linear(self, x: torch.Tensor, w: Linear, silu_mul: bool = False) -> torch.Tensor:
        """F.linear(x, w) (of silu(gate) * up when `silu_mul`), through cuBLAS unless the plan gives this step and
        weight to the tiled linear (`kernels.tiled_linear`); a Q8_0 weight through `kernels.q8_linear`, an FP8 one
        through `kernels.fp8_linear`."""
        if isinstance(w, Fp8Weight):
            x = silu_and_mul(x) if silu_mul else x
            if x.shape[0] <= self.plan.fp8_gemv_rows:
                return fp8_gemv(x, w, scratch=self.fp8_scratch)
            return fp8_linear(x, w)
        matmul = None if isinstance(w, Q8Weight) else self.matmul_for(x.shape[0], (w.shape[0], w.shape[1]))
        if matmul is not None:
            return matmul(x, w, act="silu_mul" if silu_mul else None)
        x = silu_and_mul(x) if silu_mul else x
        if isinstance(w, Q8Weight):
            return q8_linear(x, w.codes, w.scales)
        return F.linear(x, w)

    def _head(self, pending: torch.Tensor | None, residual: torch.Tensor, batch: int, tokens: int,
              decode: bool) -> None:
        """Final residual add (of `pending`, where the last sublayer's output was not added yet) + norm on each
        sequence's last token only (on every token of a prefill into the kept hidden states, with
        `RunnerLimits.score_rows`: the norm is per row, so the last tokens' are the same), then the LM head."""
        if not decode:
            last = (self.buffers.cu_seqlens_q[1: batch + 1] - 1).clamp_(min=0).long()
            if self.limits.score_rows:
                kept = self.buffers.hidden[:tokens]
                self._normed(residual, pending, self.final_norm, out=kept)
                self.buffers.logits[:batch].copy_(self._linear(kept[last], self.lm_head))
                return
            residual, pending = residual[last], None if pending is None else pending[last]
        x = self._normed(residual, pending, self.final_norm)
        self.buffers.logits[:batch].copy_(self._linear(x, self.lm_head))

    def _sample(self, batch: int, filtered: bool = True) -> None:
        b = self.buffers
        sample(b.logits[:batch], b.temperature[:batch], b.top_k[:batch], b.top_p[:batch], b.min_p[:batch],
               b.seeds[:batch], b.sample_index[:batch], b.next_tokens[:batch], b.token_logprobs[:batch],
               b.top_ids[:batch], b.top_logprobs[:batch], filtered=filtered,
               processors=b.processors(batch) if self.limits.processors else None,
               want_logprobs=b.want_logprobs[:batch],
               device_procs=b.device_processors(batch) if self.limits.device_tables else None,
               device_grammar=b.device_grammar(batch))

    # Host-side staging (host-driven mode and tests); a device scheduler writes the same buffers.
    def stage(self, input_ids: torch.Tensor, meta, sampling: dict[str, torch.Tensor] | None = None) -> None:
        """Copy one step (`AttentionMetadata` + token ids) into the static buffers, padding the rest.

        `sampling` may hold per-sequence `temperature`, `top_k`, `top_p`, `min_p`, `seeds`,
        `sample_index`, `want_logprobs` tensors; absent ones reset to greedy / off / 0 (log-probs: on
        for the real rows, off for the padding). It may also hold the
        `kernels.sampling.processor_columns` of the step (all of them); the processor buffers are
        reset to identity only after a step that staged them.
        """
        buf, T, B = self.buffers, input_ids.shape[0], meta.context_lens.shape[0]
        width = meta.block_tables.shape[1]
        if T > self.limits.max_tokens or B > self.limits.max_batch or width > self.limits.max_blocks_per_seq:
            raise ValueError(f"step of {B} sequences / {T} tokens / {width} blocks exceeds {self.limits}")
        for name, src, pad in (("input_ids", input_ids, 0), ("positions", meta.positions, 0),
                               ("slot_mapping", meta.slot_mapping, -1), ("context_lens", meta.context_lens, 0)):
            dst = getattr(buf, name)
            dst[len(src):].fill_(pad)
            dst[: len(src)].copy_(src)
        buf.cu_seqlens_q[B + 1:].fill_(T)
        buf.cu_seqlens_q[: B + 1].copy_(meta.cu_seqlens_q)
        decode_ctx, cu_chunks = split_rows(meta.cu_seqlens_q, meta.context_lens)
        buf.decode_ctx.fill_(0)
        buf.decode_ctx[:B].copy_(decode_ctx)
        buf.cu_chunks[B + 1:].fill_(T)
        buf.cu_chunks[: B + 1].copy_(cu_chunks)
        buf.block_tables.fill_(-1)
        buf.block_tables[:B, :width].copy_(meta.block_tables)
        defaults = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seeds": 0, "sample_index": 0,
                    "want_logprobs": 0}
        for name, value in defaults.items():
            dst = getattr(buf, name)
            dst.fill_(value)
            if sampling and name in sampling:
                dst[:B].copy_(sampling[name])
            elif name == "want_logprobs":
                dst[:B].fill_(1)
        self._stage_processors(B, sampling or {})

    def _stage_processors(self, B: int, sampling: dict[str, torch.Tensor]) -> None:
        staged = "logit_add" in sampling
        if staged and not self.limits.processors:
            raise ValueError("this runner was built without logits processors (RunnerLimits.processors)")
        if not (staged or self._processors_staged):
            return
        buf = self.buffers
        names = {"logit_add": "logit_add", "counts": "pen_counts", "seen": "pen_seen", "repetition": "repetition",
                 "frequency": "frequency", "presence": "presence"}
        for col, pad in Processors.IDENTITY.items():
            dst = getattr(buf, names[col])
            dst.fill_(pad)
            if staged:
                dst[:B].copy_(sampling[col])
        self._processors_staged = staged


def split_rows(cu_seqlens: torch.Tensor, context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(decode_ctx, cu_chunks) of a step: the leading run of one-token rows (row r with
    cu[r + 1] == r + 1) keeps its context length in decode_ctx and is empty in cu_chunks
    (cu_chunks[r] = max(cu[r], that run's length)); every other row is 0 in decode_ctx."""
    cu = cu_seqlens.to(torch.int64)
    rows = torch.arange(1, cu.numel(), dtype=torch.int64, device=cu.device)
    lead = torch.cumprod((cu[1:] == rows).to(torch.int64), 0).bool()
    nd = int(lead.sum())
    decode_ctx = torch.where(lead, context_lens.to(torch.int32), torch.zeros_like(context_lens, dtype=torch.int32))
    return decode_ctx, cu.clamp(min=nd).to(torch.int32)

