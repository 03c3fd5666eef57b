"""bench/roofline.py without a GPU: its plot from a result file (what `--plot-only` draws)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _row(model: str, batch: int, ctx: int, ms: float, floor: float) -> dict:
    return {"model": model, "phase": "decode", "batch": batch, "context": ctx, "tokens": batch, "ms": ms,
            "floor_ms": floor}


def test_plot_only_draws_the_decode_rows_of_a_result_file(tmp_path: Path) -> None:
    """The plot is made from the file alone (no CUDA), one panel per model, and a PNG comes out; prefill rows
    are not decode rows and are left out rather than breaking the panels."""
    pytest.importorskip("matplotlib")
    result = {"device": "test", "hbm_gbps_measured": 4000.0, "rows": [
        _row("llama3-8b-shape", 1, 512, 4.75, 3.53), _row("llama3-8b-shape", 64, 512, 6.27, 4.52),
        _row("llama3-8b-shape", 1, 2048, 4.86, 3.58), _row("qwen3-30b-a3b-shape", 64, 512, 18.4, 14.7),
        {"model": "llama3-8b-shape", "phase": "prefill", "batch": 1, "context": 512, "tokens": 512, "ms": 12.9,
         "floor_ms": 9.3}]}
    out = tmp_path / "roofline.json"
    out.write_text(json.dumps(result))
    png = tmp_path / "roofline.png"
    res = subprocess.run([sys.executable, "bench/roofline.py", "--out", str(out), "--plot", str(png), "--plot-only"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(out.read_text()) == result  # drawing leaves the file as it was
