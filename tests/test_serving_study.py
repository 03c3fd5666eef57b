"""The serving study script (``bench/serving_study.py``).

End to end on the CPU engine: two invocations, one mode label each (both served by the CPU backend), one rate,
isolated then under interference; the second must keep the first one's runs. Nothing may be left running: no
co-tenant, no server process. The budget and drain logic run against a small fake SSE server; merging and the
table on plain documents.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from helpers.byte_tokenizer import ByteTokenizer
from helpers.procfs import processes

from bench import serve_bench as sb
from bench import serving_study as ss
from bench.workloads import WORKLOADS, Limits
from dpu_tokenizer.fetch_assets import default_assets_dir
from harness import models as hm

ROOT = Path(__file__).resolve().parents[1]
RUN_KEYS = ("mode", "interference", "rate", "completed", "failed", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
            "tpot_p99_ms", "itl_p99_ms", "req_per_s", "out_tok_per_s", "unfinished", "engine_cpu_s_per_min")


def have_llama3_assets() -> bool:
    try:
        hm.llama3_assets(default_assets_dir())
    except FileNotFoundError:
        return False
    return True


def processes_with(text: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose command line holds ``text``."""
    return [(p.pid, p.cmdline) for p in processes() if text in p.cmdline and p.state != "Z" and p.pid != os.getpid()]


def wait_none(text: str, timeout_s: float = 5.0) -> list[tuple[int, str]]:
    end = time.monotonic() + timeout_s
    while (left := processes_with(text)) and time.monotonic() < end:
        time.sleep(0.1)
    return left


# ---------------------------------------------------------------------- end to end
def run_study(tmp_path: Path, mode: str, model: str) -> tuple[dict[str, Any], str]:
    work = tmp_path / f"work-{mode}"
    cmd = [sys.executable, "-m", "bench.serving_study", "--modes", mode, "--backend-override", "cpu",
           "--model-config", model, "--tokenizer-assets", str(default_assets_dir()), "--rates", "3",
           "--duration-s", "2", "--drain-s", "20", "--warmup", "2", "--workload", "vllm", "--prompt-mean", "24",
           "--output-mean", "6", "--max-batch", "8", "--free-cores", "1", "--time-budget-s", "150",
           "--out", str(tmp_path / "serving.json"), "--plot", str(tmp_path / "serving"), "--work-dir", str(work)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        out, _ = proc.communicate(timeout=170)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-4000:]
    assert not wait_none(f"--parent-pid {proc.pid} "), "interference workers outlived the study"
    assert not wait_none(str(work)), "server processes outlived the study"
    return json.loads((tmp_path / "serving.json").read_text()), out


def check_runs(runs: list[dict[str, Any]], mode: str) -> None:
    assert [r["interference"] for r in runs] == [False, True]
    for run in runs:
        missing = [k for k in RUN_KEYS if k not in run]
        assert not missing, missing
        assert run["mode"] == mode and run["rate"] == 3.0 and run["backend"] == "cpu"
        assert run["completed"] >= 1 and run["failed"] == 0 and run["unfinished"] == 0, run
        assert run["ttft_p99_ms"] >= run["ttft_p50_ms"] > 0 and run["req_per_s"] > 0 and run["out_tok_per_s"] > 0
        assert run["engine_cpu_s_per_min"] > 0  # the CPU engine computes on the host


@pytest.mark.timeout(400)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a core for the generator and one for co-tenants")
def test_two_invocations_build_one_file(tmp_path: Path) -> None:
    model = "small" if have_llama3_assets() else ss.EMBEDDED
    first, log = run_study(tmp_path, "persistent", model)
    assert "[persistent interference] rate 3" in log and "interference stopped" in log
    assert {"device", "model", "workload", "runs"} <= first.keys()
    assert first["workload"]["name"] == "vllm" and first["device"].startswith("cpu")
    check_runs(first["runs"], "persistent")
    assert first["modes"]["persistent"]["interference"]["reported"] >= 2

    second, _ = run_study(tmp_path, "host", model)
    persistent = [r for r in second["runs"] if r["mode"] == "persistent"]
    assert persistent == first["runs"]  # kept as they were
    check_runs([r for r in second["runs"] if r["mode"] == "host"], "host")
    assert [r["mode"] for r in second["runs"]] == ["persistent"] * 2 + ["host"] * 2
    assert set(second["modes"]) == {"persistent", "host"} and not second["errors"] and not second["skipped"]
    table = (tmp_path / "serving.md").read_text()
    assert "| persistent | 3 |" in table and "| host | 3 |" in table
    for name in ("serving_latency.png", "serving_throughput.png"):
        assert (tmp_path / name).stat().st_size > 10000


