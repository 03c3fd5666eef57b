"""FP8 linears for the GPU backends: a checkpoint's own (the Hugging Face forms vLLM loads) or a dense model's
quantized at load (``--quantization fp8``).

Checkpoints (``config.json``'s ``quantization_config``), read as they are, nothing dequantized:

- ``quant_method: "fp8"`` (AutoFP8, vLLM's own format): float8_e4m3fn ``weight`` with ``weight_scale`` (one scale,
  or one a row), ``activation_scheme`` dynamic or static (then ``input_scale`` a linear);
- ``quant_method: "compressed-tensors"`` (llm-compressor's FP8 and FP8_DYNAMIC), format ``float-quantized``: one
  config group of 8-bit float weights, strategy ``channel`` or ``tensor``, and 8-bit float input activations,
  dynamic per ``token`` / per ``tensor`` or static per ``tensor``.

Which linears are FP8 is what the file stores as float8_e4m3fn (its ignore lists are not read). Blink keeps FP8
the decoder layers' dense projections (q/k/v, o, gate/up, down); every other variant is refused by name:
block-wise scales (``weight_block_size``, ``weight_scale_inv``: the official Qwen3 and DeepSeek FP8 files),
group or per-input-channel scales, weight-only FP8, calibrated KV-cache or output scales (``kv_cache_scheme``,
``k_scale``/``v_scale``/``output_scale`` tensors), e5m2, and FP8 tensors elsewhere (MoE experts, the LM head); so are
scales that are not finite and positive, and a scale beside a weight not stored in FP8.

``--quantization fp8`` of a dense model takes the same linears, as vLLM's online fp8 takes every linear but the
LM head (MoE experts and routers stay in --dtype here: the fused MoE kernel multiplies bf16 experts).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Protocol

import torch

from gpu_engine.models.config import ModelConfig
from gpu_engine.models.decoder import CausalLM
from gpu_engine.models.errors import ModelLoadError
from gpu_engine.models.fp8_weight import Fp8Weight, quantize_fp8

FP8_STORED = "F8_E4M3"  # safetensors' name of float8_e4m3fn
LINEARS = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")  # our fused linears, as the runner holds them
# Our linear -> its parts in a Hugging Face checkpoint (under model.layers.N.); Phi-3 stores them fused.
HF_PARTS = {"attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "attn.o": ("self_attn.o_proj",),
            "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj"), "mlp.down": ("mlp.down_proj",)}
PHI3_PARTS = HF_PARTS | {"attn.qkv": ("self_attn.qkv_proj",), "mlp.gate_up": ("mlp.gate_up_proj",)}


@dataclasses.dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """How FP8 linears scale: the weight per ``channel`` or ``tensor``; the activations dynamic per ``token`` or
    ``tensor``, or ``static`` (a checkpoint's ``input_scale``)."""

    weights: str = "channel"
    activations: str = "token"
    method: str = "fp8"  # the checkpoint's quant_method, or "fp8" for --quantization fp8

    def __post_init__(self) -> None:
        if self.weights not in ("channel", "tensor") or self.activations not in ("token", "tensor", "static"):
            raise ValueError(f"FP8 scheme {self.weights}/{self.activations}: weights channel|tensor, "
                             "activations token|tensor|static")


class TensorSource(Protocol):
    """What the checkpoint reader needs of ``loader.SafetensorsSource``."""

    location: Path

    def names(self) -> list[str]: ...
    def has(self, name: str) -> bool: ...
    def get(self, name: str) -> torch.Tensor: ...
    def stored_dtype(self, name: str) -> str: ...


def _refuse(path: Path, what: str) -> ModelLoadError:
    return ModelLoadError(f"{path}: {what} is not supported; Blink loads FP8 checkpoints with float8_e4m3fn weights "
                          "scaled per tensor or per output channel and FP8 activations (dynamic, or static per "
                          "tensor), in quant_method fp8 or compressed-tensors float-quantized")


def read_scheme(directory: Path) -> Fp8Scheme | None:
    """The FP8 scheme of a Hugging Face folder's ``quantization_config``, None where it has none; a quantization
    Blink does not load raises ``ModelLoadError`` naming it."""
    try:
        raw = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None  # ModelConfig.from_file reports what is wrong with it
    qc = raw.get("quantization_config") if isinstance(raw, dict) else None
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8_method(directory, qc)
    if method == "compressed-tensors":
        return _compressed_tensors(directory, qc)
    raise _refuse(directory, f"quantization_config quant_method {method!r}")


KV_SCALES = ("an FP8 KV cache with calibrated scales ({}; Blink's FP8 KV cache, --kv-cache-dtype fp8, takes a "
             "scale of 1.0)")
# tensors of calibrated KV-cache (and attention output) scales, in either format: refused, not left unread
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale", ".output_scale", ".q_scale", ".prob_scale")


def _fp8_method(path: Path, qc: dict[str, Any]) -> Fp8Scheme:
    if qc.get("kv_cache_scheme") is not None:
        raise _refuse(path, KV_SCALES.format("kv_cache_scheme"))
    if qc.get("weight_block_size") is not None:
        raise _refuse(path, f"block-wise FP8 (weight_block_size {qc['weight_block_size']}, weight_scale_inv)")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _refuse(path, f"FP8 format {qc['fmt']!r}")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _refuse(path, f"activation_scheme {scheme!r}")
    # the weight's granularity is read per tensor (weight_scale's size): "channel" stands for either
    return Fp8Scheme("channel", "token" if scheme == "dynamic" else "static", "fp8")


def _compressed_tensors(path: Path, qc: dict[str, Any]) -> Fp8Scheme:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _refuse(path, f"compressed-tensors format {fmt!r}")
    if qc.get("kv_cache_scheme") is not None:
        raise _refuse(path, KV_SCALES.format("kv_cache_scheme"))
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise _refuse(path, f"{len(groups)} compressed-tensors config groups (Blink takes one)")
    group = groups[0]
    if "Linear" not in group.get("targets", []):
        raise _refuse(path, f"config group targets {group.get('targets')} (Blink takes 'Linear')")
    w, a = group.get("weights") or {}, group.get("input_activations")
    if (w.get("type"), w.get("num_bits")) != ("float", 8) or w.get("dynamic") or not w.get("symmetric", True):
        raise _refuse(path, f"compressed-tensors weights {w}")
    if w.get("strategy") not in ("channel", "tensor"):
        raise _refuse(path, f"weight strategy {w.get('strategy')!r} (block- or group-wise scales)")
    if a is None:
        raise _refuse(path, "weight-only FP8 (W8A16: no input_activations)")
    if (a.get("type"), a.get("num_bits")) != ("float", 8) or not a.get("symmetric", True):
        raise _refuse(path, f"compressed-tensors input activations {a}")
    act = a.get("strategy") if a.get("dynamic") else "static" if a.get("strategy") == "tensor" else None
    if act not in ("token", "tensor", "static"):
        raise _refuse(path, f"input activation strategy {a.get('strategy')!r} (dynamic {a.get('dynamic')})")
    return Fp8Scheme(w["strategy"], act, "compressed-tensors")


def checkpoint_linears(source: TensorSource, config: ModelConfig, scheme: Fp8Scheme) -> dict[str, Fp8Weight]:
    """The checkpoint's FP8 linears by our parameter name, as stored (parts fused as the runner holds them); an FP8
    tensor anywhere else, or a fused linear whose parts are not all FP8, raises ``ModelLoadError``."""
    parts_of = PHI3_PARTS if config.family == "phi3" else HF_PARTS
    out: dict[str, Fp8Weight] = {}
    used: set[str] = set()
    for i in range(config.num_layers):
        for ours in LINEARS:
            if ours.startswith("mlp.") and config.is_moe_layer(i):
                continue
            names = [f"model.layers.{i}.{p}" for p in parts_of[ours]]
            stored = [source.stored_dtype(f"{n}.weight") == FP8_STORED for n in names]
            if not any(stored):
                continue
            if not all(stored):
                raise _refuse(source.location, f"FP8 for only some of {', '.join(names)} (fused into one product)")
            out[f"layers.{i}.{ours}.weight"] = Fp8Weight.cat([_part(source, n, scheme) for n in names])
            used.update(f"{n}.weight" for n in names)
    for name in source.names():
        if name not in used and source.stored_dtype(name).startswith("F8"):
            raise _refuse(source.location, f"FP8 tensor {name} ({source.stored_dtype(name)}) outside the decoder "
                          "layers' dense projections")
        if name.endswith(KV_SCALE_SUFFIXES):
            raise _refuse(source.location, KV_SCALES.format(name))
        weight = name.rsplit(".", 1)[0] + ".weight"
        if name.endswith((".weight_scale", ".input_scale")) and weight not in used:
            kind = source.stored_dtype(weight) if source.has(weight) else "absent"
            raise _refuse(source.location, f"{name} beside a weight not stored as float8_e4m3fn ({weight}: {kind})")
    if not out:
        raise ModelLoadError(f"{source.location}: quantization_config says {scheme.method} but no linear is stored "
                             "as float8_e4m3fn")
    return out


def _part(source: TensorSource, name: str, scheme: Fp8Scheme) -> Fp8Weight:
    """One stored FP8 linear: its weight, its scales as one a row, its static input scale where it has one."""
    if source.has(f"{name}.weight_scale_inv"):
        raise _refuse(source.location, f"block-wise scales ({name}.weight_scale_inv)")
    weight = source.get(f"{name}.weight")
    rows = weight.shape[0]
    stored = source.get(f"{name}.weight_scale")
    # one scale (any shape of one element), or one a row ([rows] or [rows, 1]); a [1, K] or [K] scale is per input
    # channel, which a square weight's element count alone would not tell apart
    if stored.numel() != 1 and tuple(stored.shape) not in ((rows,), (rows, 1)):
        raise _refuse(source.location, f"{name}.weight_scale of shape {tuple(stored.shape)} for a weight of "
                      f"{rows} rows (per input channel, block- or group-wise scales)")
    if scheme.method == "compressed-tensors" and (stored.numel() == 1) != (scheme.weights == "tensor"):
        raise ModelLoadError(f"{source.location}: {name}.weight_scale of shape {tuple(stored.shape)} under weight "
                             f"strategy {scheme.weights!r}")
    scale = _positive(source, f"{name}.weight_scale", stored.float().flatten())
    input_scale = None
    if scheme.activations == "static":
        if not source.has(f"{name}.input_scale"):
            raise ModelLoadError(f"{source.location}: static activation scales but no {name}.input_scale")
        input_scale = _positive(source, f"{name}.input_scale", source.get(f"{name}.input_scale").float().flatten())
        if input_scale.numel() != 1:
            raise _refuse(source.location, f"{name}.input_scale of {input_scale.numel()} values (per-tensor only)")
    return Fp8Weight(weight, scale.expand(rows).contiguous(), scale.numel() == 1, scheme.activations == "tensor",
                     input_scale)


def _positive(source: TensorSource, name: str, scale: torch.Tensor) -> torch.Tensor:
    """``scale`` when every value is finite and above zero; a scale of 0, below 0, inf or NaN would load as zeroed
    weights or non-finite logits: ``ModelLoadError`` naming the tensor."""
    bad = scale[~(torch.isfinite(scale) & (scale > 0))]
    if bad.numel():
        raise ModelLoadError(f"{source.location}: {name} holds {bad.numel()} scale(s) that are not finite and "
                             f"positive (first: {bad[0].item()})")
    return scale


def quantize_linears(model: CausalLM, scheme: Fp8Scheme = Fp8Scheme()) -> dict[str, Fp8Weight]:
    """``--quantization fp8``: the decoder layers' dense projections of a loaded model quantized to FP8 (on the
    model's device, ``scheme``'s scales), their parameters left empty (freed); by our parameter name."""
    if scheme.activations == "static":
        raise ValueError("--quantization fp8 has no calibration: activations dynamic per token or per tensor")
    out: dict[str, Fp8Weight] = {}
    for i, layer in enumerate(model.layers):
        for ours in LINEARS:
            if ours.startswith("mlp.") and hasattr(layer.mlp, "router"):
                continue  # MoE experts stay as loaded
            module = layer.get_submodule(ours)
            weight = module.weight
            assert isinstance(weight, torch.Tensor)
            out[f"layers.{i}.{ours}.weight"] = quantize_fp8(weight, scheme.weights == "tensor",
                                                            scheme.activations == "tensor")
            module.weight = torch.nn.Parameter(weight.new_empty(0), requires_grad=False)
    return out
