"""Read a GGUF file (llama.cpp format): hyperparameters into a ``ModelConfig``, tensors dequantized.

Supported architectures: ``llama``, ``qwen3``, ``qwen3moe``, ``phi3``. llama.cpp's converter
permutes the rows of Q and K for ``llama`` so that its interleaved-pair RoPE works; that permutation
is undone (``gguf_weights.unpermute_rope_rows``) because our RoPE pairs channel i with i + d/2, as
the HF checkpoints do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quant_shape_to_byte_shape

from gpu_engine.kernels.cpu_linear import _cpu_quant, quant_kernels_available
from gpu_engine.models.config import ModelConfig
from gpu_engine.models.errors import ModelLoadError
from gpu_engine.models.gguf_weights import map_gguf_blocks, map_gguf_q4_1, map_gguf_weights
from gpu_engine.models.q8_weight import Q8Weight
from shared.gguf_meta import GgufMeta, TensorInfo, read_meta
from shared.model_context import gguf_context

FAMILY_BY_ARCH = {"llama": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "phi3": "phi3"}
Q = GGMLQuantizationType
SUPPORTED_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
                             Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K})
FLOAT_TYPES = {Q.F32: np.float32, Q.F16: np.float16}  # stored as plain arrays; the others as blocks of bytes


@dataclasses.dataclass(frozen=True)
class RawTensor:
    """One tensor of the file: its GGUF entry and its stored bytes (a view of the mapped file), shaped as the
    ``gguf`` package's reader shapes them (reversed dimensions; quantized rows as bytes)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first
    data: np.ndarray


def raw_tensor(mapped: np.ndarray, info: TensorInfo, path: Path) -> RawTensor:
    try:
        qtype = GGMLQuantizationType(info.ggml_type)
    except ValueError:
        raise ModelLoadError(f"{path}: tensor {info.name} has unknown type {info.ggml_type}") from None
    dims = tuple(reversed(info.shape))
    if qtype in FLOAT_TYPES:
        dtype, shape = np.dtype(FLOAT_TYPES[qtype]), dims
    elif qtype in GGML_QUANT_SIZES:
        dtype, shape = np.dtype(np.uint8), quant_shape_to_byte_shape(dims, qtype)
    else:
        raise ModelLoadError(f"{path}: tensor {info.name} has unsupported quantization type {qtype.name}")
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if info.offset + nbytes > mapped.size:
        raise ModelLoadError(f"{path}: tensor {info.name} runs past the end of the file (truncated?)")
    return RawTensor(info.name, qtype, info.shape,
                     mapped[info.offset:info.offset + nbytes].view(dtype).reshape(shape))


