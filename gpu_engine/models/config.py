"""Model hyperparameters, read from a Hugging Face ``config.json`` (or built by the GGUF loader)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from gpu_engine.models.errors import ModelLoadError
from shared.model_context import hf_context

# Hugging Face architecture name -> model family.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Phi3ForCausalLM": "phi3",
}
FAMILIES = frozenset(ARCHITECTURES.values())
QK_NORM_FAMILIES = frozenset({"qwen3", "qwen3_moe"})
ROPE_TYPES = frozenset({"llama3", "longrope", "factors"})


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the decoder needs to know about a model's shape.

    ``rope_scaling`` is ``None`` for plain RoPE, else a dict with a ``rope_type`` of
    ``"llama3"`` (keys factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    or ``"longrope"`` (keys short_factor, long_factor, attention_factor,
    original_max_position_embeddings) or ``"factors"`` (key factors: per-frequency divisors, as GGUF
    files store Llama-3.1 scaling).
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    partial_rotary_factor: float = 1.0
    sliding_window: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if not 0.0 < self.partial_rotary_factor <= 1.0 or self.rotary_dim % 2:
            raise ValueError(f"rotary dim {self.rotary_dim} (head_dim * partial_rotary_factor) must be even")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") not in ROPE_TYPES:
            raise ValueError(f"unsupported rope scaling {self.rope_scaling.get('rope_type')!r}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")
        self._validate_mlp()

    def _validate_mlp(self) -> None:
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok {self.num_experts_per_tok} not in 1..num_experts {self.num_experts}"
                )
            if self.moe_intermediate_size <= 0 or self.decoder_sparse_step <= 0:
                raise ValueError("moe_intermediate_size and decoder_sparse_step must be positive")
        if any(not self.is_moe_layer(i) for i in range(self.num_layers)) and self.intermediate_size <= 0:
            raise ValueError("intermediate_size must be positive when some layer has a dense MLP")

    def __hash__(self) -> int:
        return hash(tuple(_frozen(getattr(self, f.name)) for f in fields(self)))

    @property
    def rotary_dim(self) -> int:
        """Leading channels of each head that RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def qk_norm(self) -> bool:
        """Whether each head's query and key go through an RMSNorm before RoPE."""
        return self.family in QK_NORM_FAMILIES

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer`` uses the mixture-of-experts block instead of a dense MLP."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read a Hugging Face ``config.json``."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ModelLoadError(f"{path}: file not found") from None
        except OSError as exc:
            raise ModelLoadError(f"{path}: cannot read: {exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path}: malformed JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ModelLoadError(f"{path}: malformed JSON: top level is not an object")
        return cls.from_hf(data, source=str(path))

    @classmethod
    def from_hf(cls, data: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a parsed Hugging Face config dict; ``source`` names the file in errors."""
        archs = data.get("architectures") or []
        arch = archs[0] if archs else None
        family = ARCHITECTURES.get(arch) if isinstance(arch, str) else None
        if family is None:
            supported = ", ".join(ARCHITECTURES)
            raise ModelLoadError(f"{source}: unsupported architecture {arch!r} (supported: {supported})")
        try:
            return cls(**_hf_fields(data, family))
        except KeyError as exc:
            raise ModelLoadError(f"{source}: missing key {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"{source}: invalid config: {exc}") from None


def _hf_fields(data: Mapping[str, Any], family: str) -> dict[str, Any]:
    for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if data.get(flag):
            raise ValueError(f"{flag}=true is not supported")
    num_heads = int(data["num_attention_heads"])
    hidden = int(data["hidden_size"])
    rope_params = dict(data.get("rope_parameters") or data.get("rope_scaling") or {})
    rope_theta = data.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    fields: dict[str, Any] = {
        "family": family,
        "vocab_size": int(data["vocab_size"]),
        "hidden_size": hidden,
        "intermediate_size": int(data.get("intermediate_size") or 0),
        "num_layers": int(data["num_hidden_layers"]),
        "num_heads": num_heads,
        "num_kv_heads": int(data.get("num_key_value_heads") or num_heads),
        "head_dim": int(data.get("head_dim") or hidden // num_heads),
        "rms_norm_eps": float(data.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(rope_theta),
        "rope_scaling": _rope_scaling(rope_params, data),
        "max_position_embeddings": hf_context(data),
        "tie_word_embeddings": bool(data.get("tie_word_embeddings", False)),
        "bos_token_id": data.get("bos_token_id"),
        "eos_token_ids": _token_ids(data.get("eos_token_id")),
        "partial_rotary_factor": float(
            data.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0))
        ),
        # Qwen3 configs carry a window that only applies with use_sliding_window (rejected above).
        "sliding_window": data.get("sliding_window") if family == "phi3" else None,
    }
    if family == "qwen3_moe":
        fields.update(
            num_experts=int(data.get("num_experts", data.get("num_local_experts", 0))),
            num_experts_per_tok=int(data["num_experts_per_tok"]),
            moe_intermediate_size=int(data["moe_intermediate_size"]),
            norm_topk_prob=bool(data.get("norm_topk_prob", False)),
            decoder_sparse_step=int(data.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(i) for i in data.get("mlp_only_layers") or ()),
        )
    return fields


def _frozen(value: Any) -> Any:
    """A hashable stand-in for nested dicts/lists (for ``ModelConfig.__hash__``)."""
    if isinstance(value, Mapping):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return value


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_scaling(params: Mapping[str, Any], data: Mapping[str, Any]) -> dict[str, Any] | None:
    """Normalise HF ``rope_scaling``/``rope_parameters`` into our ``rope_scaling`` dict."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "su":
        rope_type = "longrope"
    original = params.get("original_max_position_embeddings", data.get("original_max_position_embeddings"))
    if rope_type == "default":
        return None
    if rope_type == "llama3":
        return {
            "rope_type": "llama3",
            "factor": float(params["factor"]),
            "low_freq_factor": float(params["low_freq_factor"]),
            "high_freq_factor": float(params["high_freq_factor"]),
            "original_max_position_embeddings": int(original),
        }
    if rope_type == "longrope":
        return _longrope(params, data, int(original))
    raise ValueError(f"unsupported rope scaling {rope_type!r}")


def _longrope(params: Mapping[str, Any], data: Mapping[str, Any], original: int) -> dict[str, Any]:
    factor = params.get("factor") or data.get("max_position_embeddings", original) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {
        "rope_type": "longrope",
        "short_factor": tuple(float(f) for f in params["short_factor"]),
        "long_factor": tuple(float(f) for f in params["long_factor"]),
        "attention_factor": float(attention_factor),
        "original_max_position_embeddings": original,
    }
