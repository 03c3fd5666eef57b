"""The standby engine of ``blink serve``: a spare engine process, started once the engine is READY, that waits
for the go and takes a dead engine's place (the restart itself: ``tests/test_device_watchdog_stack.py``).

With the real CPU engine: the spare holds no shared-memory segment and no key, one that dies is replaced, and
it dies with a SIGKILLed supervisor; without a live spare at a fault the engine restarts cold. With the fake
engine: the spare stops with the supervisor on SIGTERM and SIGINT, one that keeps dying is given up, and
``--no-standby-engine`` starts none.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from helpers.http_jobs import engine_events
from helpers.procfs import fd_targets
from helpers.stack import MODEL, Stack, processes_of, segment_exists, start_stack, stop_stack

from blink.supervisor import RESTARTS_PER_MINUTE
from harness.serve_proc import http_get
from shared import ring_layout as L
from shared.ring import attach_shm_ring
from shared.transport import RingError

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


def new_engine(stack: Stack, old: int) -> int | None:
    """The pid the ring names its engine, once that is READY and not ``old``."""
    try:
        ring = attach_shm_ring(stack.ring)
    except (RingError, ValueError):
        return None
    try:
        pid, state = ring.header_load32("engine_pid"), ring.header_load32("engine_state")
    finally:
        ring.close()
    return pid if pid != old and state == L.EngineState.READY else None


def shm_held(pid: int) -> list[str]:
    """The shared-memory files a process maps or has open."""
    maps = [line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/dev/shm/" in line]
    return maps + [t for t in fd_targets(pid) if t.startswith("/dev/shm/")]


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode(errors="replace").partition("=")[::2] for kv in raw if b"=" in kv)


def exited(pid: int) -> bool:
    """A zombie whose every thread has ended: only then can its parent reap it (a leader that took SIGKILL shows
    Z while its other threads still unmap the process's memory)."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return status["State"].split()[0] == "Z" and status["Threads"].strip() == "1"


def completion(stack: Stack, key: str | None = None) -> int:
    import openai

    c = openai.OpenAI(base_url=stack.url + "/v1", api_key=key or "unused", max_retries=0, timeout=30)
    out = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2)
    return len(out.choices)


def test_the_spare_holds_no_segment_nor_key_is_replaced_when_it_dies_and_dies_with_the_supervisor(
        tmp_path: Path) -> None:
    key = f"key-{uuid.uuid4().hex}"
    stack = start_stack(tmp_path, *ENGINE_FLAGS, api_key=key, engine_module=REAL_ENGINE, env=ENGINE_ENV,
                        timeout_s=LIMIT_S)
    try:
        (spare,) = wait_until("standby engine ready", lambda: spares_ready(stack, 1), stack)
        assert stack.children()["standby-engine"] == spare and stack.engine_pid() != spare
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


def test_without_a_live_spare_a_dead_engine_restarts_cold(tmp_path: Path) -> None:
    """The spare and the engine die while the supervisor is stopped, so it finds both dead at once."""
    stack = start_stack(tmp_path, *ENGINE_FLAGS, engine_module=REAL_ENGINE, env=ENGINE_ENV, timeout_s=LIMIT_S)
    try:
        (spare,) = wait_until("standby engine ready", lambda: spares_ready(stack, 1), stack)
        engine = stack.engine_pid()
        assert stack.proc is not None
        os.kill(stack.proc.pid, signal.SIGSTOP)
        try:
            for pid in (spare, engine):
                os.kill(pid, signal.SIGKILL)
            wait_until("both dead", lambda: exited(spare) and exited(engine), stack, 10)
        finally:
            os.kill(stack.proc.pid, signal.SIGCONT)
        cold = wait_until("a restarted engine", lambda: new_engine(stack, engine), stack)
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
    stack = start_stack(tmp_path)
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
    stack = start_stack(tmp_path, "--no-standby-engine")
    try:
        engine = stack.engine_pid()
        time.sleep(1.0)  # a spare would be started within the supervisor's next look (0.2 s)
        assert sorted(stack.children()) == ["engine", "gateway-0", "reader", "tokenizer", "tracker"]
        os.kill(engine, signal.SIGKILL)
        wait_until("a restarted engine", lambda: new_engine(stack, engine), stack, 30)
        time.sleep(1.0)
        assert "standby-engine" not in stack.children()
        assert engine_events(stack.log_path, "standby engine took over") == []
    finally:
        assert stop_stack(stack) == 0, stack.log()
    assert processes_of(stack) == []


def test_a_spare_that_keeps_dying_is_given_up(tmp_path: Path) -> None:
    """Replaced at most RESTARTS_PER_MINUTE times a minute, then given up: engines restart cold from there."""
    stack = start_stack(tmp_path)
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
                   stack, 10)
        time.sleep(1.0)
        assert "standby-engine" not in stack.children()
        assert {e["pid"] for e in engine_events(stack.log_path, "standby engine exited")} == killed
    finally:
        assert stop_stack(stack) == 0, stack.log()
    assert processes_of(stack) == []
