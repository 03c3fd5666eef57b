"""The persistent backend's lifecycle with the product's liveness defaults (issue 48), on a GPU host:

- ``test_lifecycle_heavy_cotenant_no_liveness_failures``: streams for ``LIFECYCLE_LOAD_S`` (120 s) beside the heavy
  co-tenant of ``bench/interfere.py`` (churn, three workers a core, every allowed core); no request may fail
  for liveness, and no engine may be taken for hung;
- ``test_lifecycle_sigstop_of_the_engine_is_replaced``: SIGSTOP of the engine's host process while streams
  run; the supervisor's verdict (``engine hung``), the spare's takeover and READY are timed (the criterion:
  READY within 10 s of the stop, ``ready_after_sigstop_s``, read from the figures).

Figures go to ``$BLINK_GPU_OUT/lifecycle_gpu.json``. Run on the GPU machine with
``PERSISTENT_K=lifecycle bash scripts/gpu_run.sh OUT persistent``. ``BLINK_LIFECYCLE_BACKEND=cpu`` runs the
same on the CPU engine (a dry run of the harness, without a GPU).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from harness.serve_proc import MODEL, ServeProc, http_get, new_ready_engine, ring_engine_pid

OUT = Path(os.environ.get("BLINK_GPU_OUT", "/tmp/blink-gpu-out"))
BACKEND = os.environ.get("BLINK_LIFECYCLE_BACKEND", "persistent")
LOAD_S = float(os.environ.get("LIFECYCLE_LOAD_S", "120"))
LIVENESS_ERRORS = ("the engine stopped responding", "the engine is not running", "the model is loading")
LIMIT_S = 300.0  # guards against waiting for ever only


def serve_args(tmp: Path) -> tuple[tuple[str, ...], str]:
    """The server's flags and the model name its requests use."""
    if BACKEND == "cpu":
        return ("--backend", "cpu", "--num-slots", "16", "--max-prompt-tokens", "64", "--max-output-tokens",
                "256"), MODEL
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from dpu_tokenizer.fetch_assets import default_assets_dir
    from harness.models import build_model_folder

    try:
        model = build_model_folder("tiny", default_assets_dir(), tmp / "model")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return ("--backend", "persistent", "--model", str(model), "--random-weights", "--dtype", "float32",
            "--served-model-name", "tiny", "--num-slots", "64", "--max-prompt-tokens", "64",
            "--max-output-tokens", "2048", "--max-batch", "8", "--kv-blocks", "2048", "--block-size", "16"), "tiny"


async def stream_once(session: aiohttp.ClientSession, url: str, model: str, max_tokens: int) -> str | None:
    """One streamed completion; None when it finished, else its error text."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "temperature": 0}
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            text = (await resp.read()).decode(errors="replace")
    except aiohttp.ClientError as exc:
        return repr(exc)
    if resp.status != 200 or '"error"' in text or "[DONE]" not in text:
        return f"{resp.status}: {text[-300:]}"
    return None


async def closed_loops(url: str, model: str, streams: int, until: float, max_tokens: int) -> list[str | None]:
    outcomes: list[str | None] = []

    async def loop() -> None:
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < until:
                outcomes.append(await stream_once(session, url, model, max_tokens))

    await asyncio.gather(*(loop() for _ in range(streams)))
    return outcomes


def log_events(serve: ServeProc, event: str) -> list[dict[str, Any]]:
    out = []
    for line in serve.log_path.read_text(errors="replace").splitlines():
        if f'"event": "{event}"' in line and line.lstrip().startswith("{"):
            out.append(json.loads(line[line.index("{"):]))
    return out


def events_between(serve: ServeProc, start: float, end: float) -> list[tuple[float, str, str]]:
    """Every log event of the server's processes from ``start`` to ``end`` (epoch seconds): (seconds after
    ``start``, service, event), where the time of a replacement goes."""
    out = []
    for line in serve.log_path.read_text(errors="replace").splitlines():
        if '"timestamp"' not in line or "{" not in line:
            continue
        try:
            entry = json.loads(line[line.index("{"):])
            at = datetime.datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00")).timestamp()
        except (ValueError, KeyError, TypeError):
            continue
        if start <= at <= end:
            out.append((round(at - start, 2), str(entry.get("service")), str(entry.get("event"))))
    return out


def record(name: str, figures: dict[str, Any]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "lifecycle_gpu.json"
    runs = json.loads(path.read_text()) if path.exists() else {}
    runs[name] = {**figures, "backend": BACKEND, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    path.write_text(json.dumps(runs, indent=1) + "\n")


def test_lifecycle_heavy_cotenant_no_liveness_failures(tmp_path: Path) -> None:
    from bench.interfere import Interference

    args, model = serve_args(tmp_path)
    serve = ServeProc(args, tmp_path).start(LIMIT_S)
    try:
        with Interference(kinds=("churn",), per_core=3, block_kb=384) as co:
            outcomes = asyncio.run(closed_loops(serve.url, model, 16, time.monotonic() + LOAD_S, 256))
        errors = [o for o in outcomes if o is not None]
        liveness = [e for e in errors if any(text in e for text in LIVENESS_ERRORS)]
        hung = log_events(serve, "engine hung: killed, to be replaced")
        record("heavy_cotenant", {"load_s": LOAD_S, "requests": len(outcomes), "errors": len(errors),
                                  "liveness_failures": len(liveness), "engines_taken_for_hung": len(hung),
                                  "co_tenant": co.report, "first_errors": errors[:5]})
    finally:
        serve.stop()
    assert liveness == [] and hung == [], (liveness[:5], hung)


def test_lifecycle_sigstop_of_the_engine_is_replaced(tmp_path: Path) -> None:
    args, model = serve_args(tmp_path)
    serve = ServeProc(args, tmp_path).start(LIMIT_S)  # returns once the standby engine is ready too
    try:
        old = ring_engine_pid(serve.ring)
        assert old is not None
        loads = asyncio.run(closed_loops(serve.url, model, 4, time.monotonic() + 3, 64))
        assert all(o is None for o in loads), loads
        stopped_at = time.time()
        os.kill(old, signal.SIGSTOP)
        end = time.monotonic() + LIMIT_S
        while (new := new_ready_engine(serve.ring, old)) is None:
            assert time.monotonic() < end, serve.log_tail()
            time.sleep(0.05)
        ready_at = time.time()
        while http_get(serve.url + "/health")[0] != 200:
            assert time.monotonic() < end, serve.log_tail()
            time.sleep(0.05)
        verdict = log_events(serve, "engine hung: killed, to be replaced")[0]
        verdict_at = datetime.datetime.fromisoformat(verdict["timestamp"].replace("Z", "+00:00")).timestamp()
        figures = {"verdict_after_sigstop_s": round(verdict_at - stopped_at, 2),
                   "ready_after_verdict_s": round(ready_at - verdict_at, 2),
                   "ready_after_sigstop_s": round(ready_at - stopped_at, 2), "verdict": verdict,
                   "took_over": bool(log_events(serve, "standby engine took over")), "new_engine": new,
                   "events_after_sigstop": events_between(serve, stopped_at, ready_at)[:80]}
        record("sigstop", figures)
        assert asyncio.run(closed_loops(serve.url, model, 2, time.monotonic() + 2, 16)).count(None) >= 1
    finally:
        serve.stop()
    # the 10 s bound (READY within 10 s of the stop) is read from the figures, not asserted: timings vary
    assert figures["took_over"], figures
