"""``blink serve --data-parallel-size 2`` with two real CPU engines (the embedded SmolLM2-135M), spoken to
over HTTP with the official ``openai`` client: requests spread over both engines, killing one fails only
its in-flight requests (with the engine-failure error) while the other keeps serving, ``/health`` says
degraded meanwhile, and at the end both rings have every slot free.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Iterator

import openai
import pytest
from helpers.e2e import ENGINE_ENV, REAL_ENGINE, async_client, wait_for
from helpers.grafana import problems, scrape
from helpers.stack import MODEL, Stack, processes_of, start_stack, stop_stack

from dpu_gateway.reader import RESTARTED
from shared import ring_layout as L
from shared.data_parallel import engine_ring_names
from shared.ring import attach_shm_ring
from shared.transport import RingError

ENGINES = 2
FLAGS = ("--data-parallel-size", str(ENGINES), "--num-slots", "8", "--max-prompt-tokens", "128",
         "--max-output-tokens", "128", "--kv-blocks", "256")
PROMPT = "Once upon a time"
SERIES = re.compile(r'^(blink:dp_[a-z_]+)\{([^}]*)\} (\S+)$')


@pytest.fixture(scope="module")
def dp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # No standby engine: a killed engine restarts cold, so it stays down while the other one serves (a spare
    # would take its place within the test's requests; tests/test_standby_engine.py covers it under -dp 2).
    stack = start_stack(tmp_path_factory.mktemp("dp"), *FLAGS, engine_module=REAL_ENGINE, timeout_s=300,
                        env=ENGINE_ENV, standby_engine=False)
    yield stack
    assert stop_stack(stack) == 0, stack.log()
    assert processes_of(stack) == []


@pytest.fixture
async def client(dp: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    c = async_client(dp)
    yield c
    await c.close()


def per_engine(stack: Stack) -> dict[str, dict[int, float]]:
    """The ``blink:dp_*`` series of ``/metrics``: {name: {engine: value}}."""
    status, body = stack.get("/metrics")
    assert status == 200
    out: dict[str, dict[int, float]] = {}
    for line in body.decode().splitlines():
        got = SERIES.match(line)
        if got:
            engine = int(re.search(r'engine="(\d+)"', got.group(2)).group(1))  # type: ignore[union-attr]
            out.setdefault(got.group(1), {})[engine] = float(got.group(3))
    return out


def rings(stack: Stack) -> tuple[str, ...]:
    return engine_ring_names(stack.ring, ENGINES)


def engine_pid(ring_name: str) -> int:
    ring = attach_shm_ring(ring_name)
    try:
        return ring.header_load32("engine_pid")
    finally:
        ring.close()


def free_slots(ring_name: str) -> tuple[int, int]:
    """(EMPTY slots, slots) of a ring."""
    ring = attach_shm_ring(ring_name)
    try:
        states = ring.read_slots()["state"]
        return int((states == L.SlotState.EMPTY).sum()), int(states.size)
    finally:
        ring.close()


def idle(stack: Stack) -> None:
    """Wait until no slot is in use anywhere, then for the tracker's next refresh of its slot views."""
    wait_for(lambda: set(per_engine(stack)["blink:dp_slots_in_use"].values()) == {0.0}, 30, 0.1)
    time.sleep(0.3)


async def complete(client: openai.AsyncOpenAI, max_tokens: int = 4) -> openai.types.Completion:
    return await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=0)


async def test_requests_spread_over_both_engines(dp: Stack, client: openai.AsyncOpenAI) -> None:
    await complete(client, 1)  # a first request, so that the counts below start from a used stack
    idle(dp)
    before = per_engine(dp)["blink:dp_engine_prompt_tokens_total"]
    n = 6
    answers = await asyncio.gather(*(complete(client) for _ in range(n)))
    prompt_len = answers[0].usage.prompt_tokens
    assert all(a.choices[0].text for a in answers)

    def counts() -> dict[int, float]:
        after = per_engine(dp)["blink:dp_engine_prompt_tokens_total"]
        return {e: (after[e] - before[e]) / prompt_len for e in range(ENGINES)}

    wait_for(lambda: sum(counts().values()) == n, 60, 0.1)  # the engines publish their stats every 0.1 s
    assert counts() == {0: n / ENGINES, 1: n / ENGINES}, counts()


