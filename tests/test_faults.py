"""Kill -9 each part of ``blink serve`` (real CPU engine, two gateways) while a stream runs.

For every part: the in-flight stream ends (an error event then ``[DONE]`` when it depended on
the part, a closed connection for its own gateway, a normal end when it did not need the part or,
for the token reader, when the restarted reader took the stream over)
and none hangs; ``/health`` says 503 while a part the whole server needs is down (the engine's is too short to
be seen: the standby engine, ready before the faults, takes its place); the supervisor
restarts it; new requests succeed; no process is left over (a new spare follows); slots return to zero. A dead
engine's ring segment is replaced by the restarted engine's. Recovery times are printed, and
written as JSON to ``$BLINK_FAULTS_OUT`` when set.

A full ring (bounded wait, then 429 + Retry-After) is ``tests/test_frontend_backpressure.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from helpers.http_jobs import engine_events
from helpers.procfs import fd_targets, tcp_sockets
from helpers.stack import MODEL, Stack, processes_of, start_stack, stop_stack

from shared import ipc
from shared import ring_layout as L
from shared.ring import attach_shm_ring
from shared.transport import SHM_DIR

REAL_ENGINE = "gpu_engine.serve"
TOKENS = 64
LONG = 1024  # a stream that must outlast a restart
STREAM = {"model": MODEL, "prompt": [1, 504, 3287, 314, 260, 1345, 30], "max_tokens": TOKENS, "ignore_eos": True,
          "temperature": 0, "stream": True}
SHORT = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2}  # text: the tokenizer is needed
PROCESSES = 1 + 2 + 3 + 2  # supervisor, engine and standby engine, tokenizer/reader/tracker, two gateways
RESULTS: dict[str, dict] = {}


@pytest.fixture(scope="module")
def fault_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("faults"), "--gateways", "2", "--num-slots", "16",
                        "--max-prompt-tokens", "64", "--max-output-tokens", str(LONG), engine_module=REAL_ENGINE,
                        env={"BLINK_HEARTBEAT_TIMEOUT_S": "5"}, timeout_s=300, standby_engine=True)
    deadline = time.monotonic() + 120  # the restart figures are the standby engine's
    while not engine_events(stack.log_path, "standby engine ready"):
        assert time.monotonic() < deadline, f"no standby engine:\n{stack.log()}"
        time.sleep(0.2)
    yield stack
    code = stop_stack(stack)
    out = os.environ.get("BLINK_FAULTS_OUT")
    print("\nfault recovery:", json.dumps(RESULTS, indent=1))
    if out:
        Path(out).write_text(json.dumps(RESULTS, indent=1) + "\n")
    assert code == 0, stack.log()
    assert processes_of(stack) == []


# ---------------------------------------------------------------------- who is who
def ready_pid(stack: Stack, name: str) -> int | None:
    try:
        return int(ipc.ready_path(stack.run_dir, name).read_text())
    except (FileNotFoundError, ValueError):
        return None


def socket_inodes(pid: int) -> set[int]:
    return {int(t[8:-1]) for t in fd_targets(pid) if t.startswith("socket:[")}


def server_socket_inode(server_port: int, client_port: int) -> int | None:
    """The inode of the server's end of the TCP connection from ``client_port``."""
    return next((s.inode for s in tcp_sockets() if s.local_port == server_port and s.remote_port == client_port),
                None)


def victim_pid(stack: Stack, part: str, client_port: int) -> int:
    if part == "engine":
        return stack.engine_pid()
    if part != "gateway":
        pid = ready_pid(stack, part)
        assert pid is not None
        return pid
    inode = server_socket_inode(stack.port, client_port)
    for name in ("gateway-0", "gateway-1"):
        pid = ready_pid(stack, name)
        if pid is not None and inode in socket_inodes(pid):
            return pid
    raise AssertionError("no gateway owns the stream's connection")


