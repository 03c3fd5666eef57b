"""The standby engine of ``blink serve``: a spare engine process, started once the engines are READY and idle,
that waits for the go and takes a dead engine's place (the restart itself: ``tests/test_device_watchdog_stack.py``).

With the real CPU engine: the spare holds no shared-memory segment and no key, one that dies is replaced, and
it dies with a SIGKILLed supervisor; without a live spare at a fault the engine restarts cold. With the fake
engine: the spare waits for the engines idle, stops with the supervisor on SIGTERM and SIGINT, one that keeps
dying is given up, under ``-dp 2`` the harness names the engine that was a spare by its ring, and
``--no-standby-engine`` starts none. Without processes: when a spare is due (the deadline under load), a spare
that cannot be spawned, and a go that is not one.
"""

from __future__ import annotations

import datetime
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import pytest
from helpers.http_jobs import engine_events
from helpers.procfs import environ_of, fd_targets
from helpers.stack import FAKE_ENGINE, MODEL, Stack, processes_of, segment_exists, start_stack, stop_stack

from blink import supervisor
from blink.supervisor import RESTARTS_PER_MINUTE, STANDBY_DEADLINE_S, STANDBY_IDLE_S, ServeConfig, SpareClock
from harness.serve_proc import ROOT, http_get, new_ready_engine
from shared.data_parallel import engine_ring_names
from shared.standby import BadGo, wait_for_go

REAL_ENGINE = "gpu_engine.serve"
ENGINE_FLAGS = ("--num-slots", "8", "--max-prompt-tokens", "64", "--max-output-tokens", "64")
ENGINE_ENV = {"OMP_NUM_THREADS": "1", "BLINK_HEARTBEAT_TIMEOUT_S": "5"}
LIMIT_S = 120.0  # an engine or a spare starting on a loaded 2-core machine
T = TypeVar("T")


def wait_until(what: str, check: Callable[[], T], stack: Stack, limit_s: float = LIMIT_S) -> T:
    end = time.monotonic() + limit_s
    while not (got := check()):
        assert time.monotonic() < end, f"{what} not seen within {limit_s} s:\n{stack.log()}"
        time.sleep(0.05)
    return got


def spares_ready(stack: Stack, count: int) -> list[int]:
    """The pids of the first ``count`` spares that logged ready, once that many did."""
    pids = [e["pid"] for e in engine_events(stack.log_path, "standby engine ready")]
    return pids[:count] if len(pids) >= count else []


