"""The C byte-level BPE encoder (``_fastbpe``): which patterns it implements, and its inputs.

The extension implements the pre-tokenizer patterns below with hand-written scanners instead of
a regex engine; any other pattern keeps the tiktoken path. The scanners classify code points
through a table built here from ``unicodedata``: letters (``\\p{L}``), numbers (``\\p{N}``),
marks (``\\p{M}``) and Unicode ``White_Space`` (what ``\\s`` means to the regex engines; not
``str.isspace``, which also counts U+001C..U+001F). Code points unassigned in Python's Unicode
version are marked unknown: the reference engine may know them, so texts holding one are left to
the exact fallback. Build the extension with ``python setup.py build_ext --inplace``.
"""

from __future__ import annotations

import logging
import unicodedata
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

from dpu_tokenizer.bytelevel import DIGITS_GPT2_PATTERN, GPT2_PATTERN, LLAMA3_PATTERN, QWEN35_PATTERN, QWEN_PATTERN

try:
    from dpu_tokenizer import _fastbpe  # type: ignore[attr-defined]
except ImportError:  # not built: every tokenizer keeps its tiktoken path
    _fastbpe = None

log = logging.getLogger(__name__)

CL_L, CL_N, CL_M, CL_WS, CL_UNKNOWN = 1, 2, 4, 8, 16
SCAN_GPT2, SCAN_LLAMA3 = 0, 1

# pattern -> (scanner, digits, case-insensitive contractions, letter-run classes);
# digits: gpt2 scanner 1 = each digit its own piece, llama3 scanner = longest digit run.
SCANNERS: dict[str, tuple[int, int, bool, int]] = {
    GPT2_PATTERN: (SCAN_GPT2, 0, False, CL_L),
    DIGITS_GPT2_PATTERN: (SCAN_GPT2, 1, False, CL_L),
    LLAMA3_PATTERN: (SCAN_LLAMA3, 3, True, CL_L),
    QWEN_PATTERN: (SCAN_LLAMA3, 1, True, CL_L),
    QWEN35_PATTERN: (SCAN_LLAMA3, 1, True, CL_L | CL_M),
}

# Unicode's White_Space property (PropList.txt), the code points `\s` matches.
WHITE_SPACE = (
    *range(0x09, 0x0E),
    0x20,
    0x85,
    0xA0,
    0x1680,
    *range(0x2000, 0x200B),
    0x2028,
    0x2029,
    0x202F,
    0x205F,
    0x3000,
)


def available() -> bool:
    return _fastbpe is not None


@lru_cache(maxsize=1)
def _warn_not_built() -> None:
    log.warning("C tokenizer extension not built (python setup.py build_ext --inplace): encoding through tiktoken")


@lru_cache(maxsize=1)
def char_classes() -> bytes:
    """One class byte per code point (0..0x10FFFF), shared by every encoder of the process."""
    flags = {"L": CL_L, "N": CL_N, "M": CL_M}
    categories = list(map(unicodedata.category, map(chr, range(0x110000))))
    by_category = {cat: CL_UNKNOWN if cat == "Cn" else flags.get(cat[0], 0) for cat in set(categories)}
    table = bytearray(map(by_category.__getitem__, categories))
    for cp in WHITE_SPACE:
        table[cp] |= CL_WS
    return bytes(table)


def bad_byte_table(missing: Iterable[int]) -> bytes:
    """Bytes whose presence sends a text to the exact fallback, mirroring ``missing_bytes_guard``.

    A missing continuation byte makes every non-ASCII char suspect; a missing lead byte, every
    char it starts.
    """
    table = bytearray(256)
    for b in missing:
        if 0x80 <= b < 0xC0:
            table[0x80:] = b"\x01" * 0x80
        else:
            table[b] = 1
    return bytes(table)


def build_encoder(
    pattern: str,
    ranks: dict[bytes, int],
    added: dict[str, int],
    *,
    rank_to_id: Sequence[int] | None,
    missing_bytes: Iterable[int],
    vocab_size: int,
) -> Any | None:
    """A C encoder for this vocabulary, or None when the extension is absent or the pattern unknown.

    ``ranks`` must hold every single byte (missing ones with placeholder ranks, as tiktoken
    needs); ``added`` maps added-token texts to vocabulary ids; ``rank_to_id`` maps ranks to
    vocabulary ids when they differ.
    """
    spec = SCANNERS.get(pattern)
    if spec is None or any(not text for text in added):
        return None
    if _fastbpe is None:
        _warn_not_built()
        return None
    scan, digits, fold_case, letter = spec
    try:
        return _fastbpe.Encoder(
            scan=scan,
            digits=digits,
            fold_case=fold_case,
            letter=letter,
            classes=char_classes(),
            ranks=ranks,
            rank_to_id=list(rank_to_id) if rank_to_id is not None else None,
            added=added,
            bad_bytes=bad_byte_table(missing_bytes),
            vocab_size=vocab_size,
        )
    except (TypeError, ValueError) as exc:  # a vocabulary the C encoder cannot hold: tiktoken encodes it
        log.warning("C tokenizer encoder not used: %s", exc)
        return None
