"""Serving benchmark: Poisson load against an OpenAI-compatible ``/v1/completions`` endpoint, streamed over SSE.

    blink bench serve --base-url http://127.0.0.1:8000 --workload paper --rates 1,2,4,inf \\
        --duration-s 120 --max-concurrency 256 --label persistent --out results.json --plot results

Metrics follow vLLM's ``benchmark_serving``:

- TTFT: request sent to the first content chunk received (a chunk whose ``text`` is not empty);
- TPOT, per request: (last content chunk time - first content chunk time) / (output tokens - 1), so the
  first token is left out; requests of one output token have none;
- ITL: every gap between consecutive content chunks of a request, pooled over all requests;
- E2E latency: request sent to the last content chunk.

Output tokens come from the final ``usage`` chunk (``stream_options.include_usage``), or the number of content
chunks when a server sends none. A request fails on an HTTP error, a connection error, an ``error`` event, a
stream without ``[DONE]`` or a stream without any content. Arrivals of each rate are a Poisson process; a rate
of ``inf`` sends everything at once (or keeps ``--max-concurrency`` requests in flight for ``--duration-s``).
When the concurrency cap is reached, arrivals wait on the client and are sent as soon as a request finishes;
their clocks start when they are sent (as in vLLM).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.workloads import WORKLOADS, Limits, RequestSpec, build_requests, summary
from harness.sse import parse_event

PERCENTILES = {"p50": 50.0, "p95": 95.0, "p99": 99.0, "p999": 99.9}


@dataclass
class RequestResult:
    """What one request measured; times are seconds on ``time.perf_counter``."""

    ok: bool = False
    error: str = ""
    detail: str = ""
    sent: float = 0.0
    first: float = 0.0
    last: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_len: int = 0
    text: list[str] | None = None  # the streamed text's pieces, kept only where asked for (not None)
    finish_reason: str = ""

    @property
    def ttft(self) -> float:
        return self.first - self.sent

    @property
    def e2e(self) -> float:
        return self.last - self.sent

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.last - self.first) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


# ---------------------------------------------------------------------- one request
def chunk_text(event: dict) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def apply_event(res: RequestResult, event: dict | str, now: float) -> bool:
    """Fold one event into ``res``; True once the stream is over (``[DONE]``)."""
    if event == "[DONE]":
        res.ok = not res.error and bool(res.chunk_times)
        if not res.ok and not res.error:
            res.error = "no_content"
        return True
    assert isinstance(event, dict)
    if "error" in event:
        res.error = "error_event"
        res.detail = str((event["error"] or {}).get("message", ""))[:200]
    elif piece := chunk_text(event):
        if not res.chunk_times:
            res.first = now
        res.last = now
        res.chunk_times.append(now)
        if res.text is not None:
            res.text.append(piece)
    choices = event.get("choices") or []
    if choices and choices[0].get("finish_reason"):
        res.finish_reason = str(choices[0]["finish_reason"])
    usage = event.get("usage")
    if usage:
        res.output_tokens = int(usage.get("completion_tokens") or 0)
    return False


async def read_stream(resp: aiohttp.ClientResponse, res: RequestResult) -> None:
    done = False
    async for line in resp.content:
        event = parse_event(line)
        if event is not None and apply_event(res, event, time.perf_counter()):
            done = True
            break
    if not done:
        res.ok, res.error = False, res.error or "incomplete_stream"
    if res.ok and not res.output_tokens:
        res.output_tokens = len(res.chunk_times)


async def send_one(session: aiohttp.ClientSession, url: str, payload: dict, headers: dict[str, str],
                   res: RequestResult) -> RequestResult:
    """POST one streamed completion and time it into ``res`` (which never raises)."""
    res.sent = time.perf_counter()
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                res.error = f"http_{resp.status}"
                res.detail = (await resp.text(errors="replace"))[:200]
                return res
            await read_stream(resp, res)
    except TimeoutError:
        res.ok, res.error = False, "timeout"
    except (aiohttp.ClientError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        res.ok, res.error, res.detail = False, f"{type(exc).__name__}", str(exc)[:200]
    return res


def make_payload(model: str, spec: RequestSpec) -> dict[str, Any]:
    return {"model": model, "prompt": spec.prompt, "max_tokens": spec.output_len, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}


# ---------------------------------------------------------------------- metrics
def percentile_fields(prefix: str, seconds: list[float]) -> dict[str, float | None]:
    """``{prefix}_mean_ms`` and ``{prefix}_p50_ms`` ... ``_p999_ms`` (None without samples)."""
    out: dict[str, float | None] = {}
    arr = np.asarray(seconds, dtype=np.float64) * 1e3
    out[f"{prefix}_mean_ms"] = float(arr.mean()) if arr.size else None
    for name, q in PERCENTILES.items():
        out[f"{prefix}_{name}_ms"] = float(np.percentile(arr, q)) if arr.size else None
    return out


def summarize(rate: float, results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    """One run's record of the output JSON."""
    ok = [r for r in results if r.ok]
    failures: dict[str, int] = {}
    samples: dict[str, str] = {}
    for r in results:
        if not r.ok:
            failures[r.error] = failures.get(r.error, 0) + 1
            samples.setdefault(r.error, r.detail)
    run: dict[str, Any] = {"rate": "inf" if math.isinf(rate) else rate, "completed": len(ok),
                           "failed": len(results) - len(ok), "failures": failures, "failure_samples": samples}
    run.update(percentile_fields("ttft", [r.ttft for r in ok]))
    run.update(percentile_fields("tpot", [t for r in ok if (t := r.tpot) is not None]))
    run.update(percentile_fields("itl", [g for r in ok for g in r.itls]))
    run.update(percentile_fields("e2e", [r.e2e for r in ok]))
    out_tokens = sum(r.output_tokens for r in ok)
    run.update({"req_per_s": len(ok) / duration_s if duration_s > 0 else 0.0,
                "out_tok_per_s": out_tokens / duration_s if duration_s > 0 else 0.0,
                "in_tok_per_s": sum(r.prompt_len for r in ok) / duration_s if duration_s > 0 else 0.0,
                "output_tokens": out_tokens, "duration_s": duration_s})
    return run


