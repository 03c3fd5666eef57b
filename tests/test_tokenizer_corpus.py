"""A seeded, generated multilingual corpus for tokenizer exactness tests (and a check of its coverage)."""

from __future__ import annotations

import random
from collections.abc import Callable

LATIN_WORDS = (
    "the quick brown fox jumps over lazy dog tokenizer serving request stream latency Hello World "
    "I'm you're they'll we've she'd it's DON'T WON'T Let's O'Neil rock'n'roll naïve café résumé "
    "Straße über Ægir ñandú façade déjà-vu coöperate İstanbul ǅemal"
).split()
CYRILLIC = "Привет мир как дела съешь же ещё этих мягких французских булок Ёлка Їжак ґанок".split()
CJK = (
    "你好世界",
    "我们今天学习分词",
    "東京都",
    "こんにちは",
    "カタカナ",
    "ひらがなとカタカナ",
    "안녕하세요",
    "한국어 문장",
    "漢字",
)
ARABIC = ("مرحبا", "بالعالم", "السلام عليكم", "٣٤٥", "كتاب")
DEVANAGARI = ("नमस्ते", "दुनिया", "हिन्दी", "क्षत्रिय", "१२३")
OTHER_SCRIPTS = ("שלום", "Γειά σου κόσμε", "ສະບາຍດີ", "สวัสดี", "ሰላም", "Բարեւ", "ᚠᚢᚦ", "𐌰𐌱")
EMOJI = (
    "😀",
    "👍🏽",
    "👨‍👩‍👧‍👦",
    "🏳️‍🌈",
    "🇫🇷",
    "🇯🇵",
    "❤️",
    "🧑🏿‍💻",
    "✊🏾",
    "🙂🙃",
    "🫠",
    "©️",
    "1️⃣",
    "👩‍❤️‍💋‍👨",
)
CODE = (
    "def f(x):\n    return x ** 2\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "const x = await fetch(`/api/${id}`);",
    '{"key": [1, 2.5, null], "s": "\\u00e9"}',
    "SELECT * FROM t WHERE a >= 10 AND b <> 'x';",
    "#include <stdio.h>\nint main(void) { return 0; }",
    "fn main() -> Result<(), Box<dyn Error>> { Ok(()) }",
    "x=>x*2;;;!==~~^^&&||<<=>>=",
    "\tif a:\n\t\tpass\r\n",
)
SPECIAL_LIKE = (
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_start",
    "im_start|>",
    "<|endoftext",
    "<|",
    "|>",
    "<|im_end|",
    "<repo_name>",
    "<file_sep>",
    "<|im_start|>user\n",
    "<|<|im_start|>|>",
    "<empty_output>",
)
SPACES = (
    " ",
    "  ",
    "   ",
    "\n",
    "\n\n",
    "\t",
    "\t\t",
    " \n ",
    "\r\n",
    "    \n",
    "\u00a0",
    "\u3000",
    "\u2009",
    "",
)
PUNCT = ".,;:!?-–—…'\"`()[]{}<>/\\|@#$%^&*_+=~"
RARE = (
    "\x00",
    "\x04",
    "\x1d",
    "\x7f",
    "\ufeff",
    "\u200b",
    "\u0301",
    "e\u0301",
    "\U0002a6b3",
    "\U000e0001",
    "\U00050000",
    "\uf8ff",
    "\U0010fffd",
    "ﬁ",
    "Ⅻ",
    "½",
    "²",
    "٠١٢",
)


def _number(rnd: random.Random) -> str:
    kind = rnd.randrange(5)
    if kind == 0:
        return str(rnd.randrange(10 ** rnd.randint(1, 12)))
    if kind == 1:
        return f"{rnd.uniform(-1e4, 1e4):.{rnd.randint(0, 6)}f}"
    if kind == 2:
        return f"{rnd.randrange(10**9):,}"
    if kind == 3:
        return f"{rnd.randrange(1, 13)}/{rnd.randrange(1, 29)}/20{rnd.randrange(100):02d}"
    return "0x" + "".join(rnd.choice("0123456789abcdef") for _ in range(rnd.randint(1, 16)))


def _long_word(rnd: random.Random) -> str:
    pool = rnd.choice(("abcdefghijklmnopqrstuvwxyz", "аеиоуклмн", "的一是不了人", "ab", "x", "-=", "ﬁé"))
    return "".join(rnd.choice(pool) for _ in range(rnd.randint(40, 400)))


def _random_chars(rnd: random.Random) -> str:
    out = []
    for _ in range(rnd.randint(1, 20)):
        block = rnd.choice(
            (
                (0x20, 0x7E),
                (0xA0, 0x24F),
                (0x370, 0x52F),
                (0x600, 0x6FF),
                (0x900, 0x97F),
                (0x3040, 0x30FF),
                (0x4E00, 0x9FFF),
                (0xAC00, 0xD7A3),
                (0x1F300, 0x1FAFF),
            )
        )
        out.append(chr(rnd.randint(*block)))
    return "".join(out)


def _pick(pool: tuple[str, ...] | list[str]) -> Callable[[random.Random], str]:
    return lambda rnd: rnd.choice(pool)


FRAGMENTS: tuple[Callable[[random.Random], str], ...] = (
    _pick(LATIN_WORDS),
    _pick(LATIN_WORDS),
    _pick(LATIN_WORDS),
    _pick(CYRILLIC),
    _pick(CJK),
    _pick(ARABIC),
    _pick(DEVANAGARI),
    _pick(OTHER_SCRIPTS),
    _pick(EMOJI),
    _pick(CODE),
    _pick(SPECIAL_LIKE),
    _pick(SPACES),
    _pick(RARE),
    _number,
    _number,
    _long_word,
    _random_chars,
    lambda rnd: rnd.choice(PUNCT) * rnd.randint(1, 4),
)


def make_corpus(n: int = 12000, seed: int = 1234) -> list[str]:
    """``n`` deterministic strings mixing scripts, emoji, code, numbers, whitespace and token look-alikes."""
    rnd = random.Random(seed)
    out: list[str] = ["", " ", "\n", "a", "  leading", "trailing  ", "\t\n \r\n"]
    while len(out) < n:
        parts = [rnd.choice(FRAGMENTS)(rnd) for _ in range(rnd.randint(1, 12))]
        seps = [rnd.choice((" ", " ", " ", "", "\n", "  ", "\t", ", ")) for _ in parts]
        out.append(
            "".join(p + s for p, s in zip(parts, seps, strict=True)).rstrip(rnd.choice(("", " ", "\n")))
        )
    return out


def test_corpus_is_deterministic_and_diverse() -> None:
    corpus = make_corpus()
    assert corpus == make_corpus()
    assert len(corpus) >= 10000
    text = "".join(corpus)
    for probe in ("Привет", "你好", "مرحبا", "नमस्ते", "\u200d", "<|im_start|>", "<|im_start", "\t\t", "  \n"):
        assert probe in text, probe
    assert max(map(len, corpus)) > 400
