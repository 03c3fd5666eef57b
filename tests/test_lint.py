"""Style gates that run with the test suite: ruff, mypy (started in the background: conftest) and clang-format."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.background import MYPY, Background

ROOT = Path(__file__).resolve().parent.parent
CPP_DIRS = ("gpu_engine/csrc", "tests/cpp", "bench/csrc")


def _tool(name: str) -> str:
    exe = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if exe is None:
        pytest.fail(f"{name} not installed: pip install -e '.[dev]'")
    return exe


def test_ruff() -> None:
    out = subprocess.run([_tool("ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_mypy(background_checks: Background) -> None:
    """The same ``mypy`` run as ever, started in the background when the session began (it takes minutes
    and needs nothing from the other tests): this test waits for its exit status and output."""
    code, out = background_checks.result(MYPY)
    assert code == 0, out


def test_clang_format() -> None:
    files = [str(p) for d in CPP_DIRS for p in sorted((ROOT / d).glob("**/*"))
             if p.suffix in (".cu", ".cuh", ".cpp", ".h") and "generated" not in p.parts]
    if not files:
        pytest.skip("no C++ sources")
    out = subprocess.run([_tool("clang-format"), "--dry-run", "--Werror", *files], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]
