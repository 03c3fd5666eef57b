"""``--kv-cache-dtype fp8`` outside the kernels: the cache's sizing (twice the blocks for the same memory), its
per-layer scales, what the ring header and ``vllm:cache_config_info`` say of it, and the runner taking the cache."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from gpu_engine import serve as engine_serve
from gpu_engine.gpu.kv_memory import blocks_after_capture
from gpu_engine.kv_cache import KVCache, block_bytes
from shared import ring_layout as L
from shared.config import EngineConfig
from shared.metrics import CacheConfig
from shared.ring import RingGeometry, create_shm_ring


@dataclasses.dataclass(frozen=True)
class Shape:
    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128


def test_an_fp8_cache_gets_twice_the_blocks_of_a_bf16_one_for_the_same_memory() -> None:
    """Llama-3-8B's shape: a 16-token block over 32 layers is 2 MiB in bf16, 1 MiB in FP8; the budget of
    --gpu-memory-utilization of the free memory holds twice as many."""
    shape, free = Shape(), 40 * 2**30
    assert block_bytes(shape, 16, torch.bfloat16) == 2 * 2**20
    assert block_bytes(shape, 16, torch.float8_e4m3fn) == 2**20
    tensors, granule = 2 * shape.num_layers, 2**21
    bf16 = blocks_after_capture(free, 0, 0.5, tensors, granule, block_bytes(shape, 16, torch.bfloat16) // tensors)
    fp8 = blocks_after_capture(free, 0, 0.5, tensors, granule, block_bytes(shape, 16, torch.float8_e4m3fn) // tensors)
    assert (bf16, fp8) == (10240, 20480)


def test_an_fp8_cache_holds_e4m3_codes_with_unit_scales_a_layer() -> None:
    kv = KVCache(Shape(num_layers=3, num_kv_heads=2, head_dim=16), 4, 8, dtype=torch.float8_e4m3fn)
    assert all(t.dtype == torch.float8_e4m3fn and t.shape == (4, 8, 2, 16) for t in kv.k + kv.v)
    assert all(t.untyped_storage().nbytes() == 4 * 8 * 2 * 16 for t in kv.k + kv.v)
    assert [kv.kv_scale(i) for i in range(3)] == [(1.0, 1.0)] * 3
    kv.v_scale[1] = 0.5
    assert kv.kv_scale(1) == (1.0, 0.5)


def _header_after(cfg: EngineConfig, name: str) -> tuple[int, CacheConfig | None]:
    ring = create_shm_ring(name, RingGeometry(num_slots=4, max_prompt_tokens=64, max_output_tokens=16))
    try:
        backend = types.SimpleNamespace(policy=types.SimpleNamespace(prefix_caching=True), make_engine=None)
        engine_serve.write_cache_config(ring, cfg, backend)  # type: ignore[arg-type]
        header = ring.header[0]
        return int(header["kv_cache_dtype"]), CacheConfig.of_header(header, 100)
    finally:
        ring.close()


@pytest.mark.parametrize(("argv", "code", "name"), [
    ({"backend": "host", "kv_cache_dtype": "fp8"}, L.KvCacheDtype.FLOAT8_E4M3, "fp8_e4m3"),
    ({"backend": "persistent", "kv_cache_dtype": "fp8_e4m3"}, L.KvCacheDtype.FLOAT8_E4M3, "fp8_e4m3"),
    ({"backend": "host"}, L.KvCacheDtype.BFLOAT16, "bfloat16"),
    ({"backend": "cpu"}, L.KvCacheDtype.FLOAT16, "float16"),
])
def test_the_ring_header_and_the_cache_config_info_name_the_kv_dtype(ring_name: str, argv: dict, code: int,
                                                                     name: str) -> None:
    """The engine writes the cache's element type into the header (FLOAT8_E4M3 = 4 for an FP8 cache); the frontend's
    ``vllm:cache_config_info`` names it in ``cache_dtype``."""
    got, info = _header_after(EngineConfig(ring_name=ring_name, **argv), ring_name)
    assert got == code
    assert info is not None and info.labels()["cache_dtype"] == name
    assert int(L.KvCacheDtype.FLOAT8_E4M3) == 4


LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
         "rope_theta": 10000.0, "max_position_embeddings": 256}


def _runners(dtype: torch.dtype, device: str = "cpu"):
    from gpu_engine.gpu.runner import GpuModelRunner, RunnerLimits
    from gpu_engine.models.config import ModelConfig
    from gpu_engine.models.loader import build_empty, init_random

    cfg = ModelConfig.from_hf(LLAMA)
    model = build_empty(cfg, dtype, device)
    init_random(model, 0)
    limits = RunnerLimits(2, 32, 8)
    plain = GpuModelRunner(model, KVCache(cfg, 16, 4, dtype=dtype, device=device), limits)
    fp8 = GpuModelRunner(model, KVCache(cfg, 16, 4, dtype=torch.float8_e4m3fn, device=device), limits)
    return cfg, plain, fp8


def test_the_gpu_runner_takes_an_fp8_cache_and_refuses_another_dtype() -> None:
    """The runner's check lets an FP8 cache beside the model's weights through, and still refuses a cache of a third
    dtype (before any kernel runs)."""
    from gpu_engine.gpu.runner import GpuModelRunner, RunnerLimits
    from gpu_engine.models.config import ModelConfig
    from gpu_engine.models.loader import build_empty

    cfg = ModelConfig.from_hf(LLAMA)
    model = build_empty(cfg, torch.float32, "cpu")
    with pytest.raises(ValueError, match="the cache takes its dtype or FP8"):
        GpuModelRunner(model, KVCache(cfg, 8, 4, dtype=torch.float16), RunnerLimits(2, 32, 8))
    _, plain, fp8 = _runners(torch.float32)
    assert fp8.kv.dtype == torch.float8_e4m3fn and fp8.dtype == torch.float32 == plain.kv.dtype


def test_the_runner_over_an_fp8_cache_keeps_the_logits_within_the_bound_and_the_greedy_tokens() -> None:
    """The tiny random Llama (2 layers, float32 under the interpreter) over an FP8 cache and over a float32 one,
    prefill then decode steps on the same tokens: every step's logits within ``helpers.fp8_kv_runner``'s bound of
    the float32 cache's, the greedy tokens the same at most steps; and the FP8 cache really was read (the logits
    are not all equal)."""
    from helpers.fp8_interpret import gpu_rounding
    from helpers.fp8_kv_runner import compare, logit_bound

    cfg, plain, fp8 = _runners(torch.float32)
    with gpu_rounding():
        pairs = compare(plain, fp8, num_seqs=2, prompt=6, decodes=4, vocab=cfg.vocab_size, device="cpu")
    same = 0
    for want, got in pairs:
        assert float((got - want).abs().max()) <= logit_bound(cfg.num_layers, want)
        same += int(torch.equal(got.argmax(-1), want.argmax(-1)))
    assert same >= len(pairs) - 1
    assert any(not torch.equal(got, want) for want, got in pairs)


def test_an_fp8_cache_is_refused_at_the_engine_start_on_a_gpu_before_sm89(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an sm_80 GPU the flag is refused before the weights load (a ValueError, which the engine's start prints
    as a refused setting), not at a kernel's compile or a graph's capture; sm_89 and sm_90 take it."""
    from gpu_engine.gpu import serve_gpu
    from gpu_engine.kv_cache import fp8_cache_runs_on

    fp8_cache_runs_on((8, 9))
    fp8_cache_runs_on((9, 0))
    monkeypatch.setattr(serve_gpu.torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(serve_gpu, "load_gpu_weights", lambda *a, **k: pytest.fail("weights loaded"))
    cfg = EngineConfig(backend="persistent", kv_cache_dtype="fp8", random_weights=True)
    with pytest.raises(ValueError, match="sm_89 GPU or later .* this one is sm_80"):
        serve_gpu.build_parts(cfg)

