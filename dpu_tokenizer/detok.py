"""Streaming detokenization: emit only final text, never half a UTF-8 char or part of a stop string."""

from __future__ import annotations

import collections
import threading
from array import array
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


class StopAutomaton:
    """The stop strings as one Aho-Corasick automaton over bytes, in flat arrays.

    Node ``n`` > 0 is the prefix of a stop string that ends at byte ``n - 1`` of the stop strings
    concatenated (the first stop string with that prefix holds it; node 0 is the empty prefix), so a
    node costs 11 bytes, and the automaton at most that times the stop strings' total length. Fed the
    output byte by byte (amortized O(1) a byte, whatever their number), its state is the longest tail
    of the output that begins a stop string (``depth``); ``found`` names the longest stop string that
    ends there (-1: none).
    """

    __slots__ = ("branch", "depth", "fail", "found", "next_byte", "stops")

    def __init__(self, stops: tuple[bytes, ...]) -> None:
        self.stops = stops
        buf = b"".join(stops)
        size = len(buf) + 1
        self.next_byte = array("h", [256]) * size  # the byte that continues node n's own stop string (256: none)
        self.branch: dict[int, int] = {}  # node << 8 | byte -> child, for every other child
        self.depth = array("H", [0]) * size
        self.fail = array("i", [0]) * size
        self.found = array("h", [-1]) * size
        heads: list[tuple[int, int, int, int]] = []  # per stop string's own nodes: (depth, first, its parent, last)
        at = 0
        for i, stop in enumerate(stops):
            node, k = 0, 0
            while k < len(stop):  # along the prefix that earlier stop strings spelled already
                nxt = self.child(node, stop[k])
                if not nxt:
                    break
                node, k = nxt, k + 1
            if k < len(stop):
                first = at + k + 1
                self.branch[node << 8 | stop[k]] = first
                heads.append((k + 1, first, node, at + len(stop)))
                for n in range(first, at + len(stop)):
                    self.next_byte[n] = buf[n]
                for d, n in enumerate(range(first, at + len(stop) + 1), k + 1):
                    self.depth[n] = d
                node = at + len(stop)
            if self.found[node] < 0:
                self.found[node] = i
            at += len(stop)
        # failure links by increasing depth: a node's link and the links it follows are shallower
        pending, level = heads, 1
        while pending:
            later = []
            for d, node, parent, last in pending:
                if d != level:
                    later.append((d, node, parent, last))
                    continue
                byte = buf[node - 1]
                f = 0 if parent == 0 else self.step(self.fail[parent], byte)
                self.fail[node] = f
                if self.found[node] < 0:
                    self.found[node] = self.found[f]
                if node < last:
                    later.append((d + 1, node + 1, node, last))
            pending = later
            level += 1

    @property
    def size(self) -> int:
        return len(self.fail)

    def child(self, node: int, byte: int) -> int:
        """The node after ``node`` on ``byte`` in the trie, 0 when there is none."""
        if self.next_byte[node] == byte:
            return node + 1
        return self.branch.get(node << 8 | byte, 0)

    def step(self, state: int, byte: int) -> int:
        """The automaton's move: the node of the longest tail of (``state``'s prefix + ``byte``) in the trie."""
        while True:
            nxt = self.child(state, byte)
            if nxt or not state:
                return nxt
            state = self.fail[state]


class _AutomatonCache:
    """Automata of recent stop-string sets (requests mostly share theirs: a chat template's), kept while their
    nodes total at most ``budget``; an automaton bigger than that is built for its request alone."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._kept: collections.OrderedDict[tuple[bytes, ...], StopAutomaton] = collections.OrderedDict()
        self._nodes = 0
        self._lock = threading.Lock()

    def get(self, stops: tuple[bytes, ...]) -> StopAutomaton:
        with self._lock:
            found = self._kept.get(stops)
            if found is not None:
                self._kept.move_to_end(stops)
                return found
        made = StopAutomaton(stops)
        if made.size > self.budget:
            return made
        with self._lock:
            if stops not in self._kept:
                self._kept[stops] = made
                self._nodes += made.size
            while self._nodes > self.budget:
                _, old = self._kept.popitem(last=False)
                self._nodes -= old.size
        return made


_AUTOMATA = _AutomatonCache(budget=1 << 20)  # nodes: about 11 MB


def stop_automaton(stops: tuple[bytes, ...]) -> StopAutomaton:
    return _AUTOMATA.get(stops)


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
        stops = tuple(s.encode("utf-8") for s in dict.fromkeys(stop_strings) if s)
        self._automaton = stop_automaton(stops) if stops else None
        self._max_stop = max(map(len, stops), default=0)
        self._state = 0  # of the automaton: the longest output tail that begins a stop string is held
        self._held = b""
        self._strip_space = bool(getattr(tokenizer, "strip_leading_space", False))
        self.stopped = False
        self.stop_string: str | None = None

    def push(self, token_ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        table = self._table
        new = table[token_ids[0]] if len(token_ids) == 1 else b"".join([table[t] for t in token_ids])
        if self._strip_space and new:
            self._strip_space = False
            if new[:1] == b" ":
                new = new[1:]
        data = self._held + new
        keep = len(data) if not data or data[-1] < 0x80 else utf8_complete_prefix(data)
        if self._automaton is not None:
            if new:
                hit = self._feed(new, len(self._held))
                if hit >= 0:
                    self._held = b""
                    return data[:hit].decode("utf-8", "replace")
            # hold back a tail that may begin a stop string (also where this push had no text: a special token
            # skipped), as well as an incomplete UTF-8 char
            keep = min(keep, len(data) - self._automaton.depth[self._state])
        self._held = data[keep:]
        return data[:keep].decode("utf-8", "replace")

    def _feed(self, new: bytes, base: int) -> int:
        """Run ``new`` (which follows ``base`` held bytes) through the automaton. Where the first stop string
        begins (of those completed by ``new``, the one that begins first; at one place, the first given), and
        the generation stops there; -1 when none was completed."""
        auto = self._automaton
        assert auto is not None
        next_byte, branch, fail, found, stops = auto.next_byte, auto.branch, auto.fail, auto.found, auto.stops
        state, hit, which = self._state, -1, -1
        for end, byte in enumerate(new, base + 1):
            while next_byte[state] != byte:  # StopAutomaton.step, inline
                nxt = branch.get(state << 8 | byte, 0)
                if nxt or not state:
                    state = nxt
                    break
                state = fail[state]
            else:
                state += 1
            f = found[state]
            if f >= 0:
                begin = end - len(stops[f])
                if hit < 0 or begin < hit or (begin == hit and f < which):
                    hit, which = begin, f
            if hit >= 0 and end - self._max_stop >= hit:
                break  # a stop string completed later begins after this one
        self._state = state
        if hit >= 0:
            self.stopped = True
            self.stop_string = stops[which].decode("utf-8")
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
