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
import urllib.request
from collections.abc import Iterator

import pytest
from helpers.fuzz import fuzz
from helpers.stack import MODEL, Stack, processes_of, start_stack, stop_stack

REAL_ENGINE = "gpu_engine.serve"
GETS = {"/v1/models": 5, "/health": 3, "/metrics": 3}


@pytest.fixture(scope="module")
def fuzz_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("fuzz"), "--max-output-tokens", "4", "--max-prompt-tokens", "64",
                        "--num-slots", "32", engine_module=REAL_ENGINE, env={"BLINK_HEARTBEAT_TIMEOUT_S": "10"},
                        timeout_s=300)
    yield stack
    assert stop_stack(stack) == 0, stack.log()
    assert processes_of(stack) == []


def still_serving(stack: Stack) -> None:
    assert stack.get("/health")[0] == 200, stack.log()
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 2}).encode()
    req = urllib.request.Request(stack.url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert json.loads(resp.read())["usage"]["completion_tokens"] == 2
    assert "Traceback" not in stack.log_path.read_text(errors="replace")


def run_fuzz(stack: Stack, per_mode: int, seed: int, minimum: int) -> None:
    report = fuzz(stack.url, {"/v1/completions": per_mode, "/v1/chat/completions": per_mode, **GETS}, seed=seed)
    print("\nfuzz:", json.dumps(report.summary()))
    assert not report.failures, "\n\n".join(report.failures[:10])
    assert report.requests >= minimum, report.summary()
    assert not [s for s in report.statuses if s >= 500], report.summary()
    assert report.statuses[200] > 0.1 * report.requests, report.summary()  # the engine was reached
    still_serving(stack)


def test_document_states_the_served_model_and_limits(fuzz_stack: Stack) -> None:
    status, raw = fuzz_stack.get("/openapi.json")
    schemas = json.loads(raw)["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    assert status == 200 and completion["model"]["enum"] == [MODEL]
    assert completion["max_tokens"]["maximum"] == 4
    assert completion["prompt"]["oneOf"][1]["maxItems"] == 64
    assert schemas["ChatCompletionRequest"]["properties"]["stop"]["oneOf"][1]["maxItems"] == 4


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