def shm_held(pid: int) -> list[str]:
    """The shared-memory files a process maps or has open."""
    maps = [line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/dev/shm/" in line]
    return maps + [t for t in fd_targets(pid) if t.startswith("/dev/shm/")]


def exited(pid: int) -> bool:
    """A zombie whose every thread has ended: only then can its parent reap it (a leader that took SIGKILL shows
    Z while its other threads still unmap the process's memory)."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return status["State"].split()[0] == "Z" and status["Threads"].strip() == "1"


def completion(stack: Stack, key: str | None = None, max_tokens: int = 2) -> int:
    import openai

    c = openai.OpenAI(base_url=stack.url + "/v1", api_key=key or "unused", max_retries=0, timeout=30)
    out = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=max_tokens,
                               extra_body={"ignore_eos": True})
    return len(out.choices)


def wall(record: dict) -> float:
    """A log record's time (its ISO timestamp), in seconds since the epoch."""
    return datetime.datetime.fromisoformat(record["timestamp"]).timestamp()


def spare_starts(stack: Stack) -> list[dict]:
    return [e for e in engine_events(stack.log_path, "started") if e.get("child") == "standby-engine"]


def test_the_spare_holds_no_segment_nor_key_is_replaced_when_it_dies_and_dies_with_the_supervisor(
        tmp_path: Path) -> None:
    key = f"key-{uuid.uuid4().hex}"
    stack = start_stack(tmp_path, *ENGINE_FLAGS, api_key=key, engine_module=REAL_ENGINE, env=ENGINE_ENV,
                        timeout_s=LIMIT_S, standby_engine=True)
    try:
        (spare,) = wait_until("standby engine ready", lambda: spares_ready(stack, 1), stack)
        assert stack.children()["standby-engine"] == spare and stack.engine_pid() != spare
        # one engine: the spare's GPU is known at its start (a GPU backend's spare makes its context early)
        assert "--standby-gpu-known" in Path(f"/proc/{spare}/cmdline").read_text().split("\0")
        assert shm_held(spare) == [] and shm_held(stack.engine_pid()) != []
        assert key not in Path(f"/proc/{spare}/cmdline").read_text() and "BLINK_API_KEY" not in environ_of(spare)
        os.kill(spare, signal.SIGKILL)
        exited = wait_until("standby engine exited", lambda: engine_events(stack.log_path, "standby engine exited"),
                            stack)
        assert exited[0]["pid"] == spare and exited[0]["code"] == -signal.SIGKILL
        second = wait_until("a second spare", lambda: spares_ready(stack, 2), stack)[1]
        assert second != spare and stack.children()["standby-engine"] == second and shm_held(second) == []
        assert completion(stack, key) == 1
        assert stack.proc is not None
        stack.proc.kill()  # no drain, no clean-up: every child must still go (PR_SET_PDEATHSIG, the go pipe)
        stack.proc.wait()
        wait_until("no process of the stack", lambda: processes_of(stack) == [], stack, 30)
        wait_until("the engine's segment removed", lambda: not segment_exists(stack), stack, 30)
    finally:
        stop_stack(stack)


def weight_files(pid: int) -> set[str]:
    """The shared weight files (``gpu_engine.models.shared_weights``) a process maps."""
    return {line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if line.rstrip().endswith(".bin") and "/weights-" in line}


def test_with_a_weights_folder_the_engine_and_the_spare_map_one_file(tmp_path: Path) -> None:
    folder = tmp_path / "weights"
    folder.mkdir(mode=0o700)
    stack = start_stack(tmp_path, *ENGINE_FLAGS, engine_module=REAL_ENGINE, timeout_s=LIMIT_S, standby_engine=True,
                        env={**ENGINE_ENV, "BLINK_CPU_WEIGHTS_DIR": str(folder)})
    try:
        (spare,) = wait_until("standby engine ready", lambda: spares_ready(stack, 1), stack)
        (path,) = weight_files(stack.engine_pid())
        assert weight_files(spare) == {path} and Path(path).parent == folder
        shared = engine_events(stack.log_path, "weights shared")
        assert [e["wrote"] for e in shared] == [True, False] and {e["file"] for e in shared} == {path}
        assert all(e["kept_mib"] == 0 for e in shared)
        assert completion(stack, max_tokens=4) == 1
    finally:
        assert stop_stack(stack) == 0, stack.log()
    assert [p.name for p in folder.iterdir()] == [Path(path).name]  # kept for the next start, which checks it


@pytest.mark.parametrize("engine_module", [FAKE_ENGINE, pytest.param(REAL_ENGINE, marks=pytest.mark.slow)],
                         ids=["fake", "real"])
def test_without_a_live_spare_a_dead_engine_restarts_cold(tmp_path: Path, engine_module: str) -> None:
    """The spare and the engine die while the supervisor is stopped, so it finds both dead at once. What restarts
    cold is the supervisor's choice, so CI runs it with the fake engine; with the real one (three engine loads) the
    form is marked ``slow``."""
    stack = start_stack(tmp_path, *ENGINE_FLAGS, engine_module=engine_module, env=ENGINE_ENV, timeout_s=LIMIT_S,
                        standby_engine=True)
    try:
        (spare,) = wait_until("standby engine ready", lambda: spares_ready(stack, 1), stack)
        engine = stack.engine_pid()
        assert stack.proc is not None
        os.kill(stack.proc.pid, signal.SIGSTOP)
        try:
            for pid in (spare, engine):
                os.kill(pid, signal.SIGKILL)
            wait_until("both dead", lambda: exited(spare) and exited(engine), stack, 30)
        finally:
            os.kill(stack.proc.pid, signal.SIGCONT)
        cold = wait_until("a restarted engine", lambda: new_ready_engine(stack.ring, engine), stack)
        assert "--standby" not in Path(f"/proc/{cold}/cmdline").read_text().split("\0")
        assert engine_events(stack.log_path, "standby engine took over") == []
        assert [e["child"] for e in engine_events(stack.log_path, "started")].count("engine") == 2
        wait_until("the engines' health", lambda: http_get(stack.url + "/health")[0] == 200, stack, 30)
        assert completion(stack) == 1
        second = wait_until("a new spare", lambda: spares_ready(stack, 2), stack)[1]
        assert second not in (spare, cold) and stack.children()["standby-engine"] == second
    finally:
        assert stop_stack(stack) == 0, stack.log()
    assert processes_of(stack) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_spare_stops_with_the_supervisor(tmp_path: Path, sig: signal.Signals) -> None:
    stack = start_stack(tmp_path, standby_engine=True)
    assert stack.proc is not None
    try:
        spare = wait_until("a spare", lambda: stack.children().get("standby-engine"), stack, 30)
        stack.proc.send_signal(sig)
        assert stack.proc.wait(60) == 0, stack.log()
        assert not Path(f"/proc/{spare}").exists()
        assert processes_of(stack) == []
    finally:
        stop_stack(stack)


def test_no_standby_engine_starts_none_and_restarts_cold(tmp_path: Path) -> None:
    stack = start_stack(tmp_path)  # the harness's default: --no-standby-engine
    assert "--no-standby-engine" in stack.args
    try:
        engine = stack.engine_pid()
        time.sleep(STANDBY_IDLE_S + 1.0)  # a spare would be started once the idle engine had been so that long
        assert sorted(stack.children()) == ["engine", "gateway-0", "reader", "tokenizer", "tracker"]
        os.kill(engine, signal.SIGKILL)
        wait_until("a restarted engine", lambda: new_ready_engine(stack.ring, engine), stack, 30)
        time.sleep(STANDBY_IDLE_S + 1.0)
        assert "standby-engine" not in stack.children()
        assert engine_events(stack.log_path, "standby engine took over") == []
    finally:
        assert stop_stack(stack) == 0, stack.log()
    assert processes_of(stack) == []


def test_a_spare_that_keeps_dying_is_given_up(tmp_path: Path) -> None:
    """Replaced at most RESTARTS_PER_MINUTE times a minute, then given up: engines restart cold from there."""
    stack = start_stack(tmp_path, standby_engine=True)
    killed: set[int] = set()

    def new_spare() -> int | None:
        pid = stack.children().get("standby-engine")
        return pid if pid not in killed else None

    try:
        for _ in range(RESTARTS_PER_MINUTE + 1):
            spare = wait_until("a new spare", new_spare, stack, 30)
            os.kill(spare, signal.SIGKILL)
            killed.add(spare)
        wait_until("given up", lambda: engine_events(stack.log_path, "standby engine given up: engines restart cold"),
                   stack, 30)
        time.sleep(1.0)
        assert "standby-engine" not in stack.children()
        assert {e["pid"] for e in engine_events(stack.log_path, "standby engine exited")} == killed
    finally:
        assert stop_stack(stack) == 0, stack.log()
    assert processes_of(stack) == []


def test_a_spare_waits_for_the_engines_idle(tmp_path: Path) -> None:
    """STANDBY_IDLE_S after READY with no request; a spare that died under load is replaced only once the load
    ended and the engine was idle that long (the deadline under load: ``test_a_spare_is_due``)."""
    stack = start_stack(tmp_path, standby_engine=True)
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            completion(stack, max_tokens=200)  # about 0.5 s on the fake engine

    try:
        first = wait_until("a spare", lambda: stack.children().get("standby-engine"), stack, 30)
        (ready,) = [e for e in engine_events(stack.log_path, "ready") if e.get("service") == "serve"]
        assert wall(spare_starts(stack)[0]) - wall(ready) >= STANDBY_IDLE_S
        with ThreadPoolExecutor(2) as pool:  # two clients: a request always runs
            clients = [pool.submit(load) for _ in range(2)]
            wait_until("requests running", lambda: stack.gauges()["num_requests_running"], stack, 60)
            os.kill(first, signal.SIGKILL)
            wait_until("the spare's exit", lambda: engine_events(stack.log_path, "standby engine exited"), stack, 60)
            time.sleep(2 * STANDBY_IDLE_S)
            idle_from = time.time()  # the last request ends after this (the clients run until told to stop)
            stop.set()
            for c in clients:
                c.result()
        assert len(spare_starts(stack)) == 1, "a spare was started under load"
        wait_until("a new spare", lambda: len(spare_starts(stack)) == 2, stack, 60)
        assert wall(spare_starts(stack)[1]) - idle_from >= STANDBY_IDLE_S
    finally:
        stop.set()
        assert stop_stack(stack) == 0, stack.log()
    assert processes_of(stack) == []


def test_a_spare_is_due() -> None:
    """Every serving engine READY and idle STANDBY_IDLE_S, or READY STANDBY_DEADLINE_S whatever the load; an
    engine not READY starts both clocks again."""
    clock = SpareClock()
    assert not clock.due(0.0, ready=False, idle=False)
    assert not clock.due(1.0, ready=True, idle=True)
    assert not clock.due(1.0 + STANDBY_IDLE_S - 0.1, ready=True, idle=True)
    assert clock.due(1.0 + STANDBY_IDLE_S, ready=True, idle=True)
    busy = SpareClock()
    t = 10.0
    assert not busy.due(t, ready=True, idle=False)
    for k in range(1, int(STANDBY_DEADLINE_S)):  # a request always running, an idle look now and then
        assert not busy.due(t + k, ready=True, idle=k % 2 == 0)
    assert busy.due(t + STANDBY_DEADLINE_S, ready=True, idle=False)
    assert not busy.due(t + STANDBY_DEADLINE_S + 1, ready=False, idle=False)  # an engine restarting
    assert not busy.due(t + STANDBY_DEADLINE_S + 2, ready=True, idle=False)


def test_a_spare_that_cannot_be_spawned_counts_as_one_that_died(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Spawning the spare raises OSError (here exec of an interpreter that is gone): logged, the server goes
    on, and after RESTARTS_PER_MINUTE + 1 in a minute the spare is given up, as one that keeps dying."""
    sup = supervisor.Supervisor(ServeConfig(tmp_path, "blink-test-spawn", "127.0.0.1", 0, 1, (("--ring", "r"),),
                                            (), (), ()))
    assert sup.standby is not None
    sup.standby.argv = [str(tmp_path / "gone" / "python"), *sup.standby.argv[1:]]
    monkeypatch.setattr(sup, "_engine_status", lambda _engine: (True, True))  # READY and idle
    monkeypatch.setattr(supervisor, "STANDBY_IDLE_S", 0.0)  # due at every look
    for _ in range(RESTARTS_PER_MINUTE + 1):
        sup._keep_standby()
    assert sup.standby is None
    err = capsys.readouterr().err
    assert err.count("standby engine not started") == RESTARTS_PER_MINUTE + 1, err
    assert "No such file or directory" in err and err.count("standby engine given up") == 1, err


@pytest.mark.parametrize("line", [b"go\n", b"\n", b'{"ring": 3}\n', b'{"env": {}}\n'])
def test_a_line_that_is_not_a_go_is_refused(line: bytes) -> None:
    with pytest.raises(BadGo, match="--standby waits for blink serve's go on stdin"):
        wait_for_go(io.BytesIO(line))
    assert wait_for_go(io.BytesIO(b"")) is None


def test_a_spare_typed_at_says_so_and_exits_2(tmp_path: Path) -> None:
    """``blink engine --standby`` from a terminal, and a line typed: one error line, no traceback. (A GPU backend
    only imports before the go, which takes the CPU backend's weight loading out of the test.)"""
    out = subprocess.run([sys.executable, "-m", "gpu_engine.serve", "--standby", "--backend", "host", "--ring",
                          f"blink-test-{uuid.uuid4().hex[:10]}"], cwd=ROOT, input="hello\n", capture_output=True,
                         text=True, timeout=LIMIT_S, env={**os.environ, "BLINK_LOG_JSON": "1"})
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.splitlines()[-1].startswith("error: --standby waits for blink serve's go on stdin, not 'hello'")


def test_a_gpu_spare_without_a_gpu_makes_no_context_and_still_takes_the_go() -> None:
    """``--standby-gpu-known`` where CUDA cannot start (this torch has none, or the GPU's memory is taken): a
    warning, the context left to the go as on a cold start, and the spare still answers its stdin."""
    out = subprocess.run([sys.executable, "-m", "gpu_engine.serve", "--standby", "--standby-gpu-known", "--backend",
                          "host", "--ring", f"blink-test-{uuid.uuid4().hex[:10]}"], cwd=ROOT, input="hello\n",
                         capture_output=True, text=True, timeout=LIMIT_S, env={**os.environ, "BLINK_LOG_JSON": "1",
                                                                               "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 2, out.stderr
    ready = [json.loads(line) for line in out.stdout.splitlines() + out.stderr.splitlines()
             if '"standby engine ready"' in line]
    assert [r["cuda_context"] for r in ready] == [False], out.stderr
    assert "no CUDA context before the go" in out.stdout + out.stderr
    assert out.stderr.splitlines()[-1].startswith("error: --standby waits for blink serve's go on stdin")


def test_under_dp_the_engine_that_was_a_spare_is_named_by_its_ring(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, "--data-parallel-size", "2", standby_engine=True)
    try:
        spare = wait_until("a spare", lambda: stack.children().get("standby-engine"), stack, 30)
        children = stack.children()
        assert {"engine-0", "engine-1", "standby-engine"} <= set(children) and "engine" not in children
        # which GPU the spare gets is told only at the go: no context before it
        assert "--standby-gpu-known" not in Path(f"/proc/{spare}/cmdline").read_text().split("\0")
        ring1 = engine_ring_names(stack.ring, 2)[1]
        os.kill(children["engine-1"], signal.SIGKILL)
        took = wait_until("the spare serving ring 1", lambda: new_ready_engine(ring1, children["engine-1"]), stack)
        assert took == spare
        assert stack.children()["engine-1"] == spare and stack.children()["engine-0"] == children["engine-0"]
        second = wait_until("a new spare", lambda: stack.children().get("standby-engine"), stack, 30)
        assert second != spare and stack.children()["engine-1"] == spare
    finally:
        assert stop_stack(stack) == 0, stack.log()
    assert processes_of(stack) == []