def arrival_offsets(rate: float, rng: np.random.Generator, count: int | None, duration_s: float | None) -> list[float]:
    """Send times (seconds from the start) of a Poisson process of ``rate``; all zeros when it is infinite."""
    if math.isinf(rate):
        return [0.0] * (count if count is not None else 0)
    if count is not None:
        return np.cumsum(rng.exponential(1.0 / rate, size=count)).tolist()
    assert duration_s is not None
    times: list[float] = []
    t = rng.exponential(1.0 / rate)
    while t < duration_s:
        times.append(float(t))
        t += rng.exponential(1.0 / rate)
    return times


# ---------------------------------------------------------------------- one rate
class Progress:
    """One status line on stderr, rewritten in place on a terminal and every 10 s otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.rate = "-"
        self.sent = self.done = self.failed = 0
        self.start = time.perf_counter()

    def reset(self, rate: float) -> None:
        self.rate = "inf" if math.isinf(rate) else f"{rate:g}"
        self.sent = self.done = self.failed = 0
        self.start = time.perf_counter()

    def line(self) -> str:
        return (f"rate {self.rate} req/s | sent {self.sent} | done {self.done} | failed {self.failed} | "
                f"elapsed {time.perf_counter() - self.start:6.1f} s")

    def show(self, final: bool = False) -> None:
        if not self.enabled:
            return
        if self.tty:
            sys.stderr.write("\r\033[K" + self.line() + ("\n" if final else ""))
        else:
            sys.stderr.write(self.line() + "\n")
        sys.stderr.flush()

    async def ticker(self) -> None:
        period = 0.25 if self.tty else 10.0
        while True:
            await asyncio.sleep(period)
            self.show()


@dataclass
class Target:
    """Where and how requests go."""

    url: str
    model: str
    headers: dict[str, str]
    max_concurrency: int | None = None


async def _one_tracked(session: aiohttp.ClientSession, target: Target, spec: RequestSpec,
                       sem: asyncio.Semaphore | None, progress: Progress) -> RequestResult:
    res = RequestResult(prompt_len=spec.prompt_len)
    try:
        await send_one(session, target.url, make_payload(target.model, spec), target.headers, res)
    finally:
        if sem is not None:
            sem.release()
        progress.done += 1
        progress.failed += 0 if res.ok else 1
    return res


async def _sleep_until(when: float) -> None:
    delay = when - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def run_rate(session: aiohttp.ClientSession, target: Target, specs: list[RequestSpec], rate: float,
                   offsets: list[float], duration_s: float | None, progress: Progress) -> dict[str, Any]:
    """Send ``specs`` (cycled) at ``offsets``; an infinite rate in duration mode keeps the cap full until
    ``duration_s``. The run lasts from the first send to the last completion."""
    sem = asyncio.Semaphore(target.max_concurrency) if target.max_concurrency else None
    progress.reset(rate)
    start = time.perf_counter()
    deadline = start + duration_s if duration_s is not None and math.isinf(rate) else None
    tasks: list[asyncio.Task[RequestResult]] = []
    for i in itertools.count():
        if deadline is None:
            if i >= len(offsets):
                break
            await _sleep_until(start + offsets[i])
        if sem is not None:
            await sem.acquire()
        if deadline is not None and time.perf_counter() >= deadline:
            if sem is not None:
                sem.release()
            break
        spec = specs[i % len(specs)]
        tasks.append(asyncio.create_task(_one_tracked(session, target, spec, sem, progress)))
        progress.sent += 1
    results = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    progress.show(final=True)
    return summarize(rate, results, duration)


# ---------------------------------------------------------------------- the sweep
def parse_rates(text: str) -> list[float]:
    rates = [math.inf if r.strip().lower() in ("inf", "infinity") else float(r) for r in text.split(",") if r.strip()]
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be positive numbers or inf: {text!r}")
    return rates


async def discover(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str],
                   model: str | None) -> tuple[str, int | None]:
    """The served model's name (the first one listed unless given) and its context length if the server says."""
    async with session.get(f"{base_url}/v1/models", headers=headers) as resp:
        resp.raise_for_status()
        data = (await resp.json()).get("data") or []
    entry = next((m for m in data if model is None or m.get("id") == model), None)
    if entry is None:
        if model is None:
            raise RuntimeError(f"{base_url}/v1/models lists no model")
        return model, None
    return entry["id"], entry.get("max_model_len")


