"""Streaming detokenization: emit only final text, never half a UTF-8 char or part of a stop string."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from dpu_tokenizer.base import Tokenizer


def utf8_complete_prefix(data: bytes) -> int:
    """Length of ``data`` without a trailing, still completable, UTF-8 sequence."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        byte = data[n - back]
        if byte < 0x80:
            return n
        if byte >= 0xC0:
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            if byte > 0xF4 or need <= back:
                return n  # invalid lead, or the sequence is already whole
            return n - back
    return n  # only continuation bytes: nothing can complete them


@functools.lru_cache(maxsize=256)
def prefixes_by_last(stops: tuple[bytes, ...]) -> dict[int, list[bytes]]:
    """Last byte -> the proper prefixes of ``stops`` ending with it, longest first. Requests mostly share
    their stop strings (a chat template's), so the table is built once per set, not per request."""
    prefixes: dict[int, set[bytes]] = {}
    for stop in stops:
        for size in range(1, len(stop)):
            prefixes.setdefault(stop[size - 1], set()).add(stop[:size])
    return {b: sorted(p, key=len, reverse=True) for b, p in prefixes.items()}


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces whose concatenation equals a full decode.

    ``push`` returns text that can no longer change: a trailing incomplete UTF-8 sequence, and any
    tail that could still grow into one of ``stop_strings``, are held back. When a stop string is
    completed the text before it is returned, ``stopped`` becomes True and ``stop_string`` names it;
    later pushes return "". ``finish`` releases what is held (incomplete bytes become U+FFFD).
    """

    def __init__(
        self, tokenizer: Tokenizer, stop_strings: Sequence[str] = (), skip_special_tokens: bool = True
    ) -> None:
        table_of = getattr(tokenizer, "token_bytes_table", None)
        if table_of is not None:
            self._table: Sequence[bytes] = table_of(skip_special_tokens=skip_special_tokens)
        else:
            self._table = _table_from(tokenizer, skip_special_tokens)
        self._stops = [s.encode("utf-8") for s in dict.fromkeys(stop_strings) if s]
        self._max_stop = max(map(len, self._stops), default=0)
        self._prefixes_by_last = prefixes_by_last(tuple(self._stops))
        self._held = b""
        self._strip_space = bool(getattr(tokenizer, "strip_leading_space", False))
        self.stopped = False
        self.stop_string: str | None = None

    def push(self, token_ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        table = self._table
        if len(token_ids) == 1:
            data = self._held + table[token_ids[0]]
        else:
            data = self._held + b"".join([table[t] for t in token_ids])
        if self._strip_space and data:
            self._strip_space = False
            if data[:1] == b" ":
                data = data[1:]
        if self._stops:
            hit = self._stop_at(data, len(self._held))
            if hit >= 0:
                self._held = b""
                return data[:hit].decode("utf-8", "replace")
        # hold back an incomplete UTF-8 char, and a tail that may begin a stop string
        keep = len(data) if not data or data[-1] < 0x80 else utf8_complete_prefix(data)
        if self._stops and data:
            for prefix in self._prefixes_by_last.get(data[-1], ()):
                if data.endswith(prefix):
                    keep = min(keep, len(data) - len(prefix))
                    break
        self._held = data[keep:]
        return data[:keep].decode("utf-8", "replace")

    def _stop_at(self, data: bytes, old: int) -> int:
        """Where the first stop string in ``data`` begins (searched from where one could start across
        the ``old`` held bytes), and the generation stops there; -1 when there is none."""
        start = max(0, old - self._max_stop + 1)
        hit, which = -1, b""
        for stop in self._stops:
            pos = data.find(stop, start)
            if pos >= 0 and (hit < 0 or pos < hit):
                hit, which = pos, stop
        if hit >= 0:
            self.stopped = True
            self.stop_string = which.decode("utf-8")
        return hit

    def finish(self) -> str:
        """Everything still held: no more tokens can complete a char or a stop string."""
        if self.stopped:
            return ""
        data, self._held = self._held, b""
        return data.decode("utf-8", "replace")


def _table_from(tokenizer: Tokenizer, skip_special_tokens: bool) -> list[bytes]:
    return [
        b"" if skip_special_tokens and tokenizer.is_special(i) else tokenizer.token_bytes(i)
        for i in range(tokenizer.vocab_size)
    ]
