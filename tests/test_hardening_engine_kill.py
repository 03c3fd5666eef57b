"""Kill -9 the real CPU engine while several streams run: the token reader survives, and every
client gets the engine's error (not "the token reader went away"), then the restarted engine serves.

``tests/test_faults.py`` kills each part once with one stream; this is the case that crashed the
reader (it cancelled slots through the dead ring's closed mapping).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from helpers.stack import Stack, processes_of, start_stack, stop_stack
from test_faults import SHORT, STREAM, read_rest, ready_pid

STREAMS = 4


@pytest.fixture(scope="module")
def engine_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("engine-kill"), "--num-slots", "8", "--max-prompt-tokens", "64",
                        "--max-output-tokens", "128", engine_module="gpu_engine.serve",
                        env={"BLINK_HEARTBEAT_TIMEOUT_S": "5"}, timeout_s=300)
    yield stack
    assert stop_stack(stack) == 0, stack.log()
    assert processes_of(stack) == []


async def open_streams(session: aiohttp.ClientSession, stack: Stack) -> list[aiohttp.ClientResponse]:
    body = {**STREAM, "max_tokens": 128}
    resps = [await session.post(stack.url + "/v1/completions", json=body) for _ in range(STREAMS)]
    for resp in resps:
        assert resp.status == 200, await resp.text()
        await resp.content.readuntil(b"\n\n")  # a first token: every request is in the engine
    return resps


async def wait_success(session: aiohttp.ClientSession, stack: Stack, limit_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        try:
            async with session.post(stack.url + "/v1/completions", json=SHORT) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise AssertionError(f"no request succeeded after the engine restart:\n{stack.log()}")


async def test_engine_killed_with_streams_in_flight(engine_stack: Stack) -> None:
    stack = engine_stack
    reader = ready_pid(stack, "reader")
    assert reader is not None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
        resps = await open_streams(session, stack)
        t_kill = time.monotonic()
        os.kill(stack.engine_pid(), signal.SIGKILL)
        ends = await asyncio.gather(*(read_rest(r, t_kill) for r in resps))
        await wait_success(session, stack, 120)
    for end in ends:
        assert end["done"] and end["error"] is not None, end
        assert end["error"]["type"] == "service_unavailable", end
        assert "engine" in end["error"]["message"], end  # before the fix: "the token reader went away"
    assert ready_pid(stack, "reader") == reader and Path(f"/proc/{reader}").exists(), stack.log()
    assert b"reader" not in b"".join(line for line in stack.log_path.read_bytes().splitlines()
                                     if b"child_exited" in line), stack.log()
