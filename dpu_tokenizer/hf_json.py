"""Hugging Face ``tokenizer.json`` folders: tiktoken when the pipeline is plain byte-level BPE, else HF."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tokenizers

from dpu_tokenizer.base import ByteTableTokenizer
from dpu_tokenizer.bytelevel import DIGITS_GPT2_PATTERN, GPT2_PATTERN, token_to_bytes
from dpu_tokenizer.hf_backend import HFTokenizer
from dpu_tokenizer.plan_cache import cached_plan_ranks
from dpu_tokenizer.sources import read_json, read_json_if_present, token_text
from dpu_tokenizer.tiktoken_backend import TiktokenTokenizer


def _is_bytelevel(step: dict[str, Any], *, use_regex: bool) -> bool:
    return (
        step.get("type") == "ByteLevel"
        and not step.get("add_prefix_space", False)
        and bool(step.get("use_regex", True)) == use_regex
    )


def pre_tokenizer_pattern(pre: dict[str, Any] | None) -> str | None:
    """The single regex equivalent to a byte-level pre-tokenizer, or None when there is none."""
    if pre is None:
        return None
    if _is_bytelevel(pre, use_regex=True):
        return GPT2_PATTERN
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    if len(steps) != 2:
        return None
    first, second = steps
    if (
        first.get("type") == "Digits"
        and first.get("individual_digits")
        and _is_bytelevel(second, use_regex=True)
    ):
        return DIGITS_GPT2_PATTERN
    split_ok = (
        first.get("type") == "Split"
        and "Regex" in first.get("pattern", {})
        and first.get("behavior") == "Isolated"
        and not first.get("invert", False)
    )
    if split_ok and _is_bytelevel(second, use_regex=False):
        return str(first["pattern"]["Regex"])
    return None


def _template_ids(proc: dict[str, Any]) -> tuple[list[int], list[int]] | None:
    prefix: list[int] = []
    suffix: list[int] = []
    seen_sequence = False
    for piece in proc.get("single", []):
        if "Sequence" in piece:
            seen_sequence = True
            continue
        name = piece.get("SpecialToken", {}).get("id")
        ids = proc.get("special_tokens", {}).get(name, {}).get("ids")
        if ids is None:
            return None
        (suffix if seen_sequence else prefix).extend(ids)
    return prefix, suffix


def post_processor_ids(proc: dict[str, Any] | None) -> tuple[list[int], list[int]] | None:
    """Ids added before/after a sequence with ``add_special_tokens``; None when not understood."""
    if proc is None or proc.get("type") == "ByteLevel":
        return [], []
    if proc.get("type") == "TemplateProcessing":
        return _template_ids(proc)
    if proc.get("type") == "Sequence":
        prefix: list[int] = []
        suffix: list[int] = []
        for sub in proc.get("processors", []):
            part = post_processor_ids(sub)
            if part is None:
                return None
            prefix.extend(part[0])
            suffix[:0] = part[1]
        return prefix, suffix
    return None


def _fast_blockers(data: dict[str, Any]) -> str | None:
    """Why this tokenizer.json cannot go through tiktoken exactly (None when it can)."""
    model = data.get("model") or {}
    normalizer = data.get("normalizer")
    if model.get("type") != "BPE":
        return f"model type {model.get('type')!r} is not BPE"
    if model.get("dropout") or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return "BPE options (dropout or affixes) have no rank-BPE equivalent"
    if model.get("byte_fallback"):
        return "byte fallback BPE"
    if normalizer is not None and normalizer.get("type") != "NFC":
        return f"normalizer {normalizer.get('type')!r}"
    if pre_tokenizer_pattern(data.get("pre_tokenizer")) is None:
        return "pre-tokenizer is not a plain byte-level split"
    if post_processor_ids(data.get("post_processor")) is None:
        return "post-processor not understood"
    if any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in data.get("added_tokens", [])):
        return "added tokens strip or match single words"
    return None


def _ids_of(folder: Path, data: dict[str, Any]) -> tuple[int | None, list[int]]:
    """bos id and eos ids from tokenizer_config.json and generation_config.json."""
    lookup = dict(data.get("model", {}).get("vocab", {}))
    lookup.update({t["content"]: t["id"] for t in data.get("added_tokens", [])})
    config = read_json_if_present(folder / "tokenizer_config.json")
    bos_text = token_text(config.get("bos_token"))
    eos_text = token_text(config.get("eos_token"))
    eos = [lookup[eos_text]] if eos_text in lookup else []
    gen = read_json_if_present(folder / "generation_config.json").get("eos_token_id")
    eos.extend([gen] if isinstance(gen, int) else [e for e in gen or [] if isinstance(e, int)])
    bos = lookup.get(bos_text) if bos_text else None
    if bos is None and isinstance(
        read_json_if_present(folder / "generation_config.json").get("bos_token_id"), int
    ):
        bos = read_json_if_present(folder / "generation_config.json")["bos_token_id"]
    return bos, eos


def _hf(path: Path, bos: int | None, eos: list[int], byte_level: bool, reason: str) -> ByteTableTokenizer:
    tok = HFTokenizer(
        tokenizers.Tokenizer.from_file(str(path)), bos_token_id=bos, eos_token_ids=eos, byte_level=byte_level
    )
    tok.backend_reason = reason  # type: ignore[attr-defined]
    return tok


def load_tokenizer_json(path: Path) -> ByteTableTokenizer:
    data = read_json(path)
    bos, eos = _ids_of(path.parent, data)
    decoder = data.get("decoder") or {}
    byte_level = decoder.get("type") == "ByteLevel"
    blocker = _fast_blockers(data) if byte_level else "decoder is not byte-level"
    if blocker is not None:
        return _hf(path, bos, eos, byte_level, blocker)
    model = data["model"]
    vocab: dict[str, int] = model["vocab"]
    added = {t["content"]: int(t["id"]) for t in data.get("added_tokens", [])}
    special_ids = {int(t["id"]) for t in data.get("added_tokens", []) if t.get("special")}
    size = max([*vocab.values(), *added.values()]) + 1
    tokens = [""] * size
    for tok, tid in vocab.items():
        tokens[tid] = tok
    plan = cached_plan_ranks(
        tokens, model.get("merges", []), set(added.values()), ignore_merges=bool(model.get("ignore_merges"))
    )
    if not plan.exact:
        return _hf(path, bos, eos, byte_level, "rank BPE would differ: " + "; ".join(plan.problems[:3]))
    table = [token_to_bytes(t) or t.encode("utf-8") for t in tokens]
    for text, tid in added.items():
        table[tid] = text.encode("utf-8")
    prefix, suffix = post_processor_ids(data.get("post_processor")) or ([], [])
    normalizer = data.get("normalizer")
    result = TiktokenTokenizer(
        name=path.parent.name or "tokenizer",
        pattern=pre_tokenizer_pattern(data.get("pre_tokenizer")) or GPT2_PATTERN,
        ranks=plan.ranks,
        added=added,
        table=table,
        special_ids=special_ids,
        bos_token_id=bos,
        eos_token_ids=eos,
        prefix_ids=prefix,
        suffix_ids=suffix,
        rank_to_id=plan.rank_to_id,
        missing_bytes=plan.missing_bytes,
        exact_fallback=lambda: _hf(path, bos, eos, True, "exact fallback"),
        nfc=normalizer is not None,
    )
    result.backend_reason = "tokenizer.json byte-level BPE: merges verified for rank BPE"  # type: ignore[attr-defined]
    return result
