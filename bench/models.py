"""Model configs for benchmarks: Hugging Face config.json files written on the fly, used with
``--random-weights`` where real weights can't be had."""

from __future__ import annotations

import json
from pathlib import Path

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
