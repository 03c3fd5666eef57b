"""Steady streaming load for rolling upgrades: a few concurrent streams, each request's fate recorded.

A client retries only where a user would: when the port refuses or drops the connection before any
response (a gateway being replaced closed its listener), and on a 429 or 503 answered before the
stream starts (they carry Retry-After, and the official SDKs retry them). Once a request got its
200 it is never retried: it either completes (``[DONE]`` after a finish reason) or counts as failed,
with the error event the gateway streamed.

Usable as a library (``Load``, by the rolling-upgrade test) and as a script (by
``docker/rolling_upgrade.sh``): ``python docker/loadgen.py --url http://127.0.0.1:8000 --seconds 60``
runs until the time is up or SIGTERM/SIGINT, then prints the counts as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import signal
import sys
import time
from collections import Counter

import aiohttp

RETRY_STATUSES = (429, 503)
RETRY_PAUSE_S = 0.1
MAX_RETRY_AFTER_S = 1.0


@dataclasses.dataclass(slots=True)
class Result:
    """One request: when it started, got its 200 and ended, and how it ended."""

    started: float
    ok_at: float | None = None       # the 200 arrived
    ended: float = 0.0
    finish: str | None = None        # finish_reason of the last choice
    error: dict | None = None        # the error event streamed after the 200, or the broken stream
    tokens: int = 0
    retries: int = 0
    text: str = ""                   # the streamed text, put together

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish in ("stop", "length")


class RetryBeforeStart(Exception):
    """Nothing was promised yet: a user would send the request again, after ``pause_s``."""

    def __init__(self, why: str, pause_s: float = RETRY_PAUSE_S) -> None:
        super().__init__(why)
        self.pause_s = pause_s


def retry_after(resp: aiohttp.ClientResponse) -> float:
    """The answer's Retry-After in seconds (capped at MAX_RETRY_AFTER_S), or the default pause."""
    try:
        return min(float(resp.headers.get("Retry-After", RETRY_PAUSE_S)), MAX_RETRY_AFTER_S)
    except ValueError:
        return RETRY_PAUSE_S


@dataclasses.dataclass(frozen=True, slots=True)
class LoadConfig:
    url: str
    model: str = "SmolLM2-135M-Instruct"
    streams: int = 3
    max_tokens: int = 16
    prompt: str = "The history of the river begins"
    request_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.streams < 1 or self.max_tokens < 1:
            raise ValueError(f"load: streams and max_tokens must be >= 1, got {self.streams}, {self.max_tokens}")


class Load:
    """``streams`` workers, each sending one streamed completion after another until ``stop()``."""

    def __init__(self, cfg: LoadConfig) -> None:
        self.cfg = cfg
        self.results: list[Result] = []
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.cfg.request_timeout_s))
        self._tasks = [asyncio.create_task(self._worker()) for _ in range(self.cfg.streams)]

    async def stop(self) -> None:
        """Let every worker finish its current request, then close."""
        self._stopping.set()
        await asyncio.gather(*self._tasks)
        if self._session is not None:
            await self._session.close()

    def in_flight_at(self, t: float) -> list[Result]:
        return [r for r in self.results if r.ok_at is not None and r.ok_at <= t and (not r.ended or r.ended > t)]

    async def _worker(self) -> None:
        while not self._stopping.is_set():
            res = Result(time.monotonic())
            self.results.append(res)
            while True:
                try:
                    await self._one(res)
                    break
                except RetryBeforeStart as again:
                    res.retries += 1
                    await asyncio.sleep(again.pause_s)
            res.ended = time.monotonic()

    def _body(self) -> dict:
        return {"model": self.cfg.model, "prompt": self.cfg.prompt, "max_tokens": self.cfg.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}

    async def _one(self, res: Result) -> None:
        assert self._session is not None
        try:
            async with self._session.post(f"{self.cfg.url}/v1/completions", json=self._body()) as resp:
                if resp.status in RETRY_STATUSES:
                    raise RetryBeforeStart(str(resp.status), retry_after(resp))
                if resp.status != 200:
                    res.error = {"status": resp.status, "body": (await resp.text())[:300]}
                    return
                res.ok_at = time.monotonic()
                await self._read_stream(resp, res)
        except (TimeoutError, aiohttp.ClientConnectionError) as exc:
            if res.ok_at is None:
                raise RetryBeforeStart(str(exc)) from None
            res.error = {"broken": f"{type(exc).__name__}: {exc}"}

    @staticmethod
    async def _read_stream(resp: aiohttp.ClientResponse, res: Result) -> None:
        done = False
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                res.error = event["error"]
                continue
            for choice in event.get("choices", ()):
                res.tokens += 1 if choice.get("text") else 0
                res.text += choice.get("text") or ""
                res.finish = choice.get("finish_reason") or res.finish
        if not done and res.error is None:
            res.error = {"broken": "stream ended without [DONE]"}


def summary(results: list[Result]) -> dict:
    """Counts an operator reads: requests sent, completed, failed (by error), retries before a 200."""
    failed = [r for r in results if r.ended and not r.ok]
    kinds = Counter(str((r.error or {}).get("code") or (r.error or {}).get("status") or
                        (r.error or {}).get("broken") or r.finish) for r in failed)
    return {"requests": sum(1 for r in results if r.ended), "completed": sum(1 for r in results if r.ok),
            "failed": len(failed), "failed_by": dict(kinds), "retries_before_200": sum(r.retries for r in results)}


async def _main(args: argparse.Namespace) -> dict:
    load = Load(LoadConfig(args.url, args.model, args.streams, args.max_tokens))
    load.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), args.seconds)
    await load.stop()
    return summary(load.results)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=60.0)
    counts = asyncio.run(_main(ap.parse_args(argv)))
    print(json.dumps(counts), flush=True)
    return 0 if counts["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
