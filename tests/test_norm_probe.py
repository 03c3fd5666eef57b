"""scripts/norm_probe.py without a GPU: each of its forms of the tiled loop (the fused RMSNorm's halves, the whole,
and the norm's weight folded into w with 1 / RMS from a prologue) gives its reference's product in the interpreter,
so that the GPU run times forms that compute what they claim."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_form_of_the_norm_probe_matches_its_reference() -> None:
    res = subprocess.run([sys.executable, "scripts/norm_probe.py", "--check-only", "--device", "cpu", "--dtype",
                          "float32", "--shape", "64,256", "--config", "n32_k128_s4", "--rows", "1,3"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [r["rows"] for r in rows] == [1, 3]
    for r in rows:
        assert set(r["errors"]) == {"plain", "weight", "squares", "both", "prologue", "dotsq", "both_dot", "fold_dot"}
        assert max(r["errors"].values()) < 1e-5, r