async def test_each_engine_has_vllm_s_series_under_its_engine_label(dp: Stack, client: openai.AsyncOpenAI) -> None:
    """vLLM's names, one series per engine (``engine`` "0" and "1"): the requests each engine ran are counted under
    it, its gauges and counters are its own, and vLLM's dashboards find every series they query."""
    idle(dp)
    before, engines = per_engine(dp)["blink:dp_engine_prompt_tokens_total"], [str(e) for e in range(ENGINES)]
    _, text_before = dp.get("/metrics")
    n = 4
    answers = await asyncio.gather(*(complete(client) for _ in range(n)))
    prompt_len = answers[0].usage.prompt_tokens
    wait_for(lambda: sum(per_engine(dp)["blink:dp_engine_prompt_tokens_total"].values()) - sum(before.values())
             == n * prompt_len, 30, 0.1)
    idle(dp)
    _, text_after = dp.get("/metrics")
    after = per_engine(dp)["blink:dp_engine_prompt_tokens_total"]
    text = text_after.decode()
    assert problems(text, MODEL) == []

    def grew(sample: str, engine: str) -> float:
        return (total(text, sample, engine=engine, model_name=MODEL)
                - total(text_before.decode(), sample, engine=engine, model_name=MODEL))

    ran = {str(e): (after[e] - before[e]) / prompt_len for e in range(ENGINES)}  # the engine's own count
    for engine in engines:
        assert grew("vllm:request_success_total", engine) == ran[engine] > 0, engine
        assert grew("vllm:e2e_request_latency_seconds_count", engine) == ran[engine], engine
        assert grew("vllm:request_queue_time_seconds_count", engine) == ran[engine], engine
        assert grew("vllm:prompt_tokens_total", engine) == ran[engine] * prompt_len, engine
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total"):
            assert any(s.name == name and s.labels.get("engine") == engine
                       for fam in scrape(text).values() for s in fam.samples), (name, engine)
    configs = {s.labels["engine"]: s.labels for s in scrape(text)["vllm:cache_config_info"].samples}
    assert sorted(configs) == engines and configs["0"]["num_gpu_blocks"] == "256"  # --kv-blocks 256 each
    gone = ("blink:dp_num_requests_running", "blink:dp_num_requests_waiting", "blink:dp_kv_cache_usage_perc",
            "blink:dp_engine_preemptions")  # vLLM's names per engine replace them
    assert not [name for name in gone if name in text], gone


def total(text: str, sample: str, **labels: str) -> float:
    return sum(s.value for fam in scrape(text).values() for s in fam.samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


async def open_stream(client: openai.AsyncOpenAI) -> tuple[openai.AsyncStream, str]:
    stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=128, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    first = await stream.__anext__()  # a first token: the request runs in its engine
    return stream, first.choices[0].text


async def finish(stream: openai.AsyncStream) -> dict:
    """How a stream ended: its finish reason, or the error the server sent."""
    reason = None
    try:
        async for chunk in stream:
            reason = chunk.choices[0].finish_reason or reason
    except openai.APIError as exc:
        return {"error": exc.message, "body": exc.body}
    return {"finish_reason": reason}


def health(stack: Stack) -> tuple[int, dict]:
    status, body = stack.get("/health")
    return status, json.loads(body) if body else {}


async def test_killing_one_engine_fails_only_its_requests(dp: Stack, client: openai.AsyncOpenAI) -> None:
    idle(dp)
    streams = [await open_stream(client) for _ in range(4)]
    victim, other = rings(dp)
    other_pid = engine_pid(other)
    os.kill(engine_pid(victim), signal.SIGKILL)
    ends = asyncio.gather(*(finish(s) for s, _ in streams))
    wait_for(lambda: health(dp)[1].get("status") == "degraded", 60, 0.05)  # while the engine loads again
    status, body = health(dp)
    assert status == 200 and [e["status"] for e in body["engines"]] == ["down", "ok"], body
    answers = [await complete(client) for _ in range(3)]  # served by the other engine meanwhile
    assert all(a.choices[0].text for a in answers)
    assert health(dp)[1]["status"] == "degraded"  # they were not waiting for the killed one
    failed = [e for e in await ends if "error" in e]
    assert len(failed) == 2, ends  # the two on the killed engine (requests alternate between equal engines)
    assert all(RESTARTED in e["error"] for e in failed), failed
    assert [e["finish_reason"] for e in ends.result() if "error" not in e] == ["length", "length"], ends
    wait_for(lambda: health(dp)[1].get("status") == "ok", 180, 0.2)
    assert per_engine(dp)["blink:dp_engine_up"] == {0: 1.0, 1: 1.0}
    assert engine_pid(other) == other_pid  # the supervisor restarted only the killed engine


async def test_both_rings_return_every_slot(dp: Stack, client: openai.AsyncOpenAI) -> None:
    await asyncio.gather(*(complete(client) for _ in range(4)))
    wait_for(lambda: all(free_slots(r)[0] == free_slots(r)[1] for r in rings(dp)), 30, 0.1)
    assert per_engine(dp)["blink:dp_slots_in_use"] == {0: 0.0, 1: 0.0}
    for name in rings(dp):
        try:
            free, total = free_slots(name)
        except RingError as exc:  # pragma: no cover - the message says which ring
            raise AssertionError(f"{name}: {exc}") from exc
        assert (free, total) == (8, 8), name
