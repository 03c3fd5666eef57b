"""``python -m bench.peers``: the command line of the peer study (``bench/peers/study.py`` says what it does)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import serve_bench as sb
from bench import serving_study as ss
from bench.peers import report, study
from bench.peers.constraint import SCHEMAS, ResponseFormat, parse_response_format
from bench.peers.load import ARRIVALS, MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS, Clients, Window, peer_limits
from bench.peers.systems import BLINK_MODES, PEER_KINDS, Peer, parse_peer, write_tokenizer_config
from bench.workloads import WORKLOADS
from harness.models import MODEL_CONFIGS, QWEN3_MOE, build_model_folder

RESULTS = {QWEN3_MOE: "bench/results/peers_moe"}  # by --model-config; any other: bench/results/peers


def parse_list(choices: tuple[str, ...] | None) -> Any:
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if choices is not None and t not in choices]
        if not items or bad or len(set(items)) != len(items):
            raise argparse.ArgumentTypeError(f"distinct names{f' among {choices}' if choices else ''}: {text!r}")
        return items
    return parse


def parse_finite_rates(text: str) -> list[float]:
    rates = sb.parse_rates(text)
    if any(math.isinf(r) for r in rates):
        raise argparse.ArgumentTypeError("steady-state rates must be finite")
    return rates


def parse_range(text: str) -> tuple[float, float]:
    low, _, high = text.partition(":")
    try:
        lo, hi = float(low), float(high)
    except ValueError:
        raise argparse.ArgumentTypeError(f"LOW:HIGH in req/s, e.g. 8:32: {text!r}") from None
    if not 0 < lo < hi or math.isinf(hi):
        raise argparse.ArgumentTypeError(f"need 0 < LOW < HIGH: {text!r}")
    return lo, hi


def response_format_arg(text: str) -> ResponseFormat:
    try:
        return parse_response_format(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def peer_arg(text: str) -> Peer:
    try:
        return parse_peer(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    from dpu_tokenizer.fetch_assets import default_assets_dir

    ap = argparse.ArgumentParser(prog="python -m bench.peers", description=study.__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--systems", type=parse_list(None), default=["persistent", "vllm"],
                    help=f"in order: Blink modes ({', '.join(BLINK_MODES)}) and peer names")
    ap.add_argument("--peer", type=peer_arg, action="append", default=[], metavar="NAME[:KIND][=COMMAND]",
                    help=f"a peer (kinds {', '.join(PEER_KINDS)}); placeholders {{model}} {{port}} {{max_num_seqs}} "
                         "{max_model_len} {served_name} {python} {precision} (--quantization and --kv-cache-dtype "
                         "as vLLM names them; vllm and blink commands get them at the end); 'vllm' alone is vLLM's "
                         "own command")
    ap.add_argument("--cotenants", type=parse_list(study.LEVELS), default=["none", "heavy"])
    ap.add_argument("--rates", type=parse_finite_rates, default=[10.0, 16.0, 22.0], help="offered req/s")
    ap.add_argument("--plateau-search", type=parse_range, default=None, metavar="LOW:HIGH",
                    help="after --rates, bisect the plateau within this range to 1 req/s")
    ap.add_argument("--max-probes", type=int, default=4, help="bisection probes per (system, co-tenant level)")
    ap.add_argument("--window-s", type=float, default=60.0, help="the measurement window")
    ap.add_argument("--warmup-s", type=float, default=15.0, help="arrivals before the window, not measured")
    ap.add_argument("--drain-s", type=float, default=30.0, help="longest tail after the window")
    ap.add_argument("--clients", type=int, default=8, help="client processes sharing each rate's stream")
    ap.add_argument("--client-cores", type=int, default=2, help="the first N allowed cores run the clients")
    ap.add_argument("--max-batch", type=int, default=128, help="Blink's max batch and the peers' max_num_seqs")
    ap.add_argument("--max-prompt-tokens", type=int, default=MAX_PROMPT_TOKENS)
    ap.add_argument("--max-output-tokens", type=int, default=MAX_OUTPUT_TOKENS)
    ap.add_argument("--max-model-len", type=int, default=8192,
                    help="the peers' context limit (and Blink's under --config defaults)")
    ap.add_argument("--config", choices=report.CONFIGS, default=report.DEFAULT_CONFIG,
                    help="tuned128: every system at --max-batch sequences, its other settings its own; defaults: "
                         "each system with only the model and --max-model-len (its own max batch)")
    ap.add_argument("--response-format", type=response_format_arg, default=None,
                    metavar="json_object|json_schema:NAME|json_schema:PATH",
                    help=f"a constrained load: this response_format in every request (built-in schemas: "
                         f"{', '.join(SCHEMAS)}), the answers checked")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="paper")
    ap.add_argument("--prompt-mean", type=float, default=None)
    ap.add_argument("--output-mean", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-config", choices=[*MODEL_CONFIGS, ss.EMBEDDED], default="8b")
    ap.add_argument("--tokenizer-assets", type=Path, default=default_assets_dir())
    ap.add_argument("--backend-override", choices=("cpu", "host", "persistent"), default=None,
                    help="engine backend of every Blink mode (the mode stays the label), e.g. cpu in tests")
    ap.add_argument("--serve-args", action="append", default=[],
                    help="more flags for blink serve; repeatable, each value split as a shell would (a value of one "
                    "word that starts with -- goes after '=': --serve-args=--max-num-seqs=256)")
    ap.add_argument("--quantization", choices=("none", "fp8"), default="none",
                    help="fp8: every system quantizes its weights to FP8 at load (blink serve and vllm serve "
                         "--quantization fp8)")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                    help="fp8: every system keeps an FP8 KV cache (--kv-cache-dtype fp8 on each command line)")
    ap.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                    help="Blink engines behind one frontend (one per GPU); N > 1 names the systems MODE-dpN")
    ap.add_argument("--startup-timeout-s", type=float, default=420.0)
    ap.add_argument("--warmup-requests", type=int, default=8, help="short uncounted requests after a start")
    ap.add_argument("--warmup-timeout-s", type=float, default=300.0)
    ap.add_argument("--heavy-block-kb", type=int, default=384, help="bz2 block of a heavy co-tenant step")
    ap.add_argument("--heavy-map-mb", type=int, default=32, help="memory mapped per heavy co-tenant step")
    ap.add_argument("--time-budget-s", type=float, default=540.0, help="the whole invocation")
    ap.add_argument("--out", type=Path, default=None,
                    help="results file; None: bench/results/peers.json, peers_moe.json for the Qwen3 MoE shape")
    ap.add_argument("--plot", type=Path, default=None, help="PNG prefix; None: --out's path without .json")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--replace", action="store_true", help="start a fresh --out instead of merging into it")
    ap.add_argument("--work-dir", type=Path, default=None, help="server logs; None: a temporary folder")
    return ap


def check(ap: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Peer]:
    """The peers by name; exits with a usage error on settings that cannot run."""
    try:
        peers = {p.name: p.with_flags(study.precision_flags(args))
                 for p in [parse_peer("vllm", args.config), *args.peer]}
    except ValueError as exc:
        ap.error(str(exc))
    unknown = [s for s in args.systems if s not in BLINK_MODES and s not in peers]
    if unknown:
        ap.error(f"systems {unknown} are neither Blink modes nor peers given with --peer")
    allowed = len(os.sched_getaffinity(0))
    if not 1 <= args.client_cores < allowed and not (args.client_cores == allowed == 1):
        ap.error(f"--client-cores {args.client_cores} must leave some of the {allowed} allowed cores")
    if args.clients < 1 or args.max_probes < 0 or args.warmup_requests < 0:
        ap.error("--clients must be >= 1, --max-probes and --warmup-requests >= 0")
    try:
        Window(args.warmup_s, args.window_s, args.drain_s)
    except ValueError as exc:
        ap.error(str(exc))
    return peers


def resolve_paths(args: argparse.Namespace) -> argparse.Namespace:
    """``--out`` and ``--plot`` left out: the model's results file and its plots beside it."""
    stem = RESULTS.get(args.model_config, "bench/results/peers")
    out = args.out or Path(stem + ".json")
    plot = args.plot or (out.with_suffix("") if args.out else Path(stem))
    return argparse.Namespace(**{**vars(args), "out": out, "plot": plot})


