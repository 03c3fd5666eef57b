"""The ``blink`` command: one subcommand per process, plus ``serve`` that runs them all.

Each plane is imported inside its subcommand only, so ``blink engine`` never loads the
frontend and ``blink gateway`` never loads the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from blink.hub import HubError, HubModel, Where, fetch_model, fetch_tokenizer, hub_model
from blink.vllm_flags import add_refused_flags, vllm_switch_problem
from shared.config import EngineConfig, add_engine_arguments, given_engine_flags
from shared.env import env
from shared.frontend_flags import GatewayFlags, ServeFlags, TrackerFlags, add_flags, flag_name
from shared.model_context import model_context
from shared.remote_ring import is_remote

if TYPE_CHECKING:
    from blink.supervisor import ServeConfig
    from dpu_gateway.state import GatewayConfig
    from dpu_gateway.tracker import TrackerConfig

ENGINE_MODULE = "gpu_engine.serve"


def run_until_signalled(main: Coroutine[Any, Any, None]) -> int:
    """Run a service's main coroutine; SIGTERM or SIGINT cancels it and the process exits 0."""

    async def runner() -> None:
        task = asyncio.ensure_future(main)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(runner())
    return 0


EMBEDDED_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the embedded model's Hugging Face id
EMBEDDED_ALIASES = ("SmolLM2-135M-Instruct",)         # its earlier served name, still answered


def model_name(model: str | None) -> str:
    """What /v1/models calls the model: the embedded model's Hugging Face id, else the file or folder
    name without a .gguf suffix."""
    if not model:
        return EMBEDDED_MODEL
    name = Path(model.rstrip("/")).name
    return name.removesuffix(".gguf").removesuffix(".Q4_1")


def served_names(given: list[str] | None, model: str | None) -> tuple[str, tuple[str, ...]]:
    """The name in responses and the other names requests may use (vLLM: the first of
    --served-model-name is the one reported, every one is answered)."""
    if given:
        return given[0], tuple(given[1:])
    return model_name(model), EMBEDDED_ALIASES if not model else ()


def add_common(ap: argparse.ArgumentParser, ring: bool = True) -> None:
    e = env()
    ap.add_argument("--run-dir", type=Path, default=e.run_dir,
                    help="folder of the services' Unix sockets; BLINK_RUN_DIR sets the default (default: %(default)s)")
    if ring:  # serve takes --ring from the engine's flags
        ap.add_argument("--ring", default=e.ring_name, help="shared-memory name of the engine's ring (with "
                        "--data-parallel-size N > 1: the base of the N rings' names, NAME-dp0 ...), or the "
                        "address of a ring on another host, rdma://HOST:PORT/NAME (docs/RDMA.md)")
    add_data_parallel(ap)
    ap.add_argument("--log-level", default=None, help="debug, info, warning, error (default: BLINK_LOG_LEVEL, "
                    "else info)")


def add_data_parallel(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                    help="engines behind the one frontend, each with its own ring: one per GPU (engine i "
                    "sees the i-th visible GPU), or N CPU engines; requests go to the engine with the most "
                    "free capacity (docs/SCALING.md)")


def add_tokenizer_flags(ap: argparse.ArgumentParser, model: bool = True) -> None:
    if model:  # serve takes --model from the engine's flags
        ap.add_argument("--model", default=None, help="model folder or .gguf (default: the embedded SmolLM2)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder or file, when it is not the model's "
                    "(default: the model's own)")


