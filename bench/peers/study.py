"""The peer study: Blink and its peers on the same requests, in steady state, without and with CPU co-tenants.

One system at a time (Blink persistent, Blink host-driven, or a peer started from its command line, vLLM
first), each started once and served, co-tenant level by level, a Poisson stream at each offered rate: a
warm-up, a measurement window, a tail (``bench/peers/load.py``). The same model folder (``config.json``, the
real Llama-3 tokenizer, ``generation_config.json`` and the ``tokenizer_config.json`` vLLM needs), the same
requests (same seed per rate), the same client processes (pinned to the first ``--client-cores`` cores) and
the same co-tenants for every system.

Co-tenant levels: ``none``; ``moderate``, one compressing worker per core on every core but the client's;
``heavy``, three ``churn`` workers per core on every core (a bz2 compression of ``--heavy-block-kb`` KiB
alternating with mapping, touching and unmapping ``--heavy-map-mb`` MiB). The server is not pinned.

    python -m bench.peers --systems persistent,vllm --cotenants none,heavy --rates 10,16,22 \\
        --tokenizer-assets .whl/tokenizer-assets
    python -m bench.peers --systems vllm --peer 'vllm=vllm serve {model} --load-format dummy ...' ...
    python -m bench.peers --systems persistent --cotenants none --plateau-search 8:32   # bisection

Setups (every record names its own, and records of different setups stand side by side in one file):
``--config tuned128`` (the default) serves both systems at ``--max-batch`` sequences (vLLM's --max-num-seqs,
128), each with its other defaults; ``--config defaults`` gives each system only the model and --max-model-len
(plus the random weights, served name and address the harness needs, and Blink's short drain), so each runs
at its own default batch. ``--response-format json_object|json_schema:NAME|json_schema:PATH`` makes the load
constrained: the same ``response_format`` in every request of every system, and each record counts the answers
that break it (``bench/peers/constraint.py``). ``--model-config qwen3-30b-a3b`` serves the Qwen3-30B-A3B (MoE)
shape with the real Qwen3 tokenizer; its results go to ``bench/results/peers_moe.json`` unless ``--out`` says.
``--quantization fp8`` and ``--kv-cache-dtype fp8`` put those flags on every system's command line (FP8 weights
quantized at load, an FP8 KV cache); the header records the precision and a file keeps one precision.

``--plateau-search LOW:HIGH`` adds, after ``--rates``, probes that bisect the plateau (the highest offered
rate at which the waiting queue does not grow and TTFT p50 stays under 1 s) to within 1 req/s, starting from
every rate already in ``--out``: a search left unfinished by the time budget goes on in the next invocation.
Results merge into ``--out`` after every rate (a record replaces the one of the same system, co-tenant level,
rate and setup); the table (``python -m bench.peers.report``) and the plots are redrawn at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench import serve_bench as sb
from bench import serving_study as ss
from bench.interfere import Interference
from bench.peers import report
from bench.peers.constraint import ResponseFormat
from bench.peers.load import START_LEAD_S, Clients, Window, build_schedule, request_payload
from bench.peers.measure import measure
from bench.peers.systems import (
    BLINK_MODES,
    BlinkServer,
    CommandServer,
    Peer,
    System,
)
from bench.workloads import Limits, RequestSpec, Workload, build_requests

RESERVE_S = 30.0  # stopping the co-tenants and the server, writing the results
SETTLE_S = 30.0  # longest wait for the server to hold no request between two rates
SETTLE_TYPICAL_S = 5.0  # what the budget counts for it (the reserve covers the rest)
LEVELS = ("none", "moderate", "heavy")


def say(text: str) -> None:
    print(text, flush=True)


@dataclasses.dataclass(frozen=True)
class Level:
    """One co-tenant level: which workers, how many per core, on which cores."""

    name: str
    kinds: tuple[str, ...] = ()
    per_core: int = 0
    every_core: bool = False  # else every core but the client's

    def cores(self, client: list[int]) -> list[int]:
        allowed = sorted(os.sched_getaffinity(0))
        return allowed if self.every_core else [c for c in allowed if c not in client]

    def start(self, client: list[int], block_kb: int, map_mb: int) -> Interference | None:
        if not self.kinds:
            return None
        cores = self.cores(client)
        if not cores:
            raise ValueError(f"co-tenant level {self.name}: no core left beside the client's {client}")
        co = Interference(cores=cores, kinds=self.kinds, per_core=self.per_core, block_kb=block_kb, churn_mb=map_mb)
        return co.start()


LEVEL_DEFS = {"none": Level("none"), "moderate": Level("moderate", ("compress",), 1),
              "heavy": Level("heavy", ("churn",), 3, every_core=True)}


# ---------------------------------------------------------------------- what every system shares
@dataclasses.dataclass
class Context:
    """The invocation's shared state: settings, model, clients, budget, and what was measured."""

    args: argparse.Namespace
    workload: Workload
    limits: Limits
    window: Window
    model: Path | None
    tokenizer: Any
    header: dict[str, Any]
    old: dict[str, Any] | None
    deadline: float
    client_cores: list[int]
    clients: Clients | None = None
    new: dict[str, Any] = dataclasses.field(default_factory=lambda: {"records": [], "systems": {}, "errors": {},
                                                                      "skipped": [], "order": []})

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def rate_worst_s(self) -> float:
        return START_LEAD_S + self.window.hard_end + SETTLE_TYPICAL_S

    @property
    def fmt(self) -> ResponseFormat | None:
        return self.args.response_format

    @property
    def setup(self) -> tuple[str, str]:
        """(config, response format label or ""), as ``report.setup_of`` reads a record's."""
        return self.args.config, self.fmt.label if self.fmt is not None else ""

    def labels(self) -> dict[str, Any]:
        """The setup's keys of every record."""
        return {"config": self.setup[0], "response_format": self.setup[1] or None}

    def records_of(self, system: str, level: str) -> list[dict[str, Any]]:
        """Every record of (system, level) in this setup so far: the file's and this invocation's (newer wins)."""
        doc = report.merge(self.old, {**self.header, **self.new})
        return [r for r in doc["records"]
                if r["system"] == system and r["cotenant"] == level and report.setup_of(r) == self.setup]

    def save(self) -> dict[str, Any]:
        doc = report.merge(self.old, {**self.header, **self.new})
        out: Path = self.args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".part")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(out)
        return doc


