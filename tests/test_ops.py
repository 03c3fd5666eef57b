"""Operations: a log line per answered request, 503 "the model is loading" while no engine has come up,
and one /metrics view over every gateway with the engine's counters and vLLM's names."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient
from helpers.fixtures import gateway_without_engine
from helpers.stack import MODEL, Stack, start_stack, stop_stack

from harness.serve_proc import http_get, parse_metrics


@pytest.fixture
async def loading_client(tmp_path: Path) -> AsyncIterator[TestClient]:
    """A gateway whose engine has not created its ring yet (as while the weights load)."""
    async with gateway_without_engine(tmp_path) as client:
        yield client


def summed(text: str) -> dict[str, float]:
    """Prometheus text to {name: value summed over its label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            name = series.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def request_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        start = line.find("{")
        if start >= 0 and '"event": "request"' in line:
            out.append(json.loads(line[start:]))
    return out


class Recorder:
    """Stands in for the gateway's logger: keeps each line's event and fields."""

    def __init__(self) -> None:
        self.lines: list[dict] = []

    def info(self, event: str, **fields: object) -> None:
        self.lines.append({"event": event, "level": "info", **fields})

    def debug(self, event: str, **fields: object) -> None:
        self.lines.append({"event": event, "level": "debug", **fields})


async def test_the_port_answers_503_loading_while_the_engine_is_not_up(
        loading_client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    import dpu_gateway.app

    rec = Recorder()
    monkeypatch.setattr(dpu_gateway.app, "log", rec)
    for path in ("/health",):
        resp = await loading_client.get(path)
        assert resp.status == 503
        assert (await resp.json())["error"]["message"] == "the model is loading"
    resp = await loading_client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "a secret prompt"}]})
    assert resp.status == 503 and resp.headers["Retry-After"] == "1"
    body = await resp.json()
    assert body["error"]["message"] == "the model is loading" and body["error"]["code"] == "model_loading"
    metrics = parse_metrics(await (await loading_client.get("/metrics")).text())
    assert metrics["blink:request_failures_total"] == 2  # the two 503s; /metrics itself is a 200
    assert "a secret prompt" not in repr(rec.lines)
    lines = {(r["route"], r["status"], r["level"]) for r in rec.lines if r["event"] == "request"}
    assert lines == {("/v1/chat/completions", 503, "info"), ("/health", 503, "info"), ("/metrics", 200, "debug")}


@pytest.fixture(scope="module")
def two_gateways(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("ops"), "--gateways", "2", "--num-slots", "16")
    yield stack
    stop_stack(stack)


def post(stack: Stack, path: str, body: dict) -> int:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(stack.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:  # a new connection each time: either gateway
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_metrics_count_every_request_once_over_two_gateways(two_gateways: Stack) -> None:
    n = 16
    for i in range(n):
        assert post(two_gateways, "/v1/completions", {"model": MODEL, "prompt": f"count {i}", "max_tokens": 3}) == 200
    assert post(two_gateways, "/v1/completions", {"model": "no-such-model", "prompt": "x"}) == 404
    lines = [r for r in request_lines(two_gateways.log()) if r["route"] == "/v1/completions"]
    ok = [r for r in lines if r["status"] == 200]
    assert len(ok) == n and all(r["output_tokens"] > 0 and r["prompt_tokens"] > 0 for r in ok)
    assert all(r["ttft_s"] is not None and r["total_s"] >= r["ttft_s"] and r["finish_reason"] for r in ok)
    assert len({r["service"] for r in ok}) == 2, "both gateways should have served some of the requests"
    for _ in range(4):  # whichever gateway answers the scrape, the totals are the same
        status, body = http_get(two_gateways.url + "/metrics")
        assert status == 200
        text = body.decode()
        m = summed(text)
        assert m["blink:request_success_total"] == m["vllm:request_success_total"] == n
        assert m["vllm:e2e_request_latency_seconds_count"] == n
        assert m["vllm:time_to_first_token_seconds_count"] == n
        assert m["vllm:generation_tokens_total"] == m["blink:generation_tokens_total"] > 0
        assert m["blink:request_failures_total"] == 1 and 'status="404"' in text
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "vllm:prompt_tokens_total", "blink:engine_steps_total", "blink:engine_output_tokens_total"):
            assert name in m, name