def add_frontend(ap: argparse.ArgumentParser, model: bool = True) -> None:
    """The gateway's flags: those declared in ``shared.frontend_flags.GatewayFlags``, and those of the model's names,
    chat template and key."""
    add_flags(GatewayFlags, ap)
    add_tokenizer_flags(ap, model)
    ap.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                    help="names in the API: the first is reported, every one is answered (default: the "
                    f"model's folder or file name; {EMBEDDED_MODEL} for the embedded model, which also "
                    f"answers to {', '.join(EMBEDDED_ALIASES)})")
    ap.add_argument("--chat-template", default=None, metavar="FILE_OR_JINJA",
                    help="chat template for /v1/chat/completions: a file, or the Jinja text itself "
                    "(default: the tokenizer's own, else ChatML)")
    ap.add_argument("--api-key", default=env().api_key,
                    help="require 'Authorization: Bearer KEY' on /v1; BLINK_API_KEY sets the default")


# ---------------------------------------------------------------------- subcommands
def gateway_config(args: argparse.Namespace, ring: str, model: str = "") -> GatewayConfig:
    """The gateway's config from its flags: ``blink gateway``'s, or ``blink serve``'s, which checks them this way
    before it starts anything (a bad value is a ValueError); ``model``: the tokenizer's files."""
    from dpu_gateway.state import GatewayConfig

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be within 0..65535, got {args.port}")
    name, aliases = served_names(args.served_model_name, args.model)
    return GatewayConfig(run_dir=args.run_dir, ring_name=ring, model=model, served_model_name=name,
                         model_aliases=aliases, chat_template=args.chat_template,
                         api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                         grammar_store_mb=args.grammar_store_mb,
                         drain_timeout_s=args.drain_timeout, heartbeat_timeout_s=env().heartbeat_timeout_s,
                         max_connections=args.max_connections, header_timeout_s=args.header_timeout,
                         body_timeout_s=args.body_timeout, keepalive_timeout_s=args.keepalive_timeout,
                         log_requests=not args.disable_log_requests, data_parallel_size=args.data_parallel_size,
                         enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                         reasoning_parser=args.reasoning_parser)


def tracker_config(args: argparse.Namespace, ring: str) -> TrackerConfig:
    """The tracker's config from its flags (``blink tracker``'s, or ``blink serve``'s, checked before it starts)."""
    from dpu_gateway.tracker import TrackerConfig

    return TrackerConfig(args.run_dir, ring, max_waiting=args.max_waiting, retry_after_s=args.retry_after,
                         heartbeat_timeout_s=env().heartbeat_timeout_s, data_parallel_size=args.data_parallel_size)


def cmd_gateway(args: argparse.Namespace) -> int:
    from dpu_gateway.server import run_gateway
    from dpu_tokenizer.service import resolve_model
    from shared.metrics import MetricsSpaceError

    cfg = gateway_config(args, args.ring, args.tokenizer or resolve_model(args.model))
    try:
        asyncio.run(run_gateway(cfg, args.host, args.port, args.name, reuse_port=args.reuse_port))
    except MetricsSpaceError as exc:  # a full run-dir filesystem: said, not a SIGBUS at the first metric written
        from shared.log import get_logger

        get_logger("gateway").error("gateway not started: no room for its metrics files", reason=str(exc),
                                    metrics_dir=str(env().metrics_dir))
        return 1
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from dpu_tokenizer.service import TokenizerServiceConfig, resolve_model, run_tokenizer

    cfg = TokenizerServiceConfig(args.run_dir, args.tokenizer or resolve_model(args.model))
    return run_until_signalled(run_tokenizer(cfg))


def cmd_tracker(args: argparse.Namespace) -> int:
    from dpu_gateway.tracker import run_tracker

    return run_until_signalled(run_tracker(tracker_config(args, args.ring)))


def cmd_reader(args: argparse.Namespace) -> int:
    from dpu_gateway.reader import ReaderConfig, run_reader

    cfg = ReaderConfig(args.run_dir, args.ring, heartbeat_timeout_s=env().heartbeat_timeout_s,
                       data_parallel_size=args.data_parallel_size)
    return run_until_signalled(run_reader(cfg))


