"""Regular grammars over bytes, compiled to a token-level DFA (``shared/token_dfa.TokenDFA``).

A pattern is a function ``(nfa, continuation state) -> start state`` that adds its states to a
Thompson NFA, built back to front so that a pattern used in several places (an object's optional
members) shares its continuation instead of being copied. ``byte_dfa`` makes the NFA deterministic
(subset construction over byte classes); ``token_dfa`` runs every token's bytes through that DFA from
each state reachable at a token boundary, vectorised over the vocabulary, and keeps the tables the
engine looks up.

Every step is bounded by a ``Budget`` checked while it runs, so a grammar too big to serve is refused
(``TooComplex``, naming the limit) after a bounded amount of work, never after its expansion: the NFA's
size as patterns add states, the subset construction's states and work, and the minimized automaton's
states before any token is walked through it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from shared.token_dfa import GrammarError, TokenDFA


@dataclasses.dataclass(frozen=True, slots=True)
class Budget:
    """How much one compile may build. Each limit bounds the next step's time and memory: NFA states
    bound the pattern's expansion; subset work (NFA states visited) bounds the determinization; token
    states bound the walk of the vocabulary (one vectorised pass over every token per state)."""

    nfa_states: int = 200_000
    dfa_states: int = 20_000
    subset_work: int = 4_000_000
    token_states: int = 2048


DEFAULT_BUDGET = Budget()


class TooComplex(GrammarError):
    """A grammar over one of ``Budget``'s limits; ``limit`` names the field."""

    def __init__(self, what: str, limit: str, value: int) -> None:
        super().__init__(f"the grammar is too complex to enforce: {what} more than {value} "
                         f"(this server's limit {limit} = {value})")
        self.limit = limit


class NFA:
    def __init__(self, budget: Budget = DEFAULT_BUDGET) -> None:
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[frozenset[int], int]]] = []
        self.max_states = budget.nfa_states

    def new(self) -> int:
        if len(self.eps) >= self.max_states:
            raise TooComplex("its pattern needs NFA states:", "nfa_states", self.max_states)
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


def until(marker: str | bytes) -> Pat:
    """Any bytes in which ``marker`` does not occur, then ``marker``: the text up to its first occurrence. One
    state per byte of the marker matched so far (the Knuth-Morris-Pratt automaton), so it adds ``len(marker)``
    states whatever follows."""
    return _scan(marker, ends=False)


def without(marker: str | bytes) -> Pat:
    """Any bytes in which ``marker`` does not occur (the same automaton as ``until``'s, each state an exit)."""
    return _scan(marker, ends=True)


def _scan(marker: str | bytes, ends: bool) -> Pat:
    """The KMP automaton of ``marker``: ``ends`` false, the marker's first occurrence leads on; true, every
    state before one leads on and the occurrence itself is no way on."""
    data = marker.encode() if isinstance(marker, str) else marker

    def matched(k: int, b: int) -> int:
        """How much of ``data`` is matched after ``data[:k]`` and byte ``b``."""
        text = data[:k] + bytes((b,))
        return next(j for j in range(len(text), -1, -1) if data.startswith(text[len(text) - j:]))

    def build(nfa: NFA, cont: int) -> int:
        states = [nfa.new() for _ in data]
        for k, state in enumerate(states):
            by_target: dict[int, set[int]] = {}
            for b in range(256):
                j = matched(k, b)
                if j < len(data) or not ends:
                    by_target.setdefault(cont if j == len(data) else states[j], set()).add(b)
            nfa.edges[state] += [(frozenset(bs), target) for target, bs in by_target.items()]
            if ends:
                nfa.eps[state].append(cont)
        return states[0]
    return build


def _upto(part: Pat, k: int) -> Pat:
    """``part`` at most ``k`` times: built in a loop (a chain of ``k`` nested patterns would recurse ``k`` deep)."""
    def build(nfa: NFA, cont: int) -> int:
        state = cont
        for _ in range(k):
            state = nfa.fork([cont, part(nfa, state)])
        return state
    return build


