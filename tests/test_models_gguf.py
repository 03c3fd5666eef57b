"""GGUF loading: round trip of a tiny llama written with gguf.GGUFWriter, and the embedded default model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from gpu_engine.kv_cache import KVCache
from gpu_engine.models.gguf_weights import unpermute_rope_rows
from gpu_engine.models.loader import default_model_path, load_model
from gpu_engine.models.reference import greedy_generate

transformers = pytest.importorskip("transformers")

Q = gguf.GGMLQuantizationType
PROMPTS = [[5, 17, 33, 2, 41, 60, 7, 19, 23], [44, 8], [12, 90, 31, 4, 55]]
HEADS, KV_HEADS = 4, 2


def _hf_llama(llama3_rope: bool) -> Any:
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if llama3_rope:
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16, "rope_theta": 500000.0}
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, initializer_range=0.25, rms_norm_eps=1e-5, bos_token_id=1,
        eos_token_id=2, pad_token_id=None, rope_parameters=rope,
    )
    torch.manual_seed(7)
    return transformers.LlamaForCausalLM(cfg).eval()


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter layout for Q/K rows: half-split pairs -> interleaved pairs."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def _gguf_tensors(hf: Any) -> dict[str, np.ndarray]:
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output.weight": sd["lm_head.weight"],
           "output_norm.weight": sd["model.norm.weight"]}
    for i in range(hf.config.num_hidden_layers):
        for hf_name, name in GGUF_NAMES.items():
            w = sd[f"model.layers.{i}.{hf_name}.weight"]
            if name in ("attn_q", "attn_k"):
                w = _permute(w, HEADS if name == "attn_q" else KV_HEADS)
            out[f"blk.{i}.{name}.weight"] = w
    return out


def write_llama_gguf(hf: Any, path: Path, qtype: Any = Q.F32, arch: str = "llama") -> None:
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", 2), ("context_length", 256), ("embedding_length", 64),
                       ("feed_forward_length", 128), ("attention.head_count", HEADS),
                       ("attention.head_count_kv", KV_HEADS), ("vocab_size", 96),
                       ("rope.dimension_count", 16)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", c.rope_parameters["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    for name, t in _gguf_tensors(hf).items():
        if t.ndim == 2 and qtype != Q.F32:
            w.add_tensor(name, quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, t.astype(np.float32))
    if c.rope_parameters["rope_type"] == "llama3":
        init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"]
        scaled, _ = init(c, "cpu")
        base = 1.0 / (c.rope_parameters["rope_theta"] ** (torch.arange(0, 16, 2).float() / 16))
        w.add_tensor("rope_freqs.weight", (base / scaled).numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("llama3_rope", [False, True])
def test_f32_gguf_matches_transformers(tmp_path: Path, llama3_rope: bool) -> None:
    hf = _hf_llama(llama3_rope)
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(hf, path)
    model, config = load_model(path)
    assert (config.family, config.eos_token_ids, config.bos_token_id) == ("llama", (2,), 1)
    assert not config.tie_word_embeddings
    ours = greedy_generate(model, KVCache(config, 32, 4), PROMPTS, 12)
    for b, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                              min_new_tokens=12, output_logits=True, return_dict_in_generate=True)
        ref = torch.cat(out.logits)
        assert ours.tokens[b] == out.sequences[0, len(prompt):].tolist()
        assert (ours.logits[:, b] - ref).abs().max() / ref.abs().max() <= 1e-4


def _quantize_in_place(hf: Any, qtype: Any) -> None:
    """Replace every matrix by its quantize -> dequantize round trip (block quantization is per row,
    so it commutes with the Q/K row permutation)."""
    with torch.no_grad():
        for param in hf.parameters():
            if param.ndim == 2:
                w = param.numpy()
                param.copy_(torch.from_numpy(np.array(dequantize(quantize(w, qtype), qtype))))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.BF16])
def test_quantized_gguf_matches_dequantized_reference(tmp_path: Path, qtype: Any) -> None:
    hf = _hf_llama(False)
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_llama_gguf(hf, path, qtype)
    model, config = load_model(path)
    _quantize_in_place(hf, qtype)
    assert torch.equal(model.layers[1].attn.qkv.weight[:64], hf.model.layers[1].self_attn.q_proj.weight)
    ours = greedy_generate(model, KVCache(config, 32, 4), PROMPTS, 1).logits[0]
    for b, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1]
        assert (ours[b] - ref).abs().max() / ref.abs().max() <= 1e-4


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    w = torch.arange(8 * 16 * 3, dtype=torch.float32).reshape(8 * 16, 3)
    permuted = torch.from_numpy(_permute(w.numpy(), 8))
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_rope_rows(permuted, 8), w)


def _vocab(path: Path) -> list[str]:
    reader = gguf.GGUFReader(path)
    field = reader.fields["tokenizer.ggml.tokens"]
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def test_default_model_says_paris() -> None:
    try:
        path = default_model_path()
    except Exception as exc:  # package not installed in this environment
        pytest.skip(str(exc))
    model, config = load_model(path)
    assert (config.family, config.num_layers, config.vocab_size) == ("llama", 30, 49152)
    assert config.tie_word_embeddings
    vocab = _vocab(path)
    index = {tok: i for i, tok in enumerate(vocab)}
    # Byte-level BPE spells a leading space as "Ġ"; each of these words is one token.
    prompt = [index[w] for w in ("The", "Ġcapital", "Ġof", "ĠFrance", "Ġis")]
    kv = KVCache(config, num_blocks=8, block_size=16)
    result = greedy_generate(model, kv, [prompt], 4)
    assert index["ĠParis"] in result.tokens[0], [vocab[t] for t in result.tokens[0]]
    assert kv.allocator.num_free == kv.allocator.num_total


def _gguf_from_ours(sd: dict[str, torch.Tensor], config: Any, arch: str) -> dict[str, np.ndarray]:
    """Our (known-good) parameters under llama.cpp names, for the non-llama architectures."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    out = {"token_embd.weight": sd["embed.weight"], "output_norm.weight": sd["norm.weight"]}
    if not config.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    for i in range(config.num_layers):
        p, blk = f"layers.{i}.", f"blk.{i}."
        out |= {blk + "attn_norm.weight": sd[p + "attn_norm.weight"], blk + "ffn_norm.weight": sd[
            p + "mlp_norm.weight"], blk + "attn_output.weight": sd[p + "attn.o.weight"]}
        if arch == "phi3":
            out |= {blk + "attn_qkv.weight": sd[p + "attn.qkv.weight"], blk + "ffn_up.weight": sd[
                p + "mlp.gate_up.weight"], blk + "ffn_down.weight": sd[p + "mlp.down.weight"]}
            continue
        q, k, v = sd[p + "attn.qkv.weight"].split([q_size, kv_size, kv_size])
        out |= {blk + "attn_q.weight": q, blk + "attn_k.weight": k, blk + "attn_v.weight": v,
                blk + "attn_q_norm.weight": sd[p + "attn.q_norm.weight"],
                blk + "attn_k_norm.weight": sd[p + "attn.k_norm.weight"]}
        if arch == "qwen3moe":
            gate, up = sd[p + "mlp.gate_up"].chunk(2, dim=1)
            out |= {blk + "ffn_gate_inp.weight": sd[p + "mlp.router.weight"],
                    blk + "ffn_gate_exps.weight": gate, blk + "ffn_up_exps.weight": up,
                    blk + "ffn_down_exps.weight": sd[p + "mlp.down"]}
        else:
            gate, up = sd[p + "mlp.gate_up.weight"].chunk(2)
            out |= {blk + "ffn_gate.weight": gate, blk + "ffn_up.weight": up,
                    blk + "ffn_down.weight": sd[p + "mlp.down.weight"]}
    return {name: t.contiguous().numpy() for name, t in out.items()}


