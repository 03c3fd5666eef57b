"""structlog, set up once per process: JSON lines when stderr is not a terminal.

Two rules hold for every line a process writes, its own events and those of the libraries it uses
(aiohttp, asyncio: the standard ``logging`` records go through the same renderer):

- secrets are redacted: byte strings echoed from the wire (aiohttp quotes the offending request
  line or header), ``Bearer``/``Basic`` credentials, secret-bearing header values and URL query
  strings never reach the log;
- repeats are collapsed: a traceback that recurs (the same event and exception type, or the same
  library message) is written once, then at most once per ``REPEAT_WINDOW_S`` with ``repeated``,
  the number left out since the last line.
"""

from __future__ import annotations

import collections
import logging
import re
import sys
import time
from collections.abc import MutableMapping
from typing import Any

import structlog

from shared.env import env

REPEAT_WINDOW_S = 10.0
_CONFIGURED = False
_HANDLER: logging.Handler | None = None

_BYTES = re.compile(r"""\bb(['"])(?:\\.|(?!\1).)*\1""", re.S)  # a Python bytes literal: raw wire data
_CREDENTIAL = re.compile(r"(?i)\b(bearer|basic)\s+[^\s'\"]+")
_SECRET_HEADER = re.compile(
    r"(?i)\b(authorization|proxy-authorization|cookie|set-cookie|x-api-key|api[-_]key)([\"']?\s*[:=]\s*)[^\s,;&'\"]+")
_QUERY = re.compile(r"\?[^\s'\"#?]*=[^\s'\"#]*")


def redact(text: str) -> str:
    """``text`` with wire bytes, credentials, secret header values and query strings replaced."""
    text = _BYTES.sub(r"b\1<redacted>\1", text)
    text = _CREDENTIAL.sub(r"\1 <redacted>", text)
    text = _SECRET_HEADER.sub(r"\1\2<redacted>", text)
    return _QUERY.sub("?<redacted>", text)


def redact_event(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key, value in event.items():
        if isinstance(value, str):
            event[key] = redact(value)
    return event


class RepeatLimiter:
    """Which occurrences of a repeated key are written: the first, then one per window."""

    def __init__(self, window_s: float = REPEAT_WINDOW_S, max_keys: int = 1024) -> None:
        self.window_s, self.max_keys = window_s, max_keys
        self._seen: collections.OrderedDict[tuple, list[float]] = collections.OrderedDict()

    def admit(self, key: tuple) -> int | None:
        """None: leave this one out; else write it, with the number left out since the last one written."""
        now = time.monotonic()
        entry = self._seen.get(key)
        if entry is not None and now - entry[0] < self.window_s:
            entry[1] += 1
            return None
        self._seen[key] = [now, 0]
        self._seen.move_to_end(key)
        if len(self._seen) > self.max_keys:
            self._seen.popitem(last=False)
        return 0 if entry is None else int(entry[1])


_LIMITER = RepeatLimiter()


def admit_repeat(*key: object) -> int | None:
    """For a line that can repeat at the request rate (a 503 while the engine is down): None to leave this one
    out, else write it with ``repeated``, the number left out since the last one with this key."""
    return _LIMITER.admit(("line", *key))


def _exc_type(exc_info: Any) -> str:
    if isinstance(exc_info, BaseException):
        return type(exc_info).__name__
    if isinstance(exc_info, tuple) and exc_info and exc_info[0] is not None:
        return exc_info[0].__name__
    return type(sys.exc_info()[1]).__name__


def collapse_repeats(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: events that carry a traceback go through the limiter."""
    exc_info = event.get("exc_info")
    if not exc_info:
        return event
    dropped = _LIMITER.admit(("structlog", event.get("event"), _exc_type(exc_info)))
    if dropped is None:
        raise structlog.DropEvent
    if dropped:
        event["repeated"] = dropped
    return event


class RepeatFilter(logging.Filter):
    """The same for library records: keyed on logger, message template and exception type."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else None
        dropped = _LIMITER.admit((record.name, str(record.msg), exc))
        if dropped is None:
            return False
        if dropped:
            record.repeated = dropped
        return True


class _CurrentStderr:
    """Whatever ``sys.stderr`` is when a line is written, not when logging was set up: a process (or a
    test runner) that replaces or closes the stream it had keeps logging to the one it has now."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


_STDERR = _CurrentStderr()


def _stdlib_handler(renderer: Any, level: int) -> logging.Handler:
    """Library records (aiohttp's bad-request and access logs, asyncio) rendered like our own lines."""
    handler = logging.StreamHandler(_STDERR)
    handler.setLevel(max(level, logging.WARNING))
    handler.addFilter(RepeatFilter())
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                           structlog.stdlib.add_logger_name, structlog.stdlib.ExtraAdder(allow=["repeated"]),
                           structlog.processors.TimeStamper(fmt="iso", utc=True)],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, redact_event, renderer]))
    return handler


def _route_stdlib(renderer: Any, level: int) -> None:
    global _HANDLER
    root = logging.getLogger()
    if _HANDLER is not None:
        root.removeHandler(_HANDLER)
    _HANDLER = _stdlib_handler(renderer, level)
    root.addHandler(_HANDLER)


def setup_logging(service: str, *, level: str | None = None, json: bool | None = None) -> None:
    global _CONFIGURED
    cfg = env()
    level_name = (level or cfg.log_level).upper()
    as_json = cfg.log_json if json is None else json
    if as_json is None:
        as_json = not sys.stderr.isatty()
    renderer = structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(colors=False)
    numeric = getattr(logging, level_name, logging.INFO)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            collapse_repeats,
            structlog.processors.format_exc_info,
            redact_event,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=_STDERR),  # type: ignore[arg-type]  # write and flush suffice
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    _route_stdlib(renderer, numeric)
    _CONFIGURED = True


def get_logger(name: str = "blink") -> structlog.typing.FilteringBoundLogger:
    if not _CONFIGURED:
        setup_logging(name)
    return structlog.get_logger(name)