def test_other_setup_is_not_merged(tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    out.write_text(json.dumps({"model": "something else", "workload": {}, "runs": []}))
    assert ss.main(["--modes", "host", "--out", str(out), "--free-cores", "1"]) == 2


# ---------------------------------------------------------------------- pieces
@pytest.mark.skipif(not have_llama3_assets(), reason="Llama-3 tokenizer files not fetched")
def test_model_folder_gets_the_llama3_tokenizer(tmp_path: Path) -> None:
    from dpu_tokenizer.loader import load_tokenizer

    folder = hm.build_model_folder("small", default_assets_dir(), tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert config["vocab_size"] == 128256 and config["num_hidden_layers"] == 2
    tok = load_tokenizer(folder)
    assert tok.backend_name == "tiktoken"
    assert tok.bos_token_id == 128000 and tuple(tok.eos_token_ids) == (128001, 128009)
    assert max(tok.encode("The quick brown fox. " * 50)) < config["vocab_size"]


def test_missing_assets_say_how_to_fetch(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="fetch_assets"):
        hm.build_model_folder("8b", tmp_path, tmp_path / "m")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_pinned_restores_affinity() -> None:
    before = os.sched_getaffinity(0)
    gen, others = ss.split_cores(1)
    assert gen + others == sorted(before) and len(gen) == 1
    with ss.pinned(gen):
        for tid in os.listdir("/proc/self/task"):
            assert os.sched_getaffinity(int(tid)) == set(gen)
    assert os.sched_getaffinity(0) == before
    with pytest.raises(ValueError):
        ss.split_cores(len(before))


def run(mode: str, interference: bool, rate: Any, started: str = "t0", **extra: Any) -> dict[str, Any]:
    return {"mode": mode, "interference": interference, "rate": rate, "started": started, **extra}


def test_merge_replaces_only_the_modes_run() -> None:
    old = {"device": "gpu", "model": "m", "workload": {"name": "paper"},
           "runs": [run("host", False, 4.0), run("host", True, 4.0), run("persistent", False, 4.0)],
           "skipped": [{"mode": "persistent", "interference": True, "rate": "4", "reason": "x"}],
           "modes": {"host": {"a": 1}, "persistent": {"b": 1}}, "errors": {"persistent": "boom"}}
    new = {"device": "gpu", "model": "m", "workload": {"name": "paper"},
           "runs": [run("persistent", True, 10.0, "t1"), run("persistent", False, 10.0, "t1")], "skipped": [],
           "modes": {"persistent": {"b": 2}}, "errors": {}}
    doc = ss.merge(old, new, ["persistent"])
    assert [(r["mode"], r["interference"], r["rate"]) for r in doc["runs"]] == [
        ("persistent", False, 10.0), ("persistent", True, 10.0), ("host", False, 4.0), ("host", True, 4.0)]
    assert doc["skipped"] == [] and doc["errors"] == {} and doc["modes"] == {"host": {"a": 1}, "persistent": {"b": 2}}
    failed = {**new, "runs": [], "errors": {"host": "no server"}, "modes": {"host": {"a": 2}}}
    doc = ss.merge(old, failed, ["host"])  # a mode that measured nothing keeps its old runs
    assert sum(r["mode"] == "host" for r in doc["runs"]) == 2
    assert doc["errors"] == {"persistent": "boom", "host": "no server"}
    assert ss.compatible(old, {"model": "m", "workload": {"name": "paper"}}) is None
    assert "model" in ss.compatible(old, {"model": "other", "workload": {"name": "paper"}})


def test_table_ratios() -> None:
    runs = [run("persistent", False, 10.0, tpot_p99_ms=20.0, req_per_s=9.0, engine_cpu_s_per_min=0.0),
            run("persistent", True, 10.0, tpot_p99_ms=21.0, req_per_s=9.0, engine_cpu_s_per_min=0.1),
            run("host", False, 10.0, tpot_p99_ms=25.0, req_per_s=8.0, engine_cpu_s_per_min=60.0),
            run("host", True, 10.0, tpot_p99_ms=50.0, req_per_s=6.0, engine_cpu_s_per_min=58.0),
            run("host", False, "inf", tpot_p99_ms=30.0, req_per_s=10.0)]
    table = ss.format_table({"model": "m", "device": "d", "workload": {"name": "paper"}, "runs": runs})
    rows = [line for line in table.splitlines() if line.startswith("| persistent") or line.startswith("| host")]
    assert rows == ["| persistent | 10 | 20.00 | 21.00 | 1.05x | 9.00 | 9.00 | 1.00x | 0.0 / 0.1 |",
                    "| host | 10 | 25.00 | 50.00 | 2.00x | 8.00 | 6.00 | 0.75x | 60.0 / 58.0 |",
                    "| host | inf | 30.00 | - | -x | 10.00 | - | -x | - / - |"]


# ---------------------------------------------------------------------- budget and drain, against a fake server
class FakeServer:
    """Streams ``max_tokens`` chunks 2 ms apart; ``hang`` sends headers and then nothing."""

    def __init__(self) -> None:
        self.hang = False
        self.release = asyncio.Event()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake", "max_model_len": 4096}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if self.hang:
            await self.release.wait()
            return resp
        for i in range(int(body["max_tokens"])):
            await asyncio.sleep(0.002)
            chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture
async def fake() -> Any:
    server = FakeServer()
    app = web.Application()
    app.router.add_get("/v1/models", server.models)
    app.router.add_post("/v1/completions", server.complete)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[attr-defined,union-attr]
    yield server
    server.release.set()
    await runner.cleanup()


def plan(rates: list[float], drain_s: float = 1.0, warmup: int = 0) -> ss.Plan:
    workload = WORKLOADS["vllm"].scaled(16, 4)
    return ss.Plan(workload, Limits(64, 16, 80), rates, 0.3, drain_s, 0, warmup, None, ByteTokenizer())


async def test_budget_skips_what_cannot_fit(fake: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ss, "RESERVE_S", 0.5)
    p = plan([20.0, 20.0, 20.0])
    class Frozen(ss.Budget):
        """4.6 s left whatever the clock says: the outcome depends on the run's worst case, not on the host's speed."""

        def left(self) -> float:
            return self.end

    # isolated: the first run needs 2 x 2 s (it and its replay) + 0.5 s of reserve and fits; the second needs
    # 1.2 x the first's wall time (at least its last send, 0.27 s in) more and does not; interference: the first
    # replay needs 2.5 s
    budget = Frozen(4.6, 2.0)
    out = ss.ModeResult()
    replay: list[float] = []
    await ss.sweep(None, fake.url, p, "host", "cpu", budget, False, replay, 5.0, out)
    await ss.sweep(None, fake.url, p, "host", "cpu", budget, True, replay, 5.0, out)
    assert [(r["interference"], r["rate"]) for r in out.runs] == [(False, 20.0), (True, 20.0)]
    assert out.runs[0]["completed"] >= 1 and out.runs[0]["sent"] == out.runs[1]["sent"]
    reasons = [(s["interference"], s["reason"].split(":")[0]) for s in out.skipped]
    assert reasons == [(False, "time budget")] * 2 + [(True, "not run isolated")] * 2


async def test_drain_limit_cuts_and_a_stuck_engine_stops_the_mode(fake: FakeServer) -> None:
    fake.hang = True
    out = ss.ModeResult()
    budget = ss.Budget(time.monotonic() + 60.0, 2.0)
    with pytest.raises(RuntimeError, match="not serving"):
        await ss.sweep(None, fake.url, plan([20.0, 20.0], drain_s=0.5), "persistent", "cpu", budget, False, [],
                       5.0, out)
    (only,) = out.runs  # the mode stopped at its first rate: the second was not run
    assert only["completed"] == 0 and only["failed"] == 0 and only["unfinished"] == only["sent"] >= 1
    with pytest.raises(RuntimeError, match="no warm-up request completed"):
        await ss.sweep(None, fake.url, plan([20.0], warmup=2), "host", "cpu", budget, False, [], 0.5,
                       ss.ModeResult())


def test_tokens_while_sending_counts_cut_requests_and_not_the_drain() -> None:
    def res(sent: float, chunks: list[float], ok: bool, tokens: int = 0) -> sb.RequestResult:
        return sb.RequestResult(ok=ok, sent=sent, chunk_times=chunks, output_tokens=tokens)

    results = [res(100.0, [100.5, 101.0, 103.0], True, 6),  # 2 tokens a chunk; 2 chunks inside 2 s
               res(101.0, [101.5, 104.0], False)]  # cut later: 1 chunk inside
    assert ss.tokens_while_sending(results, 2.0) == pytest.approx(2 * 3 / 2.0)
    assert ss.tokens_while_sending([], 2.0) == 0.0
