"""Regular grammars over bytes, compiled to a token-level DFA (``shared/token_dfa.TokenDFA``).

A pattern is a function ``(nfa, continuation state) -> start state`` that adds its states to a
Thompson NFA, built back to front so that a pattern used in several places (an object's optional
members) shares its continuation instead of being copied. ``byte_dfa`` makes the NFA deterministic
(subset construction over byte classes); ``token_dfa`` runs every token's bytes through that DFA from
each state reachable at a token boundary, vectorised over the vocabulary, and keeps the tables the
engine looks up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from shared.token_dfa import GrammarError, TokenDFA

MAX_TOKEN_STATES = 8192  # a grammar needing more token-boundary states is refused as too complex


class NFA:
    def __init__(self) -> None:
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[frozenset[int], int]]] = []

    def new(self) -> int:
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def edge(self, byteset: frozenset[int], target: int) -> int:
        s = self.new()
        self.edges[s].append((byteset, target))
        return s

    def fork(self, targets: Sequence[int]) -> int:
        s = self.new()
        self.eps[s].extend(targets)
        return s


Pat = Callable[[NFA, int], int]


def lit(text: str | bytes) -> Pat:
    data = text.encode() if isinstance(text, str) else text

    def build(nfa: NFA, cont: int) -> int:
        for b in reversed(data):
            cont = nfa.edge(frozenset((b,)), cont)
        return cont
    return build


def byteset(values: bytes | Sequence[int]) -> Pat:
    allowed = frozenset(values)
    return lambda nfa, cont: nfa.edge(allowed, cont)


def seq(*parts: Pat) -> Pat:
    def build(nfa: NFA, cont: int) -> int:
        for p in reversed(parts):
            cont = p(nfa, cont)
        return cont
    return build


def alt(*parts: Pat) -> Pat:
    return lambda nfa, cont: nfa.fork([p(nfa, cont) for p in parts])


def star(part: Pat) -> Pat:
    def build(nfa: NFA, cont: int) -> int:
        loop = nfa.fork([cont])
        nfa.eps[loop].append(part(nfa, loop))
        return loop
    return build


def opt(part: Pat) -> Pat:
    return lambda nfa, cont: nfa.fork([cont, part(nfa, cont)])


def rep(part: Pat, lo: int, hi: int | None) -> Pat:
    """``part`` at least ``lo`` and at most ``hi`` (None: unbounded) times."""
    tail: Pat = star(part) if hi is None else _upto(part, hi - lo)
    return seq(*([part] * lo), tail)


def _upto(part: Pat, k: int) -> Pat:
    out: Pat = lambda nfa, cont: cont  # noqa: E731
    for _ in range(k):
        out = opt(seq(part, out))
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class ByteDFA:
    trans: np.ndarray   # int32 [C, 256]; -1: no way on
    accept: np.ndarray  # bool [C]
    start: int = 0


def byte_dfa(pattern: Pat, max_states: int = 65536) -> ByteDFA:
    """Subset construction of ``pattern``'s NFA; state 0 is the start."""
    nfa = NFA()
    final = nfa.new()
    start = pattern(nfa, final)
    classes, members = _byte_classes(nfa)
    closure = _Closure(nfa)
    first = closure.of([start])
    ids, order = {first: 0}, [first]
    rows: list[list[int]] = []
    while len(rows) < len(order):
        moves: list[set[int]] = [set() for _ in members]
        for s in order[len(rows)]:
            for allowed, target in nfa.edges[s]:
                for c in classes[allowed]:
                    moves[c].add(target)
        row = []
        for targets in moves:
            nxt = closure.of(targets) if targets else None
            if nxt is not None and nxt not in ids:
                ids[nxt] = len(order)
                order.append(nxt)
                if len(order) > max_states:
                    raise GrammarError("the grammar is too complex (its automaton has too many states)")
            row.append(-1 if nxt is None else ids[nxt])
        rows.append(row)
    by_class = np.array(rows, dtype=np.int32).reshape(len(rows), len(members))
    byte_class = np.zeros(256, dtype=np.int64)
    for c, bs in enumerate(members):
        byte_class[list(bs)] = c
    accept = np.array([final in s for s in order], dtype=bool)
    return minimize(ByteDFA(by_class[:, byte_class], accept))


def minimize(dfa: ByteDFA) -> ByteDFA:
    """Merge states no input tells apart (Moore's refinement); the start stays state 0."""
    C = len(dfa.accept)
    block = dfa.accept.astype(np.int64)
    while True:
        succ = np.where(dfa.trans < 0, -1, block[np.maximum(dfa.trans, 0)])
        _, new = np.unique(np.hstack([block[:, None], succ]), axis=0, return_inverse=True)
        new = new.reshape(-1)
        if len(np.unique(new)) == len(np.unique(block)):
            break
        block = new
    first = np.full(int(block.max()) + 1, -1, dtype=np.int64)  # renumber by first appearance: start is 0
    order: list[int] = []
    for s in range(C):
        if first[block[s]] < 0:
            first[block[s]] = len(order)
            order.append(s)
    rep_states = np.array(order)
    trans = dfa.trans[rep_states]
    trans = np.where(trans < 0, -1, first[block[np.maximum(trans, 0)]]).astype(np.int32)
    return ByteDFA(trans, dfa.accept[rep_states], 0)


