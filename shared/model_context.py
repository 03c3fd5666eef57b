"""A model's context length, read from its ``config.json`` or GGUF metadata without loading it.

The one reading of it: the engine's loaders take ``max_position_embeddings`` from here (``ModelConfig``), and
``blink serve`` checks ``--max-model-len`` against it before it starts any process.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shared.gguf_meta import read_meta

DEFAULT_CONTEXT = 4096  # the context of a model whose config does not say


def hf_context(config: Mapping[str, Any]) -> int:
    """The context of a Hugging Face ``config.json`` (parsed)."""
    return int(config.get("max_position_embeddings", DEFAULT_CONTEXT))


def gguf_context(fields: Mapping[str, Any], arch: str) -> int:
    """The context of a GGUF file, from its metadata fields and ``general.architecture``."""
    return int(fields.get(f"{arch}.context_length", DEFAULT_CONTEXT))


def model_context(path: str | Path) -> int | None:
    """The context of the model at ``path`` (a folder with ``config.json``, or a ``.gguf`` file); None when it
    cannot be read here (the engine then says why when it loads the model)."""
    path = Path(path)
    try:
        if path.is_file() and path.suffix == ".gguf":
            fields = read_meta(path).fields
            return gguf_context(fields, str(fields["general.architecture"]))
        data = json.loads((path / "config.json").read_text(encoding="utf-8"))
        return hf_context(data) if isinstance(data, dict) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