def restarted(stack: Stack, part: str, old: int) -> bool:
    if part == "engine":
        try:
            return stack.engine_pid() != old and stack.get("/health")[0] == 200
        except Exception:
            return False
    names = ("gateway-0", "gateway-1") if part == "gateway" else (part,)
    pids = [ready_pid(stack, n) for n in names]
    return old not in pids and None not in pids


# ---------------------------------------------------------------------- the client's view
async def open_stream(session: aiohttp.ClientSession, stack: Stack) -> tuple[aiohttp.ClientResponse, int]:
    resp = await session.post(stack.url + "/v1/completions", json=STREAM)
    assert resp.status == 200, await resp.text()
    await resp.content.readuntil(b"\n\n")  # the first token: generation is under way
    assert resp.connection is not None
    port = resp.connection.transport.get_extra_info("sockname")[1]
    return resp, port


async def read_rest(resp: aiohttp.ClientResponse, t_kill: float) -> dict:
    """How the stream ended: its last events, and when (seconds after the kill)."""
    events: list = []
    how = "eof"
    try:
        async for raw in resp.content:
            line = raw.strip()
            if line.startswith(b"data: "):
                data = line[6:].decode()
                events.append(data if data == "[DONE]" else json.loads(data))
    except aiohttp.ClientError as exc:
        how = type(exc).__name__
    tokens = sum(1 for e in events if isinstance(e, dict) and e.get("choices") and e["choices"][0]["text"])
    return {"ended_s": time.monotonic() - t_kill, "how": how, "done": bool(events) and events[-1] == "[DONE]",
            "error": next((e["error"] for e in events if isinstance(e, dict) and "error" in e), None),
            "tokens_after_kill": tokens}


async def health_seen(stack: Stack, seconds: float) -> list[int]:
    seen = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        seen.append((await asyncio.to_thread(stack.get, "/health"))[0])
        await asyncio.sleep(0.05)
    return seen


async def first_success(session: aiohttp.ClientSession, stack: Stack, t_kill: float, limit_s: float) -> float:
    while True:
        try:
            async with session.post(stack.url + "/v1/completions", json=SHORT) as r:
                if r.status == 200:
                    return time.monotonic() - t_kill
        except aiohttp.ClientError:
            pass
        assert time.monotonic() - t_kill < limit_s, "no request succeeded after the fault"
        await asyncio.sleep(0.1)


async def wait_restart(stack: Stack, part: str, old: int, t_kill: float, limit_s: float) -> float:
    while not await asyncio.to_thread(restarted, stack, part, old):
        assert time.monotonic() - t_kill < limit_s, f"{part} was not restarted:\n{stack.log()}"
        await asyncio.sleep(0.05)
    return time.monotonic() - t_kill


# ---------------------------------------------------------------------- the faults
def check_stream_end(part: str, end: dict) -> None:
    if part == "engine":  # the stream needed it: an error event, then [DONE], at once
        assert end["error"] is not None and end["done"], end
        assert end["error"]["type"] == "service_unavailable", end
    elif part == "gateway":  # its own gateway is gone: the connection closes, with no [DONE]
        assert not end["done"], end
    else:  # tokenizer, tracker: an admitted stream needs neither; reader: the restarted one re-attaches it
        # (docs/DEPLOY.md); it finishes whole
        assert end["error"] is None and end["done"], end
        assert end["tokens_after_kill"] >= 1, end


async def settle(stack: Stack) -> None:
    deadline = time.monotonic() + 60
    while stack.metric("blink:slots_in_use") != 0:
        assert time.monotonic() < deadline, "slots were not released after the fault"
        await asyncio.sleep(0.1)


async def all_gateways_linked(stack: Stack, timeout_s: float = 30) -> None:
    """Ten healthy answers in a row, each on a new connection (spread over both gateways by the
    kernel): every gateway has its links to tokenizer, tracker and reader back."""
    deadline, streak = time.monotonic() + timeout_s, 0
    while streak < 10:
        assert time.monotonic() < deadline, f"a gateway did not re-link:\n{stack.log()}"
        streak = streak + 1 if (await asyncio.to_thread(stack.get, "/health"))[0] == 200 else 0
        await asyncio.sleep(0.02)


