"""``blink serve``: several gateways on one port, restart of a crashed service, clean stop on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import openai
from helpers.stack import MODEL, Stack, processes_of, segment_exists, sse_events, start_stack, stop_stack

from shared import ipc


def ask(url: str) -> str | None:
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=10)
    out = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    return out.choices[0].finish_reason


def ready_pid(run_dir: Path, name: str) -> int | None:
    try:
        return int(ipc.ready_path(run_dir, name).read_text())
    except (FileNotFoundError, ValueError):
        return None


def restart_tracker(stack: Stack) -> None:
    tracker = ready_pid(stack.run_dir, "tracker")
    assert tracker is not None
    os.kill(tracker, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while ready_pid(stack.run_dir, "tracker") in (None, tracker):
        assert time.monotonic() < deadline, "tracker was not restarted"
        time.sleep(0.1)
    deadline = time.monotonic() + 60
    while True:  # the gateways re-link to the new tracker
        try:
            assert ask(stack.url) in ("stop", "length")
            break
        except (openai.APIStatusError, openai.APITimeoutError):
            assert time.monotonic() < deadline
            time.sleep(0.2)


async def stop_during_a_stream(stack: Stack) -> tuple[int, list]:
    """SIGTERM while a long stream runs: the stream must still end with [DONE] (drain, then stop)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 1000,
            "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(stack.url + "/v1/chat/completions", json=body)
        await resp.content.readuntil(b"\n\n")
        stopping = asyncio.create_task(asyncio.to_thread(stop_stack, stack))
        events = sse_events(await asyncio.wait_for(resp.read(), 30))
    return await stopping, events


async def test_serve_restarts_and_stops_cleanly(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, "--gateways", "2", "--drain-timeout", "0.5")
    try:
        assert {ready_pid(stack.run_dir, f"gateway-{i}") is not None for i in range(2)} == {True}
        for _ in range(6):  # connections spread over both gateways by SO_REUSEPORT
            assert await asyncio.to_thread(ask, stack.url) in ("stop", "length")
        await asyncio.to_thread(restart_tracker, stack)
        code, events = await stop_during_a_stream(stack)
        assert events[-1] == "[DONE]"
    finally:
        code = stop_stack(stack)
    assert code == 0, stack.log()
    assert processes_of(stack) == []
    assert not segment_exists(stack)
    assert not any(stack.run_dir.glob("*.sock")) and not any(stack.run_dir.glob("*.ready"))


def test_a_run_dir_too_long_for_unix_sockets_is_refused(tmp_path: Path) -> None:
    long_dir = tmp_path / ("d" * 100)
    out = subprocess.run([sys.executable, "-m", "blink.cli", "serve", "--run-dir", str(long_dir)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "too long for Unix sockets" in out.stderr and "--run-dir" in out.stderr


def nice_of(pid: int) -> set[int]:
    """The nice values of every thread of a process (field 19 of /proc/PID/task/TID/stat)."""
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out.add(int(task.joinpath("stat").read_text().rpartition(")")[2].split()[16]))
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return out


def test_service_nice_reaches_every_child_and_its_threads(tmp_path: Path) -> None:
    """--service-nice: every process blink serve starts (engine, tokenizer, reader, tracker, gateway) and every
    thread they start run at it; the supervisor itself does not. Below 0 where this test may (root)."""
    want = -3 if os.geteuid() == 0 else min(19, os.getpriority(os.PRIO_PROCESS, 0) + 4)
    stack = start_stack(tmp_path, "--service-nice", str(want))
    try:
        assert ask(stack.url) in ("stop", "length")
        assert stack.proc is not None
        children = [pid for pid in processes_of(stack) if pid != stack.proc.pid]
        assert len(children) >= 5, children
        assert {pid: nice_of(pid) for pid in children} == {pid: {want} for pid in children}
        assert nice_of(stack.proc.pid) == {os.getpriority(os.PRIO_PROCESS, 0)}
    finally:
        assert stop_stack(stack) == 0, stack.log()


def test_a_nice_value_the_user_may_not_take_is_reported_and_the_child_runs(tmp_path: Path) -> None:
    """Below 0 without CAP_SYS_NICE: the child still starts (at the nice it inherits) and the supervisor logs
    that the value was not taken. Run as an unprivileged user, which a root test process becomes first."""
    if os.geteuid() != 0:
        import pytest  # noqa: PLC0415

        pytest.skip("needs root to become an unprivileged user")
    # everything imported before the user changes (the interpreter's files may be closed to that user)
    code = ("import os, sys; from blink.supervisor import Child, log; log.info('probe'); os.setgid(65534); "
            "os.setuid(65534); c = Child('probe', ['sleep', '5'], None, nice=-3); c.spawn(); "
            "print(os.getpriority(os.PRIO_PROCESS, c.proc.pid)); c.proc.kill(); c.proc.wait()")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(root), "BLINK_LOG_JSON": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str(os.getpriority(os.PRIO_PROCESS, 0))
    assert "nice value not taken" in proc.stderr and "CAP_SYS_NICE" in proc.stderr, proc.stderr[-2000:]
