"""Steady streaming load for rolling upgrades: a few concurrent streams, each request's fate recorded.

A client retries only where a user would: when the port refuses or drops the connection before any
response (a gateway being replaced closed its listener), and on a 429 or 503 answered before the
stream starts (they carry Retry-After, and the official SDKs retry them). Once a request got its
200 it is never retried: it either completes (``[DONE]`` after a finish reason) or counts as failed,
with the error event the gateway streamed.

Usable as a library (``Load``, and the classification of failures by phase, by the rolling-upgrade
test) and as a script (by ``docker/rolling_upgrade.sh``):
``python docker/loadgen.py --url http://127.0.0.1:8000 --seconds 60 [--results R.jsonl]`` runs until
the time is up or SIGTERM/SIGINT, prints the counts as JSON and appends each request to R.jsonl;
``python docker/loadgen.py --results R.jsonl --report PHASES.jsonl`` reads every request recorded
there and the replacements (one JSON object a line: name, start, end and, for a replacement that
starts the new one beside the old, cut and gone; wall-clock seconds) and prints the counts by phase.
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

ENGINE_ERRORS = ("engine_unavailable",)  # the code a stream lost with its engine ends with
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


def dump(results: list[Result], path: str) -> None:
    """Append each ended request to ``path`` as one JSON line, its times on the wall clock."""
    shift = time.time() - time.monotonic()
    with open(path, "a", encoding="utf-8") as f:
        for r in results:
            if r.ended:
                rec = dataclasses.asdict(r)
                for key in ("started", "ok_at", "ended"):
                    rec[key] = None if rec[key] is None else rec[key] + shift
                f.write(json.dumps(rec) + "\n")


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def summary(results: list[Result]) -> dict:
    """Counts an operator reads: requests sent, completed, failed (by error), retries before a 200."""
    failed = [r for r in results if r.ended and not r.ok]
    kinds = Counter(str((r.error or {}).get("code") or (r.error or {}).get("status") or
                        (r.error or {}).get("broken") or r.finish) for r in failed)
    return {"requests": sum(1 for r in results if r.ended), "completed": sum(1 for r in results if r.ok),
            "failed": len(failed), "failed_by": dict(kinds), "retries_before_200": sum(r.retries for r in results)}


# ---------------------------------------------------------------------- failures by phase
@dataclasses.dataclass(slots=True)
class Phase:
    """One replacement, on the clock of the results: started, done, and for one that starts the new
    one beside the old, when the old was told to stop (``cut``) and when it had exited (``gone``)."""

    name: str
    start: float
    end: float = 0.0
    cut: float = 0.0
    gone: float = 0.0


def phase_of(res: Result, phases: list[Phase]) -> str:
    """The replacement a failed request died in: the one under way when it ended, else one it overlapped."""
    for p in phases:
        if p.start <= res.ended <= p.end:
            return p.name
    hit = next((p for p in phases if res.ok_at is not None and res.ok_at <= p.end and res.ended >= p.start), None)
    return hit.name if hit is not None else "steady load"


def classify_failures(results: list[Result], phases: list[Phase]) -> tuple[dict[str, int], list[str]]:
    """Failed requests counted by phase, and the ones the design does not allow: any failure outside the
    engine's restart, or one there without the defined error."""
    per_phase: dict[str, int] = {}
    wrong: list[str] = []
    for res in [r for r in results if r.ended and not r.ok]:
        name = phase_of(res, phases)
        per_phase[name] = per_phase.get(name, 0) + 1
        code = (res.error or {}).get("code")
        if not (name.startswith("engine") and (code in ENGINE_ERRORS or res.finish == "abort")):
            wrong.append(f"{name}: {res.error or res.finish}")
    return per_phase, wrong


def across_cuts(results: list[Result], phases: list[Phase]) -> dict[str, list[Result]]:
    """Per replacement with a cut, the streams the old one carried when it was told to stop: their 200
    came before it had exited, their end after it was told to stop."""
    return {p.name: [r for r in results if r.ok_at is not None and r.ok_at < p.gone and r.ended > p.cut]
            for p in phases if p.cut}


def wrong_texts(results: list[Result]) -> list[str]:
    """Completed streams whose text is not the one most of them have (one greedy prompt: one text)."""
    texts = [r.text for r in results if r.ok]
    if not texts:
        return []
    common = max(set(texts), key=texts.count)
    return [f"{r.text!r} (expected {common!r})" for r in results if r.ok and r.text != common]


def report(results: list[Result], phases: list[Phase]) -> dict:
    """The counts, failures by phase (and those not allowed), the streams across each cut (and how many
    of them did not complete), completed streams with another text."""
    by_phase, not_allowed = classify_failures(results, phases)
    cuts = across_cuts(results, phases)
    return {**summary(results), "failed_by_phase": by_phase, "failures_not_allowed": not_allowed,
            "streams_across_cut": {k: len(v) for k, v in cuts.items()},
            "lost_across_cut": {k: sum(not r.ok for r in v) for k, v in cuts.items()},
            "other_text": wrong_texts(results), "phases_s": {p.name: round(p.end - p.start, 2) for p in phases}}


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
    if args.results:
        dump(load.results, args.results)
    return summary(load.results)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--results", help="append each request to this file (JSON lines)")
    ap.add_argument("--report", metavar="PHASES", help="no load: report on --results by the phases in PHASES")
    args = ap.parse_args(argv)
    if args.report:
        if not args.results:
            ap.error("--report needs --results")
        out = report([Result(**r) for r in read_jsonl(args.results)], [Phase(**p) for p in read_jsonl(args.report)])
        print(json.dumps(out, indent=1), flush=True)
        return 0 if not out["failures_not_allowed"] and not any(out["lost_across_cut"].values()) else 1
    counts = asyncio.run(_main(args))
    print(json.dumps(counts), flush=True)
    return 0 if counts["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
