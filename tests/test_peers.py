"""The peer study (``bench/peers``): Blink beside a peer started from a command line, in steady state.

End to end on the CPU: two invocations into one results file, one serving the embedded model through
``blink serve`` started from a command line (the peer's code path, the one vLLM takes), one through Blink's own
mode; the records' shape, their counts, the same requests for both systems, and both kept after the merge.
Nothing may be left running. The window's bookkeeping, the plateau's bisection, the vLLM log parser, the merge
and the table run on plain data. In CI the end-to-end part is its short form (one system, one point); the long
one, with a co-tenant and two invocations merged, is marked ``slow`` (``python -m pytest -m slow tests/test_peers.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.procfs import processes

from bench.peers import report
from bench.peers.load import ARRIVALS, Outcome, Schedule, Window, build_schedule
from bench.peers.measure import cache_window, keeps_up, queue_growth, window_counts
from bench.peers.systems import Peer, parse_peer, parse_vllm_log, write_tokenizer_config
from bench.workloads import WORKLOADS, Limits, RequestSpec, build_requests

ROOT = Path(__file__).resolve().parents[1]
RECORD_KEYS = ("system", "version", "cotenant", "rate", "window_s", "arrived", "completed", "failed", "unfinished",
               "queue_start", "queue_end", "sustained_req_s", "sustained_out_tok_s", "ttft_ms", "tpot_ms", "itl_ms")
PCTS = {"p50", "p95", "p99", "p999"}


def alive_with(text: str) -> list[tuple[int, str]]:
    return [(p.pid, p.cmdline) for p in processes() if text in p.cmdline and p.state != "Z" and p.pid != os.getpid()]


def wait_none(text: str, timeout_s: float = 10.0) -> list[tuple[int, str]]:
    end = time.monotonic() + timeout_s
    while (left := alive_with(text)) and time.monotonic() < end:
        time.sleep(0.2)
    return left


# ---------------------------------------------------------------------- end to end
def invoke(tmp_path: Path, system: str, cotenants: str, extra: list[str]) -> tuple[dict[str, Any], str]:
    cmd = [sys.executable, "-m", "bench.peers", "--systems", system, "--cotenants", cotenants, "--model-config",
           "embedded", "--backend-override", "cpu", "--rates", "1", "--window-s", "3", "--warmup-s", "1",
           "--drain-s", "15", "--clients", "2", "--client-cores", "1", "--max-batch", "8", "--max-prompt-tokens",
           "64", "--max-output-tokens", "16", "--max-model-len", "80", "--workload", "vllm", "--prompt-mean", "24",
           "--output-mean", "6", "--warmup-requests", "2", "--time-budget-s", "360", "--out",
           str(tmp_path / "peers.json"), "--plot", str(tmp_path / "peers"), "--work-dir", str(tmp_path / system),
           *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return json.loads((tmp_path / "peers.json").read_text()), out


def check_record(rec: dict[str, Any], served: bool = True) -> None:
    """The record's keys and counts; ``served``: at least one measured request completed (not asked of a
    loaded host under co-tenants, where a short tail may cut them all)."""
    missing = [k for k in RECORD_KEYS if k not in rec]
    assert not missing, missing
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert set(rec[key]) == PCTS, rec[key]
    assert rec["arrived"] == rec["completed"] + rec["failed"] + rec["unfinished"] >= 1, rec
    assert rec["failed"] == 0, rec
    if served or rec["completed"]:
        assert rec["completed"] >= 1 and rec["ttft_ms"]["p999"] >= rec["ttft_ms"]["p50"] > 0, rec
    assert rec["queue_start"] is not None and rec["queue_end"] is not None  # Blink's waiting gauge is read
    assert rec["version"] and rec["window_s"] == 3.0 and rec["rate"] == 1.0
    assert len(rec["client_cpu_s_per_min"]) == 2 and rec["cores"]["client"] == sorted(os.sched_getaffinity(0))[:1]
    cache = rec["prefix_cache"]  # Blink's counters, read at the window's start and end
    assert cache is not None and cache["hits"] <= cache["queries"], cache


def peer_command(tmp_path: Path) -> tuple[str, str]:
    """(ring, the ``--peer`` command): ``blink serve`` on the CPU started from a command line, as vLLM is."""
    ring = f"blink-peer-{uuid.uuid4().hex[:8]}"
    command = (f"BLINK_LOG_JSON=1 BLINK_HEARTBEAT_TIMEOUT_S=10 exec {{python}} -m blink.cli serve --backend cpu "
               f"--port {{port}} --ring {ring} --run-dir {tmp_path / 'peer-run'} --max-batch {{max_num_seqs}} "
               "--max-prompt-tokens 64 --max-output-tokens 16 --drain-timeout 5 --no-standby-engine")
    return ring, f"cpupeer:blink={command}"


@pytest.mark.timeout(600)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a core for the clients and one for the server")
def test_a_command_line_peer_measured_and_stopped(tmp_path: Path) -> None:
    """The short form: one system started from its command line, one point; the record, the settings read from
    the peer's log, the plots, and nothing left running. The long form below adds a co-tenant and a merge."""
    ring, peer = peer_command(tmp_path)
    out, log = invoke(tmp_path, "cpupeer", "none", ["--peer", peer])
    assert not wait_none(ring), "the peer outlived the study"
    assert [(r["system"], r["cotenant"]) for r in out["records"]] == [("cpupeer", "none")], log
    check_record(out["records"][0])
    peer_info = out["systems"]["cpupeer"]
    assert peer_info["kind"] == "blink" and peer_info["settings"]["max_context"] == 80 and peer_info["exit_code"] == 0
    assert {(p["system"], p["cotenant"]) for p in out["plateau"]} == {("cpupeer", "none")} and not out["errors"]
    for name in ("peers_latency.png", "peers_throughput.png"):
        assert (tmp_path / name).stat().st_size > 10000


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a core for the clients and one for co-tenants")
def test_blink_and_a_command_line_peer_in_one_file(tmp_path: Path) -> None:
    ring, peer = peer_command(tmp_path)
    first, log = invoke(tmp_path, "cpupeer", "none,moderate", ["--peer", peer])
    assert not wait_none(ring), "the peer outlived the study"
    assert [(r["system"], r["cotenant"]) for r in first["records"]] == [
        ("cpupeer", "none"), ("cpupeer", "moderate")], log
    check_record(first["records"][0])
    moderate = first["records"][1]
    check_record(moderate, served=False)
    assert moderate["cores"]["cotenants"] == sorted(os.sched_getaffinity(0))[1:]
    assert moderate["cotenant_work"]["reported"] >= 1 and moderate["cotenant_work"]["compress_mb_per_s"] > 0
    peer = first["systems"]["cpupeer"]
    assert peer["kind"] == "blink" and peer["settings"]["max_context"] == 80 and peer["exit_code"] == 0

    second, _ = invoke(tmp_path, "persistent", "none", [])
    assert not wait_none(str(tmp_path / "persistent")), "blink serve outlived the study"
    assert [r for r in second["records"] if r["system"] == "cpupeer"] == first["records"]  # kept as they were
    (blink,) = [r for r in second["records"] if r["system"] == "blink-persistent"]
    check_record(blink)
    assert blink["arrived"] == first["records"][0]["arrived"]  # the same requests
    assert {(p["system"], p["cotenant"]) for p in second["plateau"]} == {
        ("cpupeer", "none"), ("cpupeer", "moderate"), ("blink-persistent", "none")}
    assert set(second["systems"]) == {"cpupeer", "blink-persistent"} and not second["errors"]
    for name in ("peers_latency.png", "peers_throughput.png"):
        assert (tmp_path / name).stat().st_size > 10000
    assert "| none | 1 | blink-persistent / cpupeer |" in report.format_table(second, peer="cpupeer")


