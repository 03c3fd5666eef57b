"""The gateway's grammar compiler: a constraint's key to a grammar id whose tables the engine can load.

The id is a 64-bit hash of the key, the vocabulary's texts and its size, so two gateways (or a restarted
one) agree on it and compile each grammar at most once per ring: a grammar already in the ring's store
is not compiled again. Compiles run in worker processes (``grammar_pool``), bounded by ``grammar.Budget``;
a grammar refused for good (a schema keyword not enforced, a limit of the budget) is remembered by id, so
the same request again is refused at once. Every outcome is one log line, ``grammar_compile``, whose
``result`` is ``compiled``, ``stored`` (already there), ``refused``, ``refused_cached`` or ``busy``.

The store is bounded (``store_bytes``, --grammar-store-mb): after each compile the least recently used grammars
no request uses are removed until it fits (``shared.token_dfa.prune``, logged as ``grammar_store_pruned``). The
requests of this gateway hold theirs from the moment ``compile`` returns their id to their end (``REQUEST_HOLDS``,
which the app's middleware opens and releases around each request); another gateway's are
spared by their last use, which each gateway renews every ``REFRESH_S`` for the grammars it holds (``refresh``),
well within ``GRACE_S``.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import hashlib
from typing import NoReturn

from dpu_gateway.errors import APIError
from dpu_gateway.grammar_pool import GrammarPool, Job, PoolBusy, Refusal
from dpu_gateway.textio import TextCodec
from shared import token_dfa as store
from shared.log import get_logger
from shared.remote_ring import is_remote

log = get_logger("gateway")
MAX_REFUSALS_KEPT = 1024
MAX_SIZES_KEPT = 1024  # grammars whose device size is remembered
BUSY_RETRY_AFTER_S = 2.0
GRACE_S = 60.0     # a grammar used this recently is never pruned: another gateway may have just compiled it
REFRESH_S = 10.0   # how often a gateway marks the grammars of its requests as used
# The grammar ids the current request holds (the app's middleware sets a list per request and releases it at the end)
REQUEST_HOLDS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("grammar_holds", default=None)


class GrammarCompiler:
    def __init__(self, codec: TextCodec, ring_name: str, *, workers: int = 1, queue_bound: int = 8,
                 store_bytes: int = 0) -> None:
        self.codec, self.ring_name = codec, ring_name
        self.workers, self.queue_bound = workers, queue_bound
        self.store_bytes = store_bytes  # 0: the store is not bounded
        self.held: collections.Counter[int] = collections.Counter()  # grammar id -> this gateway's requests on it
        self._texts: tuple[list[bytes | None], bytes] | None = None
        self._pool: GrammarPool | None = None
        self._refused: collections.OrderedDict[int, Refusal] = collections.OrderedDict()
        self._sizes: collections.OrderedDict[int, int] = collections.OrderedDict()  # grammar id -> device bytes

    def texts(self) -> tuple[list[bytes | None], bytes]:
        """The tokenizer's matchable token texts (None: special) and their fingerprint, computed once."""
        if self._texts is None:
            tok = self.codec.tokenizer
            texts = [None if tok.is_special(i) else self.codec.token_bytes(i) for i in range(tok.vocab_size)]
            digest = hashlib.blake2b(digest_size=16)
            for t in texts:
                digest.update(b"\xff" if t is None else len(t).to_bytes(2, "little") + t)
            self._texts = (texts, digest.digest())
        return self._texts

    def grammar_id(self, key: str, vocab_size: int) -> int:
        fingerprint = self.texts()[1]
        digest = hashlib.blake2b(key.encode() + fingerprint + vocab_size.to_bytes(4, "little"), digest_size=8)
        return int.from_bytes(digest.digest(), "little") or 1

    async def compile(self, key: str, vocab_size: int, param: str, arena_bytes: int = 0) -> int:
        """The id of the grammar ``key`` names, compiled and stored if it is not yet; a grammar that cannot
        be enforced is a 400 naming ``param`` (and the keyword or limit), a full queue a 429. ``arena_bytes``
        (the ring header's ``grammar_arena_bytes``; 0: no limit): a grammar whose device tables are larger is a
        400 naming that limit."""
        gid = await self._compile(key, vocab_size, param)
        holds = REQUEST_HOLDS.get()
        if holds is not None:  # held until the request ends, however long its prompt takes to tokenize
            holds.append(gid)
            self.held[gid] += 1
        if arena_bytes:
            self.check_fits(gid, param, arena_bytes)
        return gid

    def check_fits(self, gid: int, param: str, arena_bytes: int) -> None:
        size = self._sizes.get(gid)
        if size is None:
            try:
                size = store.stored_device_bytes(self.ring_name, gid)
            except store.GrammarError as exc:
                raise APIError(503, f"{param}: the compiled grammar could not be read back ({exc})",
                               param=param, code="service_unavailable") from None
            self._sizes[gid] = size
            while len(self._sizes) > MAX_SIZES_KEPT:
                self._sizes.popitem(last=False)
        if size > arena_bytes:
            raise APIError(400, f"{param}: this grammar's tables need {size / 2**20:.1f} MiB of GPU memory; the "
                           f"engine's grammar arena holds {arena_bytes / 2**20:.1f} MiB (--grammar-cache-mb); a "
                           "smaller schema fits", param=param, code="grammar_too_large")

    async def _compile(self, key: str, vocab_size: int, param: str) -> int:
        if is_remote(self.ring_name):
            raise APIError(400, f"{param}: constrained output is not served over an RDMA ring: the engine loads "
                           "each grammar from a store in its own host's shared memory, which a frontend on another "
                           "host cannot write (docs/RDMA.md)", param=param, code="unsupported_on_remote_ring")
        if vocab_size <= 0:
            raise APIError(503, "the engine has not said its vocabulary yet", code="service_unavailable")
        if self._texts is None:
            await asyncio.to_thread(self.texts)
        gid = self.grammar_id(key, vocab_size)
        refused = self._refused.get(gid)
        if refused is not None:
            self._refused.move_to_end(gid)
            return self._refuse(gid, refused, param, cached=True)
        if store.touch(self.ring_name, gid):
            log.debug("grammar_compile", result="stored", grammar_id=f"{gid:016x}")
            return gid
        try:
            refusal = await self.pool().run(Job(key, gid, vocab_size))
        except PoolBusy:
            log.warning("grammar_compile", result="busy", grammar_id=f"{gid:016x}", **self.pool().stats())
            raise APIError(429, f"{param}: the grammar compiler is busy ({self.queue_bound} compiles waiting); "
                           "retry later", param=param, code="grammar_queue_full",
                           retry_after_s=BUSY_RETRY_AFTER_S) from None
        except OSError as exc:  # no worker process could be started (a process or memory limit)
            log.error("grammar_compile", result="no_worker", grammar_id=f"{gid:016x}", reason=str(exc))
            raise APIError(503, f"{param}: the grammar compiler could not start a worker; retry later",
                           param=param, code="service_unavailable", retry_after_s=BUSY_RETRY_AFTER_S) from None
        if refusal is not None:
            return self._refuse(gid, refusal, param, cached=False)
        log.info("grammar_compile", result="compiled", grammar_id=f"{gid:016x}")
        if self.store_bytes:
            self.prune()
        return gid

    def prune(self) -> store.Pruned:
        """The store brought back within ``store_bytes``, sparing the grammars requests use."""
        try:
            pruned = store.prune(self.ring_name, self.store_bytes, set(self.held), GRACE_S)
        except OSError as exc:  # the folder unreadable: the request was compiled and goes on; said
            log.warning("grammar store not pruned", error=str(exc))
            return store.Pruned(0, 0, 0, 0)
        if pruned.removed or pruned.kept:
            log.info("grammar_store_pruned", removed=pruned.removed, freed_bytes=pruned.freed,
                     store_bytes=pruned.left, limit_bytes=self.store_bytes, kept=pruned.kept)
        return pruned

    def release(self, gids: list[int]) -> None:
        """What a request's compiles took (``REQUEST_HOLDS``), given back at its end: the engine loads a request's
        grammar when it admits it, which may be after a restart, so the request holds it all its life."""
        self.held -= collections.Counter(gids)  # a Counter's difference keeps the ids still held

    async def refresh(self) -> None:
        """Every ``REFRESH_S``, mark the grammars this gateway's requests hold as used, so that no other gateway
        of the ring prunes them (a grammar pruned meanwhile, which should not happen, is left to be compiled
        again by the next request that asks for it)."""
        while True:
            await asyncio.sleep(REFRESH_S)
            for gid in list(self.held):
                try:
                    store.touch(self.ring_name, gid)
                except OSError as exc:  # the store's folder unreadable: said, and tried again next time
                    log.warning("grammar store not refreshed", grammar_id=f"{gid:016x}", error=str(exc))

    def _refuse(self, gid: int, refusal: Refusal, param: str, cached: bool) -> NoReturn:
        log.info("grammar_compile", result="refused_cached" if cached else "refused", grammar_id=f"{gid:016x}",
                 reason=refusal.keyword)
        if refusal.final and not cached:
            self._refused[gid] = refusal
            while len(self._refused) > MAX_REFUSALS_KEPT:
                self._refused.popitem(last=False)
        raise APIError(400, f"{param}: {refusal.message}", param=f"{param}.{refusal.keyword}" if refusal.keyword
                       else param, code="unsupported_value")

    def pool(self) -> GrammarPool:
        if self._pool is None:
            self._pool = GrammarPool(self.texts()[0], self.ring_name, workers=self.workers,
                                     queue_bound=self.queue_bound)
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
