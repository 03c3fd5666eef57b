"""Hugging Face checkpoint tensor names -> this package's parameter names, per family.

Our modules always hold fused weights: ``attn.qkv`` is ``[q; k; v]`` rows, ``mlp.gate_up`` is
``[gate; up]`` rows, and MoE experts are stacked along a leading expert dim. Llama and Qwen3
checkpoints store the parts separately, so they are concatenated here; Phi-3 stores them fused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from gpu_engine.models.config import ModelConfig
from gpu_engine.models.errors import ModelLoadError

# Fetches one checkpoint tensor by its HF name; raises ModelLoadError when absent.
Getter = Callable[[str], torch.Tensor]
# Our parameter name -> (tensor, the checkpoint names it came from).
Mapped = Iterator[tuple[str, torch.Tensor, str]]


def _cat(get: Getter, names: list[str], dim: int = 0) -> tuple[torch.Tensor, str]:
    parts = [get(n) for n in names]
    joined = "+".join(names)
    try:
        return torch.cat(parts, dim=dim), joined
    except RuntimeError as exc:
        raise ModelLoadError(f"shape mismatch joining {joined}: {exc}") from None


def map_hf_weights(config: ModelConfig, get: Getter, has: Callable[[str], bool]) -> Mapped:
    """Yield ``(our_name, tensor, source_names)`` for every parameter of ``CausalLM(config)``."""
    yield "embed.weight", get("model.embed_tokens.weight"), "model.embed_tokens.weight"
    yield "norm.weight", get("model.norm.weight"), "model.norm.weight"
    if not config.tie_word_embeddings:
        yield "lm_head.weight", get("lm_head.weight"), "lm_head.weight"
    for i in range(config.num_layers):
        yield from _layer(config, i, get, has)


def _layer(config: ModelConfig, i: int, get: Getter, has: Callable[[str], bool]) -> Mapped:
    hf, ours = f"model.layers.{i}.", f"layers.{i}."
    for src, dst in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm"),
                     ("self_attn.o_proj", "attn.o")):
        yield f"{ours}{dst}.weight", get(f"{hf}{src}.weight"), f"{hf}{src}.weight"
    if config.family == "phi3":
        name = f"{hf}self_attn.qkv_proj.weight"
        yield f"{ours}attn.qkv.weight", get(name), name
    else:
        yield f"{ours}attn.qkv.weight", *_cat(get, [f"{hf}self_attn.{p}_proj.weight" for p in "qkv"])
    if config.qk_norm:
        for p in ("q_norm", "k_norm"):
            yield f"{ours}attn.{p}.weight", get(f"{hf}self_attn.{p}.weight"), f"{hf}self_attn.{p}.weight"
    if config.is_moe_layer(i):
        yield from _moe(config, hf + "mlp.", ours + "mlp.", get, has)
    elif config.family == "phi3":
        yield f"{ours}mlp.gate_up.weight", get(f"{hf}mlp.gate_up_proj.weight"), f"{hf}mlp.gate_up_proj.weight"
        yield f"{ours}mlp.down.weight", get(f"{hf}mlp.down_proj.weight"), f"{hf}mlp.down_proj.weight"
    else:
        yield f"{ours}mlp.gate_up.weight", *_cat(get, [f"{hf}mlp.{p}_proj.weight" for p in ("gate", "up")])
        yield f"{ours}mlp.down.weight", get(f"{hf}mlp.down_proj.weight"), f"{hf}mlp.down_proj.weight"


def _moe(config: ModelConfig, hf: str, ours: str, get: Getter, has: Callable[[str], bool]) -> Mapped:
    yield f"{ours}router.weight", get(f"{hf}gate.weight"), f"{hf}gate.weight"
    if has(f"{hf}experts.gate_up_proj"):  # already stacked
        yield f"{ours}gate_up", get(f"{hf}experts.gate_up_proj"), f"{hf}experts.gate_up_proj"
        yield f"{ours}down", get(f"{hf}experts.down_proj"), f"{hf}experts.down_proj"
        return
    gate_up, down = [], []
    for e in range(config.num_experts):
        prefix = f"{hf}experts.{e}."
        gate_up.append(_cat(get, [f"{prefix}gate_proj.weight", f"{prefix}up_proj.weight"])[0])
        down.append(get(f"{prefix}down_proj.weight"))
    names = f"{hf}experts.*"
    try:
        yield f"{ours}gate_up", torch.stack(gate_up), names + ".gate_proj/up_proj"
        yield f"{ours}down", torch.stack(down), names + ".down_proj"
    except RuntimeError as exc:
        raise ModelLoadError(f"shape mismatch stacking {names}: {exc}") from None
