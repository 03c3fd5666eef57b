"""End to end with the real CPU engine and the embedded SmolLM2-135M-Instruct: ``blink serve`` as real
processes, spoken to through the official ``openai`` client (sync and async)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import openai
import pytest
from helpers.e2e import (
    FRANCE,
    MAX_CONTEXT,
    alive,
    async_client,
    children_of,
    finished,
    idle_kv_usage,
    start_real_stack,
    sync_client,
    wait_for,
)
from helpers.stack import MODEL, Stack, processes_of, segment_exists, stop_stack
from openai.types.chat import ChatCompletionChunk

from dpu_tokenizer.chat import render_chat

_OPEN: list[openai.AsyncOpenAI] = []


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_real_stack(tmp_path_factory.mktemp("e2e"))
    yield stack
    stop_stack(stack)


def aclient(stack: Stack) -> openai.AsyncOpenAI:
    c = async_client(stack)
    _OPEN.append(c)
    return c


@pytest.fixture(autouse=True)
async def close_clients() -> AsyncIterator[None]:
    yield
    while _OPEN:
        await _OPEN.pop().close()


def greedy_chat(stack: Stack, messages: list[dict], **kw) -> openai.types.chat.ChatCompletion:
    return sync_client(stack).chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


async def stream_chat(c: openai.AsyncOpenAI, messages: list[dict], **kw) -> tuple[str, list]:
    stream = await c.chat.completions.create(model=MODEL, messages=messages, stream=True, **kw)
    chunks = [ch async for ch in stream]
    return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), chunks


# ---------------------------------------------------------------------- 1. greedy chat, usage
async def test_greedy_chat_paris_stream_equals_whole(real: Stack, text) -> None:
    whole = greedy_chat(real, FRANCE, max_tokens=24, logprobs=True)
    content = whole.choices[0].message.content
    assert "Paris" in content
    assert whole.choices[0].finish_reason == "stop"
    streamed, chunks = await stream_chat(aclient(real), FRANCE, max_tokens=24, temperature=0, logprobs=True,
                                         stream_options={"include_usage": True})
    assert streamed == content
    tokens = sum(len(ch.choices[0].logprobs.content) for ch in chunks if ch.choices and ch.choices[0].logprobs)
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    prompt_len = len(text.chat_ids(FRANCE))
    assert (whole.usage.prompt_tokens, usage.prompt_tokens) == (prompt_len, prompt_len)
    assert whole.usage.completion_tokens == usage.completion_tokens == tokens == len(whole.choices[0].logprobs.content)
    assert usage.total_tokens == prompt_len + tokens


# ---------------------------------------------------------------------- 2. completions
async def test_completions_length_and_ignore_eos(real: Stack, text) -> None:
    c = aclient(real)
    prompt = "The three primary colors are"
    whole = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(text.ids(prompt)), 6)
    stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True)
    chunks = [ch async for ch in stream]
    assert "".join(ch.choices[0].text for ch in chunks) == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason] == ["length"]
    # A prompt the model answers briefly: stops at EOS, unless ignore_eos makes it run to max_tokens.
    chat_prompt = render_chat(text.template, FRANCE)
    short = await c.completions.create(model=MODEL, prompt=chat_prompt, max_tokens=20, temperature=0)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 20
    forced = await c.completions.create(model=MODEL, prompt=chat_prompt, max_tokens=20, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 20
    assert forced.choices[0].text.startswith(short.choices[0].text)


# ---------------------------------------------------------------------- 3. stop strings
def middle_piece(text: str, size: int = 5) -> str:
    """A piece of ``text`` from its middle on (often cutting a token), found nowhere before."""
    for start in range(len(text) // 2, len(text) - size):
        if text.index(text[start : start + size]) == start:
            return text[start : start + size]
    raise AssertionError(f"no piece of {text!r} occurs only from its middle on")


async def test_stop_string_from_the_greedy_output(real: Stack) -> None:
    c = aclient(real)
    prompt = "Once upon a time, in a small village,"
    free = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    full = free.choices[0].text
    stop = middle_piece(full)
    prefix = full[: full.index(stop)]
    whole = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert whole.choices[0].text == prefix
    assert whole.choices[0].finish_reason == "stop"
    stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                        stream=True)
    pieces = [ch.choices[0].text async for ch in stream]
    assert "".join(pieces) == prefix
    assert not any(stop.strip() in p for p in pieces)


# ---------------------------------------------------------------------- 4. seeds
SEEDED = [{"role": "user", "content": "Write a short sentence about the ocean."}]


async def sampled(c: openai.AsyncOpenAI, messages: list[dict], seed: int | None) -> str:
    out = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0.9,
                                          seed=seed)
    return out.choices[0].message.content


async def test_seed_reproducible_alone_and_in_a_batch(real: Stack) -> None:
    c = aclient(real)
    first, second = await sampled(c, SEEDED, 123), await sampled(c, SEEDED, 123)
    assert first == second
    others = [[{"role": "user", "content": f"Tell me a fact about the number {i}."}] for i in range(7)]
    batch = await asyncio.gather(sampled(c, SEEDED, 123), *(sampled(c, m, 1000 + i) for i, m in enumerate(others)))
    assert batch[0] == first


# ---------------------------------------------------------------------- 5. logprobs
def test_chat_logprobs_greedy(real: Stack) -> None:
    out = greedy_chat(real, FRANCE, max_tokens=8, logprobs=True, top_logprobs=3)
    entries = out.choices[0].logprobs.content
    assert len(entries) == out.usage.completion_tokens > 0
    assert "".join(e.token for e in entries) == out.choices[0].message.content
    for e in entries:
        assert e.logprob <= 0
        assert len(e.top_logprobs) == 3
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert e.top_logprobs[0].token == e.token
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-6)


# ---------------------------------------------------------------------- 6. concurrent streams
CONCURRENT = [[{"role": "user", "content": f"Name one animal that starts with the letter {ch}."}]
              for ch in "ABCDEFGHIJKLMNOP"]


async def raw_stream(c: openai.AsyncOpenAI, messages: list[dict]) -> tuple[str, list[str]]:
    """A greedy chat stream read line by line: its text, and its SSE data lines (to see the ``[DONE]``)."""
    async with c.chat.completions.with_streaming_response.create(model=MODEL, messages=messages, max_tokens=12,
                                                                 temperature=0, stream=True) as resp:
        data = [line[len("data: "):] async for line in resp.iter_lines() if line.startswith("data: ")]
    chunks = [ChatCompletionChunk.model_validate_json(d) for d in data[:-1]]
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    return "".join(ch.choices[0].delta.content or "" for ch in chunks), data


async def test_sixteen_concurrent_streams_match_sequential(real: Stack) -> None:
    c = aclient(real)
    together = await asyncio.gather(*(raw_stream(c, m) for m in CONCURRENT))
    assert [data[-1] for _, data in together] == ["[DONE]"] * len(CONCURRENT)
    alone = [(await stream_chat(c, m, max_tokens=12, temperature=0))[0] for m in CONCURRENT]
    assert [t for t, _ in together] == alone


# ---------------------------------------------------------------------- 7. disconnect
async def test_disconnect_frees_slot_and_kv_blocks(real: Stack) -> None:
    idle = await asyncio.to_thread(idle_kv_usage, real)
    c = aclient(real)
    stream = await c.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=200, stream=True,
                                             extra_body={"ignore_eos": True})
    got = 0
    async for ch in stream:
        got += bool(ch.choices and ch.choices[0].delta.content)
        if got == 3:
            break
    assert real.metric("blink:slots_in_use") == 1
    aborted = finished(real, "abort")
    await asyncio.to_thread(wait_for, lambda: real.metric("blink:kv_cache_usage_perc") > idle, 60)
    await stream.close()
    await asyncio.to_thread(wait_for, lambda: real.metric("blink:slots_in_use") == 0, 60)
    await asyncio.to_thread(wait_for, lambda: real.metric("blink:kv_cache_usage_perc") == idle, 60)
    # freed because the client left (an abort), not because the 200 tokens ran out (however slow the host)
    assert finished(real, "abort") == aborted + 1 and real.metric("blink:num_requests_running") == 0



# ---------------------------------------------------------------------- 8. errors
def post_raw(stack: Stack, path: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(stack.url + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_errors_then_still_serving(real: Stack, text) -> None:
    c = sync_client(real)
    prompt = "hello " * (MAX_CONTEXT + 50)
    with pytest.raises(openai.BadRequestError) as too_long:
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    message = too_long.value.body["message"]
    assert str(MAX_CONTEXT) in message and str(len(text.ids(prompt))) in message, message
    with pytest.raises(openai.NotFoundError) as unknown:
        c.chat.completions.create(model="no-such-model", messages=FRANCE, max_tokens=4)
    assert unknown.value.body["code"] == "model_not_found"
    status, body = post_raw(real, "/v1/chat/completions", b'{"model": "' + MODEL.encode() + b'", "messages": [')
    assert status == 400
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert "Paris" in greedy_chat(real, FRANCE, max_tokens=24).choices[0].message.content


# ---------------------------------------------------------------------- 9. SIGTERM (its own server, last)
def test_sigterm_leaves_nothing_behind(tmp_path: Path) -> None:
    stack = start_real_stack(tmp_path)
    kids = children_of(stack.proc.pid)
    assert len(kids) >= 5 and segment_exists(stack)
    code = stop_stack(stack)
    assert code == 0, stack.log()
    assert [p for p in kids if alive(p)] == []
    assert processes_of(stack) == []
    assert not segment_exists(stack)
