"""The prefix cache's index: full KV blocks found by a hash chained over their tokens.

A block's hash is a BLAKE2b digest (64 bits) of its ``block_size`` tokens and the hash of the block
before it, the first block's from the request's cache salt, so equal hashes mean equal token prefixes of
requests of one salt (a collision needs about 2^32 tries, and a salted tenant's blocks are out of another's
reach). ``PrefixCache`` maps hashes to block ids and keeps, least recently used first, the cached blocks
no request holds: they keep their content and stay findable until the allocator needs a block and evicts
the oldest (``gpu_engine.kv_cache.BlockAllocator`` owns the reference counts and calls it).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

MASK64 = (1 << 64) - 1


def chain_hash(prev: int, block: bytes) -> int:
    """The hash of a full block (its tokens as little-endian int32 words) after a block of hash ``prev``."""
    digest = hashlib.blake2b(prev.to_bytes(8, "little") + block, digest_size=8).digest()
    return int.from_bytes(digest, "little")


def extend_hashes(hashes: list[int], tokens: Sequence[int], block_size: int, salt: int) -> None:
    """Append to ``hashes`` (those of the first ``len(hashes)`` blocks) the hashes of the next full blocks
    of ``tokens``."""
    first, full = len(hashes), len(tokens) // block_size
    if full <= first:
        return
    words = np.asarray(tokens[first * block_size : full * block_size], dtype="<i4").tobytes()
    prev, step = hashes[-1] if hashes else salt & MASK64, 4 * block_size
    for k in range(full - first):
        prev = chain_hash(prev, words[k * step : (k + 1) * step])
        hashes.append(prev)


@dataclasses.dataclass(slots=True)
class CacheStats:
    """Counters in vLLM's sense: prompt tokens looked up at admission, those found cached, blocks evicted."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0


class PrefixCache:
    """Hash -> block for the full blocks registered so far, and the LRU of those no request holds."""

    def __init__(self) -> None:
        self._block_of: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
        self.stats = CacheStats()

    @property
    def num_idle(self) -> int:
        """Cached blocks that no request holds (evictable)."""
        return len(self._idle)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def find(self, hashes: Sequence[int]) -> list[int]:
        """The blocks of the longest run of leading ``hashes`` that are cached."""
        out: list[int] = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def holds(self, block: int) -> bool:
        return block in self._hash_of

    def is_idle(self, block: int) -> bool:
        return block in self._idle

    def register(self, block: int, h: int) -> bool:
        """Make ``block`` findable by ``h``; False (nothing changes) when another block already holds ``h``
        (two requests computed the same prefix at once: the first one's block stays the cached one)."""
        if h in self._block_of or block in self._hash_of:
            return False
        self._block_of[h], self._hash_of[block] = block, h
        return True

    def park(self, block: int) -> None:
        """A cached block's last holder let it go: it is now the most recently used idle block."""
        self._idle[block] = None

    def unpark(self, block: int) -> None:
        """An idle cached block is shared again."""
        del self._idle[block]

    def evict(self) -> int:
        """Forget the least recently used idle block and return its id (its content is now stale)."""
        block, _ = self._idle.popitem(last=False)
        del self._block_of[self._hash_of.pop(block)]
        self.stats.evictions += 1
        return block
