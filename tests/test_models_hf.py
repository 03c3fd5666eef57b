"""Our loader + paged decoder against Hugging Face transformers on tiny random models of each family."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_engine.kv_cache import KVCache
from gpu_engine.models.decoder import CausalLM
from gpu_engine.models.loader import load_model
from gpu_engine.models.reference import greedy_generate

transformers = pytest.importorskip("transformers")

VOCAB = 97
STEPS = 32
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], [26, 43], [83, 27, 95, 2, 88, 41, 9]]
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.25, bos_token_id=None,
    eos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0}


def _hf_model(family: str, **overrides: Any) -> Any:
    """A randomly initialised HF model of ``family`` (call ``torch.manual_seed`` first)."""
    if family == "llama":
        cfg = transformers.LlamaConfig(**COMMON, rope_parameters=LLAMA3_ROPE)
        return transformers.LlamaForCausalLM(cfg)
    if family == "qwen3":
        cfg = transformers.Qwen3Config(**{**COMMON, "tie_word_embeddings": True}, head_dim=24)
        return transformers.Qwen3ForCausalLM(cfg)
    if family == "qwen3_moe":
        moe = {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1]}
        cfg = transformers.Qwen3MoeConfig(**COMMON, head_dim=16, **{**moe, **overrides})
        return transformers.Qwen3MoeForCausalLM(cfg)
    if family == "phi3_longrope":
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0], "long_factor": [2.0] * 6,
                "original_max_position_embeddings": 64}
        cfg = transformers.Phi3Config(**{**COMMON, "max_position_embeddings": 1024}, rope_parameters=rope,
                                      original_max_position_embeddings=64)
        return transformers.Phi3ForCausalLM(cfg)
    cfg = transformers.Phi3Config(**COMMON, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "partial_rotary_factor": 0.5}, sliding_window=8)
    return transformers.Phi3ForCausalLM(cfg)


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_moe", "phi3", "phi3_longrope"])
def hf_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[Any, Path]]:
    torch.manual_seed(1234)
    model = _hf_model(request.param).eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    yield model, path


def _hf_greedy(model: Any, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=STEPS,
                             min_new_tokens=STEPS, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


def _check_against_hf(hf: Any, model: CausalLM, block_size: int = 4) -> None:
    kv = KVCache(model.config, num_blocks=64, block_size=block_size)
    ours = greedy_generate(model, kv, PROMPTS, STEPS)
    assert kv.allocator.num_free == kv.allocator.num_total
    for b, prompt in enumerate(PROMPTS):
        ref_tokens, ref_logits = _hf_greedy(hf, prompt)
        assert ours.tokens[b] == ref_tokens, f"sequence {b}"
        err = (ours.logits[:, b] - ref_logits).abs().max() / ref_logits.abs().max()
        assert err <= 1e-4, f"sequence {b}: relative logits error {err:.2e}"
        assert ref_logits.abs().max() > 1.0  # the random model's logits are not trivially flat


def test_matches_transformers(hf_checkpoint: tuple[Any, Path]) -> None:
    hf, path = hf_checkpoint
    model, config = load_model(path)
    assert config.family == json.loads((path / "config.json").read_text())["model_type"]
    if config.rope_scaling is not None:
        assert config.rope_scaling["rope_type"] in ("llama3", "longrope")
    assert config.sliding_window == getattr(hf.config, "sliding_window", None)
    _check_against_hf(hf, model)


def test_sharded_checkpoint_loads_the_same(hf_checkpoint: tuple[Any, Path], tmp_path: Path) -> None:
    hf, _ = hf_checkpoint
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    model, _ = load_model(tmp_path)
    reference, _ = load_model(hf_checkpoint[1])
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_bf16_runs_close_to_fp32(hf_checkpoint: tuple[Any, Path]) -> None:
    _, path = hf_checkpoint
    model32, config = load_model(path)
    model16, _ = load_model(path, dtype=torch.bfloat16)
    assert model16.embed.weight.dtype == torch.bfloat16
    prompts = PROMPTS[:2]
    r32 = greedy_generate(model32, KVCache(config, 16, 4), prompts, 1)
    r16 = greedy_generate(model16, KVCache(config, 16, 4, dtype=torch.bfloat16), prompts, 1)
    assert r16.logits.dtype == torch.float32
    err = (r16.logits - r32.logits).abs().max() / r32.logits.abs().max()
    assert err < 0.1