def pool_size(args: argparse.Namespace, rate: float, offsets: list[float]) -> int:
    if args.num_requests is not None or not math.isinf(rate):
        return max(1, len(offsets))
    return min(4096, max(64, 8 * args.max_concurrency))


def limits_of(args: argparse.Namespace, max_model_len: int | None) -> Limits:
    ctx = max_model_len or args.max_context or (1 << 30)
    return Limits(args.max_prompt_tokens or ctx, args.max_output_tokens or ctx, ctx)


async def warm_up(session: aiohttp.ClientSession, target: Target, specs: list[RequestSpec]) -> None:
    short = [RequestSpec(s.prompt, s.prompt_len, min(s.output_len, 16)) for s in specs]
    results = await asyncio.gather(*(send_one(session, target.url, make_payload(target.model, s), target.headers,
                                              RequestResult()) for s in short))
    bad = [r.error for r in results if not r.ok]
    if bad:
        print(f"warm-up: {len(bad)} of {len(results)} requests failed ({', '.join(sorted(set(bad)))})",
              file=sys.stderr)


async def sweep(args: argparse.Namespace, tokenizer: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every rate of ``args.rates`` in turn; returns the runs and what the server said about itself."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s, sock_connect=30)
    connector = aiohttp.TCPConnector(limit=0)
    workload = WORKLOADS[args.workload].scaled(args.prompt_mean, args.output_mean)
    progress = Progress(not args.quiet)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model, max_len = await discover(session, args.base_url, headers, args.model)
        limits = limits_of(args, max_len)
        target = Target(f"{args.base_url}{args.endpoint}", model, headers, args.max_concurrency)
        as_text = args.prompt_format == "text"
        if args.warmup > 0:
            await warm_up(session, target, build_requests(workload, args.warmup, tokenizer, limits,
                                                          args.seed + 999, as_text))
        runs = []
        ticker = asyncio.create_task(progress.ticker())
        try:
            for k, rate in enumerate(args.rates):
                rng = np.random.default_rng(args.seed + k)
                offsets = arrival_offsets(rate, rng, args.num_requests, args.duration_s)
                specs = build_requests(workload, pool_size(args, rate, offsets), tokenizer, limits,
                                       args.seed + k, as_text)
                run = await run_rate(session, target, specs, rate, offsets, args.duration_s, progress)
                run["workload"] = summary(specs)
                runs.append(run)
        finally:
            ticker.cancel()
    return runs, {"model": model, "max_model_len": max_len, "limits": asdict(limits), "workload": workload.record()}


# ---------------------------------------------------------------------- output
TABLE = (("rate", "rate", "{:>6}"), ("completed", "done", "{:>6}"), ("failed", "fail", "{:>5}"),
         ("req_per_s", "req/s", "{:>7.2f}"), ("out_tok_per_s", "tok/s", "{:>8.1f}"),
         ("ttft_p50_ms", "TTFT50", "{:>8.1f}"), ("ttft_p99_ms", "TTFT99", "{:>8.1f}"),
         ("tpot_p50_ms", "TPOT50", "{:>7.2f}"), ("tpot_p99_ms", "TPOT99", "{:>7.2f}"),
         ("itl_p50_ms", "ITL50", "{:>7.2f}"), ("itl_p99_ms", "ITL99", "{:>7.2f}"),
         ("e2e_p50_ms", "E2E50", "{:>8.0f}"), ("e2e_p99_ms", "E2E99", "{:>8.0f}"))


def format_table(runs: list[dict[str, Any]]) -> str:
    """The runs as a text table (latencies in ms)."""
    widths = [len(fmt.format(0)) for _, _, fmt in TABLE]
    head = " ".join(f"{title:>{w}}" for (_, title, _), w in zip(TABLE, widths, strict=True))
    lines = [head, "-" * len(head)]
    for run in runs:
        cells = []
        for (key, _, fmt), w in zip(TABLE, widths, strict=True):
            value = run.get(key)
            cells.append(f"{'-':>{w}}" if value is None else fmt.format(value))
        lines.append(" ".join(cells))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="blink bench serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--endpoint", default="/v1/completions")
    ap.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--tokenizer", default=None, help="model folder or file (default: the embedded SmolLM2)")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="paper")
    ap.add_argument("--prompt-mean", type=float, default=None, help="override the workload's mean prompt length")
    ap.add_argument("--output-mean", type=float, default=None, help="override the workload's mean output length")
    ap.add_argument("--prompt-format", choices=("ids", "text"), default="ids")
    ap.add_argument("--max-prompt-tokens", type=int, default=None)
    ap.add_argument("--max-output-tokens", type=int, default=None)
    ap.add_argument("--max-context", type=int, default=None, help="when the server does not report max_model_len")
    ap.add_argument("--rates", type=parse_rates, default=parse_rates("1,2,4,inf"), help="req/s, comma-separated")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--duration-s", type=float, default=None, help="send for this long at each rate")
    size.add_argument("--num-requests", type=int, default=None, help="send this many requests at each rate")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=2, help="uncounted requests before the sweep")
    ap.add_argument("--request-timeout-s", type=float, default=1800.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="blink", help="mode label for plots (e.g. persistent, host)")
    ap.add_argument("--interfere", default=None, metavar="CORES",
                    help="run CPU co-tenants on these cores during the sweep (e.g. 2-15, or all-but-2)")
    ap.add_argument("--interfere-kinds", default="compress,thrash")
    ap.add_argument("--interference", action="store_true", help="mark the results as run under interference")
    ap.add_argument("--out", type=Path, default=None, help="results JSON")
    ap.add_argument("--plot", type=Path, default=None, help="PNG prefix: PREFIX_latency.png, PREFIX_throughput.png")
    ap.add_argument("--quiet", action="store_true", help="no progress line")
    return ap


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.duration_s is None and args.num_requests is None:
        args.num_requests = 200
    if args.duration_s is not None and any(math.isinf(r) for r in args.rates) and not args.max_concurrency:
        ap.error("an infinite rate with --duration-s needs --max-concurrency (a closed loop)")
    args.base_url = args.base_url.rstrip("/")


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    """Load the tokenizer, run the sweep (under co-tenants with --interfere) and return the results document."""
    from dpu_tokenizer.loader import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    interference_report = None
    if args.interfere:
        from bench.interfere import Interference, parse_cores

        with Interference(cores=parse_cores(args.interfere), kinds=tuple(args.interfere_kinds.split(","))) as co:
            runs, server = asyncio.run(sweep(args, tokenizer))
        interference_report = co.report
    else:
        runs, server = asyncio.run(sweep(args, tokenizer))
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("rates", "api_key")}
    config.update(rates=["inf" if math.isinf(r) else r for r in args.rates], server=server,
                  interference=bool(args.interfere or args.interference), interference_report=interference_report,
                  host=platform.node(), started=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    return {"config": config, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    doc = run_sweep(args)
    print(format_table(doc["runs"]))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.out}")
    if args.plot is not None:
        from bench.plots import plot_results

        for path in plot_results([(doc, args.label, doc["config"]["interference"])], args.plot):
            print(f"wrote {path}")
    return 0 if all(r["completed"] for r in doc["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
