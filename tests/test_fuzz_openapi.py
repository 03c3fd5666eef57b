"""Schemathesis against ``/openapi.json`` of a live ``blink serve`` (the real CPU engine).

The server's limits keep generation short (at most 4 output tokens, 64 prompt tokens), so a
schema-valid request costs a few engine steps. Checks: no 5xx, responses conform to the document,
schema-violating requests get a 4xx, and every error is ``{"error": {"message", "type", "param",
"code"}}``; afterwards the server still answers. The CI run draws >= 250 requests; the long one
(``python -m pytest -m slow tests/test_fuzz_openapi.py``) >= 20,000.

The CI run's 64 cases per operation and mode still put every check on every operation, in both modes,
positive and negative; it draws fewer random bodies, and the long run (another seed, 5,000 per operation
and mode) many more. Its time grows with the count of cases.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from helpers.fuzz import fuzz
from helpers.stack import MODEL, Stack, processes_of, start_stack, stop_stack

from dpu_gateway.params import MAX_STOP_STRINGS

REAL_ENGINE = "gpu_engine.serve"
# every operation of the document is drawn: GET and HEAD a few times, the token routes (no engine step)
# a quarter as often as the generating ones
GETS = {"/v1/models": 5, "/v1/models/{model}": 5, "/version": 3, "/health": 3, "/metrics": 3, "/openapi.json": 2}


@pytest.fixture(scope="module")
def fuzz_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("fuzz"), "--max-output-tokens", "4", "--max-prompt-tokens", "64",
                        "--num-slots", "32", engine_module=REAL_ENGINE, env={"BLINK_HEARTBEAT_TIMEOUT_S": "10"},
                        timeout_s=300)
    yield stack
    assert stop_stack(stack) == 0, stack.log()
    assert processes_of(stack) == []


def post(stack: Stack, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(stack.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def still_serving(stack: Stack) -> None:
    assert stack.get("/health")[0] == 200, stack.log()
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2}).encode()
    req = urllib.request.Request(stack.url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert json.loads(resp.read())["usage"]["completion_tokens"] == 2
    assert "Traceback" not in stack.log_path.read_text(errors="replace")


def run_fuzz(stack: Stack, per_mode: int, seed: int, minimum: int) -> None:
    token_routes = {"/tokenize": per_mode // 4, "/detokenize": per_mode // 4}
    report = fuzz(stack.url, {"/v1/completions": per_mode, "/v1/chat/completions": per_mode,
                              "/v1/responses": per_mode, **token_routes, **GETS}, seed=seed)
    drawn = {label.split(" ", 2)[2] for label in report.per_operation}
    assert drawn == set(json.loads(stack.get("/openapi.json")[1])["paths"]), report.summary()
    print("\nfuzz:", json.dumps(report.summary()))
    assert not report.failures, "\n\n".join(report.failures[:10])
    assert report.requests >= minimum, report.summary()
    assert not [s for s in report.statuses if s >= 500], report.summary()
    assert report.statuses[200] > 0.1 * report.requests, report.summary()  # the engine was reached
    still_serving(stack)


def of_type(schema: dict, kind: str) -> list[dict]:
    """The alternatives of ``schema`` that have type ``kind``."""
    return [alt for alt in schema.get("anyOf", [schema]) if alt.get("type") == kind]


def test_document_states_the_served_model_and_limits(fuzz_stack: Stack) -> None:
    status, raw = fuzz_stack.get("/openapi.json")
    schemas = json.loads(raw)["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    names = completion["model"]["enum"]  # the served name first, then its aliases: each one is answered
    assert status == 200 and names[0] == MODEL
    assert [fuzz_stack.get(f"/v1/models/{n}")[0] for n in names] == [200] * len(names)
    assert of_type(completion["max_tokens"], "integer")[0]["maximum"] == 4
    token_ids = [alt for alt in of_type(completion["prompt"], "array") if alt["items"].get("type") == "integer"]
    assert [alt["maxItems"] for alt in token_ids] == [64]
    top = token_ids[0]["items"]["maximum"]  # the vocabulary's last id: the server takes it and refuses the next
    assert [post(fuzz_stack, "/detokenize", {"tokens": [t]})[0] for t in (top, top + 1)] == [200, 400]
    assert [alt["maxItems"] for alt in of_type(schemas["ChatCompletionRequest"]["properties"]["stop"], "array")] \
        == [MAX_STOP_STRINGS]


def test_default_max_tokens_within_the_limit(fuzz_stack: Stack) -> None:
    """OpenAI's default of 16 output tokens is cut to the server's limit instead of refused."""
    body = json.dumps({"model": MODEL, "prompt": "Hello"}).encode()
    req = urllib.request.Request(fuzz_stack.url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert json.loads(resp.read())["usage"]["completion_tokens"] <= 4


def test_fuzz_openapi(fuzz_stack: Stack) -> None:
    run_fuzz(fuzz_stack, per_mode=64, seed=1, minimum=250)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_fuzz_openapi_long(fuzz_stack: Stack) -> None:
    run_fuzz(fuzz_stack, per_mode=5000, seed=2, minimum=20000)