def cmd_serve(args: argparse.Namespace) -> int:
    from blink.supervisor import Supervisor

    try:
        serve = serve_config(args)
    except (ValueError, HubError) as exc:
        print(f"blink serve: {exc}", file=sys.stderr)
        return 2
    return Supervisor(serve).run()


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """What ``blink serve`` runs, once everything it can check before starting a process is checked, in order:
    every flag that needs no model (the engine's under the backend it will run, the gateway's, the tracker's, the
    supervisor's, the chat template, the tool parser, the rings' names), then the model (a Hub id fetched, a path
    that exists), then what needs the model's config (--max-model-len against its context). A refusal is a
    ValueError or a HubError that says why; nothing has been started then."""
    from blink.supervisor import ServeConfig
    from shared.ring import segment_problem

    take_model_tag(args)
    if args.frontend_only:
        return frontend_config(args)
    if is_remote(args.ring_name):
        raise ValueError(f"--ring {args.ring_name}: a ring on another host is served by a frontend set alone (blink "
                         "serve --frontend-only --ring rdma://...); its engine runs there (blink engine --rdma-listen)")
    flags_only = EngineConfig.from_namespace(argparse.Namespace(**{**vars(args), "model": None}))
    serve = ServeConfig.from_args(args, flags_only)
    problem = (vllm_switch_problem(args)
               or engine_problem(flags_only, None)
               or tool_flags_problem(args.enable_auto_tool_choice, args.tool_call_parser)
               or chat_template_problem(args.chat_template)
               or next(filter(None, map(segment_problem, serve.data_parallel.ring_names)), None))
    if problem:
        raise ValueError(problem)
    for service, check in (("gateway", gateway_config), ("tracker", tracker_config)):
        try:
            check(args, flags_only.ring_name)
        except ValueError as exc:
            raise ValueError(f"{service}: {exc}") from None
    models_from_hub(args)
    engine = EngineConfig.from_namespace(args)
    model = engine.model or default_model_file()
    problem = engine_problem(engine, None if model is None else model_context(model))
    if problem:
        raise ValueError(problem)
    return ServeConfig.from_args(args, engine)


def frontend_config(args: argparse.Namespace) -> ServeConfig:
    """``blink serve --frontend-only``: the frontend set of a ring whose engine runs apart, checked as ``serve_config``
    checks it, before anything starts: the ring (an ``rdma://`` address, and what RDMA needs here), the frontend's
    flags; engine flags are refused, as they would not apply. A Hub model's weights are never fetched: the
    tokenizer's files are, of --tokenizer when given, else of the model's repo (at its --revision, or at
    --tokenizer-revision), and --model stays the served name. Only a GGUF repo given without --tokenizer is
    fetched, its one file, which holds its tokenizer."""
    from blink.supervisor import ServeConfig

    ring = args.ring_name
    given = sorted(set(given_engine_flags(args)) - {"--ring", "--model"})
    problem = (("--frontend-only starts no engine: " + ", ".join(given) + " would not apply (they are blink engine's)")
               if given else None) or remote_ring_problem(ring, args.data_parallel_size) or (
        "--frontend-only serves one engine's ring: --data-parallel-size must be 1"
        if args.data_parallel_size != 1 else None) or tool_flags_problem(
        args.enable_auto_tool_choice, args.tool_call_parser) or chat_template_problem(args.chat_template)
    if problem:
        raise ValueError(problem)
    for service, check in (("gateway", gateway_config), ("tracker", tracker_config)):
        try:
            check(args, ring)
        except ValueError as exc:
            raise ValueError(f"{service}: {exc}") from None
    model = hub_model(args.model) if args.model else None
    if model is not None and (args.tokenizer or (model.quant is None and args.gguf_file is None)):
        source = tokenizer_source(args, model, own=True)
        args.served_model_name = args.served_model_name or [args.model]
        args.model = None
        if source is not None:
            args.tokenizer = str(fetch_tokenizer(*source))
    else:
        models_from_hub(args)
    return ServeConfig.from_args(args, EngineConfig.from_namespace(args), frontend_only=True)


