"""Model configs for benchmarks and tests: Hugging Face config.json files written on the fly, used with
``--random-weights`` where real weights can't be had (vLLM: ``--load-format dummy``), and model folders with the
real tokenizer: Llama-3's for the Llama shapes, Qwen3's for the Qwen3-30B-A3B (MoE) shape."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "rope_theta": 500000.0, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "bos_token_id": 128000, "eos_token_id": [128001, 128009], "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "torch_dtype": "bfloat16",
}

MEDIUM_LLAMA = {**LLAMA3_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                "num_attention_heads": 16, "num_key_value_heads": 8}

SMALL_LLAMA = {**LLAMA3_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096, "bos_token_id": 1,
               "eos_token_id": 2}

# Small enough to serve at thousands of tokens per second, with Llama-3's vocabulary so the real
# Llama-3 tokenizer fits it (the GPU soak).
TINY_LLAMA3 = {**LLAMA3_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2}


# Qwen3-30B-A3B's config.json (bench/roofline.py's MoE shape) with its own field names and values: 48 layers of
# 128 experts, 8 routed a token; Qwen3's vocabulary (151,643 BPE tokens and 26 added ones, padded to 151,936).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "hidden_act": "silu", "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "rope_scaling": None, "max_position_embeddings": 40960, "max_window_layers": 48, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "output_router_logits": False, "router_aux_loss_coef": 0.001, "attention_bias": False,
    "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None, "tie_word_embeddings": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "initializer_range": 0.02, "use_cache": True,
    "torch_dtype": "bfloat16",
}
QWEN3_MOE = "qwen3-30b-a3b"


def write_config(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


MODEL_CONFIGS = {"8b": LLAMA3_8B, "medium": MEDIUM_LLAMA, "small": SMALL_LLAMA, "tiny": TINY_LLAMA3,
                 QWEN3_MOE: QWEN3_30B_A3B}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def llama3_assets(assets_dir: Path) -> Path:
    """The folder holding Llama-3's ``tokenizer.json`` and ``tokenizer.model`` (``DIR/llama3`` or ``DIR``)."""
    for folder in (assets_dir / "llama3", assets_dir):
        if all((folder / name).is_file() for name in TOKENIZER_FILES):
            return folder
    raise FileNotFoundError(f"no Llama-3 tokenizer files ({', '.join(TOKENIZER_FILES)}) under {assets_dir} or "
                            f"{assets_dir / 'llama3'}; fetch them with: python -m dpu_tokenizer.fetch_assets "
                            f"{assets_dir}")


def model_config(name: str) -> dict[str, Any]:
    """The HF config of a shape; the smaller Llama shapes keep Llama-3's vocabulary and special ids, since
    they are served with its tokenizer."""
    config = dict(MODEL_CONFIGS[name])
    if name == QWEN3_MOE:
        return config
    for key in ("vocab_size", "bos_token_id", "eos_token_id"):
        config[key] = LLAMA3_8B[key]
    return config


def build_model_folder(name: str, assets_dir: Path, root: Path) -> Path:
    """``config.json`` of the shape, the tokenizer files, and ``generation_config.json`` (where the
    tokenizer loader reads bos and eos ids when it uses ``tokenizer.json``, which it prefers). The Qwen3 shape's
    folder also holds ``tokenizer_config.json`` with its chat template (``harness/qwen3_folder.py``)."""
    if name == QWEN3_MOE:
        from harness.qwen3_folder import write_qwen3_tokenizer

        folder = write_config(root / f"{name}-random", model_config(name))
        write_qwen3_tokenizer(assets_dir, folder)
        return folder
    src = llama3_assets(assets_dir)
    config = model_config(name)
    folder = write_config(root / f"llama3-{name}-random", config)
    for file in TOKENIZER_FILES:
        shutil.copyfile(src / file, folder / file)
    ids = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (folder / "generation_config.json").write_text(json.dumps(ids, indent=1) + "\n")
    return folder
