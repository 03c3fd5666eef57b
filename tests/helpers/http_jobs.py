"""Many requests through a running ``blink serve`` over HTTP, some hung up mid-stream; outputs by request.

The tests that compare two engines through the whole frontend (gateway, tokenizer, slot tracker, token
reader) send the same jobs to each and compare what came back: ``run_jobs`` sends them with a bounded
number in flight, streams the ones that hang up (and every other one), and returns each job's text,
token strings and finish reason.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from harness.serve_proc import GAUGE_NAMES, ServeProc
from harness.sse import parse_event, request_body


@dataclasses.dataclass(frozen=True)
class HttpJob:
    rid: int
    prompt: tuple[int, ...]
    max_tokens: int
    hang_up_after: int | None = None  # the client closes the stream after this many token chunks


@dataclasses.dataclass
class HttpResult:
    text: str = ""
    tokens: tuple[str, ...] = ()
    finish: str | None = None  # None: the client hung up first
    error: str = ""


def http_jobs(
    n: int, seed: int, max_prompt: int, max_new: int, cancel_frac: float, ids: tuple[int, int]
) -> list[HttpJob]:
    """``n`` jobs: prompt ids drawn from ``ids`` (1..max_prompt of them), 1..max_new output tokens; a
    ``cancel_frac`` share hangs up after fewer chunks than it asked tokens for."""
    rng = np.random.default_rng(seed)
    jobs = []
    for rid in range(n):
        prompt = tuple(int(t) for t in rng.integers(ids[0], ids[1], int(rng.integers(1, max_prompt + 1))))
        new = int(rng.integers(1, max_new + 1))
        hang = int(rng.integers(1, new)) if new > 1 and rng.random() < cancel_frac else None
        jobs.append(HttpJob(rid, prompt, new, hang))
    return jobs


async def read_stream(resp: aiohttp.ClientResponse, res: HttpResult, hang_up_after: int | None) -> None:
    text: list[str] = []
    tokens: list[str] = []
    chunks = 0
    async for raw in resp.content:
        event = parse_event(raw)
        if not isinstance(event, dict):  # blank, comment or [DONE]
            continue
        if "error" in event:
            res.error = json.dumps(event)[:300]
            break
        for choice in event["choices"]:
            text.append(choice["text"])
            tokens.extend((choice.get("logprobs") or {}).get("tokens") or [])
            res.finish = choice.get("finish_reason") or res.finish
        chunks += 1
        if hang_up_after is not None and chunks >= hang_up_after and res.finish is None:
            break  # the client goes away; the response is closed below
    res.text, res.tokens = "".join(text), tuple(tokens)


async def one(session: aiohttp.ClientSession, url: str, model: str, job: HttpJob, stream: bool) -> HttpResult:
    res = HttpResult()
    try:
        body = request_body(list(job.prompt), job.max_tokens, stream, model)
        resp = await session.post(url + "/v1/completions", json=body)
        try:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            elif stream:
                await read_stream(resp, res, job.hang_up_after)
            else:
                choice = (await resp.json())["choices"][0]
                res.text, res.tokens = choice["text"], tuple(choice["logprobs"]["tokens"])
                res.finish = choice["finish_reason"]
        finally:
            resp.close()
    except aiohttp.ClientError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run_jobs_async(url: str, model: str, jobs: list[HttpJob], in_flight: int) -> dict[int, HttpResult]:
    sem = asyncio.Semaphore(in_flight)
    timeout = aiohttp.ClientTimeout(total=900)

    async def bounded(session: aiohttp.ClientSession, job: HttpJob) -> tuple[int, HttpResult]:
        async with sem:
            stream = job.hang_up_after is not None or job.rid % 2 == 0
            return job.rid, await one(session, url, model, job, stream)

    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        return dict(await asyncio.gather(*(bounded(session, j) for j in jobs)))


def run_jobs(url: str, model: str, jobs: list[HttpJob], in_flight: int = 64) -> dict[int, HttpResult]:
    return asyncio.run(run_jobs_async(url, model, jobs, in_flight))


def settled_gauges(serve: ServeProc, timeout_s: float = 30.0) -> dict[str, float | None]:
    """The slot, running and KV gauges once they read zero (or after ``timeout_s``)."""
    return serve.wait_gauges(dict.fromkeys(GAUGE_NAMES, 0.0), timeout_s)


def engine_events(log: Path, event: str) -> list[dict[str, Any]]:
    """Every JSON log record of ``event`` in a ``blink serve`` log (the engine's lines included)."""
    found = []
    for line in log.read_text(errors="replace").splitlines():
        m = re.search(r"\{.*\}", line)
        if m and f'"event": "{event}"' in m.group(0):
            found.append(json.loads(m.group(0)))
    return found


def compare(jobs: list[HttpJob], got: dict[int, HttpResult], ref: dict[int, HttpResult]) -> list[str]:
    """Differences: a job that hung up must hold a prefix of the reference; every other one all of it."""
    bad = []
    for j in jobs:
        g, r = got[j.rid], ref[j.rid]
        if g.error or r.error:
            bad.append(f"request {j.rid}: {g.error or r.error}")
        elif g.finish is None:
            if j.hang_up_after is None or g.tokens != r.tokens[: len(g.tokens)]:
                bad.append(f"request {j.rid}: ended without a finish reason, or not a prefix of the reference")
        elif (g.finish, g.tokens, g.text) != ("length", r.tokens, r.text) or len(g.tokens) != j.max_tokens:
            bad.append(
                f"request {j.rid}: {g.finish} {len(g.tokens)} tokens != reference {r.finish} {len(r.tokens)} tokens"
            )
    return bad