def remote_ring_problem(ring: str, data_parallel_size: int = 1) -> str | None:
    """Why a frontend service cannot reach ``ring`` when it is an ``rdma://`` address (a bad address, one engine
    per address, pyverbs or a device missing here), or None; a local name is not checked here."""
    from shared.remote_ring import parse_ring_address, rdma_problem

    if not is_remote(ring):
        return None
    try:
        address = parse_ring_address(ring)
    except ValueError as exc:
        return str(exc)
    if data_parallel_size != 1:
        return f"--ring {ring}: an rdma:// address is one engine's ring; --data-parallel-size must be 1"
    problem = rdma_problem(address.verbs)
    return f"--ring {ring}: {problem}" if problem else None


def take_model_tag(args: argparse.Namespace) -> None:
    """vLLM's positional model (``blink serve Qwen/Qwen3-8B``) is ``--model``; both, naming two models, are refused."""
    if args.model_tag is None:
        return
    if args.model is not None and args.model != args.model_tag:
        raise ValueError(f"two models given: {args.model_tag} and --model {args.model}")
    args.model = args.model_tag


def models_from_hub(args: argparse.Namespace) -> None:
    """--model and --tokenizer given as Hugging Face Hub ids: fetched into the Hub's cache (or found there) once,
    here, and replaced by their local paths, which the processes get; the model's served name stays the id given,
    as vLLM's. --revision and --gguf-file apply to a model from the Hub only, --tokenizer-revision to a tokenizer
    from the Hub (``tokenizer_source``)."""
    where = Where(args.revision, args.download_dir)
    model = hub_model(args.model) if args.model else None
    if model is None:
        for name in ("revision", "gguf_file"):  # ServeFlags' fields (declared there alone)
            if getattr(args, name) is not None:
                raise ValueError(f"--{name.replace('_', '-')} applies to a model from the Hugging Face Hub (--model "
                                 f"ORG/NAME); the model here is {args.model or 'the embedded one'}")
    tokenizer = tokenizer_source(args, model, own=False)  # checked before anything is fetched
    if model is not None:
        if not args.served_model_name:
            args.served_model_name = [args.model]
        args.model = str(fetch_model(model, where, args.gguf_file))
    if tokenizer is not None:
        args.tokenizer = str(fetch_tokenizer(*tokenizer))


def tokenizer_source(args: argparse.Namespace, model: HubModel | None,
                     own: bool) -> tuple[str, Where, str] | None:
    """The Hub repo whose tokenizer files alone are fetched, with where from and the flag that names its revision
    (for ``fetch_tokenizer``), or None: ``--tokenizer ORG/NAME``; without --tokenizer, the repo of ``model`` (a
    safetensors one) when ``own`` (its weights are not wanted: --frontend-only) or when --tokenizer-revision is
    given. The revision is --tokenizer-revision, else the model's --revision for the model's own repo (vLLM's
    default), else the repo's default branch. A --tokenizer path must exist; --tokenizer-revision without a
    tokenizer from the Hub is refused."""
    given = hub_model(args.tokenizer) if args.tokenizer else None
    repo = None
    if args.tokenizer and (given is None or given.quant is not None):
        if not Path(args.tokenizer).exists():
            raise ValueError(f"--tokenizer: path {args.tokenizer} does not exist (nor is it a Hub id ORG/NAME)")
    elif given is not None:
        repo = given.repo
    elif (model is not None and model.quant is None and args.gguf_file is None
          and (own or args.tokenizer_revision is not None)):
        repo = model.repo
    if repo is None:
        if args.tokenizer_revision is not None:
            here = args.tokenizer or f"the model's own ({args.model or 'the embedded one'})"
            raise ValueError("--tokenizer-revision applies to a tokenizer from the Hugging Face Hub (--tokenizer "
                             f"ORG/NAME, or a safetensors --model ORG/NAME's own); the tokenizer here is {here}")
        return None
    if args.tokenizer_revision is not None:
        return repo, Where(args.tokenizer_revision, args.download_dir), serve_flag("tokenizer_revision")
    if model is not None and repo == model.repo:
        return repo, Where(args.revision, args.download_dir), serve_flag("revision")
    return repo, Where(None, args.download_dir), serve_flag("tokenizer_revision")


