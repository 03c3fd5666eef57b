"""Shared fixtures: unique ring names, cleanup of shared memory, CUDA detection."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from shared.transport import SHM_DIR


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def ring_name() -> Iterator[str]:
    """A fresh segment name; whatever is left under it is removed afterwards."""
    name = f"blink-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    (SHM_DIR / name).unlink(missing_ok=True)
