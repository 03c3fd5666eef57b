"""bench/real_weights: its fixed prompts, and (slow) the whole comparison through the CPU engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import real_weights

ROOT = Path(__file__).resolve().parent.parent


def test_at_least_fifty_distinct_fixed_prompts() -> None:
    texts = real_weights.prompt_texts(64)
    assert len(set(texts)) == 64 and texts == real_weights.prompt_texts(64)
    with pytest.raises(SystemExit):
        real_weights.prompt_texts(10_000)


@pytest.mark.slow
def test_cpu_engine_matches_transformers_through_blink_serve(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "rw.json"
    run = subprocess.run([sys.executable, "-m", "bench.real_weights", "--backends", "cpu", "--prompts", "4",
                          "--max-tokens", "8", "--out", str(out), "--log-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result) >= {"model", "backends", "dtype"}
    assert result["backends"]["cpu"] == {"prompts": 4, "identical": 4, "mismatches": []}
