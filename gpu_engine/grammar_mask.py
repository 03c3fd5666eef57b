"""Constrained decoding on the engine's side: table lookups in a token DFA the frontend compiled.

The frontend stored the tables (``shared/token_dfa.py``) before publishing the slot; the engine loads
each grammar id once (``GrammarCache``) and per step only walks the row's output through the tables and
reads the allowed-token mask of the state it reached. The end tokens (EOS, the request's stop ids) are
allowed exactly where the text so far is complete.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

import numpy as np

from shared import token_dfa
from shared.token_dfa import GrammarError, TokenDFA

CACHED_GRAMMARS = 64


def allowed_tokens(dfa: TokenDFA, output: Sequence[int], end_ids: Iterable[int], vocab: int) -> np.ndarray:
    """bool [vocab]: what may be sampled after ``output``; only end tokens once the output left the grammar."""
    state = dfa.walk(list(output))
    allowed = np.zeros(vocab, dtype=bool)
    if state >= 0:
        allowed[: dfa.vocab_size] = dfa.allowed(state)[:vocab]
    if state < 0 or dfa.accept[state]:
        ends = [t for t in end_ids if 0 <= t < vocab]
        allowed[ends] = True
    return allowed


class GrammarCache:
    """The token DFAs of one ring's store, loaded once per id (least recently used dropped)."""

    def __init__(self, ring_name: str, vocab_size: int, size: int = CACHED_GRAMMARS) -> None:
        self.ring_name, self.vocab_size, self.size = ring_name, vocab_size, size
        self.loaded: collections.OrderedDict[int, TokenDFA] = collections.OrderedDict()

    def get(self, grammar_id: int) -> TokenDFA | None:
        """The grammar's tables; None when they are missing, malformed or of another vocabulary."""
        dfa = self.loaded.get(grammar_id)
        if dfa is None:
            try:
                dfa = token_dfa.load(self.ring_name, grammar_id)
            except GrammarError:
                return None
            if dfa.vocab_size != self.vocab_size:
                return None
        self.loaded[grammar_id] = dfa
        self.loaded.move_to_end(grammar_id)
        while len(self.loaded) > self.size:
            self.loaded.popitem(last=False)
        return dfa
