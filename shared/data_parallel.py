"""Data parallelism on one host: how N engines, each with its own ring, are named and placed.

``blink serve --data-parallel-size N`` starts N engines. Engine ``i`` creates the ring
``engine_ring_names(base, N)[i]``; every frontend service is given the base name and N and derives the
same names, so no list of names travels between processes. With N = 1 the one ring keeps the base
name, so a single-engine server is named as before.
"""

from __future__ import annotations

import dataclasses

MAX_DATA_PARALLEL = 64


def check_size(size: int) -> int:
    if not 1 <= size <= MAX_DATA_PARALLEL:
        raise ValueError(f"--data-parallel-size must be in [1, {MAX_DATA_PARALLEL}], got {size}")
    return size


def engine_ring_names(base: str, size: int) -> tuple[str, ...]:
    """The ring of each engine: ``base`` alone for one engine, ``base-dp0`` ... ``base-dpN-1`` for more."""
    check_size(size)
    if size == 1:
        return (base,)
    return tuple(f"{base}-dp{i}" for i in range(size))


def engine_devices(size: int, visible: str | None) -> tuple[str, ...]:
    """``CUDA_VISIBLE_DEVICES`` for each engine: the i-th of the devices this process may use (its own
    ``CUDA_VISIBLE_DEVICES``, else 0 .. N-1), so that each engine sees one GPU as ``cuda:0``."""
    check_size(size)
    if visible is None or not visible.strip():
        return tuple(str(i) for i in range(size))
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    if len(devices) < size:
        raise ValueError(f"--data-parallel-size {size} needs {size} GPUs, but CUDA_VISIBLE_DEVICES={visible!r} "
                         f"names {len(devices)}")
    return tuple(devices[:size])


@dataclasses.dataclass(frozen=True, slots=True)
class DataParallelConfig:
    """The serve-level data-parallel settings: how many engines, and the base name of their rings."""

    size: int
    base_ring: str

    def __post_init__(self) -> None:
        check_size(self.size)
        if not self.base_ring:
            raise ValueError("--ring must not be empty")

    @property
    def ring_names(self) -> tuple[str, ...]:
        return engine_ring_names(self.base_ring, self.size)

    def engine_name(self, i: int) -> str:
        """The engine's name among the supervisor's children and in logs: ``engine`` alone, else ``engine-I``."""
        return "engine" if self.size == 1 else f"engine-{i}"
