"""The frontend's flags, declared once: each a field with its default and help, as ``shared.config.EngineConfig``.

``GatewayFlags`` are ``blink gateway``'s (``blink serve`` passes those not at their default to its gateways),
``TrackerFlags`` are ``blink tracker``'s (the same from ``blink serve``), ``ServeFlags`` are ``blink serve``'s own.
``add_flags`` declares a class's flags on a parser, ``from_namespace`` reads them back, ``to_argv`` writes a child's
command line; the services' configs (``GatewayConfig``, ``TrackerConfig``, ``ServeConfig``) take their defaults from
``GATEWAY``, ``TRACKER`` and ``SERVE``, so each default is written here only.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def _flag(default: Any, help: str, *, choices: tuple[str, ...] = (), kind: type | None = None,
          negatable: bool = False) -> Any:
    """A flag field: ``negatable`` makes a boolean ``--x/--no-x``; ``kind`` types a flag whose default is None."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "kind": kind,
                                                        "negatable": negatable})


@dataclasses.dataclass(frozen=True, slots=True)
class GatewayFlags:
    host: str = _flag("127.0.0.1", "address the gateways listen on")
    port: int = _flag(8000, "port the gateways listen on")
    reuse_port: bool = _flag(False, "listen with SO_REUSEPORT, so that other sockets of this user may share the port "
                             "and the kernel splits connections between them (blink serve sets it for its own "
                             "gateways when --gateways > 1; off, a port already in use is refused)")
    max_body_bytes: int = _flag(4 * 1024 * 1024, "largest request body")
    grammar_store_mb: int = _flag(1024, "MiB of shared memory the compiled grammars of structured output may take "
                                  "(one a distinct schema, up to tens of MiB each); past it the least recently used "
                                  "that no request uses are removed, and compiled again if asked for again "
                                  "(0: no limit)")
    drain_timeout: float = _flag(30.0, "seconds live requests get at shutdown")
    max_connections: int = _flag(1024, "open connections per gateway; more get a quick 503")
    header_timeout: float = _flag(10.0, "seconds a request head may take after its first byte (then the "
                                  "connection closes)")
    body_timeout: float = _flag(30.0, "seconds a request body may take after its head (then 408)")
    keepalive_timeout: float = _flag(15.0, "seconds an idle keep-alive connection stays open")
    disable_log_requests: bool = _flag(False, "no log line per answered request (as vLLM's flag)")
    enable_auto_tool_choice: bool = _flag(False, "serve tool_choice \"auto\": the model decides whether to call a "
                                          "tool (needs --tool-call-parser; \"required\" and named choices are "
                                          "enforced without it)")
    tool_call_parser: str | None = _flag(None, "the format tool calls are read in: hermes (<tool_call> JSON "
                                         "</tool_call>, Hermes and Qwen) or llama3_json (Llama 3.x JSON); also the "
                                         "format forced calls are written in (default: none; forced calls use "
                                         "hermes)", kind=str)
    reasoning_parser: str | None = _flag(None, "return the <think>...</think> text of chat answers as "
                                         "reasoning_content and the rest as content, as vLLM's parsers of these "
                                         "names (default: none; the text comes back as generated)",
                                         choices=("qwen3", "deepseek_r1"), kind=str)


@dataclasses.dataclass(frozen=True, slots=True)
class TrackerFlags:
    max_waiting: int = _flag(256, "requests queued when the ring is full")
    retry_after: float = _flag(1.0, "Retry-After seconds on a 429")


@dataclasses.dataclass(frozen=True, slots=True)
class ServeFlags:
    gateways: int = _flag(1, "gateway processes sharing the port")
    startup_timeout: float = _flag(600.0, "seconds the engine and services may take to become ready")
    service_nice: int = _flag(0, "nice value (-20..19) of every process blink serve starts; below 0 needs "
                              "CAP_SYS_NICE and keeps the frontend's share of the cores beside CPU-bound neighbours")
    standby_engine: bool = _flag(True, "keep a spare engine process beside the live one, started and (on the CPU) "
                                 "loaded, that takes a failed engine's place at once; --no-standby-engine: restart "
                                 "engines cold (RELIABILITY.md)", negatable=True)
    revision: str | None = _flag(None, "a model from the Hugging Face Hub: the branch, tag or commit of its repo "
                                 "(default: main)", kind=str)
    tokenizer_revision: str | None = _flag(None, "a tokenizer from the Hugging Face Hub: the branch, tag or commit "
                                           "of its repo (vLLM's flag; default: --revision for the model's own "
                                           "tokenizer, main for another repo's, --tokenizer ORG/NAME)", kind=str)
    download_dir: str | None = _flag(None, "a model from the Hugging Face Hub: the cache folder it is downloaded to "
                                     "and read from (default: huggingface_hub's, HF_HUB_CACHE or HF_HOME/hub)",
                                     kind=str)
    gguf_file: str | None = _flag(None, "the GGUF file of a Hugging Face Hub repo to serve (--model ORG/NAME-GGUF "
                                  "--gguf-file NAME.Q8_0.gguf); vLLM's ORG/NAME-GGUF:QUANT picks it by its "
                                  "quantization instead", kind=str)
    frontend_only: bool = _flag(False, "start the frontend set alone (gateways, tokenizer, tracker, reader) for a "
                                "ring whose engine runs apart: on another host, --ring rdma://HOST:PORT/NAME (that "
                                "engine started with blink engine --rdma-listen), or here under a local --ring name; "
                                "the engine's flags then do not apply")


GATEWAY, TRACKER, SERVE = GatewayFlags(), TrackerFlags(), ServeFlags()


def flag_name(f: dataclasses.Field[Any]) -> str:
    return "--" + f.name.replace("_", "-")


def add_flags(cls: type, ap: argparse.ArgumentParser | Any) -> None:
    """Declare every flag of ``cls`` (a dataclass above) on a parser or argument group."""
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if meta["negatable"]:
            ap.add_argument(flag_name(f), dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                            help=meta["help"])
        elif isinstance(f.default, bool):
            ap.add_argument(flag_name(f), dest=f.name, action="store_true", help=meta["help"])
        else:
            kind = meta["kind"] or type(f.default)
            ap.add_argument(flag_name(f), dest=f.name, type=kind, default=f.default, choices=meta["choices"] or None,
                            help=meta["help"])


def from_namespace(cls: type[T], ns: argparse.Namespace) -> T:
    """The flags of ``cls`` as parsed (a parser that ``add_flags(cls, ...)`` filled)."""
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]


def to_argv(flags: Any) -> list[str]:
    """The flags not at their default, as a child's command line that parses back to ``flags``."""
    argv: list[str] = []
    for f in dataclasses.fields(flags):
        value = getattr(flags, f.name)
        if value == f.default:
            continue
        if isinstance(value, bool):
            argv.append(flag_name(f) if value else "--no-" + flag_name(f)[2:])
        else:
            argv += [flag_name(f), str(value)]
    return argv