@dataclasses.dataclass(frozen=True, slots=True)
class ByteDFA:
    trans: np.ndarray   # int32 [C, 256]; -1: no way on
    accept: np.ndarray  # bool [C]
    start: int = 0


def byte_dfa(pattern: Pat, budget: Budget = DEFAULT_BUDGET) -> ByteDFA:
    """Subset construction of ``pattern``'s NFA, minimized; state 0 is the start. Refused (``TooComplex``)
    as soon as a step goes over ``budget``, and before a token walk when the result has more states than
    ``budget.token_states`` (every DFA state is a token-boundary state under a vocabulary of single bytes)."""
    nfa = NFA(budget)
    final = nfa.new()
    start = pattern(nfa, final)
    rows, order, members = _Subsets(nfa, budget).build(start)
    by_class = np.array(rows, dtype=np.int32).reshape(len(rows), len(members))
    accept = np.array([final in s for s in order], dtype=bool)
    by_class, accept = minimize(by_class, accept, budget)
    byte_class = np.zeros(256, dtype=np.int64)
    for c, bs in enumerate(members):
        byte_class[list(bs)] = c
    return ByteDFA(np.ascontiguousarray(by_class[:, byte_class]), accept)


def minimize(trans: np.ndarray, accept: np.ndarray, budget: Budget) -> tuple[np.ndarray, np.ndarray]:
    """Merge states no input tells apart (Moore's refinement over byte classes); the start stays state 0.
    Each round splits blocks, so more rounds than ``budget.token_states`` means more states than that."""
    block = accept.astype(np.int64)
    for rounds in range(1, budget.token_states + 2):
        if rounds * len(block) > budget.subset_work:
            raise TooComplex("minimizing its automaton takes steps:", "subset_work", budget.subset_work)
        succ = np.where(trans < 0, -1, block[np.maximum(trans, 0)])
        new = _row_ids(np.hstack([block[:, None], succ]))
        stable = new.max() == len(np.unique(block)) - 1
        block = new
        if block.max() + 1 > budget.token_states:
            raise TooComplex("its minimal automaton has states:", "token_states", budget.token_states)
        if stable:
            break
    # _row_ids numbers blocks by first appearance, so the start's block is 0
    reps = np.unique(block, return_index=True)[1]
    out = np.where(trans[reps] < 0, -1, block[np.maximum(trans[reps], 0)]).astype(np.int32)
    return out, accept[reps]


def _row_ids(table: np.ndarray) -> np.ndarray:
    """One id per distinct row of ``table``, numbered by first appearance."""
    ids: dict[bytes, int] = {}
    data = np.ascontiguousarray(table)
    return np.array([ids.setdefault(row.tobytes(), len(ids)) for row in data], dtype=np.int64)


