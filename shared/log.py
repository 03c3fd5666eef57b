"""structlog, set up once per process: JSON lines when stderr is not a terminal."""

from __future__ import annotations

import logging
import sys

import structlog

from shared.env import env

_CONFIGURED = False


def setup_logging(service: str, *, level: str | None = None, json: bool | None = None) -> None:
    global _CONFIGURED
    cfg = env()
    level_name = (level or cfg.log_level).upper()
    as_json = cfg.log_json if json is None else json
    if as_json is None:
        as_json = not sys.stderr.isatty()
    renderer = structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level_name, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    _CONFIGURED = True


def get_logger(name: str = "blink") -> structlog.typing.FilteringBoundLogger:
    if not _CONFIGURED:
        setup_logging(name)
    return structlog.get_logger(name)