# ---------------------------------------------------------------------- one system
def precision_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The flags every system's command line gets for ``--quantization`` and ``--kv-cache-dtype`` (vLLM's names,
    which ``blink serve`` takes too)."""
    out: tuple[str, ...] = ()
    if args.quantization != "none":
        out += ("--quantization", args.quantization)
    if args.kv_cache_dtype != "auto":
        out += ("--kv-cache-dtype", args.kv_cache_dtype)
    return out


def blink_flags(args: argparse.Namespace, backend: str, model: Path | None) -> tuple[str, ...]:
    """``blink serve``'s flags: tuned128's (the serving study's: --max-batch, the prompt and output limits),
    or under ``defaults`` only the backend, --max-model-len, the model (random weights, served name) and a
    short drain (how long a stop waits for streams; the harness stops the server only when it is idle)."""
    if args.config != "defaults":
        return (*ss.serve_args(args, backend, model), *precision_flags(args))
    out = ["--backend", backend, "--max-model-len", str(args.max_model_len), "--drain-timeout", "5"]
    if model is not None:
        out += ["--model", str(model), "--random-weights", "--served-model-name", model.name]
    return (*out, *ss.extra_serve_args(args), *precision_flags(args))


def blink_label(mode: str, args: argparse.Namespace) -> str:
    """A Blink system's name in the records: ``blink-MODE``, with the --serve-args it ran with in brackets
    (``blink-persistent[--max-num-seqs=256]``), so that runs of other settings never replace each other's records
    of the same setup and rate in one file."""
    extra = ss.extra_serve_args(args)
    return f"{mode}[{' '.join(extra)}]" if extra else mode


def make_system(name: str, ctx: Context, peers: dict[str, Peer], work: Path) -> System:
    args = ctx.args
    if name in BLINK_MODES:
        backend = args.backend_override or name
        env = {"BLINK_HEARTBEAT_TIMEOUT_S": os.environ.get("BLINK_HEARTBEAT_TIMEOUT_S", "10")} if backend == "cpu" \
            else {}
        flags = blink_flags(args, backend, ctx.model)
        name = blink_label(name, args)
        dp = getattr(args, "data_parallel_size", 1)
        if dp > 1:  # N engines: --max-batch is per engine, the record is MODE-dpN
            return BlinkServer(f"{name}-dp{dp}", (*flags, "--data-parallel-size", str(dp)), env, work)
        return BlinkServer(name, flags, env, work)
    tuned = args.config != "defaults"  # under defaults a command that names {max_num_seqs} is refused
    values = {"model": ctx.model, "max_num_seqs": args.max_batch if tuned else None,
              "max_model_len": args.max_model_len, "served_name": ctx.model.name if ctx.model else None}
    return CommandServer(peers[name], values, work)


async def warm_up(url: str, model: str, ctx: Context) -> int:
    """A few short requests at once (under the load's constraint, whose grammar they compile); raises when none
    completes (a server that does not serve is not swept)."""
    n = ctx.args.warmup_requests
    specs = build_requests(ctx.workload, n, ctx.tokenizer, ctx.limits, ctx.args.seed + 999) if n else []
    timeout = aiohttp.ClientTimeout(total=ctx.args.warmup_timeout_s)
    body = ctx.fmt.body if ctx.fmt is not None else None
    async with aiohttp.ClientSession(timeout=timeout) as session:
        results = await asyncio.gather(*(sb.send_one(
            session, f"{url}/v1/completions", request_payload(model, RequestSpec(s.prompt, s.prompt_len,
                                                                                 min(16, s.output_len)), body), {},
            sb.RequestResult()) for s in specs))
    ok = sum(r.ok for r in results)
    if specs and not ok:
        raise RuntimeError(f"no warm-up request completed ({sorted({r.error for r in results})})")
    return ok


async def served_model(url: str, ctx: Context) -> str:
    """The served model's name; an error when the server accepts fewer tokens than the requests need."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        model, max_len = await sb.discover(session, url, {}, None)
    if max_len is not None and max_len < ctx.limits.max_context:
        raise RuntimeError(f"the server's max_model_len {max_len} is below the workload's {ctx.limits.max_context}"
                           " (prompt + output limits): raise its limit or lower --max-prompt/--max-output-tokens")
    return model


async def settle(system: System) -> None:
    """Wait until the server holds no request, at most ``SETTLE_S``."""
    end = time.monotonic() + SETTLE_S
    while time.monotonic() < end:
        waiting, running = await asyncio.to_thread(system.gauges)
        if not waiting and not running:
            return
        await asyncio.sleep(0.5)


def level_rates(ctx: Context, system: str, level: str) -> Any:
    """The rates of one (system, level): ``--rates``, then the plateau's bisection probes (a generator that
    looks at what was measured before each probe)."""
    yield from ctx.args.rates
    if ctx.args.plateau_search is None:
        return
    low, high = ctx.args.plateau_search
    for _ in range(ctx.args.max_probes):
        lo, hi = report.bracket(ctx.records_of(system, level))
        probe = report.next_probe(lo, hi, low, high)
        if probe is None:
            return
        say(f"[{system} {level}] plateau bracket {lo}..{hi}: probing {probe:g} req/s")
        yield probe


async def run_level(system: System, model: str, level: Level, ctx: Context) -> None:
    co = level.start(ctx.client_cores, ctx.args.heavy_block_kb, ctx.args.heavy_map_mb)
    mine: list[dict[str, Any]] = []
    cores = {"client": ctx.client_cores, "server": system.describe()["cores"],
             "cotenants": co.cores if co else [], "cotenant_kinds": list(level.kinds), "per_core": level.per_core}
    say(f"[{system.name}] co-tenants {level.name}: {cores}")
    try:
        for rate in level_rates(ctx, system.name, level.name):
            if ctx.rate_worst_s() + RESERVE_S > ctx.left():
                ctx.new["skipped"].append({"system": system.name, "cotenant": level.name, "rate": rate,
                                           **ctx.labels(), "reason": f"time budget: {ctx.left():.0f} s left"})
                say(f"[{system.name} {level.name}] rate {rate:g}: skipped (time budget)")
                continue
            await settle(system)
            schedule = build_schedule(rate, ctx.window, ctx.workload, ctx.limits, ctx.tokenizer, ctx.args.seed,
                                      level.name)
            assert ctx.clients is not None
            rec = await measure(system, ctx.clients, model, schedule, ctx.fmt)
            key = report.system_key(system.name, ctx.args.config)
            rec = {"system": system.name, "version": ctx.new["systems"][key]["version"], "cotenant": level.name,
                   **ctx.labels(), **rec, "cores": cores, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            mine.append(rec)
            ctx.new["records"].append(rec)
            ctx.save()
            say(summary_line(rec))
    finally:
        if co is not None:
            work = co.stop()
            for rec in mine:
                rec["cotenant_work"] = work
            say(f"[{system.name}] co-tenants {level.name} stopped: {work['reported']}/{work['workers']} reported")
            ctx.save()


def summary_line(rec: dict[str, Any]) -> str:
    check = rec.get("output_check")
    checked = (f" | {rec['response_format']}: {check['stop']} stopped, {check['length']} cut at length, "
               f"{rec['invalid_outputs']} invalid") if check else ""
    return (f"[{rec['system']} {rec['cotenant']}] rate {rec['rate']:g}: arrived {rec['arrived']}, completed "
            f"{rec['completed']}, failed {rec['failed']}, unfinished {rec['unfinished']} | sustained "
            f"{rec['sustained_req_s']:.2f} req/s, {rec['sustained_out_tok_s']:.0f} tok/s | queue "
            f"{rec['queue_start']} -> {rec['queue_end']} | TTFT p50/p99 {report.fmt(rec['ttft_ms']['p50'], '.0f')}/"
            f"{report.fmt(rec['ttft_ms']['p99'], '.0f')} ms | TPOT p50/p99 {report.fmt(rec['tpot_ms']['p50'], '.1f')}/"
            f"{report.fmt(rec['tpot_ms']['p99'], '.1f')} ms | client CPU {max(rec['client_cpu_s_per_min'] or [0])} "
            f"s/min{' (CLIENT BUSY: add --clients)' if rec['client_busy'] else ''} | keeps up: {rec['keeps_up_why']}"
            f"{checked}")


async def serve_levels(system: System, ctx: Context) -> None:
    model = await served_model(system.url, ctx)
    say(f"[{system.name}] warm-up: {await warm_up(system.url, model, ctx)}/{ctx.args.warmup_requests} completed")
    for name in ctx.args.cotenants:
        await run_level(system, model, LEVEL_DEFS[name], ctx)
    await settle(system)


def run_system(name: str, ctx: Context, peers: dict[str, Peer], work: Path) -> None:
    """Start one system, serve every level, stop it (also on errors and interrupts)."""
    system = make_system(name, ctx, peers, work)
    name = system.name  # Blink's modes are blink-MODE in the results
    key = report.system_key(name, ctx.args.config)  # its entry in systems and errors
    ctx.new["order"].append(name)
    t0 = time.monotonic()
    try:
        say(f"[{name}] starting (config {ctx.args.config})")
        system.start(max(30.0, min(ctx.args.startup_timeout_s, ctx.left() - RESERVE_S)))
        ctx.new["systems"][key] = {**system.describe(), "device": ctx.header["device"], "config": ctx.args.config}
        say(f"[{name}] healthy after {time.monotonic() - t0:.0f} s on {system.url}: {ctx.new['systems'][key]}")
        asyncio.run(serve_levels(system, ctx))
    except Exception as exc:  # a failed system is reported; the others still run
        ctx.new["errors"][key] = f"{type(exc).__name__}: {exc}"
        say(f"[{name}] FAILED: {ctx.new['errors'][key]}\n{system.log_tail(3000)}")
    finally:
        info = system.describe()  # the whole start-up log is there by now
        code = system.stop()
        ctx.new["systems"].setdefault(key, {"device": ctx.header["device"], "config": ctx.args.config}).update(
            info, exit_code=code)
        ctx.save()
        say(f"[{name}] stopped (exit code {code})")