class _Subsets:
    """The subset construction, counting its work (NFA states visited) against the budget."""

    def __init__(self, nfa: NFA, budget: Budget) -> None:
        self.nfa, self.budget, self.work = nfa, budget, 0
        self.classes, self.members = _byte_classes(nfa)
        self.closure = _Closure(nfa, self)

    def charge(self, n: int) -> None:
        self.work += n
        if self.work > self.budget.subset_work:
            raise TooComplex("making its automaton deterministic takes steps:", "subset_work",
                             self.budget.subset_work)

    def build(self, start: int) -> tuple[list[list[int]], list[frozenset[int]], list[list[int]]]:
        first = self.closure.of([start])
        ids, order = {first: 0}, [first]
        rows: list[list[int]] = []
        while len(rows) < len(order):
            row = [-1] * len(self.members)
            for c, targets in self.moves(order[len(rows)]).items():
                nxt = self.closure.of(targets)
                if nxt not in ids:
                    if len(order) >= self.budget.dfa_states:
                        raise TooComplex("its deterministic automaton needs states:", "dfa_states",
                                         self.budget.dfa_states)
                    ids[nxt] = len(order)
                    order.append(nxt)
                row[c] = ids[nxt]
            rows.append(row)
        return rows, order, self.members

    def moves(self, subset: frozenset[int]) -> dict[int, set[int]]:
        """Byte class -> the NFA states ``subset`` moves to on it (classes with none left out)."""
        self.charge(len(subset))
        moves: dict[int, set[int]] = {}
        for s in subset:
            for allowed, target in self.nfa.edges[s]:
                for c in self.classes[allowed]:
                    moves.setdefault(c, set()).add(target)
        return moves


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
    def __init__(self, nfa: NFA, subsets: _Subsets) -> None:
        self.nfa, self.subsets = nfa, subsets
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
            self.subsets.charge(len(seen))
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
    by_first: tuple[np.ndarray, ...] = ()  # per first byte, the rows starting with it (ascending)

    @classmethod
    def of(cls, texts: Sequence[bytes | None], size: int) -> Vocab:
        ids = [i for i, t in enumerate(texts[:size]) if t]
        ids.sort(key=lambda i: -len(texts[i] or b""))
        lengths = np.array([len(texts[i] or b"") for i in ids], dtype=np.int64)
        data = np.zeros((len(ids), int(lengths.max()) if ids else 0), dtype=np.uint8)
        for row, i in enumerate(ids):
            data[row, : lengths[row]] = np.frombuffer(texts[i] or b"", dtype=np.uint8)
        columns = tuple(np.ascontiguousarray(data[:, j], dtype=np.int64) for j in range(data.shape[1]))
        first = columns[0] if columns else np.zeros(0, dtype=np.int64)
        by_first = tuple(np.flatnonzero(first == b) for b in range(256))
        return cls(size, np.array(ids, dtype=np.int64), lengths, data, columns, by_first)


def token_dfa(dfa: ByteDFA, vocab: Vocab, budget: Budget = DEFAULT_BUDGET) -> TokenDFA:
    """The token-level DFA of ``dfa``: its states are the byte states reachable at token boundaries."""
    C = len(dfa.accept)
    dead = C
    trans = np.vstack([np.where(dfa.trans < 0, dead, dfa.trans), np.full((1, 256), dead)]).astype(np.int64)
    flat = trans.reshape(-1)  # state * 256 + byte: one 1-D gather per byte position
    token_id = np.full(C + 1, -1, dtype=np.int64)  # byte state -> token state
    token_id[dfa.start] = 0
    found = [dfa.start]
    tables = _Tables(vocab.size)
    for c in found:  # grows while it is walked (breadth first)
        rows, cur = _walk(flat, c, vocab, dead)
        for u in np.unique(cur):
            if token_id[u] < 0:
                token_id[u] = len(found)
                found.append(int(u))
                if len(found) > budget.token_states:
                    raise TooComplex("it has states at token boundaries:", "token_states", budget.token_states)
        tables.add(vocab.order[rows], token_id[cur])
    return tables.finish(dfa.accept[found])


def _walk(flat: np.ndarray, state: int, vocab: Vocab, dead: int) -> tuple[np.ndarray, np.ndarray]:
    """Every token's bytes from byte state ``state``: the rows (into ``vocab.order``) of the tokens that
    stay alive, and the states they end in. A token is dropped at its first byte the grammar rules out, so
    the work follows the live tokens (few, in a state that allows only a few bytes)."""
    first = np.flatnonzero(flat[state * 256: state * 256 + 256] != dead)
    rows = np.sort(np.concatenate([vocab.by_first[b] for b in first])) if len(first) else np.zeros(0, np.int64)
    cur = np.full(len(rows), state, dtype=np.int64)
    done_rows, done_states = [], []
    for j in range(vocab.data.shape[1]):
        cur = flat[cur * 256 + vocab.columns[j][rows]]
        alive = cur != dead
        rows, cur = rows[alive], cur[alive]
        ended = vocab.lengths[rows] == j + 1  # rows stay longest first: the ended ones are the tail
        k = len(rows) - int(np.count_nonzero(ended))
        done_rows.append(rows[k:])
        done_states.append(cur[k:])
        rows, cur = rows[:k], cur[:k]
        if not k:
            break
    if not done_rows:
        return rows, cur
    return np.concatenate(done_rows), np.concatenate(done_states)


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
