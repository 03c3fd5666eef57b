"""Streaming detokenization with stop strings, push by push, against a brute-force oracle."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence

import pytest
from test_tokenizer_corpus import make_corpus

from dpu_tokenizer import Tokenizer, load_tokenizer
from dpu_tokenizer.detok import IncrementalDetokenizer, StopAutomaton, utf8_complete_prefix


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer()


def _oracle(full: bytes, stops: list[bytes]) -> tuple[int, bytes | None]:
    """(bytes that may be emitted, the stop string found) after the stream ``full``.

    The first stop to appear ends the stream at its start (the leftmost one when several appear
    in the same push); otherwise what is held back is the longer of an incomplete UTF-8 tail and
    the longest tail that is a proper prefix of a stop string.
    """
    found = [(full.find(s), i) for i, s in enumerate(stops) if s in full]
    if found:
        pos, i = min(found)
        return pos, stops[i]
    tail = max((k for s in stops for k in range(1, len(s)) if full.endswith(s[:k])), default=0)
    return min(len(full) - tail, utf8_complete_prefix(full)), None


def _texts(rnd: random.Random) -> list[str]:
    base = make_corpus(300, seed=17) + ["aaaaab aab ab", "é!é!! 😀😀 done", "User: x\n\nUser:", "abcabcabd"]
    return [rnd.choice(base) + " " + rnd.choice(base) for _ in range(400)]


def _stops_for(text: str, rnd: random.Random) -> list[str]:
    stops = [rnd.choice(("aab", "ab", "abd", "é!!", "😀", "\n\nUser:", "</answer>", "zzz"))]
    if len(text) > 4:
        start = rnd.randrange(len(text) - 3)
        stops.append(text[start : start + rnd.randint(1, 6)])  # often present, sometimes overlapping others
    if rnd.random() < 0.5:
        stops.append(stops[-1][:-1] + "#")  # shares a prefix, never completes
    return stops


def test_each_push_emits_what_the_oracle_allows(tok: Tokenizer) -> None:
    rnd = random.Random(12)
    table = [tok.token_bytes(i) for i in range(tok.vocab_size)]
    for text in _texts(rnd):
        ids = tok.encode(text)
        stops = _stops_for(text, rnd)
        encoded = [s.encode() for s in dict.fromkeys(stops) if s]
        det = IncrementalDetokenizer(tok, stop_strings=stops, skip_special_tokens=False)
        full, out, pos = b"", "", 0
        while pos < len(ids):
            step = rnd.randint(1, 4)
            chunk = ids[pos : pos + step]
            pos += step
            full += b"".join(table[i] for i in chunk)
            out += det.push(chunk)
            allowed, stop = _oracle(full, encoded)
            assert out == full[:allowed].decode("utf-8", "replace"), (text, stops)
            if stop is not None:
                assert det.stopped and det.stop_string == stop.decode()
                break
            assert not det.stopped
        if det.stopped:
            assert det.push(ids[:1]) == "" and det.finish() == ""
        else:
            assert out + det.finish() == full.decode("utf-8", "replace")


def test_sixty_four_stop_strings_push_by_push(tok: Tokenizer) -> None:
    """Many stop strings (the gateway serves up to 64), overlapping, sharing prefixes and suffixes, some far
    longer than any text: each push emits exactly what the oracle allows."""
    rnd = random.Random(64)
    table = [tok.token_bytes(i) for i in range(tok.vocab_size)]
    for text in _texts(rnd)[:150]:
        ids = tok.encode(text)
        stops = list(dict.fromkeys(_stops_for(text, rnd) + [
            "".join(rnd.choice("ab é😀\n") for _ in range(rnd.randint(1, 12))) for _ in range(40)] + [
            text[-rnd.randint(1, 8):] + "#" * rnd.randint(0, 3) for _ in range(10)] + ["x" * 256, "ab" * 128]))
        stops = stops[:64]
        encoded = [s.encode() for s in stops if s]
        det = IncrementalDetokenizer(tok, stop_strings=stops, skip_special_tokens=False)
        _against_oracle(det, _chunks(ids, rnd, 4), table, encoded)


def test_pushes_of_skipped_special_tokens_keep_what_is_held(tok: Tokenizer) -> None:
    """With special tokens skipped (the default), a push of special tokens only has no text: what is held as the
    beginning of a stop string stays held, and the stop string is still found when its rest comes."""
    rnd = random.Random(5)
    special = [i for i in range(tok.vocab_size) if tok.is_special(i)]
    assert special
    table = [b"" if tok.is_special(i) else tok.token_bytes(i) for i in range(tok.vocab_size)]
    for text in _texts(rnd)[:150]:
        ids = tok.encode(text)
        stops = _stops_for(text, rnd)
        encoded = [s.encode() for s in dict.fromkeys(stops) if s]
        det = IncrementalDetokenizer(tok, stop_strings=stops)
        _against_oracle(det, _chunks(ids, rnd, 3, special), table, encoded)


def _chunks(ids: list[int], rnd: random.Random, most: int, special: Sequence[int] = ()) -> Iterator[list[int]]:
    """``ids`` in pushes of 1 to ``most``; with ``special``, pushes of one of them (no text where special tokens
    are skipped) between those at random."""
    pos = 0
    while pos < len(ids):
        if special and rnd.random() < 0.4:
            yield [rnd.choice(special)]
            continue
        chunk = ids[pos : pos + rnd.randint(1, most)]
        pos += len(chunk)
        yield chunk


def _against_oracle(det: IncrementalDetokenizer, pushes: Iterable[list[int]], table: Sequence[bytes],
                    encoded: list[bytes]) -> None:
    """Each push emits exactly what the oracle allows; the stop string found is the oracle's; without one, the
    rest comes out at the end."""
    full, out = b"", ""
    for chunk in pushes:
        full += b"".join(table[i] for i in chunk)
        out += det.push(chunk)
        allowed, stop = _oracle(full, encoded)
        assert out == full[:allowed].decode("utf-8", "replace"), encoded
        if stop is not None:
            assert det.stopped and det.stop_string == stop.decode()
            return
    assert out + det.finish() == full.decode("utf-8", "replace")


def test_the_stop_automaton_is_linear_in_the_stop_strings() -> None:
    """A node per byte of the stop strings at most, in flat arrays (about 11 bytes a node): the memory a request's
    stop strings cost is bounded by their length, whatever their overlaps."""
    rnd = random.Random(7)
    sets = [tuple(("".join(chr(rnd.randrange(0x10000, 0x10FFFF)) for _ in range(256))).encode() for _ in range(64)),
            tuple(("a" * i + "b" * (256 - i)).encode() for i in range(64)),
            tuple(("ab" * 200)[:256 - i].encode() for i in range(64))]
    for stops in sets:
        auto = StopAutomaton(stops)
        total = sum(len(s) for s in stops)
        assert auto.size == total + 1
        arrays = (auto.next_byte, auto.depth, auto.fail, auto.found)
        assert sum(a.itemsize * len(a) for a in arrays) <= 10 * (total + 1)
        assert len(auto.branch) <= len(stops)  # one branch where each stop string leaves the others' prefixes
