"""The serving load generator against a small real SSE server with known token timing.

The server streams OpenAI-shaped completion chunks: the first content chunk ``first_ms`` after the request,
then one every ``gap_ms``, then a finish chunk, a usage chunk and ``[DONE]``. Its model name picks a
behaviour: ``ok``, ``fail500``, ``drop`` (ends the stream before ``[DONE]``), ``cut`` (closes the
connection mid-stream), ``errevent`` (an error event instead of tokens) and ``flaky`` (every other request
answers 500).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from helpers.byte_tokenizer import ByteTokenizer

from bench import serve_bench as sb
from bench.workloads import RequestSpec


class FakeServer:
    def __init__(self, first_ms: float = 50.0, gap_ms: float = 20.0) -> None:
        self.first_s, self.gap_s = first_ms / 1e3, gap_ms / 1e3
        self.arrivals: list[float] = []
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.complete)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "ok", "max_model_len": 4096}]})

    def chunk(self, text: str, finish: str | None = None) -> bytes:
        body = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": text,
                                                                      "finish_reason": finish}], "usage": None}
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.arrivals.append(asyncio.get_running_loop().time())
        self.bodies.append(body)
        mode = body["model"]
        if mode == "fail500" or (mode == "flaky" and len(self.bodies) % 2 == 0):
            return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self.stream(request, mode, int(body["max_tokens"]))
        finally:
            self.in_flight -= 1

    async def stream(self, request: web.Request, mode: str, n: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(self.first_s)
        if mode == "errevent":
            await resp.write(b'data: {"error": {"message": "engine died", "type": "server_error"}}\n\n')
        for i in range(n if mode != "errevent" else 0):
            if i:
                await asyncio.sleep(self.gap_s)
            await resp.write(self.chunk(f" t{i}"))
            if i == 2 and mode == "cut":
                assert request.transport is not None
                request.transport.close()
                return resp
            if i == 2 and mode == "drop":
                await resp.write_eof()
                return resp
        await resp.write(self.chunk("", "length"))
        usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": n + 5}
        await resp.write(b"data: " + json.dumps({"id": "c", "choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.fixture
async def server():
    fake = FakeServer()
    runner = web.AppRunner(fake.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    fake.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    yield fake
    await runner.cleanup()


def make_args(url: str, **over: object) -> argparse.Namespace:
    args = sb.build_parser().parse_args(["--base-url", url, "--workload", "fixed", "--quiet", "--warmup", "0",
                                         "--prompt-mean", "16", "--output-mean", "10"])
    vars(args).update(over)
    sb.check_args(argparse.ArgumentParser(), args)
    return args


async def test_metrics_match_known_delays(server: FakeServer) -> None:
    args = make_args(server.url, model="ok", rates=[math.inf], num_requests=6)
    runs, info = await sb.sweep(args, ByteTokenizer())
    run = runs[0]
    assert (run["completed"], run["failed"]) == (6, 0)
    assert (info["model"], info["max_model_len"]) == ("ok", 4096)
    # the server's delays (50 ms to the first token, 20 ms between tokens, one after another) bound the first token
    # and the whole request from below; a busy host only adds to them, so from above each is held to what contains
    # it on the same clock, not to a time. Between tokens no bound from below: a client that reads late reads the
    # chunks bunched, so its gaps can come out shorter than the server's
    assert 48 <= run["ttft_p50_ms"] <= run["ttft_p99_ms"] <= run["e2e_p99_ms"]
    assert 0 < run["tpot_p50_ms"] <= run["tpot_p99_ms"] and 0 <= run["itl_p50_ms"] <= run["itl_p99_ms"]
    assert 50 + 9 * 20 <= run["e2e_p50_ms"] <= run["e2e_p99_ms"] <= run["duration_s"] * 1e3
    # a request's TPOT is (e2e - TTFT) / 9 (10 tokens), so every percentile of it is at most e2e's over 9
    assert run["tpot_p50_ms"] <= run["e2e_p50_ms"] / 9 and run["tpot_p99_ms"] <= run["e2e_p99_ms"] / 9
    assert run["output_tokens"] == 60
    assert run["out_tok_per_s"] == pytest.approx(60 / run["duration_s"])
    body = server.bodies[0]
    assert body["stream"] and body["ignore_eos"] and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 10 and isinstance(body["prompt"], list) and len(body["prompt"]) == 16


@pytest.mark.parametrize(("mode", "reason"), [("fail500", "http_500"), ("drop", "incomplete_stream"),
                                             ("cut", "ClientPayloadError"), ("errevent", "error_event")])
async def test_failures_are_counted(server: FakeServer, mode: str, reason: str) -> None:
    args = make_args(server.url, model=mode, rates=[math.inf], num_requests=4)
    run = (await sb.sweep(args, ByteTokenizer()))[0][0]
    assert (run["completed"], run["failed"]) == (0, 4)
    assert run["failures"] == {reason: 4}
    assert run["ttft_p50_ms"] is None and run["req_per_s"] == 0


async def test_flaky_server_mixes(server: FakeServer) -> None:
    args = make_args(server.url, model="flaky", rates=[math.inf], num_requests=8)
    run = (await sb.sweep(args, ByteTokenizer()))[0][0]
    assert (run["completed"], run["failed"], run["failures"]) == (4, 4, {"http_500": 4})


async def test_poisson_arrivals_and_concurrency_cap(server: FakeServer) -> None:
    server.first_s = server.gap_s = 0.001
    args = make_args(server.url, model="ok", rates=[40.0], duration_s=2.0, num_requests=None)
    t0 = asyncio.get_running_loop().time()  # the server's clock, before the sweep starts its own
    run = (await sb.sweep(args, ByteTokenizer()))[0][0]
    # every send of the Poisson schedule the sweep drew for 40 req/s over 2 s (its seed's: the statistics are
    # test_arrival_offsets_statistics'), however late a busy host sends them, and none before its time (the i-th
    # arrival no sooner than the i-th send; 5 ms for the event loop's early wake-ups)
    schedule = sb.arrival_offsets(40.0, np.random.default_rng(args.seed), None, 2.0)
    assert 50 <= len(schedule) <= 115  # 80 expected, sd ~9
    assert run["completed"] == len(server.arrivals) == len(schedule) and run["failed"] == 0
    assert all(at - t0 >= due - 0.005 for at, due in zip(sorted(server.arrivals), schedule, strict=True))
    server.first_s, server.max_in_flight = 0.05, 0
    args = make_args(server.url, model="ok", rates=[math.inf], num_requests=9, max_concurrency=3)
    run = (await sb.sweep(args, ByteTokenizer()))[0][0]
    assert run["completed"] == 9 and server.max_in_flight == 3


def test_arrival_offsets_statistics() -> None:
    rng = np.random.default_rng(3)
    times = sb.arrival_offsets(50.0, rng, None, 200.0)
    assert abs(len(times) - 10000) < 400 and max(times) < 200.0
    gaps = np.diff(times)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential: CV of 1
    assert sb.arrival_offsets(math.inf, rng, 5, None) == [0.0] * 5


def test_metric_math_on_synthetic_timings() -> None:
    a = sb.RequestResult(ok=True, sent=0.0, first=0.1, last=0.4, chunk_times=[0.1, 0.2, 0.4], output_tokens=4)
    b = sb.RequestResult(ok=True, sent=1.0, first=1.3, last=1.3, chunk_times=[1.3], output_tokens=1)
    c = sb.RequestResult(ok=False, error="http_503")
    run = sb.summarize(2.0, [a, b, c], duration_s=2.0)
    assert run["ttft_p50_ms"] == pytest.approx(200.0) and run["tpot_p50_ms"] == pytest.approx(100.0)
    assert run["itl_mean_ms"] == pytest.approx(150.0) and run["e2e_p99_ms"] == pytest.approx(399.0)
    assert (run["completed"], run["failed"], run["failures"], run["req_per_s"]) == (2, 1, {"http_503": 1}, 1.0)
    assert run["out_tok_per_s"] == pytest.approx(2.5)


async def test_main_writes_json_and_plots(server: FakeServer, tmp_path) -> None:
    server.first_s = server.gap_s = 0.002
    out = tmp_path / "r.json"
    argv = ["--base-url", server.url, "--workload", "vllm", "--prompt-mean", "24", "--output-mean", "6",
            "--rates", "20,inf", "--num-requests", "10", "--quiet", "--out", str(out), "--plot", str(tmp_path / "p"),
            "--label", "cpu"]
    assert await asyncio.to_thread(sb.main, argv) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["label"] == "cpu" and doc["config"]["rates"] == [20.0, "inf"]
    for run in doc["runs"]:
        for key in ("rate", "completed", "failed", "ttft_p999_ms", "tpot_p95_ms", "itl_p99_ms", "e2e_p50_ms",
                    "req_per_s", "out_tok_per_s", "duration_s"):
            assert key in run
        assert run["completed"] == 10
    assert (tmp_path / "p_latency.png").stat().st_size > 10000 and (tmp_path / "p_throughput.png").exists()


async def test_unreachable_server_fails_cleanly() -> None:
    res = sb.RequestResult()
    async with aiohttp.ClientSession() as session:
        await sb.send_one(session, "http://127.0.0.1:9/v1/completions", sb.make_payload("m", RequestSpec([1], 1, 1)),
                          {}, res)
    assert not res.ok and res.error
