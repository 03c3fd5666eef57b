"""Paged KV cache storage and the block allocator that hands out its blocks."""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np
import torch


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
    """Hands out cache block ids ``0 .. num_blocks-1``; all-or-nothing allocation, double frees detected."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self._total = num_blocks
        # Popped from the end, so low ids go out first.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used = [False] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_total(self) -> int:
        return self._total

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks, or raise ``NoFreeBlocks`` and take none."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise NoFreeBlocks(f"requested {n} blocks, {len(self._free)} free of {self._total}")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self._used[b] = True
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Return blocks; raises ``ValueError`` (freeing none of them) on an unknown or already-free id."""
        seen: set[int] = set()
        for b in blocks:
            if not 0 <= b < self._total:
                raise ValueError(f"block {b} out of range 0..{self._total - 1}")
            if not self._used[b] or b in seen:
                raise ValueError(f"double free of block {b}")
            seen.add(b)
        for b in blocks:
            self._used[b] = False
            self._free.append(b)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor; on the CPU from ``calloc``ed memory, so a page becomes resident only once written
    (the cache's resident size follows the blocks in use, not ``num_blocks``)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class KVCache:
    """Per layer ``k[i]`` / ``v[i]`` tensors of shape [num_blocks, block_size, num_kv_heads, head_dim].

    Token at position p of a sequence lives in block ``block_table[p // block_size]`` at offset
    ``p % block_size``; its flat slot is ``block * block_size + offset``. ``allocator`` manages the blocks.
    """

    def __init__(self, config: KVShape, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.k = [_zeros(shape, dtype, device) for _ in range(config.num_layers)]
        self.v = [_zeros(shape, dtype, device) for _ in range(config.num_layers)]
        self.allocator = BlockAllocator(num_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks required to hold ``num_tokens`` tokens of one sequence."""
        return -(-num_tokens // self.block_size)
