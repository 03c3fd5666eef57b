"""Paged KV cache storage and the block allocator that hands out its blocks."""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np
import torch

from gpu_engine.prefix_cache import PrefixCache


class KVShape(Protocol):
    """What the cache needs to know of a model (``models.config.ModelConfig`` has it): the cache sits
    below the models, which write into it, so it names only these three numbers."""

    @property
    def num_layers(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


class NoFreeBlocks(Exception):
    """Raised by ``BlockAllocator.allocate`` when the request cannot be met (nothing is allocated)."""


class BlockAllocator:
    """Hands out cache block ids ``0 .. num_blocks-1`` with reference counts; all-or-nothing allocation,
    double frees detected.

    A block is held (reference count > 0: in some request's block table), idle-cached (count 0, its
    content registered in ``cache``, the prefix cache's index, and findable until evicted) or unused.
    ``num_free`` counts the last two: an allocation takes unused blocks first (low ids first), then
    evicts idle-cached ones, least recently used first. Without registrations (prefix caching off) no
    block is ever idle-cached and this is a plain free list.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self._total = num_blocks
        # Popped from the end, so low ids go out first.
        self._unused = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self.cache = PrefixCache()

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: unused plus idle-cached (evictable)."""
        return len(self._unused) + self.cache.num_idle

    @property
    def num_total(self) -> int:
        return self._total

    @property
    def num_held(self) -> int:
        """Blocks with a reference count above 0 (``num_held + num_free == num_total`` always)."""
        return self._total - self.num_free

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` fresh blocks (count 1 each), or raise ``NoFreeBlocks`` and take none."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise NoFreeBlocks(f"requested {n} blocks, {self.num_free} free of {self._total}")
        blocks = [self._unused.pop() if self._unused else self.cache.evict() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """One more holder for each of ``blocks`` (cached blocks found by the prefix cache); an idle one
        leaves the LRU, so an allocation cannot evict it."""
        for b in blocks:
            if not self.cache.holds(b):
                raise ValueError(f"block {b} is not cached: only cached blocks are shared")
        for b in blocks:
            if self._refs[b] == 0:
                self.cache.unpark(b)
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        """One holder fewer for each block; raises ``ValueError`` (changing nothing) on an unknown id or
        one freed more often than it is held. A block whose count reaches 0 keeps its content when it is
        cached (idle-cached, the tail of ``blocks`` first in the LRU, so a prefix outlives its extensions),
        else it is unused again."""
        seen: dict[int, int] = {}
        for b in blocks:
            if not 0 <= b < self._total:
                raise ValueError(f"block {b} out of range 0..{self._total - 1}")
            seen[b] = seen.get(b, 0) + 1
            if seen[b] > self._refs[b]:
                raise ValueError(f"double free of block {b}")
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0 and not self.cache.holds(b):
                self._unused.append(b)
        for b in reversed(blocks):
            if self._refs[b] == 0 and self.cache.holds(b) and not self.cache.is_idle(b):
                self.cache.park(b)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor; on the CPU from ``calloc``ed memory, so a page becomes resident only once written
    (the cache's resident size follows the blocks in use, not ``num_blocks``)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def block_bytes(config: KVShape, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block over every layer, keys and values (an FP8 block half a bf16 one's)."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize * block_size


class KVCache:
    """Per layer ``k[i]`` / ``v[i]`` tensors of shape [num_blocks, block_size, num_kv_heads, head_dim].

    Token at position p of a sequence lives in block ``block_table[p // block_size]`` at offset
    ``p % block_size``; its flat slot is ``block * block_size + offset``. ``allocator`` manages the blocks.

    An FP8 cache (``torch.float8_e4m3fn``, ``--kv-cache-dtype fp8``) has a scale a layer for its keys and one for
    its values (``kv_scale(i)``), 1.0 each: vLLM's default without calibration. e4m3 keeps 3 significand bits from
    2^-6 to 448, so a scale of 1 stores keys and values of the usual sizes (a few units to a few tens) at full
    relative precision and saturates only past 448; the kernels take any other positive scale.
    """

    def __init__(self, config: KVShape, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.block_size = block_size
        self.dtype = dtype
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.hold([_zeros(shape, dtype, device) for _ in range(config.num_layers)],
                  [_zeros(shape, dtype, device) for _ in range(config.num_layers)])
        self.k_scale = [1.0] * config.num_layers
        self.v_scale = [1.0] * config.num_layers

    def hold(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """Take per-layer key and value tensors of [num_blocks, block_size, Hkv, D] as the cache, every block free."""
        self.k, self.v = k, v
        self.num_blocks = int(k[0].shape[0])
        self.allocator = BlockAllocator(self.num_blocks)

    def kv_scale(self, layer: int) -> tuple[float, float]:
        """Layer ``layer``'s (key scale, value scale): what an FP8 cache's codes are multiplied by when read."""
        return self.k_scale[layer], self.v_scale[layer]

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks required to hold ``num_tokens`` tokens of one sequence."""
        return -(-num_tokens // self.block_size)


def fp8_cache_runs_on(capability: tuple[int, int]) -> None:
    """An FP8 (e4m3) KV cache needs an sm_89 GPU or later (the kernels' e4m3 conversions); ValueError, at the
    engine's start, on an older one."""
    if capability < (8, 9):
        raise ValueError(f"--kv-cache-dtype fp8 needs an sm_89 GPU or later (e4m3 conversions); this one is "
                         f"sm_{capability[0]}{capability[1]}: drop the flag")
