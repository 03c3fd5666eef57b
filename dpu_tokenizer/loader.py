"""``load_tokenizer``: pick the fastest encoder that is exact for the model's tokenizer files.

Choice per source:
- GGUF ``gpt2`` (byte-level BPE) vocabularies and Hugging Face ``tokenizer.json`` byte-level BPE:
  tiktoken, after checking that rank-rule BPE reproduces every merge; Hugging Face ``tokenizers``
  otherwise, and for texts holding bytes the vocabulary lacks.
- tiktoken rank files (``*.tiktoken``, Llama-3's ``tokenizer.model``): tiktoken (their reference).
- sentencepiece ``.model`` files: the sentencepiece library (their reference).
- any other ``tokenizer.json``: Hugging Face ``tokenizers``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from dpu_tokenizer.base import ByteTableTokenizer, TokenizerError
from dpu_tokenizer.bytelevel import DIGITS_GPT2_PATTERN, GGUF_PRE_PATTERNS, token_to_bytes
from dpu_tokenizer.families import RANK_FAMILIES
from dpu_tokenizer.hf_backend import HFTokenizer, build_bytelevel_bpe, gguf_pre_tokenizer
from dpu_tokenizer.hf_json import load_tokenizer_json
from dpu_tokenizer.plan_cache import cached_plan_ranks
from dpu_tokenizer.sources import (
    GGUF_CONTROL,
    GGUF_UNKNOWN,
    GGUF_USER_DEFINED,
    default_model_path,
    find_gguf,
    is_tiktoken_file,
    read_gguf_vocab,
    read_tiktoken_ranks,
)
from dpu_tokenizer.sp_backend import SentencePieceTokenizer
from dpu_tokenizer.tiktoken_backend import TiktokenTokenizer

log = logging.getLogger(__name__)
# llama.cpp pre-tokenizers whose words found whole in the vocabulary skip merging (HF ignore_merges).
IGNORE_MERGES_PRE = frozenset({"llama3", "llama-bpe"})


def load_tokenizer(model_path: str | os.PathLike[str] | None = None) -> ByteTableTokenizer:
    """Load the tokenizer of a model folder or file; ``None`` means the embedded default model."""
    path = Path(model_path) if model_path is not None else default_model_path()
    if path.is_dir():
        tok = _load_folder(path)
    elif path.is_file():
        tok = _load_file(path)
    else:
        raise TokenizerError(f"no tokenizer files at {path}")
    log.info("tokenizer %s: backend %s (%s)", path, tok.backend_name, getattr(tok, "backend_reason", ""))
    return tok


def _load_folder(folder: Path) -> ByteTableTokenizer:
    if (folder / "tokenizer.json").is_file():
        return load_tokenizer_json(folder / "tokenizer.json")
    ranks = sorted(folder.glob("*.tiktoken"))
    if ranks:
        return _from_rank_file(ranks[0])
    if (folder / "tokenizer.model").is_file():
        return _load_file(folder / "tokenizer.model")
    gguf = find_gguf(folder)
    if gguf is not None:
        return _from_gguf(gguf)
    raise TokenizerError(f"{folder} holds no tokenizer.json, *.tiktoken, tokenizer.model or *.gguf file")


def _load_file(path: Path) -> ByteTableTokenizer:
    if path.suffix == ".gguf":
        return _from_gguf(path)
    if path.suffix == ".json":
        return load_tokenizer_json(path)
    if path.suffix == ".tiktoken" or is_tiktoken_file(path):
        return _from_rank_file(path)
    return _mark(SentencePieceTokenizer(path), "sentencepiece model: its own library is the reference")


def _mark(tok: ByteTableTokenizer, reason: str) -> ByteTableTokenizer:
    tok.backend_reason = reason  # type: ignore[attr-defined]
    return tok


def _from_rank_file(path: Path) -> ByteTableTokenizer:
    ranks = read_tiktoken_ranks(path)
    family = RANK_FAMILIES.get(len(ranks))
    if family is None:
        known = ", ".join(f"{n} ({f.name})" for n, f in RANK_FAMILIES.items())
        raise TokenizerError(f"{path}: {len(ranks)} ranks matches no known family ({known})")
    table = [b""] * (len(ranks) + len(family.specials))
    for raw, rank in ranks.items():
        table[rank] = raw
    added = {text: len(ranks) + i for i, text in enumerate(family.specials)}
    for text, tid in added.items():
        table[tid] = text.encode("utf-8")
    bos = added[family.bos] if family.bos else None
    tok = TiktokenTokenizer(
        name=family.name,
        pattern=family.pattern,
        ranks=ranks,
        added=added,
        table=table,
        special_ids=added.values(),
        bos_token_id=bos,
        eos_token_ids=[added[e] for e in family.eos],
        prefix_ids=[bos] if bos is not None else [],
    )
    return _mark(tok, f"tiktoken rank file ({family.name} family): tiktoken is the reference")


def _from_gguf(path: Path) -> ByteTableTokenizer:
    vocab = read_gguf_vocab(str(path))
    if vocab.model != "gpt2":
        raise TokenizerError(f"{path}: GGUF tokenizer model {vocab.model!r} is not supported (only 'gpt2')")
    pattern = GGUF_PRE_PATTERNS.get(vocab.pre)
    if pattern is None:
        raise TokenizerError(f"{path}: unknown GGUF pre-tokenizer {vocab.pre!r}")
    ignore = vocab.pre in IGNORE_MERGES_PRE
    kinds = (GGUF_CONTROL, GGUF_UNKNOWN, GGUF_USER_DEFINED)
    added = {
        tok: i
        for i, (tok, kind) in enumerate(zip(vocab.tokens, vocab.token_types, strict=True))
        if kind in kinds
    }
    special_ids = {i for i, kind in enumerate(vocab.token_types) if kind in (GGUF_CONTROL, GGUF_UNKNOWN)}
    table = [(token_to_bytes(t) if i not in added.values() else None) for i, t in enumerate(vocab.tokens)]
    table_b = [
        raw if raw is not None else tok.encode("utf-8") for raw, tok in zip(table, vocab.tokens, strict=True)
    ]
    bos: int | None = vocab.bos_token_id
    eos: tuple[int, ...] = tuple(vocab.eos_token_ids)
    prefix: list[int] = [bos] if vocab.add_bos and bos is not None else []
    suffix: list[int] = list(eos[:1]) if vocab.add_eos else []

    def exact() -> ByteTableTokenizer:
        pre = gguf_pre_tokenizer(pattern, digits=pattern == DIGITS_GPT2_PATTERN)
        hf = build_bytelevel_bpe(vocab.tokens, vocab.merges, added, special_ids, pre, ignore_merges=ignore)
        return HFTokenizer(
            hf,
            bos_token_id=bos,
            eos_token_ids=eos,
            byte_level=True,
            wrap_ids=(prefix, suffix),
        )

    plan = cached_plan_ranks(vocab.tokens, vocab.merges, set(added.values()), ignore_merges=ignore)
    if not plan.exact:
        return _mark(exact(), "rank BPE would differ: " + "; ".join(plan.problems[:3]))
    tok = TiktokenTokenizer(
        name=path.stem,
        pattern=pattern,
        ranks=plan.ranks,
        added=added,
        table=table_b,
        special_ids=special_ids,
        rank_to_id=plan.rank_to_id,
        missing_bytes=plan.missing_bytes,
        exact_fallback=exact,
        bos_token_id=bos,
        eos_token_ids=eos,
        prefix_ids=prefix,
        suffix_ids=suffix,
    )
    return _mark(tok, f"GGUF byte-level BPE (pre {vocab.pre!r}): merges verified for rank BPE")
