"""``bench.real_weights`` on the CPU backend (the GPU runs use the same code): in fp32 the embedded model's greedy
answers through ``blink serve`` are transformers' own; in bf16 the log-probs of the tokens Blink chose stay within
the bf16 bound against transformers fp32 teacher-forced on them (max(1e-2, 1.25x transformers bf16's own error))."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(tmp_path: Path, dtype: str, prompts: int, tokens: int) -> dict:
    out = tmp_path / f"rw_{dtype}.json"
    done = subprocess.run([sys.executable, "-m", "bench.real_weights", "--backends", "cpu", "--dtype", dtype,
                           "--prompts", str(prompts), "--max-tokens", str(tokens), "--out", str(out),
                           "--log-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())["backends"]["cpu"]


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_real_weights_on_the_cpu_backend(tmp_path: Path, dtype: str) -> None:
    got = run(tmp_path, dtype, 4, 12)
    assert got["prompts"] == 4
    if dtype == "float32":
        assert got["identical"] == 4 and "bound" not in got
        return
    bound = got["bound"]
    assert bound["positions"] >= 4 and bound["within"], bound
    assert bound["transformers_bf16_max_logprob_err"] > 0  # bf16 rounding did move transformers' own log-probs
