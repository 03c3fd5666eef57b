"""IncrementalDetokenizer: UTF-8 safety, stop strings, and equality with a full decode."""

from __future__ import annotations

import random

import pytest
from test_tokenizer_corpus import make_corpus

from dpu_tokenizer import Tokenizer, load_tokenizer
from dpu_tokenizer.detok import IncrementalDetokenizer, utf8_complete_prefix


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer()


def _stream(
    tok: Tokenizer, ids: list[int], rnd: random.Random | None = None, **kw: object
) -> tuple[list[str], str]:
    det = IncrementalDetokenizer(tok, **kw)  # type: ignore[arg-type]
    pieces: list[str] = []
    pos = 0
    while pos < len(ids) and not det.stopped:
        step = 1 if rnd is None else rnd.randint(1, 4)
        pieces.append(det.push(ids[pos : pos + step]))
        pos += step
    return pieces, det.finish()


def test_utf8_complete_prefix() -> None:
    assert utf8_complete_prefix(b"ab") == 2
    assert utf8_complete_prefix("é".encode()[:1]) == 0
    assert utf8_complete_prefix(b"x" + "😀".encode()[:3]) == 1
    assert utf8_complete_prefix("😀".encode()) == 4
    assert utf8_complete_prefix(b"\x80\x80") == 2  # stray continuation bytes never complete


def test_split_utf8_never_yields_replacement_mid_stream(tok: Tokenizer) -> None:
    text = "emoji 👨‍👩‍👧‍👦 and 🇫🇷 and 漢字かな 한국어 𠜎𠜱 done"
    ids = tok.encode(text)
    assert any(len(tok.token_bytes(i)) == 1 and tok.token_bytes(i)[0] >= 0x80 for i in ids)
    pieces, tail = _stream(tok, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + tail == text


def test_concatenation_equals_full_decode(tok: Tokenizer) -> None:
    rnd = random.Random(3)
    for text in make_corpus(1500, seed=99):
        ids = tok.encode(text)
        for skip in (True, False):
            pieces, tail = _stream(tok, ids, rnd, skip_special_tokens=skip)
            assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip)


def test_random_ids_match_full_decode(tok: Tokenizer) -> None:
    rnd = random.Random(5)
    for _ in range(1000):
        ids = [rnd.randrange(tok.vocab_size) for _ in range(rnd.randint(1, 30))]
        pieces, tail = _stream(tok, ids, rnd)
        assert "".join(pieces) + tail == tok.decode(ids)
        assert all("\ufffd" not in p for p in pieces) or "\ufffd" in tok.decode(ids)


def test_incomplete_tail_becomes_replacement_at_finish(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀")
    det = IncrementalDetokenizer(tok)
    head = det.push(ids[:-1])
    assert "\ufffd" not in head
    assert head + det.finish() == tok.decode(ids[:-1])


@pytest.mark.parametrize("stop", ["STOP", "\n\nUser:", "😀", "<|im_end|>", "é!"])
def test_stop_string_across_tokens_is_never_emitted(tok: Tokenizer, stop: str) -> None:
    before, after = "Sure, here it is: a reply with words", " and what follows"
    ids = tok.encode(before + stop + after)
    for chunking in (None, random.Random(1)):
        det = IncrementalDetokenizer(tok, stop_strings=[stop, "never-seen"], skip_special_tokens=False)
        out = []
        pos = 0
        while pos < len(ids):
            step = 1 if chunking is None else chunking.randint(1, 3)
            piece = det.push(ids[pos : pos + step])
            pos += step
            out.append(piece)
            assert before.startswith("".join(out)), out
        out.append(det.finish())
        assert "".join(out) == before
        assert det.stopped and det.stop_string == stop


def test_partial_stop_released_at_finish(tok: Tokenizer) -> None:
    det = IncrementalDetokenizer(tok, stop_strings=["STOPPING"])
    first = det.push(tok.encode("hello STOP"))
    assert first == "hello "
    assert det.finish() == "STOP"
    assert not det.stopped


def test_pushes_after_stop_return_nothing(tok: Tokenizer) -> None:
    det = IncrementalDetokenizer(tok, stop_strings=["end"])
    assert det.push(tok.encode("the end is near")) == "the "
    assert det.push(tok.encode(" more")) == ""
    assert det.finish() == ""


def test_token_at_a_time_over_a_long_corpus_equals_one_decode(tok: Tokenizer) -> None:
    # its speed lives in bench/tokenizer_bench.py (streaming detokenization, tokens/s)
    ids = tok.encode(" ".join(make_corpus(400, seed=5)))[:20000]
    det = IncrementalDetokenizer(tok)
    text = "".join(det.push((tid,)) for tid in ids) + det.finish()
    assert text == tok.decode(ids)
