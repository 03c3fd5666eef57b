"""Model definitions and loaders for the engine (plain PyTorch, paged KV cache, packed batches)."""

from gpu_engine.models.attention import AttentionMetadata, SeqStep, build_metadata
from gpu_engine.models.config import ModelConfig
from gpu_engine.models.decoder import CausalLM
from gpu_engine.models.errors import ModelLoadError
from gpu_engine.models.loader import default_model_path, load_model

__all__ = [
    "AttentionMetadata",
    "CausalLM",
    "ModelConfig",
    "ModelLoadError",
    "SeqStep",
    "build_metadata",
    "default_model_path",
    "load_model",
]
