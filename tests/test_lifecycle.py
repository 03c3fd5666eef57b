"""The server's lifecycle under stress (issue 48), with real processes and sockets: a hung engine replaced, one
server per run dir, ring and port, ``/health`` of this server's engine only, a drain that refuses new requests,
idle connections that cannot lock clients out, a full or read-only run dir said clearly, and the heartbeat
timeout's one default. No timing is asserted: deadlines here only keep a broken build from hanging.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from helpers.http_jobs import engine_events
from helpers.stack import MODEL, Stack, processes_of, start_stack, stop_stack
from helpers.starve import hog, pin, two_cpus

from blink.supervisor import STOPPED_S
from dpu_gateway.connguard import EVICTABLE_IDLE_S
from harness.serve_proc import ROOT, free_port, http_get, new_ready_engine, ring_engine_pid
from shared.data_parallel import engine_ring_names
from shared.ipc import SOCKET_SERVICES

LIMIT_S = 120.0  # generous: a loaded 2-core machine; only guards against waiting for ever
HANG_TIMEOUT_S = 5.0  # long enough that a healthy engine on a loaded host is never taken for hung
HANG_ENV = {"BLINK_HEARTBEAT_TIMEOUT_S": str(HANG_TIMEOUT_S)}
T = TypeVar("T")


def wait_until(what: str, check: Callable[[], T], stack: Stack | None = None, limit_s: float = LIMIT_S) -> T:
    end = time.monotonic() + limit_s
    while not (got := check()):
        assert time.monotonic() < end, f"{what} not seen within {limit_s} s:\n{stack.log() if stack else ''}"
        time.sleep(0.05)
    return got


def stream_body(max_tokens: int) -> str:
    return json.dumps({"model": MODEL, "prompt": "one two three four five six seven eight", "max_tokens": max_tokens,
                       "ignore_eos": True, "stream": True})


def post(conn: http.client.HTTPConnection, body: str) -> http.client.HTTPResponse:
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    return conn.getresponse()


@dataclasses.dataclass
class Streamed:
    """A stream read in a thread: its first bytes are flagged, the whole body kept."""

    started: threading.Event = dataclasses.field(default_factory=threading.Event)
    body: bytes = b""


def stream_in_thread(stack: Stack, max_tokens: int) -> tuple[threading.Thread, Streamed]:
    out = Streamed()

    def run() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=LIMIT_S)
        resp = post(conn, stream_body(max_tokens))
        out.body = resp.read(1)
        out.started.set()
        out.body += resp.read()
        conn.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def health(stack: Stack) -> tuple[int, str | None]:
    status, body = http_get(stack.url + "/health")
    code = json.loads(body)["error"]["code"] if status == 503 and body.startswith(b"{") else None
    return status, code


# ---------------------------------------------------------------------- a hung engine
def test_a_stopped_engine_is_killed_and_the_spare_takes_over(tmp_path: Path) -> None:
    """With the default heartbeat timeout: the stopped process is the verdict (``STOPPED_S``). The stream's 1,000
    steps of 20 ms outlast any delay a busy host puts between its first token and the stop."""
    stack = start_stack(tmp_path, standby_engine=True, env={"FAKE_ENGINE_STEP_MS": "20"})
    try:
        wait_until("the spare", lambda: engine_events(stack.log_path, "standby engine ready"), stack)
        hung = stack.engine_pid()
        thread, streamed = stream_in_thread(stack, 1000)
        assert streamed.started.wait(LIMIT_S)
        os.kill(hung, signal.SIGSTOP)
        new = wait_until("a new engine", lambda: new_ready_engine(stack.ring, hung), stack)
        thread.join(LIMIT_S)
        wait_until("/health 200", lambda: health(stack)[0] == 200, stack)
        killed = engine_events(stack.log_path, "engine hung: killed, to be replaced")
        assert [e["pid"] for e in killed] == [hung] and killed[0]["stopped_s"] >= STOPPED_S
        assert not Path(f"/proc/{hung}").exists() or "zombie" in Path(f"/proc/{hung}/status").read_text()
        assert engine_events(stack.log_path, "standby engine took over")[0]["pid"] == new
        assert b'"finish_reason":"length"' not in streamed.body and b"error" in streamed.body
    finally:
        assert stop_stack(stack) == 0, stack.log()
    assert processes_of(stack) == []


def test_an_engine_whose_beat_stops_is_killed_and_replaced(tmp_path: Path) -> None:
    """A deadlock: the process runs, its beat stops; the silence past the timeout is the verdict."""
    trigger = tmp_path / "hang-now"
    env = {**HANG_ENV, "FAKE_ENGINE_HANG_ONCE": str(trigger)}
    stack = start_stack(tmp_path, env=env, standby_engine=True)
    try:
        trigger.touch()  # the live engine takes it at its next beat and hangs
        killed = wait_until("the verdict", lambda: engine_events(stack.log_path, "engine hung: killed, to be replaced"),
                            stack)
        hung = killed[0]["pid"]
        new = wait_until("a new engine", lambda: new_ready_engine(stack.ring, hung), stack)
        wait_until("/health 200", lambda: health(stack)[0] == 200, stack)
        assert killed[0]["silent_s"] >= HANG_TIMEOUT_S and killed[0]["stopped_s"] == 0 and len(killed) == 1
        assert stack.engine_pid() == new and not Path(f"/proc/{hung}").exists()  # killed and reaped
    finally:
        assert stop_stack(stack) == 0, stack.log()


def test_under_dp_only_the_hung_engine_is_replaced(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, "--data-parallel-size", "2", env=HANG_ENV)
    try:
        ring0, ring1 = engine_ring_names(stack.ring, 2)
        first, hung = ring_engine_pid(ring0), ring_engine_pid(ring1)
        assert first is not None and hung is not None
        os.kill(hung, signal.SIGSTOP)
        wait_until("engine-1 replaced", lambda: new_ready_engine(ring1, hung), stack)
        assert ring_engine_pid(ring0) == first
        killed = engine_events(stack.log_path, "engine hung: killed, to be replaced")
        assert [e["child"] for e in killed] == ["engine-1"]
    finally:
        assert stop_stack(stack) == 0, stack.log()


# ---------------------------------------------------------------------- liveness: one default, logged 503s
def test_the_heartbeat_timeout_has_one_default() -> None:
    from blink.supervisor import ServeConfig
    from dpu_gateway.reader import ReaderConfig
    from dpu_gateway.state import GatewayConfig
    from dpu_gateway.tracker import TrackerConfig
    from shared.env import HEARTBEAT_TIMEOUT_S, Env

    defaults = {c.__name__: {f.name: f.default for f in dataclasses.fields(c)}["heartbeat_timeout_s"]
                for c in (Env, GatewayConfig, ReaderConfig, TrackerConfig, ServeConfig)}
    assert set(defaults.values()) == {HEARTBEAT_TIMEOUT_S}, defaults
    written = [p for p in [*ROOT.glob("dpu_gateway/*.py"), *ROOT.glob("blink/*.py"), ROOT / "docker/healthcheck.py"]
               if "HEARTBEAT_TIMEOUT_S = " in p.read_text() or "heartbeat_timeout_s: float = 2" in p.read_text()]
    assert written == []


def test_liveness_503s_are_logged_with_the_silence(tmp_path: Path) -> None:
    # a short timeout, under the supervisor's STOPPED_S, so that the reader's verdict can come first (the engine
    # is stopped here on purpose: a slow host cannot make a healthy one look hung before that)
    stack = start_stack(tmp_path, env={"BLINK_HEARTBEAT_TIMEOUT_S": "1.5", "FAKE_ENGINE_STEP_MS": "20"})
    try:
        hung = stack.engine_pid()
        thread, streamed = stream_in_thread(stack, 1000)
        assert streamed.started.wait(LIMIT_S)
        os.kill(hung, signal.SIGSTOP)
        thread.join(LIMIT_S)
        assert b"error" in streamed.body and b'"finish_reason":"length"' not in streamed.body
        # the reader's verdict (the streams failed) or the supervisor's (the engine killed) came first: either
        # line says how long the engine was silent
        lines = wait_until("a liveness line", lambda: engine_events(
            stack.log_path, "engine stopped responding: streams failed with 503") or engine_events(
            stack.log_path, "engine hung: killed, to be replaced"), stack)
        assert lines[0]["silent_s"] >= 1.5 and lines[0]["timeout_s"] == 1.5, lines
        wait_until("a refused request's line", lambda: health(stack)[0] == 503 and engine_events(
            stack.log_path, "engine unavailable: 503"), stack)
        line = engine_events(stack.log_path, "engine unavailable: 503")[0]
        assert "silent" in line["engines"]["0"] or "no ring" in line["engines"]["0"], line
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(hung, signal.SIGCONT)
        assert stop_stack(stack) == 0, stack.log()


def test_an_engine_kept_off_the_cpu_is_slow_not_dead(tmp_path: Path) -> None:
    """The engine's CPU kept busy by a real-time process for 3 s, with a heartbeat timeout of 0.5 s: the engine is
    silent past the timeout, runnable and waiting for the CPU all the while, and its stream goes on afterwards to
    its last token; nothing fails, no engine is replaced, and the reader says once that the engine was starved.
    (Before, the reader failed the stream with 503 "the engine stopped responding".) The frontend keeps the
    other CPUs."""
    starved, others = two_cpus()
    stack = start_stack(tmp_path, env={"BLINK_HEARTBEAT_TIMEOUT_S": "0.5", "FAKE_ENGINE_STEP_MS": "20"})
    try:
        engine = stack.engine_pid()
        for pid in processes_of(stack):
            pin(pid, others)
        pin(engine, {starved})
        thread, streamed = stream_in_thread(stack, 300)
        assert streamed.started.wait(LIMIT_S)
        hog(starved, 3.0)
        thread.join(LIMIT_S)
        assert b'"finish_reason":"length"' in streamed.body and b'"error"' not in streamed.body, streamed.body[-500:]
        said = wait_until("the starved line", lambda: engine_events(stack.log_path, STARVED), stack)
        assert said[0]["silent_s"] >= 0.5 and said[0]["starved_s"] > 0, said
        assert not engine_events(stack.log_path, "engine stopped responding: streams failed with 503")
        assert not engine_events(stack.log_path, "engine hung: killed, to be replaced")
        assert stack.engine_pid() == engine and health(stack)[0] == 200
    finally:
        for pid in processes_of(stack):
            pin(pid, {starved} | others)
        assert stop_stack(stack) == 0, stack.log()


STARVED = "engine starved: silent past the timeout while waiting for a CPU, not taken for hung"


# ---------------------------------------------------------------------- one server per run dir, ring and port
def serve_again(stack: Stack, run_dir: Path, ring: str, port: int) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "blink.cli", "serve", "--no-standby-engine", "--run-dir", str(run_dir), "--ring",
           ring, "--port", str(port), "--engine-module", "tests.helpers.fake_engine"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=LIMIT_S,
                          env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"})


def test_a_second_server_on_a_served_run_dir_ring_or_port_is_refused(tmp_path: Path) -> None:
    stack = start_stack(tmp_path / "a")
    other = tmp_path / "b-run"
    try:
        assert stack.proc is not None
        owner = f"is already served by blink serve pid {stack.proc.pid}"
        tries = {"run dir": (stack.run_dir, f"ring-{stack.ring}-b", free_port()),
                 "ring": (other, stack.ring, free_port()), "port": (other, f"{stack.ring}-b", stack.port)}
        for what, (run_dir, ring, port) in tries.items():
            done = serve_again(stack, run_dir, ring, port)
            assert done.returncode == 2 and owner in done.stderr and what in done.stderr, (what, done.stderr)
            assert "Traceback" not in done.stderr
        assert health(stack)[0] == 200 and http_get(stack.url + "/metrics")[0] == 200
        assert (stack.run_dir / "metrics").is_dir()
        assert all((stack.run_dir / f"{name}.sock").exists() for name in SOCKET_SERVICES)
    finally:
        assert stop_stack(stack) == 0, stack.log()


def test_a_port_in_use_is_not_shared_without_reuse_port(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = serve_again(Stack((), tmp_path), tmp_path / "run", f"blink-test-port-{port}", port)
    assert done.returncode != 0  # the gateway could not bind: the port is not split with another listener


# ---------------------------------------------------------------------- /health of this server's engine only
def test_a_killed_servers_ring_is_not_taken_for_this_servers_engine(tmp_path: Path) -> None:
    first = start_stack(tmp_path / "a")
    old = first.engine_pid()
    for pid in [first.proc.pid, *processes_of(first)]:  # type: ignore[union-attr]
        os.kill(pid, signal.SIGKILL)
    first.proc.wait()  # type: ignore[union-attr]
    assert ring_engine_pid(first.ring) == old  # the crashed server's ring, READY, stays behind
    seen: list[tuple[int | None, tuple[int, str | None]]] = []
    second = Stack(("--drain-timeout", "2", "--no-standby-engine"), tmp_path / "b",
                   env={"FAKE_ENGINE_LOAD_S": "15"}, engine_module="tests.helpers.fake_engine", ring=first.ring)
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            engine = ring_engine_pid(first.ring)
            seen.append((engine, health(second)))
            time.sleep(0.05)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    try:
        second.start(LIMIT_S)
        wait_until("/health 200", lambda: health(second)[0] == 200, second)
    finally:
        stop.set()
        prober.join()
        assert stop_stack(second) == 0, second.log()
    before = [answer for engine, answer in seen if engine in (old, None) and answer[0] != 0]
    assert before and all(answer == (503, "model_loading") for answer in before), before


# ---------------------------------------------------------------------- a drain refuses new requests
def test_during_a_drain_new_requests_get_503_with_retry_after(tmp_path: Path) -> None:
    # 10 ms steps: the 1,000-token stream lasts about 10 s, past the signal, the drain's log line and the new request
    # however slow the host (within the 30 s drain)
    stack = start_stack(tmp_path, "--drain-timeout", "30", env={"FAKE_ENGINE_STEP_MS": "10"})
    try:
        idle = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=LIMIT_S)
        idle.request("GET", "/health")
        assert idle.getresponse().read() and True
        thread, streamed = stream_in_thread(stack, 1000)  # keeps the gateway draining
        assert streamed.started.wait(LIMIT_S)
        stack.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        wait_until("the drain", lambda: b'"gateway_draining"' in stack.log_path.read_bytes(), stack)
        resp = post(idle, stream_body(4))  # a new request on a connection opened before
        body = json.loads(resp.read())
        assert (resp.status, resp.getheader("Retry-After"), body["error"]["code"]) == (503, "1", "server_draining")
        thread.join(LIMIT_S)
        assert b'"finish_reason":"length"' in streamed.body  # the live stream was served to its end
    finally:
        assert stop_stack(stack) == 0, stack.log()


# ---------------------------------------------------------------------- idle connections of one peer
def test_idle_connections_of_one_peer_do_not_lock_out_health(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, "--max-connections", "32")
    held: list[socket.socket] = []
    try:
        for _ in range(2):  # the lock-out was renewable: the cap filled again
            held += [socket.create_connection(("127.0.0.1", stack.port), timeout=10) for _ in range(32)]
            time.sleep(EVICTABLE_IDLE_S + 0.5)  # every one accepted, and idle long enough to make room
            wait_until("/health 200", lambda: health(stack)[0] == 200, stack)  # not locked out (a busy host: later)
        assert stack.metrics().get("blink:http_connections_timed_out_total", 0) >= 1
    finally:
        for sock in held:
            sock.close()
        assert stop_stack(stack) == 0, stack.log()


# ---------------------------------------------------------------------- a full or read-only run dir
@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_a_full_run_dir_fails_a_restarted_gateway_clearly(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "run", "size=16m,mode=0700"):
        stack = start_stack(tmp_path)
        try:
            with contextlib.suppress(OSError), open(stack.run_dir / "filler", "wb") as f:
                while True:
                    f.write(b"\0" * (1 << 20))
            os.kill(stack.children()["gateway-0"], signal.SIGKILL)
            wait_until("the gateway's clear error", lambda: engine_events(
                stack.log_path, "gateway not started: no room for its metrics files"), stack)
            exits = wait_until("its exit", lambda: [e["code"] for e in engine_events(stack.log_path, "child_exited")
                                                    if e["code"] != -signal.SIGKILL], stack)
            assert -signal.SIGBUS not in exits and exits[0] == 1, exits
        finally:
            stop_stack(stack)


def test_a_read_only_run_dir_is_one_clear_line(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "ro", "ro,size=1m,mode=0700") as run_dir:
        done = serve_again(Stack((), tmp_path), run_dir, f"blink-test-ro-{os.getpid()}", free_port())
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"blink serve: run dir {run_dir}: Read-only file system" in done.stderr, done.stderr