class GGUFSource:
    """An opened GGUF file: ``config`` plus ``named_weights`` yielding our parameter names."""

    def __init__(self, path: Path) -> None:
        self.location = path
        try:
            self._meta: GgufMeta = read_meta(path)
            mapped = np.memmap(path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{path}: not a valid GGUF file: {exc}") from None
        self._tensors = {t.name: raw_tensor(mapped, t, path) for t in self._meta.tensors}
        self.arch = str(self._field("general.architecture"))
        if self.arch not in FAMILY_BY_ARCH:
            supported = ", ".join(FAMILY_BY_ARCH)
            raise ModelLoadError(f"{path}: unsupported architecture {self.arch!r} (supported: {supported})")
        self.config = self._build_config()

    def _field(self, key: str, default: Any = ...) -> Any:
        if key not in self._meta.fields:
            if default is ...:
                raise ModelLoadError(f"{self.location}: missing metadata key {key}")
            return default
        return self._meta.fields[key]

    def _build_config(self) -> ModelConfig:
        a = self.arch
        hidden = int(self._field(f"{a}.embedding_length"))
        heads = int(self._field(f"{a}.attention.head_count"))
        head_dim = int(self._field(f"{a}.attention.key_length", hidden // heads))
        vocab = self._field(f"{a}.vocab_size", None)
        if vocab is None:
            vocab = len(self._field("tokenizer.ggml.tokens"))
        eos = [self._field(k, None) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
        fields: dict[str, Any] = {
            "family": FAMILY_BY_ARCH[a],
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(self._field(f"{a}.feed_forward_length", 0)),
            "num_layers": int(self._field(f"{a}.block_count")),
            "num_heads": heads,
            "num_kv_heads": int(self._field(f"{a}.attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "rms_norm_eps": float(self._field(f"{a}.attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self._field(f"{a}.rope.freq_base", 10000.0)),
            "rope_scaling": self._rope_scaling(),
            "max_position_embeddings": gguf_context(self._meta.fields, a),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id", None),
            "eos_token_ids": tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
            "partial_rotary_factor": int(self._field(f"{a}.rope.dimension_count", head_dim)) / head_dim,
        }
        if a == "phi3":
            fields["sliding_window"] = self._field(f"{a}.attention.sliding_window", None)
        if a == "qwen3moe":
            fields.update(
                num_experts=int(self._field(f"{a}.expert_count")),
                num_experts_per_tok=int(self._field(f"{a}.expert_used_count")),
                moe_intermediate_size=int(self._field(f"{a}.expert_feed_forward_length")),
                norm_topk_prob=bool(self._field(f"{a}.expert_weights_norm", True)),
            )
        try:
            return ModelConfig(**fields)
        except ValueError as exc:
            raise ModelLoadError(f"{self.location}: invalid hyperparameters: {exc}") from None

    def _rope_scaling(self) -> dict[str, Any] | None:
        if "rope_freqs.weight" in self._tensors:  # per-frequency divisors (Llama-3.1 style scaling)
            factors = self.tensor("rope_freqs.weight")
            return {"rope_type": "factors", "factors": tuple(factors.tolist())}
        if "rope_factors_long.weight" in self._tensors:  # Phi-3 longrope
            a = self.arch
            original = int(self._field(f"{a}.rope.scaling.original_context_length"))
            return {
                "rope_type": "longrope",
                "short_factor": tuple(self.tensor("rope_factors_short.weight").tolist()),
                "long_factor": tuple(self.tensor("rope_factors_long.weight").tolist()),
                "attention_factor": float(self._field(f"{a}.rope.scaling.attn_factor", 1.0)),
                "original_max_position_embeddings": original,
            }
        return None

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, dequantized to float32, in PyTorch's [rows, cols] order."""
        t = self._tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.location}: missing tensor {name}")
        return _dequantize(t, self.location)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def named_weights(self, config: ModelConfig,
                      placeholders: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor, str]]:
        """Every parameter's tensor, dequantized; those named in ``placeholders`` (whose values the caller has
        in another form, e.g. ``q4_1_linears``' blocks) as meta tensors of their shape, nothing read."""
        permuted = self.arch == "llama"
        shapes = map_gguf_weights(config, self._meta_tensor, self.has, permuted_qk=permuted) if placeholders else ()
        skip = {part for ours, _, origin in shapes if ours in placeholders for part in origin.split("+")}
        return map_gguf_weights(config, lambda n: self._meta_tensor(n) if n in skip else self.tensor(n), self.has,
                                permuted_qk=permuted)

    def _meta_tensor(self, name: str) -> torch.Tensor:
        """A tensor's shape as ``tensor`` gives it, on the meta device (no data)."""
        t = self._tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.location}: missing tensor {name}")
        return torch.empty(tuple(int(d) for d in reversed(t.shape)), device="meta")

    def blocks(self, name: str, qtype: GGMLQuantizationType) -> torch.Tensor | None:
        """A 2-D tensor's stored blocks as uint8 [rows, row bytes] (a copy) when it is of ``qtype``, else None."""
        t = self._tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{self.location}: missing tensor {name}")
        if t.tensor_type != qtype or t.data.ndim != 2:
            return None
        return torch.from_numpy(np.array(t.data, copy=True))

    def q4_1_blocks(self, name: str) -> torch.Tensor | None:
        """A Q4_1 tensor's stored blocks as uint8 [rows, cols / 32 * 20] (a copy), or None for another type."""
        return self.blocks(name, Q.Q4_1)

    def q8_0_linears(self, config: ModelConfig) -> dict[str, Q8Weight]:
        """Our linear weights (the decoder layers' dense ones and an untied LM head) and the token table whose
        every GGUF part is Q8_0, as ``Q8Weight`` (the file's codes and scales, nothing rounded), by parameter
        name."""
        found = map_gguf_blocks(config, lambda n: self.blocks(n, Q.Q8_0), permuted_qk=self.arch == "llama",
                                lm_head=True, embedding=True)
        return {name: Q8Weight.from_blocks(b) for name, b in found.items()}

    def tensor_types(self) -> dict[str, str]:
        """Each tensor's GGUF type name, by GGUF tensor name."""
        return {name: t.tensor_type.name for name, t in self._tensors.items()}

    def q4_1_linears(self, config: ModelConfig) -> dict[str, torch.Tensor]:
        """Our linear weights whose every GGUF part is Q4_1, as those blocks (``Q4Linear``'s form), by name."""
        return map_gguf_q4_1(config, self.q4_1_blocks, permuted_qk=self.arch == "llama")


def _dequantize(t: RawTensor, path: Path) -> torch.Tensor:
    qtype = t.tensor_type
    if qtype not in SUPPORTED_TYPES:
        raise ModelLoadError(f"{path}: tensor {t.name} has unsupported quantization type {qtype.name}")
    shape = tuple(int(d) for d in reversed(t.shape))
    fast = _dequantize_in_c(t, shape)
    if fast is not None:
        return fast
    try:
        values = dequantize(t.data, qtype)
    except (NotImplementedError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot dequantize {t.name} ({qtype.name}): {exc}") from None
    array = np.array(values, dtype=np.float32, copy=True).reshape(shape)
    return torch.from_numpy(array)


def _dequantize_in_c(t: RawTensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    """Q4_1 and Q8_0 tensors through the CPU kernels (the same values as the ``gguf`` package's numpy, in a
    fraction of the time: most of an engine's start), else None."""
    kernels = {Q.Q4_1: "q4_dequant", Q.Q8_0: "q8_dequant"}
    if t.tensor_type not in kernels or len(shape) != 2 or shape[1] % 32 or shape[1] > 65536:
        return None
    if not quant_kernels_available():
        return None
    blocks = np.ascontiguousarray(t.data)
    out = torch.empty(shape, dtype=torch.float32)
    getattr(_cpu_quant, kernels[t.tensor_type])(out.data_ptr(), blocks.ctypes.data, shape[0], shape[1])
    return out
