"""Model configs for benchmarks and tests: Hugging Face config.json files written on the fly, used with
``--random-weights`` where real weights can't be had, and model folders with the real Llama-3 tokenizer."""

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


def write_config(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


MODEL_CONFIGS = {"8b": LLAMA3_8B, "medium": MEDIUM_LLAMA, "small": SMALL_LLAMA, "tiny": TINY_LLAMA3}
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
    """The HF config of a Llama-3 shape; the smaller shapes keep Llama-3's vocabulary and special ids, since
    they are served with its tokenizer."""
    config = dict(MODEL_CONFIGS[name])
    for key in ("vocab_size", "bos_token_id", "eos_token_id"):
        config[key] = LLAMA3_8B[key]
    return config


def build_model_folder(name: str, assets_dir: Path, root: Path) -> Path:
    """``config.json`` of the shape, the Llama-3 tokenizer files, and ``generation_config.json`` (where the
    tokenizer loader reads bos and eos ids when it uses ``tokenizer.json``, which it prefers)."""
    src = llama3_assets(assets_dir)
    config = model_config(name)
    folder = write_config(root / f"llama3-{name}-random", config)
    for file in TOKENIZER_FILES:
        shutil.copyfile(src / file, folder / file)
    ids = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (folder / "generation_config.json").write_text(json.dumps(ids, indent=1) + "\n")
    return folder