def _byte_classes(nfa: NFA) -> tuple[dict[frozenset[int], list[int]], list[list[int]]]:
    """Bytes no edge tells apart share a class; per edge set, the classes it holds."""
    sets = list({bs for edges in nfa.edges for bs, _ in edges})
    signature: dict[tuple[bool, ...], list[int]] = {}
    for b in range(256):
        signature.setdefault(tuple(b in s for s in sets), []).append(b)
    members = list(signature.values())
    cls_of = {b: c for c, bs in enumerate(members) for b in bs}
    return {s: sorted({cls_of[b] for b in s}) for s in sets}, members


class _Closure:
    def __init__(self, nfa: NFA) -> None:
        self.nfa = nfa
        self.memo: dict[frozenset[int], frozenset[int]] = {}

    def of(self, states: Sequence[int] | set[int]) -> frozenset[int]:
        key = frozenset(states)
        found = self.memo.get(key)
        if found is None:
            seen, stack = set(key), list(key)
            while stack:
                for t in self.nfa.eps[stack.pop()]:
                    if t not in seen:
                        seen.add(t)
                        stack.append(t)
            found = self.memo[key] = frozenset(s for s in seen if self.nfa.edges[s] or not self.nfa.eps[s])
        return found


@dataclasses.dataclass(frozen=True, slots=True)
class Vocab:
    """The token texts a grammar is compiled against: bytes per id, None for ids that never match
    (special tokens, ids past the tokenizer's table)."""

    size: int
    order: np.ndarray   # int64 [n]: the matchable ids, longest first
    lengths: np.ndarray  # int64 [n]
    data: np.ndarray    # uint8 [n, max length], zero padded
    columns: tuple[np.ndarray, ...] = ()  # data's columns as contiguous int64 arrays

    @classmethod
    def of(cls, texts: Sequence[bytes | None], size: int) -> Vocab:
        ids = [i for i, t in enumerate(texts[:size]) if t]
        ids.sort(key=lambda i: -len(texts[i] or b""))
        lengths = np.array([len(texts[i] or b"") for i in ids], dtype=np.int64)
        data = np.zeros((len(ids), int(lengths.max()) if ids else 0), dtype=np.uint8)
        for row, i in enumerate(ids):
            data[row, : lengths[row]] = np.frombuffer(texts[i] or b"", dtype=np.uint8)
        columns = tuple(np.ascontiguousarray(data[:, j], dtype=np.int64) for j in range(data.shape[1]))
        return cls(size, np.array(ids, dtype=np.int64), lengths, data, columns)


def token_dfa(dfa: ByteDFA, vocab: Vocab) -> TokenDFA:
    """The token-level DFA of ``dfa``: its states are the byte states reachable at token boundaries."""
    C = len(dfa.accept)
    dead = C
    trans = np.vstack([np.where(dfa.trans < 0, dead, dfa.trans), np.full((1, 256), dead)]).astype(np.int64)
    flat = trans.reshape(-1)  # state * 256 + byte: one 1-D gather per byte position
    active = [int((vocab.lengths > j).sum()) for j in range(vocab.data.shape[1])]
    token_id = np.full(C + 1, -1, dtype=np.int64)  # byte state -> token state
    token_id[dfa.start] = 0
    found = [dfa.start]
    tables = _Tables(vocab.size)
    for c in found:  # grows while it is walked (breadth first)
        cur = np.full(len(vocab.order), c, dtype=np.int64)
        for j, k in enumerate(active):
            cur[:k] = flat[cur[:k] * 256 + vocab.columns[j][:k]]
        live = cur != dead
        for u in np.unique(cur[live]):
            if token_id[u] < 0:
                token_id[u] = len(found)
                found.append(int(u))
                if len(found) > MAX_TOKEN_STATES:
                    raise GrammarError("the grammar is too complex (too many states at token boundaries)")
        tables.add(vocab.order[live], token_id[cur[live]])
    return tables.finish(dfa.accept[found])


class _Tables:
    """Accumulates each token state's allowed tokens and next states in ``TokenDFA``'s compressed form."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.bits: list[np.ndarray] = []
        self.default: list[int] = []
        self.exc_tokens: list[np.ndarray] = []
        self.exc_next: list[np.ndarray] = []

    def add(self, tokens: np.ndarray, nxt: np.ndarray) -> None:
        allowed = np.zeros(self.vocab_size, dtype=bool)
        allowed[tokens] = True
        self.bits.append(np.packbits(allowed))
        common = int(np.bincount(nxt).argmax()) if len(nxt) else 0
        order = np.argsort(tokens, kind="stable")
        tokens, nxt = tokens[order], nxt[order]
        odd = nxt != common
        self.default.append(common)
        self.exc_tokens.append(tokens[odd].astype(np.int32))
        self.exc_next.append(nxt[odd].astype(np.int32))

    def finish(self, accept: np.ndarray) -> TokenDFA:
        offsets = np.zeros(len(self.default) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(t) for t in self.exc_tokens])
        return TokenDFA(0, self.vocab_size, np.stack(self.bits), np.array(self.default, dtype=np.int32), offsets,
                        np.concatenate(self.exc_tokens), np.concatenate(self.exc_next), accept.astype(bool))


def accepts(dfa: ByteDFA, text: bytes) -> bool:
    """Whether ``text`` is a sentence of the grammar (tests, and checking constrained output)."""
    s = dfa.start
    for b in text:
        s = int(dfa.trans[s, b])
        if s < 0:
            return False
    return bool(dfa.accept[s])