def serve_flag(name: str) -> str:
    """The command-line form of a ``ServeFlags`` field, from its one declaration."""
    return flag_name(next(f for f in dataclasses.fields(ServeFlags) if f.name == name))


def engine_problem(engine: EngineConfig, context: int | None) -> str | None:
    """Why the engine would refuse ``engine`` once started (``EngineConfig.refusal_on``: a flag its backend does not
    take, --max-model-len above the model's ``context`` or the backend's), or None. Under --backend auto the
    backend is the hardware's choice: it is asked (``auto_runs_on_cpu``) only when the answer would differ."""
    if engine.backend != "auto":
        return engine.refusal_on(engine.backend, context)
    on_cpu, on_gpu = engine.refusal_on("cpu", context), engine.refusal_on("host", context)
    if on_cpu == on_gpu:
        return on_cpu
    if auto_runs_on_cpu():
        return on_cpu and f"{on_cpu}: --backend auto runs the CPU backend here (no CUDA GPU is visible)"
    return on_gpu and f"{on_gpu}: --backend auto runs a GPU backend here (a CUDA GPU is visible)"


def auto_runs_on_cpu() -> bool:
    """Whether --backend auto runs the CPU backend here: torch sees no CUDA GPU, as the engine decides it
    (``gpu_engine.backend.resolve_backend``). It imports torch, so it is asked only when it matters."""
    import torch

    return not torch.cuda.is_available()


def default_model_file() -> Path | None:
    """The embedded model's file (what the engine loads without --model), found without importing torch; None when
    its package is not installed (the engine says so)."""
    from dpu_tokenizer.base import TokenizerError
    from dpu_tokenizer.sources import default_model_path

    try:
        return default_model_path()
    except TokenizerError:
        return None


def chat_template_problem(value: str | None) -> str | None:
    """Why --chat-template cannot be used (checked before anything starts), or None."""
    if value is None:
        return None
    from dpu_tokenizer.chat import ChatTemplateError, chat_template_from_arg, compile_template

    try:
        compile_template(chat_template_from_arg(value))
    except ChatTemplateError as exc:
        return f"--chat-template: {exc}"
    return None


def tool_flags_problem(auto: bool, parser: str | None) -> str | None:
    """Why --enable-auto-tool-choice / --tool-call-parser cannot be used, or None (vLLM's rules)."""
    from dpu_gateway.tools import PARSERS

    if parser is not None and parser not in PARSERS:
        return f"--tool-call-parser: unknown parser {parser!r}; Blink has {', '.join(PARSERS)}"
    if auto and parser is None:
        return "--enable-auto-tool-choice needs --tool-call-parser"
    return None


def private_run_dir(args: argparse.Namespace) -> bool:
    """Every service (and serve) starts by making sure its run dir is private; False, said, when it is not."""
    from shared.ipc import RunDirError, ensure_run_dir

    try:
        ensure_run_dir(args.run_dir)
    except RunDirError as exc:
        print(f"blink {args.command}: {exc}", file=sys.stderr)
        return False
    return True


def argv_without_key(argv: list[str], key: str) -> list[str] | None:
    """``argv`` without its ``--api-key KEY`` (or ``--api-key=KEY``, or an abbreviation argparse took);
    None when the key is not there or would still show."""
    out: list[str] = []
    skip = False
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        is_key_flag = len(flag) > 4 and "--api-key".startswith(flag)
        if skip:
            skip = False
        elif is_key_flag and eq and value == key:
            continue
        elif is_key_flag and not eq and i + 1 < len(argv) and argv[i + 1] == key:
            skip = True
        else:
            out.append(arg)
    if len(out) == len(argv) or any(arg == key or arg.endswith(f"={key}") for arg in out):
        return None
    return out