def test_another_setup_is_not_merged(tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    out.write_text(json.dumps({"model": "something else", "workload": {}, "records": []}))
    proc = subprocess.run([sys.executable, "-m", "bench.peers", "--systems", "persistent", "--out", str(out),
                           "--model-config", "embedded", "--client-cores", "1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "another setup" in proc.stdout


# ---------------------------------------------------------------------- peers and their logs
def test_peer_specs() -> None:
    vllm = parse_peer("vllm")
    assert vllm.kind == "vllm" and vllm.command.startswith("vllm serve {model} --load-format dummy")
    assert "--max-num-seqs {max_num_seqs}" in vllm.command and "--max-model-len {max_model_len}" in vllm.command
    other = parse_peer("sgl=python -m sglang.launch_server --port {port}")
    assert (other.name, other.kind) == ("sgl", "openai")
    mine = parse_peer("mine:blink={python} -m blink.cli serve --port {port}")
    assert mine.kind == "blink" and mine.observer.waiting_gauge == "blink:num_requests_waiting"
    assert vllm.observer.waiting_gauge == "vllm:num_requests_waiting"
    cmd = vllm.render({"model": "/m dir", "port": 1, "max_num_seqs": 128, "max_model_len": 8192,
                       "served_name": "m"})
    assert "vllm serve '/m dir' " in cmd and "--port 1" in cmd
    with pytest.raises(ValueError, match="no value"):
        vllm.render({"port": 1})
    for bad in ("persistent=x", "x:nosuch=cmd", "x={nope}", "sgl"):
        with pytest.raises(ValueError):
            parse_peer(bad)
    with pytest.raises(ValueError, match="empty"):
        Peer("p", "openai", " ")


VLLM_LOG = """\
(APIServer pid=11) INFO 12-01 10:00:00 [api_server.py:1800] vLLM API server version 0.26.0
(APIServer pid=11) INFO 12-01 10:00:01 [utils.py:250] non-default args: {'model_tag': '/m', 'max_num_seqs': 128}
(EngineCore_DP0 pid=12) INFO 12-01 10:00:05 [core.py:90] Initializing a V1 LLM engine (v0.26.0) with config: \
model='/m', max_seq_len=8192, enable_prefix_caching=True, chunked_prefill_enabled=True, pooler_config=None
(APIServer pid=11) INFO 12-01 10:00:02 [scheduler.py:200] Chunked prefill is enabled with max_num_batched_tokens=8192.
(EngineCore_DP0 pid=12) INFO 12-01 10:01:00 [gpu_worker.py:300] Available KV cache memory: 112.56 GiB
(EngineCore_DP0 pid=12) INFO 12-01 10:01:00 [kv_cache_utils.py:1000] GPU KV cache size: 922,064 tokens
(EngineCore_DP0 pid=12) INFO 12-01 10:01:00 [kv_cache_utils.py:1004] Maximum concurrency for 8,192 tokens per \
request: 112.56x
"""


def test_vllm_settings_from_its_log() -> None:
    got = parse_vllm_log(VLLM_LOG)
    assert got["version"] == "0.26.0" and got["max_num_batched_tokens"] == 8192 and got["max_num_seqs"] == 128
    assert got["chunked_prefill"] is True and got["prefix_caching"] is True
    assert got["kv_cache_tokens"] == 922064 and got["kv_cache_gib"] == 112.56 and got["max_concurrency"] == 112.56
    assert any("GPU KV cache size" in line for line in got["log_lines"])
    assert parse_vllm_log("nothing") == {"log_lines": []}


def test_blink_settings_from_its_log() -> None:
    """The GPU engines say whether they cache prefixes in an event of their own; the CPU engine in ``model
    loaded``; both land in the record's settings."""
    from bench.peers.systems import parse_blink_log

    gpu = "\n".join([
        json.dumps({"on": False, "where": "device", "why_off": "BLINK_DEVICE_PREFIX_CACHE=0",
                    "event": "prefix caching"}),
        "[W1201 a warning line]",
        json.dumps({"count": 126, "event": "graphs captured"})])
    assert parse_blink_log(gpu) == {"prefix_caching": False}
    kv = json.dumps({"dtype": "bfloat16", "blocks": 29000, "block_size": 16, "gib": 56.64, "event": "KV cache"})
    assert parse_blink_log(kv + "\n" + gpu) == {"prefix_caching": False, "kv_blocks": 29000, "block_size": 16,
                                                "kv_cache_dtype": "bfloat16", "kv_cache_gib": 56.64,
                                                "kv_cache_tokens": 464000}
    cpu = json.dumps({"event": "model loaded", "kv_blocks": 2912, "block_size": 16, "max_context": 6144,
                      "threads": 2, "family": "llama", "prefix_caching": True, "weights": "auto packed"})
    assert parse_blink_log(cpu) == {"kv_blocks": 2912, "block_size": 16, "max_context": 6144, "threads": 2,
                                    "family": "llama", "prefix_caching": True, "kv_cache_tokens": 46592}
    assert parse_blink_log("nothing") == {}


def test_tokenizer_config_for_vllm(tmp_path: Path) -> None:
    path = write_tokenizer_config(tmp_path)
    assert json.loads(path.read_text())["eos_token"] == "<|eot_id|>"
    path.write_text("{}")
    assert write_tokenizer_config(tmp_path).read_text() == "{}"  # kept


# ---------------------------------------------------------------------- the window's bookkeeping
def out(idx: int, sent: float, chunks: list[float], ok: bool = True, error: str = "") -> Outcome:
    arr = np.asarray(chunks)
    return Outcome(idx, ok, error, sent, chunks[0] if chunks else 0.0, chunks[-1] if chunks else 0.0,
                   len(chunks) if ok else 0, arr)


def test_window_counts_measure_only_arrivals_inside_the_window() -> None:
    w = Window(warmup_s=1.0, window_s=2.0, drain_s=5.0)
    spec = RequestSpec([1, 2], 2, 3)
    offsets = (0.5, 1.1, 1.5, 2.0, 2.9, 3.5)  # indices 1-4 arrive inside [1, 3)
    sched = Schedule(4.0, offsets, (spec,) * len(offsets), w)
    outs = [out(0, 0.5, [1.2, 1.4, 2.5]),  # warm-up arrival: not measured, but completes inside the window
            out(1, 1.1, [1.3, 1.5, 1.8]), out(2, 1.5, [1.7, 2.0, 3.5]),  # completes after the window
            out(3, 2.0, [], ok=False, error="http_500"), out(4, 2.9, [3.2], ok=False, error="cut"),
            out(5, 3.5, [3.6, 3.7, 3.8])]
    got = window_counts(sched, outs)
    assert (got["arrived"], got["completed"], got["failed"], got["unfinished"]) == (4, 2, 1, 1)
    assert got["errors"] == {"http_500": 1}
    assert got["sustained_req_s"] == pytest.approx(2 / 2.0)  # requests 0 and 1 ended inside [1, 3)
    assert got["sustained_out_tok_s"] == pytest.approx(8 / 2.0)  # the chunks of requests 0, 1 and 2 inside [1, 3)
    assert got["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert got["tpot_ms"]["p50"] == pytest.approx((250 + 900) / 2)


def test_queue_growth_and_the_plateau_test() -> None:
    assert queue_growth([(1.0, 0.0), (2.0, 1.0), (3.0, 2.0)], 10.0) == pytest.approx(10.0)
    assert queue_growth([(1.0, 3.0)], 10.0) is None
    base = {"arrived": 100, "completed": 100, "ttft_ms": {"p50": 200.0}, "queue_growth": 1.0}
    assert keeps_up(base)[0]
    assert not keeps_up({**base, "queue_growth": 10.0})[0]
    assert not keeps_up({**base, "ttft_ms": {"p50": 1500.0}})[0]
    assert not keeps_up({**base, "completed": 0, "ttft_ms": {"p50": None}})[0]
    no_gauge = {**base, "queue_growth": None, "queue_start": None, "queue_end": None}
    assert keeps_up(no_gauge)[0] and not keeps_up({**no_gauge, "completed": 90})[0]


def rec(system: str, cotenant: str, rate: float, ok: bool = True, **extra: Any) -> dict[str, Any]:
    r = {"system": system, "cotenant": cotenant, "rate": rate, "arrived": 100, "completed": 100,
         "ttft_ms": {"p50": 100.0 if ok else 3000.0, "p99": 200.0}, "tpot_ms": {"p50": 10.0, "p99": 20.0},
         "queue_growth": 0.0, "sustained_req_s": rate if ok else 10.0, "sustained_out_tok_s": 400.0 * rate}
    return {**r, **extra}


def test_bisection_brackets_the_plateau_to_one_request_per_second() -> None:
    true_plateau = 13.3
    records: list[dict[str, Any]] = []
    for _ in range(12):
        probe = report.next_probe(*report.bracket(records), 4.0, 32.0)
        if probe is None:
            break
        records.append(rec("vllm", "none", probe, ok=probe <= true_plateau))
    lo, hi = report.bracket(records)
    assert lo is not None and hi is not None and lo <= true_plateau < hi and hi - lo <= 1.0
    assert len(records) <= 7
    p = report.plateau_of("vllm", "none", records)
    assert p["resolved"] and p["plateau_req_s"] == lo
    assert report.next_probe(None, 3.0, 4.0, 32.0) == 1.5  # below the range: halve
    assert report.next_probe(40.0, None, 4.0, 32.0) is None  # above it: nothing to bracket
    assert report.bracket([rec("v", "none", 8.0, ok=False), rec("v", "none", 4.0)]) == (4.0, 8.0)


def test_merge_replaces_a_record_and_keeps_other_systems() -> None:
    old = {"model": "m", "workload": {}, "order": ["vllm"], "records": [rec("vllm", "none", 10.0, started="t0")],
           "systems": {"vllm": {"version": "0.26.0"}}, "errors": {}, "skipped": []}
    new = {"model": "m", "workload": {}, "order": ["blink-persistent", "vllm"],
           "records": [rec("blink-persistent", "none", 10.0), rec("vllm", "none", 10.0, started="t1"),
                       rec("vllm", "heavy", 10.0)],
           "systems": {"blink-persistent": {"version": "0.1.0"}}, "errors": {}, "skipped": []}
    doc = report.merge(old, new)
    assert [(r["system"], r["cotenant"], r.get("started")) for r in doc["records"]] == [
        ("vllm", "none", "t1"), ("vllm", "heavy", None), ("blink-persistent", "none", None)]
    assert set(doc["systems"]) == {"vllm", "blink-persistent"}
    assert {(p["system"], p["cotenant"]) for p in doc["plateau"]} == {
        ("vllm", "none"), ("vllm", "heavy"), ("blink-persistent", "none")}
    assert report.compatible(old, {"model": "m", "workload": {}}) is None
    assert "model" in (report.compatible(old, {"model": "x", "workload": {}}) or "")
    on_h200 = {**old, "device": "NVIDIA H200"}
    assert "device" in (report.compatible(on_h200, {"model": "m", "workload": {}, "device": "NVIDIA H100 80GB HBM3"})
                        or "")


def test_table_ratios() -> None:
    doc = report.merge(None, {
        "model": "m", "device": "d", "workload": {"name": "paper"}, "order": ["blink-persistent", "vllm"],
        "records": [rec("blink-persistent", "none", 10.0, tpot_ms={"p50": 8.0, "p99": 12.0}),
                    rec("vllm", "none", 10.0), rec("blink-persistent", "heavy", 10.0),
                    rec("vllm", "heavy", 10.0, tpot_ms={"p50": 25.0, "p99": 40.0})],
        "systems": {}, "errors": {}, "skipped": []})
    table = report.format_table(doc)
    assert "| none | 10 | blink-persistent / vllm | 0.80x | 0.60x | 1.00x | 1.00x | 1.00x | - | |" in table
    assert "| heavy | 10 | blink-persistent / vllm | 0.40x | 0.50x |" in table
    assert "| vllm | 10 | 2.50x | 2.00x | 1.00x |" in table  # heavy over none
    assert "| none | >= 10 | >= 10 | 1.00x |" in table  # plateaus: not bracketed from above


class CountingServer:
    """A system whose prefix-cache counters move by fixed steps each reading (queries 1,000, hits 600)."""

    def __init__(self, counters: bool = True) -> None:
        self.readings = 0
        self.counters = counters

    def cache_counters(self) -> tuple[float | None, float | None]:
        self.readings += 1
        return (1000.0 * self.readings, 600.0 * self.readings) if self.counters else (None, None)


def test_cache_window_is_the_counters_difference_over_the_window() -> None:
    import asyncio
    import time as clock

    sched = Schedule(1.0, (), (), Window(0.0, 0.2, 0.0))
    server = CountingServer()
    got = asyncio.run(cache_window(server, clock.perf_counter(), sched))  # type: ignore[arg-type]
    assert got == {"queries": 1000.0, "hits": 600.0, "hit_rate": 0.6} and server.readings == 2
    assert asyncio.run(cache_window(CountingServer(False), clock.perf_counter(), sched)) is None  # type: ignore[arg-type]


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 1000 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def test_shared_workload_repeats_a_system_prompt_and_each_conversations_history() -> None:
    """Every prompt starts with the one system prompt (the same at every rate's seed); a conversation's next
    turn starts with its previous turn's prompt; the server's limits hold; most prompt tokens repeat."""
    limits = Limits(max_prompt=3000, max_output=512, max_context=3200)
    reqs = build_requests(WORKLOADS["shared"], 300, CharTokenizer(), limits, seed=5)
    other = build_requests(WORKLOADS["shared"], 10, CharTokenizer(), limits, seed=6)
    system = reqs[0].prompt[:1000]
    assert len(reqs) == 300 and all(r.prompt[:1000] == system for r in reqs + other)
    assert reqs[1].prompt != reqs[0].prompt
    assert all(r.prompt_len == len(r.prompt) <= 3000 and r.prompt_len + r.output_len <= 3200 for r in reqs)
    prompts = {tuple(r.prompt) for r in reqs}
    continued = sum(any(tuple(r.prompt[:k]) in prompts for k in range(1001, len(r.prompt))) for r in reqs)
    assert continued > len(reqs) // 2, continued  # turns 2-5 re-send an earlier prompt whole
    with pytest.raises(ValueError):
        WORKLOADS["shared"].scaled(prompt_mean=100)
    with pytest.raises(ValueError, match="no first turn"):  # limits no conversation fits: refused, not a hang
        build_requests(WORKLOADS["shared"], 10, CharTokenizer(), Limits(512, 64, 600), seed=1)


def test_each_level_of_the_shared_workload_has_conversations_of_its_own() -> None:
    """One server serves every co-tenant level in turn: the shared workload draws each level's conversations
    anew (a cache holding the last level's would find whole prompts), keeping the one system prompt and the
    arrivals; a length workload sends the very same requests at every level."""
    limits, window = Limits(max_prompt=3000, max_output=512, max_context=3200), Window(0.0, 20.0, 5.0)
    none, heavy = (build_schedule(2.0, window, WORKLOADS["shared"], limits, CharTokenizer(), 0, lvl)
                   for lvl in ("none", "heavy"))
    assert none.offsets == heavy.offsets and len(none.specs) > 20
    assert all(a.prompt[:1000] == b.prompt[:1000] for a, b in zip(none.specs, heavy.specs, strict=True))
    seen = {tuple(r.prompt[1000:1064]) for r in none.specs}
    assert not any(tuple(r.prompt[1000:1064]) in seen for r in heavy.specs)
    plain = [build_schedule(2.0, window, WORKLOADS["paper"], limits, CharTokenizer(), 0, lvl)
             for lvl in ("none", "heavy")]
    assert [r.prompt for r in plain[0].specs] == [r.prompt for r in plain[1].specs]


def test_a_default_run_merges_with_its_kind_and_not_with_older_arrivals() -> None:
    """A run with the GPU script's defaults records the workload as the committed peers.json does but for the
    arrivals (one stream scaled by the rate since that file was made): two such runs merge, and that file's
    records, drawn rate by rate, are refused beside them with the reason."""
    from bench.peers.cli import build_parser, header_of

    committed = json.loads((ROOT / "bench/results/peers.json").read_text())
    args = build_parser().parse_args(["--seed", str(committed["workload"]["seed"])])
    now = header_of(args)["workload"]
    assert now["arrivals"] == ARRIVALS and committed["workload"]["arrivals"] == "poisson"
    assert {**now, "arrivals": "poisson"} == committed["workload"]
    assert report.compatible({**committed, "workload": now}, {**committed, "workload": now}) is None
    assert "workload differs" in (report.compatible(committed, {**committed, "workload": now}) or "")


def test_every_rate_sends_one_stream_of_arrivals_and_lengths() -> None:
    """Rates differ only in how fast the one stream comes: at twice the rate the same arrivals at half the time
    and the same lengths request by request, the prompts' text each rate's own (no prefix found across rates)."""
    limits, window = Limits(max_prompt=3000, max_output=512, max_context=3200), Window(2.0, 20.0, 5.0)
    slow, fast = (build_schedule(r, window, WORKLOADS["paper"], limits, CharTokenizer(), 3) for r in (2.0, 4.0))
    assert len(fast.offsets) > len(slow.offsets) > 20
    assert fast.offsets[:len(slow.offsets)] == pytest.approx([t / 2 for t in slow.offsets])
    pairs = list(zip(slow.specs, fast.specs, strict=False))
    assert all((a.prompt_len, a.output_len) == (b.prompt_len, b.output_len) for a, b in pairs)
    assert sum(a.prompt != b.prompt for a, b in pairs) == len(pairs)
    assert fast.arrived > slow.arrived


# ---------------------------------------------------------------------- setups: config, constraint, model
@pytest.mark.slow  # a second server start beside test_a_command_line_peer_measured_and_stopped: -m slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a core for the clients and one for the server")
def test_blink_at_its_defaults_under_a_constraint(tmp_path: Path) -> None:
    """Blink's own mode with ``--config defaults`` (only the model and --max-model-len) serving a constrained
    load: every request carries the schema, the record names config and constraint, and its answers are
    counted (setups merged in one file: test_setups_merge_side_by_side_and_tabulate_apart)."""
    first, log = invoke(tmp_path, "persistent", "none", ["--config", "defaults", "--response-format",
                                                           "json_schema:person"])
    assert not wait_none(str(tmp_path / "persistent")), "blink serve outlived the study"
    (rec,) = first["records"]
    check_record(rec)
    assert (rec["config"], rec["response_format"]) == ("defaults", "json_schema:person"), log
    check = rec["output_check"]
    assert check["stop"] + check["length"] + check["other"] == rec["completed"]
    assert rec["invalid_outputs"] == check["invalid"] + check["length_not_object"] == 0, check
    info = first["systems"]["blink-persistent@defaults"]
    assert "--max-batch" not in info["command"] and "--max-model-len 80" in info["command"], info["command"]
    assert info["config"] == "defaults" and info["exit_code"] == 0 and not first["errors"]
    assert "Config defaults, response_format json_schema:person:" in report.format_table(first)



def test_response_formats_and_the_answer_check(tmp_path: Path) -> None:
    from bench.peers.constraint import check_outputs, parse_response_format

    assert parse_response_format("json_object").body == {"type": "json_object"}
    person = parse_response_format("json_schema:person")
    assert person.label == "json_schema:person" and person.schema is not None
    assert person.body["json_schema"]["name"] == "person"
    path = tmp_path / "point.json"
    path.write_text(json.dumps({"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}))
    from_file = parse_response_format(f"json_schema:{path}")
    assert from_file.label == "json_schema:point" and from_file.schema == json.loads(path.read_text())
    for bad in ("json", "json_schema:", "json_schema:nosuch", "regex:a+"):
        with pytest.raises(ValueError):
            parse_response_format(bad)

    good = '{"name": "a", "age": 3, "email": "e"}'
    answers = [("stop", good), ("stop", " " + good + "\n"), ("length", '{"name": "aaaa'),
               ("stop", '{"name": "a", "age": "3", "email": "e"}'),  # a wrong type
               ("stop", '{"name": "a", "age": true, "email": "e"}'),  # JSON's true is no integer
               ("stop", '{"name": "a", "email": "e"}'), ("stop", '{"name": "a", "age": 1, "email": "e", "x": 1}'),
               ("stop", '[1, 2]'), ("stop", "Sure! Here is"), ("length", "Sure! Here is the answer")]
    got = check_outputs(answers, person)
    assert (got["stop"], got["length"], got["other"]) == (8, 2, 0)
    assert got["invalid"] == 6 and got["length_not_object"] == 1
    assert got["first_problem"] == "wrong type or value of 'age'" and got["sample"].startswith('{"name"')
    # a server that ignores the constraint: free text, stopped or cut, is all invalid
    ignored = check_outputs([("stop", "The cat"), ("length", "The cat sat on")], parse_response_format("json_object"))
    assert ignored["invalid"] + ignored["length_not_object"] == 2
    assert check_outputs([("stop", '{"k": [1]}')], parse_response_format("json_object"))["invalid"] == 0
    order = parse_response_format("json_schema:order")
    assert check_outputs([("stop", '{"id": 1, "items": [], "paid": false, "status": "lost"}')], order)["invalid"] == 1


def test_constrained_requests_stream_with_the_format_and_keep_their_text() -> None:
    from bench import serve_bench as sb
    from bench.peers.load import request_payload

    spec = RequestSpec([1, 2, 3], 3, 8)
    plain = request_payload("m", spec)
    assert plain == sb.make_payload("m", spec) and plain["ignore_eos"] is True and "response_format" not in plain
    body = {"type": "json_object"}
    constrained = request_payload("m", spec, body)
    assert constrained["response_format"] == body and constrained["ignore_eos"] is False
    assert constrained["stream"] is True and constrained["prompt"] == [1, 2, 3] and constrained["max_tokens"] == 8
    kept, dropped = sb.RequestResult(text=[]), sb.RequestResult()
    for res in (kept, dropped):
        sb.apply_event(res, {"choices": [{"text": '{"a"', "finish_reason": None}]}, 1.0)
        sb.apply_event(res, {"choices": [{"text": ": 1}", "finish_reason": "stop"}]}, 2.0)
        assert sb.apply_event(res, "[DONE]", 3.0) and res.ok and res.finish_reason == "stop"
    assert kept.text == ['{"a"', ": 1}"] and dropped.text is None


def test_setups_merge_side_by_side_and_tabulate_apart() -> None:
    tuned = [rec("blink-persistent", "none", 10.0), rec("vllm", "none", 10.0)]
    defaults = [rec("blink-persistent", "none", 10.0, config="defaults", tpot_ms={"p50": 5.0, "p99": 9.0}),
                rec("vllm", "none", 10.0, config="defaults")]
    check = {"stop": 3, "length": 1, "other": 0, "invalid": 0, "length_not_object": 0}
    constrained = [rec("vllm", "none", 10.0, response_format="json_object", output_check=check, invalid_outputs=0)]
    old = {"model": "m", "workload": {}, "order": ["blink-persistent", "vllm"], "records": tuned,
           "systems": {"vllm": {"version": "0.26.0"}}, "errors": {}, "skipped": []}
    doc = report.merge(old, {"model": "m", "workload": {}, "order": ["blink-persistent", "vllm"],
                             "records": [*defaults, *constrained],
                             "systems": {"vllm@defaults": {"version": "0.26.0", "config": "defaults"}},
                             "errors": {}, "skipped": []})
    assert len(doc["records"]) == 5 and set(doc["systems"]) == {"vllm", "vllm@defaults"}
    assert [report.setup_of(r) for r in doc["records"]] == [("tuned128", "")] * 2 + [("tuned128", "json_object")] \
        + [("defaults", "")] * 2
    assert len(doc["plateau"]) == 5
    again = report.merge(doc, {"records": [rec("vllm", "none", 10.0, config="defaults", started="t2")]})
    assert len(again["records"]) == 5  # replaced within its setup only
    assert [r.get("started") for r in again["records"] if report.setup_of(r) == ("defaults", "")] == [None, "t2"]
    table = report.format_table(doc)
    parts = table.split("Config ")
    assert [p.split(":")[0] for p in parts[1:]] == ["tuned128", "tuned128, response_format json_object", "defaults"]
    assert "| none | 10 | blink-persistent / vllm | 0.50x |" in parts[3]  # defaults beside defaults
    assert "| none | 10 | blink-persistent / vllm | 1.00x |" in parts[1]
    assert "| none | 10 | vllm | 3 | 1 | 0 |" in parts[2]  # the constrained answers' check
    assert "Config" not in report.format_table(report.merge(None, {"records": tuned}))  # one default setup: as before


def test_each_config_s_server_flags() -> None:
    import argparse

    from bench.peers.study import blink_flags

    vllm = parse_peer("vllm", "defaults")
    assert "--max-num-seqs" not in vllm.command and "--max-model-len {max_model_len}" in vllm.command
    assert "--load-format dummy" in vllm.command and "--served-model-name {served_name}" in vllm.command
    assert "--max-num-seqs {max_num_seqs}" in parse_peer("vllm").command
    values = {"model": "/m", "port": 1, "max_num_seqs": None, "max_model_len": 8192, "served_name": "m"}
    assert "--max-model-len 8192" in vllm.render(values)
    with pytest.raises(ValueError, match="max_num_seqs"):  # a command that asks for it has none under defaults
        parse_peer("vllm", "tuned128").render(values)
    args = argparse.Namespace(config="defaults", max_model_len=8192, serve_args="--kv-blocks 64", max_batch=128,
                              max_prompt_tokens=4096, max_output_tokens=2048, quantization="none",
                              kv_cache_dtype="auto")
    flags = blink_flags(args, "persistent", Path("/x/model"))
    assert flags == ("--backend", "persistent", "--max-model-len", "8192", "--drain-timeout", "5", "--model",
                     "/x/model", "--random-weights", "--served-model-name", "model", "--kv-blocks", "64")
    tuned = blink_flags(argparse.Namespace(**{**vars(args), "config": "tuned128"}), "persistent", None)
    assert tuned[tuned.index("--max-batch") + 1] == "128" and "--max-model-len" not in tuned
    # repeated on the command line (a shell-split PEERS_ARGS carries a flag per value): every word, in order
    from bench.peers.cli import build_parser
    parsed = build_parser().parse_args(["--config", "defaults", "--serve-args=--max-num-seqs=256",
                                        "--serve-args", "--gpu-memory-utilization 0.85"])
    flags = blink_flags(parsed, "persistent", None)
    assert flags[-3:] == ("--max-num-seqs=256", "--gpu-memory-utilization", "0.85")


def test_runs_of_other_blink_settings_keep_their_own_records(tmp_path: Path) -> None:
    """Blink with --serve-args is named by them in the records, so a run at the same setup and rate without them
    (or with others) adds its records beside, never over, the first's; its server's folder is a plain name."""
    from bench.peers.cli import build_parser
    from bench.peers.report import merge
    from bench.peers.study import blink_label
    from bench.peers.systems import BlinkServer

    plain = build_parser().parse_args(["--config", "defaults"])
    tuned = build_parser().parse_args(["--config", "defaults", "--serve-args=--max-num-seqs=256",
                                       "--serve-args", "--gpu-memory-utilization 0.85"])
    assert blink_label("persistent", plain) == "persistent"
    server = BlinkServer(blink_label("persistent", tuned), (), {}, tmp_path)
    assert server.name == "blink-persistent[--max-num-seqs=256 --gpu-memory-utilization 0.85]"
    assert server.serve.run_root.name == "blink-persistent_--max-num-seqs_256_--gpu-memory-utilization_0.85"

    def rec(system: str, tpot: float) -> dict:
        return {"system": system, "cotenant": "none", "rate": 14.0, "config": "defaults", "tpot_ms": {"p50": tpot},
                "ttft_ms": {"p50": 100.0}, "completed": 10, "arrived": 10, "queue_growth": 0.0}

    first = merge(None, {"records": [rec(server.name, 30.2)], "order": [server.name]})
    both = merge(first, {"records": [rec("blink-persistent", 14.1)], "order": ["blink-persistent"]})
    assert sorted((r["system"], r["tpot_ms"]["p50"]) for r in both["records"]) == [
        ("blink-persistent", 14.1), (server.name, 30.2)]


def test_an_fp8_study_gives_every_system_the_flags_and_keeps_a_file_of_its_own() -> None:
    """--quantization fp8 --kv-cache-dtype fp8: vLLM's command and blink serve's flags both end with them, the
    header records the precision, and a bf16 file (one from before the precision was recorded included) refuses
    the FP8 records."""
    from bench.peers.cli import build_parser, check, header_of
    from bench.peers.study import blink_flags

    ap = build_parser()
    args = ap.parse_args(["--quantization", "fp8", "--kv-cache-dtype", "fp8", "--config", "tuned128",
                          "--client-cores", "1"])
    peers = check(ap, args)
    assert peers["vllm"].command.endswith(" --quantization fp8 --kv-cache-dtype fp8")
    assert blink_flags(args, "persistent", None)[-4:] == ("--quantization", "fp8", "--kv-cache-dtype", "fp8")
    fp8 = header_of(args)
    assert fp8["precision"] == {"weights": "fp8", "kv_cache": "fp8"}
    bf16 = header_of(ap.parse_args([]))
    assert report.compatible(bf16, bf16) is None and report.compatible(fp8, fp8) is None
    assert "precision" in (report.compatible(bf16, fp8) or "")
    legacy = {k: v for k, v in bf16.items() if k != "precision"}
    assert report.compatible(legacy, bf16) is None and "precision" in (report.compatible(legacy, fp8) or "")
    assert parse_peer("vllm").with_flags(()) == parse_peer("vllm")
    # a peer of another kind takes them where its command says, or the study is refused
    sglang = parse_peer("sglang=python -m sglang.launch_server --port {port} {precision} --log-level info")
    assert sglang.kind == "openai"
    assert sglang.with_flags(("--quantization", "fp8")).command.endswith("--quantization fp8 --log-level info")
    assert "{precision}" not in sglang.with_flags(()).command
    with pytest.raises(SystemExit):
        check(ap, ap.parse_args(["--quantization", "fp8", "--client-cores", "1", "--peer",
                                 "other=serve --port {port} | tee log"]))


@pytest.mark.timeout(60)
def test_a_vllm_that_never_gets_healthy_is_stopped_with_its_log(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM peer's process does not inherit CUDA_MODULE_LOADING (the GPU script exports EAGER for Blink); one
    that is not healthy in time is reported with its log's tail and stopped, nothing of it left running."""
    from bench.peers.systems import CommandServer

    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    marker = f"peer-never-healthy-{uuid.uuid4().hex[:8]}"
    peer = Peer("vllm", "vllm", f"echo loading=[$CUDA_MODULE_LOADING]; exec sleep 300 # {marker}")
    server = CommandServer(peer, {}, tmp_path)
    with pytest.raises(RuntimeError, match="not healthy after 2 s") as err:
        server.start(timeout_s=2.0)
    assert "loading=[]" in str(err.value)  # the log's tail, in the error
    server.stop(grace_s=5.0)
    assert not wait_none(marker), "the peer outlived its failed start"
    other = CommandServer(Peer("other", "openai", "echo loading=[$CUDA_MODULE_LOADING]; exit 3"), {}, tmp_path)
    with pytest.raises(RuntimeError, match="exited with 3"):
        other.start(timeout_s=10.0)
    assert "loading=[EAGER]" in other.log_tail()  # only vLLM's kind drops it


def have_qwen_assets() -> bool:
    from dpu_tokenizer.fetch_assets import default_assets_dir
    from harness.qwen3_folder import qwen_ranks_file

    try:
        qwen_ranks_file(default_assets_dir())
    except FileNotFoundError:
        return False
    return True


@pytest.mark.skipif(not have_qwen_assets(), reason="Qwen tokenizer assets not fetched")
def test_the_qwen3_moe_folder_loads_as_vllm_and_blink_read_it(tmp_path: Path) -> None:
    """The MoE shape's folder: config.json as transformers' Qwen3MoeConfig reads it (vLLM's route, with
    --load-format dummy), the same shape through Blink's loader, Qwen3's tokenizer through transformers and
    through Blink (the same ids), the chat template; its results file is peers_moe.json."""
    import transformers

    from bench.peers.cli import build_parser, header_of, resolve_paths
    from dpu_tokenizer.fetch_assets import default_assets_dir
    from dpu_tokenizer.loader import load_tokenizer
    from gpu_engine.models.config import ModelConfig
    from harness.models import QWEN3_30B_A3B, QWEN3_MOE, build_model_folder

    folder = build_model_folder(QWEN3_MOE, default_assets_dir(), tmp_path)
    assert {p.name for p in folder.iterdir()} == {"config.json", "tokenizer.json", "tokenizer_config.json",
                                                   "generation_config.json"}
    hf = transformers.AutoConfig.from_pretrained(folder)
    assert isinstance(hf, transformers.Qwen3MoeConfig) and hf.architectures == ["Qwen3MoeForCausalLM"]
    shape = {"hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
             "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
             "vocab_size": 151936, "intermediate_size": 6144, "norm_topk_prob": True, "decoder_sparse_step": 1}
    assert {k: getattr(hf, k) for k in shape} == shape
    from bench.roofline import QWEN3_30B_A3B as ROOFLINE_MOE  # the shape the roofline measures
    assert {k: v for k, v in QWEN3_30B_A3B.items() if k in ROOFLINE_MOE and k != "max_position_embeddings"} == {
        k: v for k, v in ROOFLINE_MOE.items() if k != "max_position_embeddings"}
    blink = ModelConfig.from_file(folder / "config.json")
    assert (blink.family, blink.num_experts, blink.num_experts_per_tok, blink.num_layers) == ("qwen3_moe", 128, 8, 48)

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert tok.eos_token_id == 151645 and tok.convert_tokens_to_ids("</think>") == 151668
    text = 'def f(x):\n    return {"a": [1, 22, 333]}  # café 中文'
    ours = load_tokenizer(folder)
    assert tok.encode(text, add_special_tokens=False) == ours.encode(text)
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True,
                                   enable_thinking=False)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert json.loads((folder / "generation_config.json").read_text()) == {
        "bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}

    args = resolve_paths(build_parser().parse_args(["--model-config", QWEN3_MOE]))
    assert args.out == Path("bench/results/peers_moe.json") and args.plot == Path("bench/results/peers_moe")
    assert "Qwen3 MoE shape" in header_of(args)["model"]
    plain = resolve_paths(build_parser().parse_args(["--out", "x/y.json"]))
    assert plain.plot == Path("x/y") and resolve_paths(build_parser().parse_args([])).out == Path(
        "bench/results/peers.json")


def test_the_table_says_the_kv_cache_each_system_got() -> None:
    """The table's first line names each system's KV cache as its start-up said, where it did."""
    doc = {"model": "m", "device": "d", "workload": {"name": "paper"}, "window": {"window_s": 60, "warmup_s": 15},
           "order": ["blink-persistent", "vllm"], "records": [],
           "systems": {"vllm": {"version": "0.26.0", "settings": {"kv_cache_tokens": 465184, "kv_cache_gib": 56.79}},
                       "blink-persistent": {"version": "0.1.0", "settings": {"kv_cache_tokens": 464000}},
                       "blink-host": {"version": "0.1.0", "settings": {}}}}
    first = report.format_table(doc).splitlines()[0]
    assert "vllm 0.26.0 (KV cache: 465,184 tokens, 56.79 GiB)" in first
    assert "blink-persistent 0.1.0 (KV cache: 464,000 tokens)" in first and first.endswith("; blink-host 0.1.0.")


def test_blink_version_names_the_commit_and_a_changed_trees_files(tmp_path: Path) -> None:
    """A clean checkout is the project's version and its commit; a tree whose files differ from its HEAD (a copy sent
    to a GPU host) says so with the git tree of its files, which is the tree of the commit that holds them."""
    import subprocess

    from bench.peers.systems import blink_version

    def git(*args: str) -> str:
        env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
               "GIT_COMMITTER_EMAIL": "t@t", "PATH": os.environ["PATH"], "HOME": str(tmp_path)}
        return subprocess.run(["git", *args], cwd=tmp_path, env=env, check=True, capture_output=True,
                              text=True).stdout.strip()

    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\nversion = "1.2.3"\n')
    (tmp_path / "a.py").write_text("A = 1\n")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "one")
    assert blink_version(tmp_path) == f"1.2.3+g{git('rev-parse', '--short', 'HEAD')}"
    base = git("rev-parse", "--short", "HEAD")
    (tmp_path / "a.py").write_text("A = 2\n")
    (tmp_path / "b.py").write_text("B = 1\n")  # a new file, not ignored: part of the tree sent
    changed = blink_version(tmp_path)
    assert changed.startswith(f"1.2.3+g{base}.dirty.t") and git("status", "--porcelain")  # the index untouched
    git("add", "-A")
    git("commit", "-qm", "two")
    assert changed.endswith(".t" + git("rev-parse", "HEAD^{tree}")[:12])
    assert blink_version(tmp_path) == f"1.2.3+g{git('rev-parse', '--short', 'HEAD')}"
