"""Security defaults and limits of the frontend.

Covered elsewhere, not repeated here: wrong API key -> 401 and the body, prompt-token, max_tokens
and stop-count limits (``tests/test_gateway_errors.py``); ring segments created 0600 and refused
at attach when another user owns them (``tests/test_ring_errors.py::test_segment_mode_and_alignment``,
``::test_other_owner_refused``).
"""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import aiohttp
import pytest
from helpers import fixtures
from helpers.procfs import fd_targets, tcp_sockets
from helpers.stack import MODEL, Stack, processes_of

from blink.cli import build_parser
from dpu_gateway import app as gateway_app
from dpu_gateway.errors import APIError
from dpu_gateway.params import MAX_STOP_CHARS

AUTH = {"Authorization": f"Bearer {fixtures.API_KEY}"}
MSGS = [{"role": "user", "content": "hi"}]


async def post(stack: Stack, path: str, body: dict, headers: dict | None = None,
               timeout_s: float = 30) -> tuple[int, dict]:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(stack.url + path, json=body, headers=AUTH if headers is None else headers) as r:
            return r.status, await r.json(content_type=None)


def listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp*) of sockets listening on ``port``."""
    return {s.local_addr for s in tcp_sockets() if s.local_port == port and s.state == "0A"}  # TCP_LISTEN


# ---------------------------------------------------------------------- bind address
def test_loopback_by_default() -> None:
    for argv in (["serve"], ["gateway"]):
        assert build_parser().parse_args(argv).host == "127.0.0.1"


def test_gateways_listen_on_loopback_only(api_stack: Stack) -> None:
    assert listening_addresses(api_stack.port) == {"0100007F"}  # 127.0.0.1, nothing else


# ---------------------------------------------------------------------- API keys
async def test_missing_or_malformed_key_is_401(api_stack: Stack) -> None:
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 1}
    for headers in ({}, {"Authorization": fixtures.API_KEY}, {"Authorization": f"Bearer {fixtures.API_KEY}x"},
                    {"Authorization": f"Basic {fixtures.API_KEY}"}, {"Authorization": "Bearer"}):
        status, payload = await post(api_stack, "/v1/chat/completions", body, headers=headers)
        assert status == 401 and payload["error"]["code"] == "invalid_api_key", (headers, payload)
    status, _ = await post(api_stack, "/v1/chat/completions", body)
    assert status == 200


async def test_key_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[bytes, bytes]] = []

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return a == b

    monkeypatch.setattr(gateway_app.hmac, "compare_digest", spy)
    check = gateway_app.auth_middleware("k3y")

    class Request:
        path = "/v1/models"
        headers = {"Authorization": "Bearer guess"}

    async def handler(_request: object) -> str:
        return "ok"

    with pytest.raises(APIError) as info:
        await check(Request(), handler)
    assert info.value.status == 401 and seen == [(b"Bearer guess", b"Bearer k3y")]


# ---------------------------------------------------------------------- limits
async def test_stop_string_length_limited(api_stack: Stack) -> None:
    for stop in ("s" * (MAX_STOP_CHARS + 1), ["ok", "s" * (MAX_STOP_CHARS + 1)]):
        status, payload = await post(api_stack, "/v1/chat/completions", {"model": MODEL, "messages": MSGS,
                                                                         "stop": stop})
        assert status == 400 and payload["error"]["param"] == "stop", payload
    status, _ = await post(api_stack, "/v1/chat/completions", {"model": MODEL, "messages": MSGS, "max_tokens": 2,
                                                                "stop": "s" * MAX_STOP_CHARS})
    assert status == 200


async def test_out_of_range_top_k_served_and_links_survive(api_stack: Stack) -> None:
    """A top_k no int32 holds once broke the tracker's link to the gateway (every request then 503)."""
    for k in (2**40, 2**63 - 1):
        status, payload = await post(api_stack, "/v1/chat/completions", {"model": MODEL, "messages": MSGS,
                                                                         "max_tokens": 2, "top_k": k})
        assert status == 200, payload
    status, _ = await post(api_stack, "/v1/chat/completions", {"model": MODEL, "messages": MSGS, "max_tokens": 2})
    assert status == 200 and api_stack.get("/health")[0] == 200


# ---------------------------------------------------------------------- no request field is a path
def fifo_has_reader(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        assert exc.errno == errno.ENXIO
        return False
    os.close(fd)
    return True


def fds_pointing_at(stack: Stack, path: Path) -> list[int]:
    return [pid for pid in processes_of(stack) for target in fd_targets(pid) if target == str(path)]


async def test_model_name_is_never_opened(api_stack: Stack, tmp_path: Path) -> None:
    """A model name is compared with the served name, nothing else: a FIFO named by it would block
    whoever opened it for reading, so a 404 in time and no reader prove that nothing opened it."""
    bait = tmp_path / "weights.gguf"
    os.mkfifo(bait, 0o600)
    depth = "../" * len(Path.cwd().parts)
    names = [str(bait), depth + str(bait).lstrip("/"), "../../etc/passwd", "/etc/passwd", f"file://{bait}"]
    for name in names:
        for path, body in (("/v1/chat/completions", {"model": name, "messages": MSGS}),
                           ("/v1/completions", {"model": name, "prompt": "hi"})):
            status, payload = await post(api_stack, path, body, timeout_s=10)
            assert status == 404 and payload["error"]["code"] == "model_not_found", (name, payload)
    await asyncio.sleep(0.2)
    assert not fifo_has_reader(bait) and fds_pointing_at(api_stack, bait) == []
