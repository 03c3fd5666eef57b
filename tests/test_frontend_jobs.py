"""The HTTP job driver of the GPU frontend tests, on the CPU engine: references, hang-ups, prefixes.

``tests/persistent/test_frontend_5k.py`` compares the persistent scheduler with the host-driven mode
through the whole frontend with this driver; here the same driver runs against one CPU ``blink serve``
(embedded SmolLM2), so that what it checks is known to hold and to be checked.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from helpers.http_jobs import HttpJob, HttpResult, compare, http_jobs, run_jobs, settled_gauges

from harness.serve_proc import MODEL, ServeProc

ARGS = ("--max-output-tokens", "64", "--max-prompt-tokens", "32", "--num-slots", "16", "--no-standby-engine")


def test_jobs_with_hang_ups_match_their_references(tmp_path: Path) -> None:
    jobs = http_jobs(40, seed=3, max_prompt=24, max_new=12, cancel_frac=0.3, ids=(300, 20000))
    jobs.append(HttpJob(1000, jobs[0].prompt[:4], 64))
    reference = [dataclasses.replace(j, hang_up_after=None) for j in jobs]
    serve = ServeProc(ARGS, tmp_path).start()
    try:
        ref = run_jobs(serve.url, MODEL, reference, in_flight=8)
        got = run_jobs(serve.url, MODEL, jobs, in_flight=8)
        gauges = settled_gauges(serve)
    finally:
        code = serve.stop()
    assert not compare(reference, ref, ref)  # every reference finished with all its tokens
    assert not compare(jobs, got, ref)
    hung_up = [j.rid for j in jobs if got[j.rid].finish is None]
    assert hung_up and all(jobs[k].hang_up_after is not None for k in hung_up)
    assert len(got[1000].tokens) == 64
    assert all(v == 0 for v in gauges.values()), gauges
    assert code == 0


def test_a_wrong_output_is_reported() -> None:
    jobs = [HttpJob(0, (5,), 2), HttpJob(1, (6,), 2, hang_up_after=1)]
    ref = {0: HttpResult("ab", ("a", "b"), "length"), 1: HttpResult("cd", ("c", "d"), "length")}
    assert not compare(jobs, ref, ref)
    got = {0: HttpResult("ax", ("a", "x"), "length"), 1: HttpResult("d", ("d",), None)}
    assert len(compare(jobs, got, ref)) == 2
