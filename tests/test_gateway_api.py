"""The OpenAI API end to end: real processes, real sockets, the official ``openai`` client."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
from helpers import fixtures
from helpers.stack import MODEL, Stack, sse_events

API_KEY = fixtures.API_KEY
USER = [{"role": "user", "content": "Tell me about the sea, in one line."}]


_OPEN: list[openai.AsyncOpenAI] = []


def client(stack: Stack) -> openai.AsyncOpenAI:
    c = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)
    _OPEN.append(c)
    return c


@pytest.fixture(autouse=True)
async def close_clients() -> AsyncIterator[None]:
    """Close each test's clients inside its own event loop."""
    yield
    while _OPEN:
        await _OPEN.pop().close()


async def test_models(api_stack: Stack) -> None:
    models = await client(api_stack).models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_chat_whole_and_usage(api_stack: Stack, text) -> None:
    prompt = text.chat_ids(USER)
    out = await client(api_stack).chat.completions.create(model=MODEL, messages=USER, max_tokens=200)
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == text.echo(prompt)
    assert choice.finish_reason == "stop"
    assert out.usage.prompt_tokens == len(prompt)
    assert out.usage.completion_tokens == len(prompt) - 1
    assert out.usage.total_tokens == 2 * len(prompt) - 1


async def test_chat_stream_with_usage(api_stack: Stack, text) -> None:
    prompt = text.chat_ids(USER)
    stream = await client(api_stack).chat.completions.create(
        model=MODEL, messages=USER, max_completion_tokens=7, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == text.echo(prompt, 7)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(prompt), 7)


async def test_completion_whole_and_stream(api_stack: Stack, text) -> None:
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = text.ids(prompt)
    c = client(api_stack)
    whole = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=5)
    assert whole.choices[0].text == text.echo(ids, 5)
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), 5)
    stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=5, stream=True)
    assert "".join([ch.choices[0].text async for ch in stream]) == whole.choices[0].text


async def test_token_id_prompt(api_stack: Stack, text) -> None:
    ids = text.ids("one two three four")
    out = await client(api_stack).completions.create(model=MODEL, prompt=ids, max_tokens=50)
    assert out.choices[0].text == text.echo(ids)
    assert out.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("stop", ["lazy", ["nothing-like-this", " over"]])
async def test_stop_strings_never_emitted(api_stack: Stack, stop) -> None:
    c = client(api_stack)
    prompt = "The quick brown fox jumps over the lazy dog"
    whole = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=50, stop=stop)
    stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=50, stop=stop, stream=True)
    chunks = [ch async for ch in stream]
    streamed = "".join(ch.choices[0].text for ch in chunks)
    first = stop if isinstance(stop, str) else stop[1]
    assert whole.choices[0].text == streamed == " quick brown fox jumps over the lazy dog".split(first)[0]
    assert whole.choices[0].finish_reason == "stop" == chunks[-1].choices[0].finish_reason
    assert first.strip() not in streamed


async def test_seed_reaches_the_engine(api_stack: Stack) -> None:
    c = client(api_stack)

    async def run(seed: int) -> str:
        out = await c.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, seed=seed, temperature=0.7)
        return out.choices[0].message.content

    a, b, again = await run(1), await run(5), await run(1)
    assert a == again and a != b  # the fake engine starts its echo at seed % prompt length


async def test_logprobs(api_stack: Stack) -> None:
    c = client(api_stack)
    chat = await c.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(e.logprob == -0.5 and len(e.top_logprobs) == 2 for e in content)
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    comp = await c.completions.create(model=MODEL, prompt="one two three four", max_tokens=3, logprobs=1)
    lp = comp.choices[0].logprobs
    assert lp.token_logprobs == [-0.5] * 3 and len(lp.top_logprobs) == 3 and len(lp.text_offset) == 3


async def test_extras_and_user_accepted(api_stack: Stack) -> None:
    out = await client(api_stack).chat.completions.create(
        model=MODEL, messages=USER, max_tokens=30, user="u1", top_p=0.9,
        extra_body={"top_k": 5, "min_p": 0.1, "ignore_eos": True})
    assert out.usage.completion_tokens == 30 and out.choices[0].finish_reason == "length"


