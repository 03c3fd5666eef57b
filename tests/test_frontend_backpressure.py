"""A full ring queues, then answers 429 + Retry-After; a stalled engine ends streams with an error."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator

import aiohttp
import pytest
from helpers.stack import MODEL, Stack, sse_events, start_stack, stop_stack

LONG = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 1000, "ignore_eos": True,
        "stream": True}
SHORT = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def small_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two slots, a wait queue of one, and an engine declared dead after 1 s without a beat; steps of 10 ms, so
    that a long stream (1,000 tokens, 10 s) is still running whatever a busy host delays in the test."""
    stack = start_stack(tmp_path_factory.mktemp("small"), "--num-slots", "2", "--max-waiting", "1",
                        env={"BLINK_HEARTBEAT_TIMEOUT_S": "1", "FAKE_ENGINE_STEP_MS": "10"})
    yield stack
    stop_stack(stack)


async def wait_until(cond, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)


async def test_full_ring_queues_then_429(small_stack: Stack) -> None:
    url = small_stack.url + "/v1/chat/completions"
    async with aiohttp.ClientSession() as session:
        streams = [await session.post(url, json=LONG) for _ in range(2)]
        for resp in streams:
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")  # the role chunk: admitted
            await resp.content.readuntil(b"\n\n")  # a token: the engine runs it (no longer "waiting")
        queued = asyncio.create_task(session.post(url, json=SHORT))
        await wait_until(lambda: small_stack.metric("blink:num_requests_waiting") >= 1, 60)
        async with session.post(url, json=SHORT) as rejected:
            assert rejected.status == 429
            assert int(rejected.headers["Retry-After"]) >= 1
            err = (await rejected.json())["error"]
            assert err["type"] == "rate_limit_exceeded" and set(err) == {"message", "type", "param", "code"}
        assert not queued.done()
        for resp in streams:
            resp.close()  # frees both slots: the queued request goes in
        done = await asyncio.wait_for(queued, 60)
        assert done.status == 200 and (await done.json())["usage"]["completion_tokens"] == 3
    await wait_until(lambda: small_stack.metric("blink:slots_in_use") == 0, 60)


async def test_stalled_engine_ends_streams_with_error(small_stack: Stack) -> None:
    engine = small_stack.engine_pid()
    async with aiohttp.ClientSession() as session:
        resp = await session.post(small_stack.url + "/v1/chat/completions", json=LONG)
        await resp.content.readuntil(b"\n\n")
        os.kill(engine, signal.SIGSTOP)
        try:
            events = sse_events(await asyncio.wait_for(resp.read(), 120))  # ended by the stale heartbeat
            assert events[-1] == "[DONE]" and "error" in events[-2]
            assert events[-2]["error"]["type"] == "service_unavailable"
            # the gateway's own look at the beat counter trails the reader's; then the supervisor kills the
            # stopped engine and starts another, loading meanwhile: 503 until it serves
            await wait_until(lambda: small_stack.get("/health")[0] == 503, 30)
            async with session.post(small_stack.url + "/v1/chat/completions", json=SHORT) as down:
                assert down.status == 503 and "error" in await down.json()
        finally:
            with contextlib.suppress(ProcessLookupError):  # killed as hung by then, as a stopped engine is
                os.kill(engine, signal.SIGCONT)
    await wait_until(lambda: small_stack.get("/health")[0] == 200, 120)
    await wait_until(lambda: small_stack.metric("blink:slots_in_use") == 0, 60)
