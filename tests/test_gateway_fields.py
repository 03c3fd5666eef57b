"""The request rule against the fake engine: every OpenAI / vLLM field is served or refused with a 400
naming it; unknown fields, a non-JSON body (415), n > 1, batched prompts, echo and vLLM's endpoints."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest
from helpers import fixtures
from helpers.stack import MODEL, Stack

AUTH = {"Authorization": f"Bearer {fixtures.API_KEY}"}
MSGS = [{"role": "user", "content": "hello there"}]
CHAT, COMP = "/v1/chat/completions", "/v1/completions"


async def call(stack: Stack, method: str, path: str, body: dict | bytes | None = None,
               headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **AUTH, **(headers or {})}
    async with aiohttp.ClientSession() as session:
        async with session.request(method, stack.url + path, data=data, headers=hdrs) as resp:
            return resp.status, await resp.json(content_type=None)


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": MSGS, "max_tokens": 4, **kw}


REFUSED = [
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice"),  # auto needs the flags
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required"), "tool_choice"),
    (CHAT, chat(tool_choice="auto"), "tool_choice"),
    (CHAT, chat(response_format={"type": "json_object"}), "response_format"),
    (CHAT, chat(response_format={"type": "bogus"}), "response_format"),
    (CHAT, chat(guided_json={"type": "object"}), "guided_json"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0]"),
    (CHAT, chat(messages=[{"role": "tool", "content": "1"}]), "messages[0].tool_call_id"),
    (CHAT, chat(best_of=2), "best_of"),
    (CHAT, chat(use_beam_search=True), "use_beam_search"),
    (CHAT, chat(prompt_logprobs=1), "prompt_logprobs"),
    (CHAT, chat(store=True), "store"),
    (CHAT, chat(web_search_options={}), "web_search_options"),  # an empty object asks for web search (OpenAI)
    (CHAT, chat(audio={}), "audio"),
    (CHAT, chat(stream=True, stream_options={"include_obfuscation": True}), "stream_options.include_obfuscation"),
    (CHAT, chat(stream_options={"include_usage": True}), "stream_options"),  # without streaming (as OpenAI, vLLM)
    (COMP, {"model": MODEL, "prompt": "hi", "stream": False, "stream_options": {}}, "stream_options"),
    (CHAT, chat(temprature=0.5), "temprature"),  # unknown (misspelt): refused by name
    (CHAT, chat(messages=[{"role": "user", "content": "x", "colour": 1}]), "messages[0].colour"),
    (CHAT, chat(presence_penalty=0.5), "presence_penalty"),  # the fake engine does not advertise penalties
    (CHAT, chat(repetition_penalty=1.2), "repetition_penalty"),
    (CHAT, chat(logit_bias={"5": -100}), "logit_bias"),
    (CHAT, chat(min_tokens=2), "min_tokens"),
    (CHAT, chat(stop_token_ids=list(range(9))), "stop_token_ids"),
    (CHAT, chat(stop_token_ids=[3], include_stop_str_in_output=True), "include_stop_str_in_output"),
    (COMP, {"model": MODEL, "prompt": "hi", "echo": True, "logprobs": 1}, "echo"),
    (COMP, {"model": MODEL, "prompt": "hi", "suffix": "end"}, "suffix"),
]


@pytest.mark.parametrize(("path", "body", "param"), REFUSED, ids=[p for _, _, p in REFUSED])
async def test_refused_fields_name_themselves(api_stack: Stack, path: str, body: dict, param: str) -> None:
    status, payload = await call(api_stack, "POST", path, body)
    assert status == 400, payload
    assert payload["error"]["param"] == param and payload["error"]["message"]


PROMPT_LOGPROBS = [
    (COMP, {"model": MODEL, "prompt": "hi", "echo": True, "logprobs": 1}, "echo"),
    (COMP, {"model": MODEL, "prompt": "hi", "prompt_logprobs": 0}, "prompt_logprobs"),
    (CHAT, chat(prompt_logprobs=2), "prompt_logprobs"),
]


@pytest.mark.parametrize(("path", "body", "param"), PROMPT_LOGPROBS, ids=[f"{p}-{x}" for p, _, x in PROMPT_LOGPROBS])
async def test_prompt_logprobs_need_an_engine_that_computes_them(api_stack: Stack, path: str, body: dict,
                                                                 param: str) -> None:
    status, payload = await call(api_stack, "POST", path, body)  # the fake engine advertises no sampling feature
    assert status == 400 and payload["error"]["param"] == param, payload
    assert "does not compute prompt log-probs" in payload["error"]["message"]


async def test_echo_without_generation_needs_no_prompt_logprobs(api_stack: Stack) -> None:
    status, payload = await call(api_stack, "POST", COMP, {"model": MODEL, "prompt": "Say it", "echo": True,
                                                            "max_tokens": 0})
    assert status == 200 and payload["choices"][0]["text"] == "Say it", payload
    assert payload["choices"][0]["finish_reason"] == "length"


NOOPS = [chat(tools=[], tool_choice="none", response_format={"type": "text"}, parallel_tool_calls=False,
              stream_options=None, presence_penalty=0,
              frequency_penalty=0.0, repetition_penalty=1.0, best_of=1, metadata={"k": "v"}, store=False,
              skip_special_tokens=True, priority=0, cache_salt="s", service_tier="auto", modalities=["text"])]


@pytest.mark.parametrize("body", NOOPS)
async def test_no_op_values_are_served(api_stack: Stack, body: dict) -> None:
    status, payload = await call(api_stack, "POST", CHAT, body)
    assert status == 200, payload


async def test_a_body_that_is_not_json_is_415(api_stack: Stack) -> None:
    for ctype in ("text/plain", "application/x-www-form-urlencoded"):
        status, payload = await call(api_stack, "POST", CHAT, json.dumps(chat()).encode(), {"Content-Type": ctype})
        assert status == 415 and payload["error"]["code"] == "unsupported_media_type"


async def test_n_choices_batched_prompts_and_echo(api_stack: Stack, text) -> None:
    async with openai.AsyncOpenAI(base_url=api_stack.url + "/v1", api_key=fixtures.API_KEY, max_retries=0) as c:
        out = await c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3, n=2, seed=4,
                                              temperature=0.7)
        assert [ch.index for ch in out.choices] == [0, 1]
        assert out.usage.prompt_tokens == len(text.chat_ids(MSGS))  # the prompt once
        assert out.usage.completion_tokens == 6
        comp = await c.completions.create(model=MODEL, prompt=["one two", "three four five"], max_tokens=2, n=2)
        assert sorted(ch.index for ch in comp.choices) == [0, 1, 2, 3]
        assert comp.usage.prompt_tokens == len(text.ids("one two")) + len(text.ids("three four five"))
        echo = await c.completions.create(model=MODEL, prompt="Say it", max_tokens=2, echo=True)
        assert echo.choices[0].text.startswith("Say it") and len(echo.choices[0].text) > len("Say it")
        stream = await c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3, n=2, stream=True,
                                                 stream_options={"include_usage": True,
                                                                 "continuous_usage_stats": True})  # type: ignore[typeddict-unknown-key]
        chunks = [ch async for ch in stream]
    finishes = {ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].finish_reason}
    assert finishes == {0, 1}
    assert all(ch.usage is not None for ch in chunks)  # continuous usage: in every chunk
    assert chunks[-1].usage.completion_tokens == 6


async def test_model_card_tokenize_detokenize_version(api_stack: Stack, text) -> None:
    status, card = await call(api_stack, "GET", f"/v1/models/{MODEL}")
    assert status == 200 and card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] > 0
    status, payload = await call(api_stack, "GET", "/v1/models/gpt-4o")
    assert status == 404 and payload["error"]["code"] == "model_not_found"
    status, tok = await call(api_stack, "POST", "/tokenize", {"model": MODEL, "prompt": "hello world"})
    assert status == 200 and tok["tokens"] == text.ids("hello world") and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == card["max_model_len"]
    status, tok = await call(api_stack, "POST", "/tokenize", {"model": MODEL, "messages": MSGS})
    assert status == 200 and tok["tokens"] == text.chat_ids(MSGS)
    status, detok = await call(api_stack, "POST", "/detokenize", {"model": MODEL, "tokens": text.ids("hello world")})
    assert status == 200 and detok["prompt"].endswith("hello world")
    status, ver = await call(api_stack, "GET", "/version")
    assert status == 200 and isinstance(ver["version"], str)
