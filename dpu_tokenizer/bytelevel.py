"""GPT-2 style byte-level helpers: the byte <-> printable-char alphabet and pre-tokenizer patterns."""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache

# Pre-tokenizer patterns (tiktoken / fancy-regex syntax).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Digits(individual_digits=True) followed by the GPT-2 regex, fused into one pattern: every digit is
# its own piece, and a whitespace run may end right before a digit (a piece boundary in the original).
DIGITS_GPT2_PATTERN = r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN35_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# llama.cpp's `tokenizer.ggml.pre` names -> the pattern that reproduces that pre-tokenizer.
GGUF_PRE_PATTERNS: dict[str, str] = {
    "gpt-2": GPT2_PATTERN,
    "gpt2": GPT2_PATTERN,
    "smollm": DIGITS_GPT2_PATTERN,
    "starcoder": DIGITS_GPT2_PATTERN,
    "refact": DIGITS_GPT2_PATTERN,
    "codeshell": DIGITS_GPT2_PATTERN,
    "llama3": LLAMA3_PATTERN,
    "llama-bpe": LLAMA3_PATTERN,
    "qwen2": QWEN_PATTERN,
}


@lru_cache(maxsize=1)
def byte_to_char() -> dict[int, str]:
    """The GPT-2 alphabet: printable bytes map to themselves, the rest to chars from U+0100 up."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(0x100 + extra)
            extra += 1
    return out


@lru_cache(maxsize=1)
def char_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_char().items()}


def token_to_bytes(token: str) -> bytes | None:
    """Raw bytes of a byte-level token string, or None when it is not written in the alphabet."""
    table = char_to_byte()
    try:
        return bytes([table[c] for c in token])
    except KeyError:
        return None


def _lead_byte_range(lead: int) -> tuple[int, int] | None:
    """Code points whose UTF-8 form starts with ``lead`` (None for bytes that never lead)."""
    if 0xC2 <= lead <= 0xDF:
        lo = (lead & 0x1F) << 6
        return lo, lo + 0x3F
    if 0xE0 <= lead <= 0xEF:
        lo = (lead & 0x0F) << 12
        return max(lo, 0x800), lo + 0xFFF
    if 0xF0 <= lead <= 0xF4:
        lo = (lead & 0x07) << 18
        return max(lo, 0x10000), min(lo + 0x3FFFF, 0x10FFFF)
    return None


def missing_bytes_guard(missing: Iterable[int]) -> re.Pattern[str] | None:
    """A regex that finds any char whose UTF-8 bytes include one of ``missing``.

    Byte-level vocabularies trained on real text can lack a few bytes; Hugging Face BPE silently
    drops such bytes (and may then merge their neighbours), which a rank-based encoder cannot
    mimic. Texts matching the guard are routed to the exact (slower) encoder.
    """
    parts: list[str] = []
    for b in sorted(set(missing)):
        if b < 0x80:
            parts.append(re.escape(chr(b)))
        elif b < 0xC0:
            return re.compile(r"[^\x00-\x7f]")
        else:
            span = _lead_byte_range(b)
            if span is not None:
                parts.append(f"{re.escape(chr(span[0]))}-{re.escape(chr(span[1]))}")
    return re.compile("[" + "".join(parts) + "]") if parts else None