def hide_api_key(args: argparse.Namespace) -> None:
    """``blink serve --api-key KEY``: run again at once with KEY in ``BLINK_API_KEY`` instead of on the
    command line (same pid), so that other local users cannot read it from ``/proc/PID/cmdline`` while
    the server runs. The supervisor hands it to the gateways through their environment only."""
    if args.command != "serve" or not args.api_key:
        return
    argv = argv_without_key(list(sys.orig_argv), args.api_key)
    if argv is not None:
        os.execve(sys.executable, argv, {**os.environ, "BLINK_API_KEY": args.api_key})


# Pass-through commands get their arguments untouched (argparse cannot forward "--flags").
def cmd_engine(argv: list[str]) -> int:
    """Run the engine in this terminal: ``python -m gpu_engine.serve`` with the given flags."""
    os.execv(sys.executable, [sys.executable, "-m", ENGINE_MODULE, *argv])
    return 1  # not reached


def cmd_gen_schema(argv: list[str]) -> int:
    from schema.generate import main as generate

    return generate(argv)


# name: (module under bench/, what it measures). The benchmarks are not installed: they run from a checkout.
BENCH_TOOLS: dict[str, tuple[str, str]] = {
    "serve": ("serve_bench", "Poisson load against an OpenAI-compatible endpoint, streamed over SSE"),
    "interfere": ("interfere", "CPU co-tenants pinned to chosen cores, for interference runs"),
    "soak": ("soak", "steady load with clients that hang up at random moments, for a long run"),
    "study": ("serving_study", "the serving evaluation: persistent vs host-driven, isolated vs interfered"),
    "roofline": ("roofline", "decode/prefill step time through captured graphs against hardware floors (GPU)"),
    "micro": ("scheduler_micro", "persistent-scheduler micro-benchmarks: launches, slot scan, admission (GPU)"),
    "fig3": ("fig3", "makespan of 16 concurrent requests, persistent vs host-driven"),
    "tokenizer": ("tokenizer_bench", "our encoder against Hugging Face tokenizers, and streaming detokenization"),
    "conn-storm": ("conn_storm", "gateway resident memory across storms of concurrent requests"),
    "cpu": ("cpu_bench", "CPU engine throughput on the embedded model against transformers' generate"),
}
CHECKOUT = Path(__file__).resolve().parent.parent  # the source tree, where this is an editable install


def bench_listing() -> str:
    width = max(map(len, BENCH_TOOLS))
    rows = [f"  {name:<{width}}  {what}" for name, (_, what) in BENCH_TOOLS.items()]
    return "\n".join(["usage: blink bench NAME [ARGS]   (blink bench NAME --help: its flags)", "", *rows])


def cmd_bench(argv: list[str]) -> int:
    """``blink bench`` lists the benchmarks; ``blink bench NAME ARGS`` runs ``python -m bench.MODULE ARGS``."""
    if not argv or argv[0] in ("-h", "--help"):
        print(bench_listing())
        return 0
    if argv[0] not in BENCH_TOOLS:
        print(f"blink bench: no benchmark {argv[0]!r}\n{bench_listing()}", file=sys.stderr)
        return 2
    if not (CHECKOUT / "bench" / "__init__.py").is_file():
        print("blink bench: the benchmarks run from a source checkout, not from an installed package: "
              "clone the repository, `pip install -e '.[dev]'` in it, then run `blink bench "
              f"{argv[0]}` (or `python -m bench.{BENCH_TOOLS[argv[0]][0]}` from its root)", file=sys.stderr)
        return 2
    path = os.pathsep.join(p for p in (str(CHECKOUT), os.environ.get("PYTHONPATH", "")) if p)
    module = f"bench.{BENCH_TOOLS[argv[0]][0]}"
    os.execve(sys.executable, [sys.executable, "-m", module, *argv[1:]], {**os.environ, "PYTHONPATH": path})
    return 1  # not reached


