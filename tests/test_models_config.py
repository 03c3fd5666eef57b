"""ModelConfig from real-world (transformers 4.x style) config.json contents."""

from __future__ import annotations

import dataclasses
import math

import pytest

from gpu_engine.models.config import ModelConfig
from gpu_engine.models.errors import ModelLoadError

LLAMA31 = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 40960,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False, "eos_token_id": 151645,
    "sliding_window": None, "use_sliding_window": False,
}
PHI3_LONG = {
    "architectures": ["Phi3ForCausalLM"], "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
    "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
    "sliding_window": 262144, "partial_rotary_factor": 0.75, "bos_token_id": 1, "eos_token_id": 32000,
}


def test_llama31() -> None:
    c = ModelConfig.from_hf(LLAMA31)
    assert (c.family, c.head_dim, c.num_kv_heads, c.rope_theta) == ("llama", 128, 8, 500000.0)
    assert c.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert c.eos_token_ids == (128001, 128008, 128009) and not c.qk_norm
    assert hash(c) == hash(ModelConfig.from_hf(LLAMA31))
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.vocab_size = 1  # type: ignore[misc]


def test_qwen3_moe() -> None:
    c = ModelConfig.from_hf(QWEN3_MOE)
    assert (c.family, c.num_experts, c.num_experts_per_tok) == ("qwen3_moe", 128, 8)
    assert c.moe_intermediate_size == 768
    assert c.norm_topk_prob and c.qk_norm and c.rope_scaling is None and c.sliding_window is None
    assert all(c.is_moe_layer(i) for i in range(48))
    sparse = ModelConfig.from_hf({**QWEN3_MOE, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert [sparse.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]


def test_phi3_longrope() -> None:
    c = ModelConfig.from_hf(PHI3_LONG)
    assert c.rotary_dim == 72 and c.sliding_window == 262144
    assert c.rope_scaling is not None and c.rope_scaling["rope_type"] == "longrope"
    assert math.isclose(c.rope_scaling["attention_factor"], math.sqrt(1 + math.log(32) / math.log(4096)))
    assert c.rope_scaling["original_max_position_embeddings"] == 4096


def test_bad_moe_fields() -> None:
    with pytest.raises(ModelLoadError, match="num_experts_per_tok 9 not in 1..num_experts 8"):
        ModelConfig.from_hf({**QWEN3_MOE, "num_experts": 8, "num_experts_per_tok": 9}, source="x/config.json")
