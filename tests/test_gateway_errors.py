"""Every error case: exact status, the OpenAI error shape, and a server that still serves afterwards."""

from __future__ import annotations

import json
import re

import aiohttp
import openai
import pytest
from helpers import fixtures
from helpers.stack import MODEL, Stack

AUTH = {"Authorization": f"Bearer {fixtures.API_KEY}"}
MSGS = [{"role": "user", "content": "hi"}]


async def post(stack: Stack, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(AUTH if headers is None else headers)}
    async with aiohttp.ClientSession() as session:
        async with session.post(stack.url + path, data=data, headers=hdrs) as resp:
            return resp.status, await resp.json(content_type=None), dict(resp.headers)


def assert_error(body: dict, kind: str, param: str | None = None) -> dict:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == kind and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


CASES = [
    ("/v1/chat/completions", b'{"model": "x", "messages": [', 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": MSGS, "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MSGS, "max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MSGS, "temperature": 3}, 400, "temperature"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL}, 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": MSGS, "n": 17}, 400, "n"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MSGS, "stop": [f"s{i}" for i in range(65)]}, 400, "stop"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MSGS, "top_logprobs": 3}, 400, "top_logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", 5]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 9}, 400, "logprobs"),
    ("/v1/chat/completions", {"model": "gpt-4o", "messages": MSGS}, 404, "model"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), CASES)
async def test_invalid_requests(api_stack: Stack, path: str, body, status: int, param: str | None) -> None:
    got, payload, _ = await post(api_stack, path, body)
    assert got == status, payload
    assert_error(payload, "invalid_request_error" if status == 400 else "not_found_error", param)


async def test_prompt_longer_than_context_names_both_numbers(api_stack: Stack) -> None:
    long_prompt = list(range(100, 1300))  # 1200 token ids; the fake engine's ring takes 1024
    status, payload, _ = await post(api_stack, "/v1/completions", {"model": MODEL, "prompt": long_prompt})
    err = assert_error(payload, "invalid_request_error")
    assert status == 400 and "1536" in err["message"] and "1200" in err["message"]
    status, payload, _ = await post(api_stack, "/v1/chat/completions",
                                    {"model": MODEL, "messages": MSGS, "max_tokens": 1530})
    err = assert_error(payload, "invalid_request_error", "max_tokens")
    assert status == 400 and "1536" in err["message"] and "1530" in err["message"]


async def test_oversized_body_is_413(api_stack: Stack) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 100_000}]}
    status, payload, _ = await post(api_stack, "/v1/chat/completions", body)
    assert status == 413
    assert_error(payload, "invalid_request_error")


async def test_api_key_required(api_stack: Stack) -> None:
    status, payload, _ = await post(api_stack, "/v1/chat/completions", {"model": MODEL, "messages": MSGS},
                                    headers={"Authorization": "Bearer wrong"})
    assert status == 401
    assert assert_error(payload, "authentication_error")["code"] == "invalid_api_key"
    status, payload, _ = await post(api_stack, "/v1/chat/completions", {"model": MODEL, "messages": MSGS},
                                    headers={})
    err = assert_error(payload, "authentication_error")
    assert status == 401 and err["code"] == "invalid_api_key" and "didn't provide an API key" in err["message"]
    async with openai.AsyncOpenAI(base_url=api_stack.url + "/v1", api_key="nope", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()


async def test_unknown_route_is_404_json(api_stack: Stack) -> None:
    status, payload, _ = await post(api_stack, "/v1/embeddings", {"model": MODEL, "input": "x"})
    assert status == 404
    assert_error(payload, "not_found_error")


async def test_openai_client_sees_typed_errors(api_stack: Stack) -> None:
    async with openai.AsyncOpenAI(base_url=api_stack.url + "/v1", api_key=fixtures.API_KEY, max_retries=0) as c:
        with pytest.raises(openai.NotFoundError):
            await c.chat.completions.create(model="nope", messages=MSGS)
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model=MODEL, messages=MSGS, n=30)
    assert info.value.param == "n"


async def test_server_alive_after_errors(api_stack: Stack) -> None:
    status, payload, _ = await post(api_stack, "/v1/chat/completions", {"model": MODEL, "messages": MSGS,
                                                                         "max_tokens": 3})
    assert status == 200 and payload["choices"][0]["finish_reason"] in ("stop", "length")
    assert api_stack.get("/health")[0] == 200


async def test_an_integral_float_for_an_integer_is_served(api_stack: Stack) -> None:
    """`"max_tokens": 3.0` is 3, as JSON Schema's integer and vLLM take it (2.5 is a 400, in CASES)."""
    status, payload, _ = await post(api_stack, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3.0,
                                                                    "n": 1.0})
    assert status == 200, payload
    assert len(payload["choices"]) == 1 and payload["usage"]["completion_tokens"] <= 3




class _ClosingWriter:
    """The payload writer of a connection whose client has just closed: the headers went out, every later write
    raises aiohttp's reset, as its writer does on a closing transport."""

    buffer_size = output_size = 0
    length = None

    def enable_chunking(self) -> None: ...

    def enable_compression(self, *args: object, **kwargs: object) -> None: ...

    async def write_headers(self, *args: object) -> None: ...

    def send_headers(self, *args: object) -> None: ...

    def set_eof(self) -> None: ...

    async def drain(self) -> None: ...

    async def write(self, *args: object, **kwargs: object) -> None:
        from aiohttp.client_exceptions import ClientConnectionResetError

        raise ClientConnectionResetError("Cannot write to closing transport")

    write_eof = write


async def test_a_stream_whose_client_closes_as_it_ends_is_a_499_not_an_error() -> None:
    """A stream's last writes ([DONE], its end) to a client that has just closed raise aiohttp's connection reset
    (seen under a fuzzing client on a busy host): the stream ends quietly and its request is marked for the log
    middleware's 499, instead of an unhandled exception, its traceback and a 500."""
    import types

    from aiohttp.test_utils import make_mocked_request

    from dpu_gateway.app import request_log_middleware
    from dpu_gateway.respond import COMPLETION, Usage, answer_stream
    from dpu_gateway.state import CLIENT_GONE
    from shared.metrics import FrontendMetrics

    request = make_mocked_request("POST", "/v1/completions", writer=_ClosingWriter())

    async def handler(req: object) -> object:
        return await answer_stream(req, [], COMPLETION, None, "m", Usage([], 0))  # type: ignore[arg-type]

    metrics = FrontendMetrics("m")
    logged = request_log_middleware(types.SimpleNamespace(log_requests=False), metrics)  # type: ignore[arg-type]
    resp = await logged(request, handler)
    assert resp.status == 200 and request.get(CLIENT_GONE) is True
    text = metrics.render().decode()
    assert re.search(r'^blink:request_failures_total\{[^}]*status="499"[^}]*\} 1\.0$', text, re.M), text
    assert 'status="500"' not in text