def segment_identity(stack: Stack) -> tuple[int, int]:
    st = os.stat(SHM_DIR / stack.ring)
    return st.st_dev, st.st_ino


@pytest.mark.parametrize("part", ["tokenizer", "tracker", "reader", "gateway", "engine"])
async def test_kill_mid_stream(fault_stack: Stack, part: str) -> None:
    stack = fault_stack
    await all_gateways_linked(stack)
    segment = segment_identity(stack)
    timeout = aiohttp.ClientTimeout(total=180)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        resp, client_port = await open_stream(session, stack)
        victim = victim_pid(stack, part, client_port)
        t_kill = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        end, health, success_s, restart_s = await asyncio.gather(
            read_rest(resp, t_kill), health_seen(stack, 1.5), first_success(session, stack, t_kill, 120),
            wait_restart(stack, part, victim, t_kill, 120))
    check_stream_end(part, end)
    if part == "gateway":
        # The other gateway keeps serving. A connection that sat in the killed gateway's accept queue at
        # the moment of the kill is reset (SO_REUSEPORT gives each listener its own queue): allow that.
        # (a slow host keeps the killed one's queue a while longer: how many looks that takes is not asked)
        assert 503 not in health and health[-1] == 200, health
    elif part != "engine":  # the standby engine takes a dead engine's place in tenths of a second: between two looks
        assert 503 in health, health
    print(f"\n{part}: first success {success_s:.2f} s, restarted {restart_s:.2f} s after the kill")  # speed: not asked
    await settle(stack)
    await all_gateways_linked(stack)
    assert not Path(f"/proc/{victim}").exists()
    deadline = time.monotonic() + 30  # after the engine's: the new spare, once the engine has been idle a while
    while len(processes_of(stack)) != PROCESSES:
        assert time.monotonic() < deadline, processes_of(stack)
        await asyncio.sleep(0.1)
    if part == "engine":
        assert segment_identity(stack) != segment and stack.engine_pid() != victim
    RESULTS[part] = {"stream_end_s": round(end["ended_s"], 3), "stream": "error event" if end["error"] else
                     ("[DONE]" if end["done"] else end["how"]), "health_503_seen": 503 in health,
                     "restarted_s": round(restart_s, 2), "first_success_s": round(success_s, 2)}


async def test_hang_up_after_tracker_restart_cancels_the_slot(fault_stack: Stack) -> None:
    """A restarted tracker never saw the requests its predecessor admitted; a client that hangs up
    on one must still free its slot at once, not after the engine generated every token."""
    stack = fault_stack
    await all_gateways_linked(stack)
    body = {**STREAM, "max_tokens": LONG}  # outlasts the restart however slow the host
    async with aiohttp.ClientSession() as session:
        resp = await session.post(stack.url + "/v1/completions", json=body)
        await resp.content.readuntil(b"\n\n")
        old = ready_pid(stack, "tracker")
        assert old is not None
        os.kill(old, signal.SIGKILL)
        await wait_restart(stack, "tracker", old, time.monotonic(), 60)
        await all_gateways_linked(stack)
        chunks = [await resp.content.readuntil(b"\n\n")]  # still streaming after the restart
        resp.close()  # the client hangs up
    assert b"[DONE]" not in chunks[-1]
    await settle(stack)
    last = last_request_of_ring(stack)  # an EMPTY slot keeps its last request's outcome until reused
    assert last["finish_reason"] == L.FinishReason.CANCELLED and last["generated"] < LONG, last


def last_request_of_ring(stack: Stack) -> dict:
    ring = attach_shm_ring(stack.ring)
    try:
        slots = ring.read_slots()
    finally:
        ring.close()
    last = slots[int(np.argmax(slots["submit_ns"]))]
    return {"finish_reason": int(last["finish_reason"]), "generated": int(last["generated"])}