def _write_family_gguf(path: Path, config: Any, arch: str, tensors: dict[str, np.ndarray]) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    keys = {"block_count": config.num_layers, "context_length": 256, "embedding_length": config.hidden_size,
            "feed_forward_length": config.intermediate_size, "attention.head_count": config.num_heads,
            "attention.head_count_kv": config.num_kv_heads, "attention.key_length": config.head_dim,
            "rope.dimension_count": config.rotary_dim, "expert_count": config.num_experts,
            "expert_used_count": config.num_experts_per_tok,
            "expert_feed_forward_length": config.moe_intermediate_size}
    for key, value in keys.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", config.rope_theta)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    if config.sliding_window is not None:
        w.add_uint32(f"{arch}.attention.sliding_window", config.sliding_window)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(config.vocab_size)])
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize(("family", "arch"),
                         [("qwen3", "qwen3"), ("qwen3_moe", "qwen3moe"), ("phi3", "phi3")])
def test_gguf_other_architectures(tmp_path: Path, family: str, arch: str) -> None:
    from test_models_hf import _hf_model

    torch.manual_seed(5)
    _hf_model(family, mlp_only_layers=[]).save_pretrained(tmp_path / "hf")
    reference, config = load_model(tmp_path / "hf")
    tensors = _gguf_from_ours(reference.state_dict(), config, arch)
    _write_family_gguf(tmp_path / "m.gguf", config, arch, tensors)
    model, gguf_config = load_model(tmp_path / "m.gguf")
    assert gguf_config.family == family
    for field in ("rotary_dim", "vocab_size", "sliding_window", "num_experts", "head_dim"):
        assert getattr(gguf_config, field) == getattr(config, field), field
    ours = greedy_generate(model, KVCache(gguf_config, 32, 4), PROMPTS, 6)
    ref = greedy_generate(reference, KVCache(config, 32, 4), PROMPTS, 6)
    assert ours.tokens == ref.tokens
    assert torch.equal(ours.logits, ref.logits)