async def test_64_concurrent_streams_finish_with_done(api_stack: Stack) -> None:
    body = {"model": MODEL, "messages": USER, "max_tokens": 20, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}

    async def one(session: aiohttp.ClientSession) -> list:
        async with session.post(api_stack.url + "/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 200
            return sse_events(await resp.read())

    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(one(session) for _ in range(64)))
    for events in results:
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")


async def test_exact_sse_bytes(api_stack: Stack, text) -> None:
    ids = text.ids("one two three")
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "stream": True}
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as session:
        async with session.post(api_stack.url + "/v1/completions", json=body) as resp:
            assert resp.headers["Content-Type"] == "text/event-stream"
            raw = await resp.read()
    head = re.match(rb'data: \{"id":"(cmpl-[0-9a-f]{32})","object":"text_completion","created":(\d+),', raw)
    assert head, raw
    cid, created = head.group(1).decode(), head.group(2).decode()
    t1, t2 = (text.tok.decode([t]) for t in ids[1:3])

    def chunk(txt: str, finish: str) -> str:
        return (f'data: {{"id":"{cid}","object":"text_completion","created":{created},"model":"{MODEL}",'
                f'"choices":[{{"index":0,"text":"{txt}","logprobs":null,"finish_reason":{finish},'
                f'"stop_reason":null}}]}}\n\n')

    # One event carries what the reader found since its last poll: on a busy host both tokens arrive
    # together. Either split, every byte must be OpenAI's framing.
    end = chunk("", '"length"') + "data: [DONE]\n\n"
    assert raw.decode() in (chunk(t1, "null") + chunk(t2, "null") + end, chunk(t1 + t2, "null") + end)


def failures_by_status(stack: Stack) -> dict[str, float]:
    _, text = stack.get("/metrics")
    found = re.findall(r'^blink:request_failures_total\{[^}]*status="(\d+)"[^}]*\} (\S+)$', text.decode(), re.M)
    return {status: float(value) for status, value in found}


async def test_disconnect_frees_the_slot(api_stack: Stack) -> None:
    """A client that closes its stream mid-way: the slot is freed within a second, and the request is counted
    (and logged) as 499, the client's doing, never as a 500."""
    before = failures_by_status(api_stack)
    body = {"model": MODEL, "messages": USER, "max_tokens": 1000, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as session:
        resp = await session.post(api_stack.url + "/v1/chat/completions", json=body)
        await resp.content.readuntil(b"\n\n")
        await resp.content.readuntil(b"\n\n")
        assert api_stack.metric("blink:slots_in_use") >= 1
        resp.close()  # drop the connection mid-stream
    t0 = time.monotonic()
    while api_stack.metric("blink:slots_in_use") > 0:
        assert time.monotonic() - t0 < 60.0, "slot not freed after the disconnect"
        await asyncio.sleep(0.05)
    while failures_by_status(api_stack).get("499", 0) == before.get("499", 0):
        assert time.monotonic() - t0 < 60.0, f"no 499 counted: {failures_by_status(api_stack)}"
        await asyncio.sleep(0.05)
    assert failures_by_status(api_stack).get("500", 0) == before.get("500", 0)


def test_health_metrics_openapi(api_stack: Stack) -> None:
    status, body = api_stack.get("/health")
    assert status == 200
    _, metrics = api_stack.get("/metrics")
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "num_requests_running", "num_requests_waiting",
                 "kv_cache_usage_perc", "prompt_tokens_total", "generation_tokens_total", "slots_in_use"):
        assert f"blink:{name}" in metrics.decode(), name
    status, doc = api_stack.get("/openapi.json")
    assert status == 200 and b'"openapi":"3.1.0"' in doc and b"/v1/chat/completions" in doc


async def test_the_embedded_model_answers_to_its_hugging_face_id_and_its_old_name(api_stack: Stack) -> None:
    assert MODEL == "HuggingFaceTB/SmolLM2-135M-Instruct"
    c = client(api_stack)
    for name in (MODEL, "SmolLM2-135M-Instruct"):
        card = await c.models.retrieve(name)
        assert card.id == MODEL  # the reported name is the Hugging Face id, whichever name was asked for
        out = await c.completions.create(model=name, prompt="Hi", max_tokens=2)
        assert out.model == MODEL
    with pytest.raises(openai.NotFoundError):
        await c.models.retrieve("SmolLM2")
