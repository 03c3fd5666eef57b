"""5,000 requests through the whole frontend: the persistent scheduler against the host-driven mode.

``blink serve`` (HTTP gateway, tokenizer, slot tracker, token reader) on a 2-layer Llama-3-shaped
model with random fp32 weights and the real Llama-3 tokenizer, first host-driven (the reference,
nothing hung up), then persistent with 10% of the clients closing their stream part way. Every other
request must return the reference's text and tokens; every hung-up one a prefix of them. Afterwards
the slot, running and KV gauges read zero, the scheduler ran through more than 100 launch windows,
gave back every KV block and saw the cancellations, and the server stops with exit code 0. One request
of 4,096 tokens crosses many windows. Needs the Llama-3 tokenizer files (``BLINK_TOKENIZER_ASSETS``,
set by ``scripts/gpu_run.sh``); marked gpu.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest
import torch
from helpers.http_jobs import HttpJob, HttpResult, compare, engine_events, http_jobs, run_jobs, settled_gauges

from dpu_tokenizer.fetch_assets import default_assets_dir
from harness.models import build_model_folder
from harness.serve_proc import ServeProc

pytestmark = pytest.mark.gpu
SERVED = "tiny"
ARGS = ("--dtype", "float32", "--num-slots", "256", "--max-prompt-tokens", "256", "--max-output-tokens", "4352",
        "--max-batch", "64", "--kv-blocks", "6000", "--block-size", "16", "--served-model-name", SERVED,
        "--random-weights", "--no-standby-engine")
OUT = Path(os.environ.get("BLINK_GPU_OUT", "/tmp/blink-gpu-out"))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    try:
        return build_model_folder("tiny", default_assets_dir(), tmp_path_factory.mktemp("frontend_5k"))
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def serve_all(model: Path, backend: str, jobs: list[HttpJob], root: Path) -> tuple[dict[int, HttpResult], dict]:
    serve = ServeProc((*ARGS, "--backend", backend, "--model", str(model)), root).start(timeout_s=300)
    try:
        t0 = time.monotonic()
        results = run_jobs(serve.url, SERVED, jobs, in_flight=64)
        elapsed = time.monotonic() - t0
        gauges = settled_gauges(serve)
    finally:
        code = serve.stop()
    return results, {"gauges": gauges, "exit_code": code, "log": serve.log_path, "elapsed_s": round(elapsed, 2)}


def test_5000_requests_through_the_frontend(model: Path, tmp_path: Path) -> None:
    jobs = http_jobs(5000, seed=4, max_prompt=160, max_new=96, cancel_frac=0.1, ids=(300, 20000))
    jobs.append(HttpJob(10_000, jobs[0].prompt[:8], 4096))
    reference = [dataclasses.replace(j, hang_up_after=None) for j in jobs]
    host, host_info = serve_all(model, "host", reference, tmp_path / "host")
    assert not compare(reference, host, host)[:5]
    pers, info = serve_all(model, "persistent", jobs, tmp_path / "persistent")
    assert not compare(jobs, pers, host)[:5]
    assert len(pers[10_000].tokens) == 4096
    hung_up = sum(r.finish is None for r in pers.values())
    assert hung_up >= 100, hung_up
    for run in (host_info, info):
        assert all(v == 0 for v in run["gauges"].values()), run["gauges"]
        assert run["exit_code"] == 0
    (stats,) = engine_events(info["log"], "scheduler exited")
    (cache,) = engine_events(info["log"], "KV cache")
    print(f"\nscheduler: {stats}")
    OUT.mkdir(parents=True, exist_ok=True)
    summary = {"requests": len(jobs), "hung_up": hung_up, "tokens": sum(len(r.tokens) for r in pers.values()),
               "persistent_s": info["elapsed_s"], "host_s": host_info["elapsed_s"], "scheduler": stats}
    (OUT / "persistent_frontend_5k.json").write_text(json.dumps(summary))
    # chunked prefill carries prompts in the decode steps: fewer launches than one step per prefill
    assert stats["windows"] > 50 and stats["kv_free"] == cache["blocks"]
    assert stats["cancels"] >= 1 and stats["launch_failures"] == 0
