"""Soak ``blink serve`` (real CPU engine) at 80 % of its measured saturation, 10 % of clients hanging up.

Every completed request must equal its greedy reference run alone (text and token strings), slot,
running and KV gauges must return to their start, no process may restart, and the resident memory of
every process must stay flat after warm-up. The logic and the figures are ``bench/soak.py``; the CI
version loads the server for about two minutes, the ``slow`` one for twenty (its recorded summary is
``bench/results/soak_cpu_20min.json``, from ``python -m bench.soak --duration-s 1200 --level-s 8``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.soak import SoakConfig, run_soak


def check(summary: dict) -> None:
    brief = {k: summary[k] for k in ("saturation", "target_rate_rps", "requests", "latency_s", "gauges", "rss")}
    print("\nsoak:", json.dumps(brief))
    assert summary["passed"], summary["violations"]
    req = summary["requests"]
    assert req["failed"] == 0 and req["mismatched"] == 0
    assert req["completed"] + req["disconnected"] == req["sent"]
    assert req["disconnected"] >= 1 and req["completed"] >= 50, req


def test_soak_two_minutes(tmp_path: Path) -> None:
    check(run_soak(SoakConfig(duration_s=80, level_s=3, warmup_s=20), tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_soak_twenty_minutes(tmp_path: Path) -> None:
    check(run_soak(SoakConfig(duration_s=1200, level_s=8, warmup_s=60), tmp_path))