def device(backend: str | None) -> str:
    """The GPU (nvidia-smi's name), or the CPU where Blink runs on the CPU or no GPU answers."""
    if backend != "cpu":
        gpu = ss.device_name("cuda")
        if "nvidia-smi unavailable" not in gpu:
            return gpu
    return ss.device_name("cpu")


def header_of(args: argparse.Namespace) -> dict[str, Any]:
    workload = WORKLOADS[args.workload].scaled(args.prompt_mean, args.output_mean)
    return {"model": ss.model_description(args.model_config),
            "workload": {**workload.record(), "max_prompt": args.max_prompt_tokens,
                         "max_output": args.max_output_tokens, "arrivals": ARRIVALS, "seed": args.seed},
            "device": device(args.backend_override), "host_cpu": ss.device_name("cpu"),
            "precision": {"weights": args.quantization, "kv_cache": args.kv_cache_dtype},
            "window": {"window_s": args.window_s, "warmup_s": args.warmup_s, "drain_s": args.drain_s}}


def load_old(args: argparse.Namespace, header: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    if not args.out.exists() or args.replace:
        return None, None
    old = json.loads(args.out.read_text())
    return old, report.compatible(old, header)


def _sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    t_start = time.monotonic()
    ap = build_parser()
    args = resolve_paths(ap.parse_args(argv))
    peers = check(ap, args)
    header = header_of(args)
    old, why = load_old(args, header)
    if why:
        study.say(f"error: {args.out} holds results of another setup ({why}); pass --replace or another --out")
        return 2
    previous = signal.signal(signal.SIGTERM, _sigterm)
    try:
        return run(args, peers, header, old, t_start)
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace, peers: dict[str, Peer], header: dict[str, Any], old: dict[str, Any] | None,
        t_start: float) -> int:
    """Every system in turn, then the table and plots; SIGINT and SIGTERM stop it early (what was measured is
    kept: the results file is written after every rate)."""
    from dpu_tokenizer.loader import load_tokenizer

    work_ctx = (contextlib.nullcontext(str(args.work_dir)) if args.work_dir else
                tempfile.TemporaryDirectory(prefix="blink-peers-"))
    with work_ctx as work_name:
        work = Path(work_name)
        try:
            model = None if args.model_config == ss.EMBEDDED else build_model_folder(args.model_config,
                                                                                  args.tokenizer_assets, work)
        except FileNotFoundError as exc:
            study.say(f"error: {exc}")
            return 2
        if model is not None:
            write_tokenizer_config(model)
        workload = WORKLOADS[args.workload].scaled(args.prompt_mean, args.output_mean)
        limits = peer_limits(args.max_prompt_tokens, args.max_output_tokens)
        client_cores = sorted(os.sched_getaffinity(0))[:args.client_cores]
        ctx = study.Context(args, workload, limits, Window(args.warmup_s, args.window_s, args.drain_s), model,
                            load_tokenizer(model), header, old, t_start + args.time_budget_s, client_cores)
        interrupted = False
        try:
            ctx.clients = Clients(args.clients, client_cores)
            study.say(f"{header['model']} ({model or 'embedded'}); systems {args.systems}; co-tenants "
                      f"{args.cotenants}; rates {args.rates}; config {args.config}; response_format "
                      f"{args.response_format.label if args.response_format else None}; {args.clients} client "
                      f"processes on cores {client_cores}")
            for name in args.systems:
                study.run_system(name, ctx, peers, work)
        except KeyboardInterrupt:
            interrupted = True
            study.say("interrupted: keeping what was measured")
        finally:
            if ctx.clients is not None:
                ctx.clients.close()
    doc = ctx.save()
    finish(doc, args)
    study.say(f"total {time.monotonic() - t_start:.0f} s")
    return 130 if interrupted else (1 if ctx.new["errors"] or not ctx.new["records"] else 0)


def finish(doc: dict[str, Any], args: argparse.Namespace) -> None:
    study.say(f"wrote {args.out}\n\n{report.format_table(doc)}")
    if not args.no_plot:
        try:
            for path in report.plot(doc, args.plot):
                study.say(f"wrote {path}")
        except ImportError as exc:
            study.say(f"no plots: {exc} (python -m bench.peers.report --plot PREFIX draws them elsewhere)")
