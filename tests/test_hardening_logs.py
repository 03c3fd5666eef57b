"""The log rules of every process (``shared/log.py``): secrets redacted, repeated tracebacks collapsed.

The whole-gateway checks (aiohttp's own bad-request lines under a flood) are in
``tests/test_hardening_gateway.py``; here each rule is checked on its own, in a child process that
sets logging up as a service does.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harness.serve_proc import ROOT
from shared.log import RepeatLimiter, redact

SECRET = "S3cr3tT0ken"

# What aiohttp 3.14 puts in the exceptions it logs for bad request heads, and the like.
LEAKY = [
    f"Got more than 8190 bytes when reading: b'Bearer {SECRET}AAAAAAAAAAAA...'.",
    f"Got more than 8190 bytes when reading: bytearray(b'/v1/models?api_key={SECRET}AAAA...').",
    f"Invalid header value char:\n\n    b'Authorization: Bearer {SECRET}\\x01'\n      ^",
    f'GET /v1/models?user=a&api_key={SECRET} HTTP/1.1',
    f"headers: Authorization: Bearer {SECRET}",
    f"x-api-key: {SECRET}",
    f"Cookie: session={SECRET}",
]


@pytest.mark.parametrize("text", LEAKY)
def test_redact_removes_the_secret(text: str) -> None:
    assert SECRET not in redact(text)


def test_redact_keeps_ordinary_text() -> None:
    for text in ("the engine is not running (is the engine running?)", "prompt token ids must be in [0, 10)",
                 "request body is not valid UTF-8 (byte 12: invalid start byte)"):
        assert redact(text) == text


def test_repeat_limiter_writes_one_per_window_with_the_count() -> None:
    limiter = RepeatLimiter(window_s=3600)
    got = [limiter.admit(("k",)) for _ in range(10_000)]
    assert got[0] == 0 and got[1:].count(None) == 9_999
    limiter.window_s = 0.0
    assert limiter.admit(("k",)) == 9_999  # the next line written says how many were left out
    assert limiter.admit(("other",)) == 0


CHILD = """
import logging, sys
from shared.log import get_logger, setup_logging
setup_logging("logtest", json=True)
log = get_logger("logtest")
for i in range(5000):
    try:
        raise OSError(24, "Too many open files")
    except OSError:
        log.exception("accept_failed", attempt=i)
        logging.getLogger("asyncio").error("socket.accept() out of system resource", exc_info=True)
logging.getLogger("aiohttp.server").error("Error handling request from %s", "127.0.0.1",
    exc_info=ValueError("Got more than 8190 bytes when reading: b'Bearer SECRET...'"))
logging.getLogger("aiohttp.access").warning('127.0.0.1 "GET /v1/models?api_key=SECRET HTTP/1.1" 200')
log.warning("own_event", header="Authorization: Bearer SECRET", url="/v1/x?api_key=SECRET")
"""


def test_a_service_log_collapses_repeats_and_redacts() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD.replace("SECRET", SECRET)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    assert len(lines) <= 6, lines[:8]  # 10,000 tracebacks: one line of each kind, plus the three below
    events = [line["event"] for line in lines]
    assert events.count("accept_failed") == 1 and events.count("socket.accept() out of system resource") == 1
    assert "Too many open files" in lines[0]["exception"]
    assert SECRET not in done.stderr
    assert any(line.get("logger") == "aiohttp.access" and "?<redacted>" in line["event"] for line in lines)
