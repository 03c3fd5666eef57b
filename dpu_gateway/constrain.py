"""The gateway's grammar compiler: a pattern and its key to a grammar id whose tables the engine can load.

The id is a 64-bit hash of the key, the vocabulary's texts and its size, so two gateways (or a restarted
one) agree on it and compile each grammar at most once per ring: a grammar already in the ring's store
is not compiled again. Compiling runs in a worker thread so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Callable

from dpu_gateway.errors import APIError
from dpu_gateway.grammar import Pat, Vocab, byte_dfa, token_dfa
from dpu_gateway.textio import TextCodec
from shared import token_dfa as store
from shared.token_dfa import GrammarError


class GrammarCompiler:
    def __init__(self, codec: TextCodec, ring_name: str) -> None:
        self.codec, self.ring_name = codec, ring_name
        self._vocab: dict[int, tuple[Vocab, bytes]] = {}
        self._lock = threading.Lock()

    def vocab(self, size: int) -> tuple[Vocab, bytes]:
        """The matchable token texts for a model of ``size`` ids, and their fingerprint."""
        with self._lock:
            found = self._vocab.get(size)
            if found is None:
                tok = self.codec.tokenizer
                texts = [None if tok.is_special(i) else self.codec.token_bytes(i)
                         for i in range(min(size, tok.vocab_size))]
                digest = hashlib.blake2b(digest_size=16)
                for t in texts:
                    digest.update(b"\xff" if t is None else len(t).to_bytes(2, "little") + t)
                found = self._vocab[size] = (Vocab.of(texts, size), digest.digest())
            return found

    def grammar_id(self, key: str, pattern: Callable[[], Pat], vocab_size: int) -> int:
        """The id of ``pattern`` (built only when not already stored), stored for the engine."""
        vocab, fingerprint = self.vocab(vocab_size)
        digest = hashlib.blake2b(key.encode() + fingerprint + vocab_size.to_bytes(4, "little"), digest_size=8)
        gid = int.from_bytes(digest.digest(), "little") or 1
        if not store.grammar_path(self.ring_name, gid).exists():
            store.store(self.ring_name, gid, token_dfa(byte_dfa(pattern()), vocab))
        return gid

    async def compile(self, key: str, pattern: Callable[[], Pat], vocab_size: int, param: str) -> int:
        """``grammar_id`` off the event loop; a grammar that cannot be enforced is a 400 naming ``param``."""
        if vocab_size <= 0:
            raise APIError(503, "the engine has not said its vocabulary yet", code="service_unavailable")
        try:
            return await asyncio.to_thread(self.grammar_id, key, pattern, vocab_size)
        except GrammarError as exc:
            keyword = getattr(exc, "keyword", "")
            raise APIError(400, f"{param}: {exc}", param=f"{param}.{keyword}" if keyword else param,
                           code="unsupported_value") from None