PASS_THROUGH = {"engine": cmd_engine, "gen-schema": cmd_gen_schema, "bench": cmd_bench}


# ---------------------------------------------------------------------- parser
class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default in its help, except where the help already says it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default:" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


HELP = HelpFormatter


class ServeHelp(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """``blink serve --help``: the epilog's command lines as written."""


SERVE_EPILOG = """\
a DPU deployment (docs/RDMA.md): the engine on the GPU host exports its ring over RDMA, the frontend set runs
on the DPU (a BlueField's Arm cores) and reaches the ring through the NIC; the GPU host's CPU runs no
frontend work:

  GPU host:  blink engine --model MODEL --ring blink-ring --rdma-listen 192.168.100.1:7471
  DPU:       blink serve --frontend-only --model MODEL --ring rdma://192.168.100.1:7471/blink-ring \\
                 --host 0.0.0.0 --port 8000

(the DPU needs the model's tokenizer only: a Hub id fetches its tokenizer files, not its weights)"""


def add_engine_flags(ap: argparse.ArgumentParser) -> None:
    """The engine's flags, as ``blink engine`` has them; ``serve`` passes on those not at their default."""
    add_engine_arguments(ap.add_argument_group("engine (passed to blink engine)"))
    ap.add_argument("--engine-module", default=ENGINE_MODULE, help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="blink", description="Blink: LLM serving over a shared ring")
    sub = ap.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the engine and every frontend service (like `vllm serve`)",
                           formatter_class=ServeHelp, epilog=SERVE_EPILOG)
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model, as vLLM's positional argument: the same as --model")
    add_common(serve, ring=False)
    add_frontend(serve, model=False)
    add_engine_flags(serve)
    add_flags(TrackerFlags, serve)
    add_flags(ServeFlags, serve)
    add_refused_flags(serve)
    serve.set_defaults(func=cmd_serve)
    gw = sub.add_parser("gateway", help="one HTTP gateway process", formatter_class=HELP)
    add_common(gw)
    add_frontend(gw)
    gw.add_argument("--name", default="gateway", help="name of its ready marker in the run dir")
    gw.set_defaults(func=cmd_gateway)
    tok = sub.add_parser("tokenizer", help="the tokenizer service", formatter_class=HELP)
    add_common(tok)
    add_tokenizer_flags(tok)
    tok.set_defaults(func=cmd_tokenizer)
    tr = sub.add_parser("tracker", help="the slot tracker service", formatter_class=HELP)
    add_common(tr)
    add_flags(TrackerFlags, tr)
    tr.set_defaults(func=cmd_tracker)
    rd = sub.add_parser("reader", help="the token reader service", formatter_class=HELP)
    add_common(rd)
    rd.set_defaults(func=cmd_reader)
    sub.add_parser("engine", help="the engine alone: python -m gpu_engine.serve ARGS", add_help=False)
    sub.add_parser("gen-schema", help="regenerate the ring layout from schema/ring.fbs [--check]", add_help=False)
    sub.add_parser("bench", help="benchmarks, from a source checkout (blink bench lists them)", add_help=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    from_command_line = argv is None
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in PASS_THROUGH:
        return PASS_THROUGH[argv[0]](argv[1:])
    args = build_parser().parse_args(argv)
    if args.command in ("gateway", "tracker", "reader") and (problem := remote_ring_problem(
            args.ring, args.data_parallel_size)):  # at once, before the service starts
        print(f"blink {args.command}: {problem}", file=sys.stderr)
        return 2
    if from_command_line:
        hide_api_key(args)
    if hasattr(args, "run_dir") and not private_run_dir(args):
        return 2
    from shared.log import setup_logging

    setup_logging(args.command if args.command != "gateway" else args.name, level=getattr(args, "log_level", None))
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
