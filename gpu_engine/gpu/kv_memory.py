"""A GPU KV cache whose size is chosen after the graphs are captured.

The graphs hold the cache tensors' addresses, and the graphs' own memory (their executables, about 4 KiB a kernel
node an instantiation, outside torch's allocator) is only known once they exist. So each layer's key and value
tensor lies in a virtual address range reserved at the start (`cuMemAddressReserve`, large enough for the whole
free memory), backed at first by one allocation granule (the capture's warm-ups and graphs write no slot: padding
slots are -1), and backed up to its final size after the capture (`cuMemCreate` + `cuMemMap`), at the same
addresses the graphs hold. `--gpu-memory-utilization` is then a fraction of what the weights, the step buffers and
the graphs left (`blocks_after_capture`).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from gpu_engine.kv_cache import KVCache, KVShape


def _driver() -> Any:
    from cuda.bindings import driver

    return driver


def _ok(result: Any, what: str) -> Any:
    """A driver call's value; a failure raises, out of memory as torch's OutOfMemoryError (the start's message)."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        d = _driver()
        if err == d.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            raise torch.cuda.OutOfMemoryError(f"{what}: CUDA_ERROR_OUT_OF_MEMORY")
        raise RuntimeError(f"{what} failed: {err}")
    return rest[0] if len(rest) == 1 else None


class _Span:
    """A device byte range as `__cuda_array_interface__`, for `torch.as_tensor` (no copy, memory not owned)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


@dataclass
class ReservedSpace:
    """`count` virtual ranges of `stride` bytes each, one reservation; each range backed from its start by the
    chunks `map_to` adds (every range alike)."""

    count: int
    stride: int
    granule: int
    device: int
    base: int = 0
    mapped: int = 0  # bytes backed at the start of each range
    chunks: list[tuple[int, int, Any]] = field(default_factory=list)  # (address, bytes, allocation handle)

    @classmethod
    def reserve(cls, count: int, bytes_each: int, device: int) -> ReservedSpace:
        d = _driver()
        prop = cls._prop(device)
        granule = int(_ok(d.cuMemGetAllocationGranularity(
            prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "granularity"))
        stride = -(-max(bytes_each, 1) // granule) * granule
        base = int(_ok(d.cuMemAddressReserve(count * stride, granule, 0, 0), "cuMemAddressReserve"))
        return cls(count, stride, granule, device, base)

    @staticmethod
    def _prop(device: int) -> Any:
        d = _driver()
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        return prop

    def map_to(self, nbytes: int) -> None:
        """Back the first `nbytes` (rounded up to the granule) of every range; the new bytes read as zero."""
        nbytes = -(-nbytes // self.granule) * self.granule
        if nbytes > self.stride:
            raise ValueError(f"{nbytes} bytes a range past the {self.stride} reserved")
        if nbytes <= self.mapped:
            return
        d, grow = _driver(), nbytes - self.mapped
        prop = self._prop(self.device)
        access = d.CUmemAccessDesc()
        access.location = prop.location
        access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        added = len(self.chunks)
        try:
            for i in range(self.count):
                addr = self.base + i * self.stride + self.mapped
                handle = _ok(d.cuMemCreate(grow, prop, 0), "cuMemCreate")
                try:
                    _ok(d.cuMemMap(d.CUdeviceptr(addr), grow, 0, handle, 0), "cuMemMap")
                except BaseException:
                    d.cuMemRelease(handle)
                    raise
                self.chunks.append((addr, grow, handle))
                _ok(d.cuMemSetAccess(d.CUdeviceptr(addr), grow, [access], 1), "cuMemSetAccess")
                _ok(d.cuMemsetD8(d.CUdeviceptr(addr), 0, grow), "cuMemsetD8")
        except BaseException:  # every range as it was: what this call mapped given back
            self._unmap(self.chunks[added:])
            del self.chunks[added:]
            raise
        torch.cuda.synchronize(self.device)  # the zeros (legacy stream) in place before any other stream's work
        self.mapped = nbytes

    def tensor(self, i: int, nbytes: int) -> torch.Tensor:
        """Bytes [0, nbytes) of range `i` as a uint8 tensor (they must be backed)."""
        if not 0 <= i < self.count or nbytes > self.mapped:
            raise ValueError(f"range {i}, {nbytes} bytes: {self.count} ranges of {self.mapped} backed bytes")
        return torch.as_tensor(_Span(self.base + i * self.stride, nbytes), device=f"cuda:{self.device}")

    @staticmethod
    def _unmap(chunks: list[tuple[int, int, Any]]) -> None:
        d = _driver()
        for addr, nbytes, handle in chunks:
            d.cuMemUnmap(d.CUdeviceptr(addr), nbytes)
            d.cuMemRelease(handle)

    def release(self) -> None:
        """Unmap and free everything (nothing may use the tensors after this)."""
        d = _driver()
        self._unmap(self.chunks)
        self.chunks.clear()
        if self.base:
            d.cuMemAddressFree(d.CUdeviceptr(self.base), self.count * self.stride)
        self.base = self.mapped = 0


def blocks_after_capture(free_bytes: int, backed_bytes: int, fraction: float, tensors: int, granule: int,
                         tensor_block_bytes: int) -> int:
    """The cache's blocks by `--gpu-memory-utilization`: `fraction` of the memory free once the graphs exist (the
    bytes the cache already holds counted in), split over its `tensors` ranges and rounded down to whole granules,
    so the backed memory stays within the fraction."""
    per_tensor = int((free_bytes + backed_bytes) * fraction) // tensors // granule * granule
    return per_tensor // tensor_block_bytes


class GrowableKVCache(KVCache):
    """`KVCache` on the GPU in reserved ranges: a granule's blocks until `grow_to` backs the final size.

    Its tensors are rebuilt at every growth (same addresses, more blocks); the runner reads them through the cache
    (`kv.k[i]`), so graphs captured before the growth read and write the grown cache.
    """

    def __init__(self, config: KVShape, block_size: int, dtype: torch.dtype, reserve_bytes: int,
                 device: int | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size ({block_size}) must be positive")
        self.block_size, self.dtype = block_size, dtype
        self.tail = (block_size, config.num_kv_heads, config.head_dim)
        self.tensor_block_bytes = math.prod(self.tail) * dtype.itemsize  # one block of one layer's keys
        self.layers = config.num_layers
        dev = torch.cuda.current_device() if device is None else device
        self.space = ReservedSpace.reserve(2 * self.layers, reserve_bytes // (2 * self.layers), dev)
        self._finalizer = weakref.finalize(self, ReservedSpace.release, self.space)
        self._finalizer.atexit = False  # at exit the process gives it back: never under a kernel still running
        self.k_scale = [1.0] * self.layers
        self.v_scale = [1.0] * self.layers
        self.max_blocks = self.space.stride // self.tensor_block_bytes
        if self.max_blocks <= 0:
            raise ValueError(f"{reserve_bytes} bytes hold no block of {self.block_bytes} bytes")
        self.grow_to(max(1, self.space.granule // self.tensor_block_bytes))

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer, keys and values."""
        return 2 * self.layers * self.tensor_block_bytes

    @property
    def backed_bytes(self) -> int:
        """Device memory the cache holds now."""
        return 2 * self.layers * self.space.mapped

    def blocks_for(self, fraction: float, free_bytes: int) -> int:
        """The blocks `fraction` of `free_bytes` and this cache's memory hold, at most the reserved ones."""
        blocks = blocks_after_capture(free_bytes, self.backed_bytes, fraction, 2 * self.layers, self.space.granule,
                                      self.tensor_block_bytes)
        return min(blocks, self.max_blocks)

    def grow_to(self, num_blocks: int) -> None:
        """Back `num_blocks` blocks (at least those already in use: the allocator starts over, empty)."""
        if not 0 < num_blocks <= self.max_blocks:
            raise ValueError(f"{num_blocks} KV blocks: the reserved ranges hold 1..{self.max_blocks}")
        self.space.map_to(num_blocks * self.tensor_block_bytes)
        n = num_blocks * self.tensor_block_bytes
        views = [self.space.tensor(i, n).view(self.dtype).view(num_blocks, *self.tail) for i in range(2 * self.layers)]
        self.hold(views[: self.layers], views[self.layers:])

    def close(self) -> None:
        """Give the memory back now (the tensors must not be used after)."""
        self._finalizer()
