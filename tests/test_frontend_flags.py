"""The frontend's flags declared once (``shared.frontend_flags``): every default has one source, the parsers take
theirs from it, and the command lines ``blink serve`` gives its gateways and tracker parse back to what it was given.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from blink.cli import build_parser
from blink.supervisor import ServeConfig, gateway_argv
from dpu_gateway.state import GatewayConfig
from dpu_gateway.tracker import TrackerConfig
from shared.config import EngineConfig
from shared.frontend_flags import GATEWAY, SERVE, TRACKER, GatewayFlags, ServeFlags, TrackerFlags, from_namespace

ROOT = Path(__file__).resolve().parent.parent
# a config field and the flag its default comes from
CONFIG_DEFAULTS = [
    (GatewayConfig, "max_body_bytes", GATEWAY.max_body_bytes),
    (GatewayConfig, "grammar_store_mb", GATEWAY.grammar_store_mb),
    (GatewayConfig, "drain_timeout_s", GATEWAY.drain_timeout),
    (GatewayConfig, "max_connections", GATEWAY.max_connections),
    (GatewayConfig, "header_timeout_s", GATEWAY.header_timeout),
    (GatewayConfig, "body_timeout_s", GATEWAY.body_timeout),
    (GatewayConfig, "keepalive_timeout_s", GATEWAY.keepalive_timeout),
    (TrackerConfig, "max_waiting", TRACKER.max_waiting), (TrackerConfig, "retry_after_s", TRACKER.retry_after),
    (ServeConfig, "drain_timeout_s", GATEWAY.drain_timeout), (ServeConfig, "startup_timeout_s", SERVE.startup_timeout),
    (ServeConfig, "service_nice", SERVE.service_nice), (ServeConfig, "standby_engine", SERVE.standby_engine),
]


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize(("cls", "field", "flag_default"), CONFIG_DEFAULTS)
def test_a_config_default_is_its_flags(cls: type, field: str, flag_default: object) -> None:
    assert {f.name: f.default for f in dataclasses.fields(cls)}[field] == flag_default


@pytest.mark.parametrize(("command", "classes"), [("serve", (GatewayFlags, TrackerFlags, ServeFlags)),
                                                  ("gateway", (GatewayFlags,)), ("tracker", (TrackerFlags,))])
def test_each_parser_takes_the_declared_defaults(command: str, classes: tuple[type, ...]) -> None:
    ns = parse(command)
    for cls in classes:
        assert from_namespace(cls, ns) == cls()


def test_no_frontend_default_or_flag_is_written_twice() -> None:
    """Each flag of the declarations is added only through them: no ``add_argument("--max-waiting"`` (or any other
    of them) and no copy of their defaults in the services' configs or the command-line module."""
    flags = [f.name.replace("_", "-") for cls in (GatewayFlags, TrackerFlags, ServeFlags)
             for f in dataclasses.fields(cls)]
    sources = {p: p.read_text() for p in [ROOT / "blink/cli.py", ROOT / "blink/supervisor.py",
                                          ROOT / "dpu_gateway/state.py", ROOT / "dpu_gateway/tracker.py"]}
    for path, text in sources.items():
        for flag in flags:
            assert f'"--{flag}"' not in text, (path, flag)
        assert not re.search(r"(max_waiting|max_connections|max_body_bytes): int = \d", text), path
        assert not re.search(r"(drain|header|body|keepalive|startup)_timeout_s: float = \d", text), path


def test_the_childrens_flags_parse_back_to_what_serve_was_given() -> None:
    ns = parse("serve", "--max-waiting", "7", "--retry-after", "2.5", "--max-connections", "9", "--gateways", "2",
               "--disable-log-requests", "--tool-call-parser", "hermes", "--port", "8123")
    serve = ServeConfig.from_args(ns, EngineConfig.from_namespace(ns))
    tracker = parse("tracker", *serve.tracker_args)
    assert from_namespace(TrackerFlags, tracker) == TrackerFlags(max_waiting=7, retry_after=2.5)
    gateway = parse("gateway", *gateway_argv(ns))
    assert from_namespace(GatewayFlags, gateway) == dataclasses.replace(from_namespace(GatewayFlags, ns),
                                                                        reuse_port=True)
    assert from_namespace(GatewayFlags, parse("gateway", *gateway_argv(parse("serve")))) == GatewayFlags()
