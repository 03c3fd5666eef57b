"""One gateway process under hostile clients: connection limits, undecodable bodies, secrets in logs.

The gateway runs alone (no engine, no services: what is tested happens before a request needs
them) with small limits, its log written to a file. Each test says which finding of the hardening
issue it guards: slow or idle connections and the connection cap (5), bodies that used to be a 500
(6), secrets that used to reach the log (8).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from helpers.stack import MODEL

from dpu_gateway import protocol
from dpu_gateway.errors import APIError
from dpu_gateway.protocol import decode_chat, decode_completion
from harness.serve_proc import ROOT, free_port, http_get

KEY = "k3y-for-tests"
SECRET = "S3cr3tT0ken"
LIMITS = {"max_connections": 8, "header_timeout_s": 1.0, "body_timeout_s": 1.0, "keepalive_timeout_s": 1.5}
SLACK_S = 1.0
LINGER_S = 2.0  # dpu_gateway.server.LINGER_S: an unread body is drained this long after the answer

LAUNCH = """
import asyncio, json, sys
from pathlib import Path
from dpu_gateway.server import run_gateway
from dpu_gateway.state import GatewayConfig
from dpu_tokenizer.service import resolve_model
from shared.log import setup_logging
args = json.loads(sys.argv[1])
setup_logging("gateway-test", json=True)
cfg = GatewayConfig(run_dir=Path(args["run_dir"]), ring_name=args["ring"], model=resolve_model(None),
                    served_model_name=args["model"], api_key=args["key"], **args["limits"])
asyncio.run(run_gateway(cfg, "127.0.0.1", args["port"]))
"""


@dataclass
class Gateway:
    port: int
    log_path: Path
    proc: subprocess.Popen

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def metric(self, name: str, phase: str | None = None) -> float:
        for _ in range(100):  # a 503 while closed connections are still counted against the cap: ask again
            status, body = http_get(f"http://127.0.0.1:{self.port}/metrics")
            if status != 503:
                break
            time.sleep(0.1)
        assert status == 200
        for line in body.decode().splitlines():
            if line.startswith(name + "{") and (phase is None or f'phase="{phase}"' in line):
                return float(line.rpartition(" ")[2])
        return 0.0

    def log(self) -> bytes:
        return self.log_path.read_bytes()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("gw")
    run_dir = tmp / "run"
    run_dir.mkdir(mode=0o700)
    port = free_port()
    args = {"run_dir": str(run_dir), "ring": f"blink-absent-{port}", "model": MODEL, "key": KEY, "port": port,
            "limits": LIMITS}
    log_path = tmp / "gateway.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", LAUNCH, json.dumps(args)], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT)
    gw = Gateway(port, log_path, proc)
    deadline = time.monotonic() + 120
    while b"gateway_listening" not in gw.log():
        assert proc.poll() is None and time.monotonic() < deadline, gw.log().decode(errors="replace")
        time.sleep(0.1)
    yield gw
    proc.terminate()
    proc.wait(30)


def answer(sock: socket.socket, limit_s: float) -> tuple[float, bytes]:
    """(seconds until the server closed the connection, everything it sent)."""
    start, got = time.monotonic(), b""
    sock.settimeout(limit_s)
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except TimeoutError:
        raise AssertionError(f"still open after {limit_s} s; got {got[:200]!r}") from None
    except ConnectionResetError:
        pass
    finally:
        sock.close()
    return time.monotonic() - start, got


def request(gw: Gateway, head: bytes, body: bytes = b"") -> tuple[int, dict]:
    sock = gw.connect()
    sock.sendall(head + b"Host: x\r\nConnection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
                 + body)
    _, raw = answer(sock, 10)
    status_line, _, rest = raw.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2] or b"null")


def post(gw: Gateway, path: str, body: bytes, auth: bytes = f"Bearer {KEY}".encode()) -> tuple[int, dict]:
    return request(gw, b"POST " + path.encode() + b" HTTP/1.1\r\nAuthorization: " + auth
                   + b"\r\nContent-Type: application/json\r\n", body)


def assert_openai_error(payload: dict, kind: str) -> dict:
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == kind and err["message"]
    return err


# ---------------------------------------------------------------------- 6: bodies that were a 500
BAD_UTF8 = [
    ("/v1/completions", b'{"model": "%s", "prompt": "caf\xc3"}' % MODEL.encode()),
    ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "\xff\xfe"}]}'
     % MODEL.encode()),
    ("/v1/completions", b'{"model": "Smol\xe9", "prompt": "hi"}'),
    ("/tokenize", b'{"prompt": "caf\xc3"}'),
]


@pytest.mark.parametrize(("path", "body"), BAD_UTF8, ids=["prompt", "chat-content", "model", "tokenize"])
def test_invalid_utf8_in_a_string_is_400(gateway: Gateway, path: str, body: bytes) -> None:
    status, payload = post(gateway, path, body)
    assert status == 400, payload
    assert "UTF-8" in assert_openai_error(payload, "invalid_request_error")["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_deep_nesting_in_an_unknown_field_is_400(gateway: Gateway, path: str) -> None:
    depth = 100_000
    body = b'{"model": "%s", "prompt": "hi", "messages": [], "extra": ' % MODEL.encode() + b"[" * depth \
        + b"]" * depth + b"}"
    status, payload = post(gateway, path, body)
    assert status == 400, payload
    assert "nested" in assert_openai_error(payload, "invalid_request_error")["message"]


def test_deep_nesting_in_a_known_field_is_400(gateway: Gateway) -> None:
    depth = 100_000
    body = (b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "guided_json": ' % MODEL.encode()
            + b"[" * depth + b"]" * depth + b"}")
    status, payload = post(gateway, "/v1/chat/completions", body)
    assert status == 400, payload
    assert "nested" in assert_openai_error(payload, "invalid_request_error")["message"]


def test_undecodable_text_is_named_before_what_the_decoder_says() -> None:
    """Invalid UTF-8 (at its offset in the body) wins over an unknown field; a sound body gets the decoder's own 400."""
    with pytest.raises(APIError, match=r"not valid UTF-8 \(byte 15: invalid continuation byte\)"):
        decode_completion(b'{"model": "Smol\xe9", "bogus": 1, "prompt": "hi"}')
    with pytest.raises(APIError, match="Unknown field `bogus`"):
        decode_completion('{"model": "Smolé", "bogus": 1, "prompt": "hi"}'.encode())
    with pytest.raises(msgspec.DecodeError, match="truncated"):
        decode_completion(b'{"model": "x", "prompt": "hi"')


def test_an_integral_float_is_an_integer_as_json_schema_and_vllm_take_it() -> None:
    """5.0 in an integer field is 5 (token ids too); a float field keeps its float; 5.5 or "5" stays refused, and
    with an integral float beside it the error names the field that is wrong."""
    req = decode_completion(b'{"model": "m", "prompt": [1.0, 7.0], "max_tokens": 5.0, "n": 2.0, "temperature": 1.0}')
    assert (req.prompt, req.max_tokens, req.n) == ([1, 7], 5, 2)
    assert all(type(v) is int for v in (*req.prompt, req.max_tokens, req.n)) and type(req.temperature) is float
    chat = decode_chat(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": true, '
                       b'"top_logprobs": 2.0, "response_format": {"type": "json_schema", "json_schema": '
                       b'{"name": "a", "schema": {"type": "number", "maximum": 2.5}}}}')
    assert chat.top_logprobs == 2 and chat.response_format["json_schema"]["schema"]["maximum"] == 2.5
    # only the integer fields change: a free-form schema's integral floats stay floats (the grammar writes 1.0)
    chat = decode_chat(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4.0, '
                       b'"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": '
                       b'{"enum": [1.0, 2], "minimum": 1.0}}}, "logit_bias": {"5": 2.0}}')
    schema = chat.response_format["json_schema"]["schema"]
    assert type(chat.max_tokens) is int and [type(v) for v in schema["enum"]] == [float, int]
    assert type(schema["minimum"]) is float
    many = decode_completion(b'{"model": "m", "prompt": [' + b", ".join(b"%d.0" % i for i in range(3000)) + b"]}")
    assert many.prompt == list(range(3000))  # a list of integers mended at once, not one decode an item
    batch = decode_completion(b'{"model": "m", "prompt": [' + b", ".join(b"[1.0, %d.0]" % i for i in range(40)) + b"]}")
    assert batch.prompt == [[1, i] for i in range(40)]  # 40 prompts in one pass, not one pass a prompt
    for body, where in ((b'{"model": "m", "prompt": "x", "max_tokens": 5.5}', "max_tokens"),
                        (b'{"model": "m", "prompt": "x", "max_tokens": "5"}', "max_tokens"),
                        (b'{"model": "m", "prompt": "x", "max_tokens": 5.0, "n": "2"}', "n")):
        with pytest.raises(msgspec.ValidationError, match=f"at `\\$.{where}`"):
            decode_completion(body)


def test_a_sound_body_is_parsed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The nesting probe runs only after a decode failed: a body that decodes costs one parse."""
    calls = []
    probe = protocol._DEPTH_PROBE
    monkeypatch.setattr(protocol, "_DEPTH_PROBE", SimpleNamespace(decode=lambda b: calls.append(b) or probe.decode(b)))
    req = decode_chat('{"model": "m", "messages": [{"role": "user", "content": "café"}]}'.encode())
    assert req.messages[0].content == "café" and calls == []
    with pytest.raises(APIError, match="nested"):
        decode_chat(b'{"model": "m", "messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")
    assert len(calls) == 1


@pytest.mark.parametrize("auth", [b"Bearer cl\xe9", b"Bearer \xff\xfe", "Bearer ключ".encode()],
                         ids=["latin-1", "invalid-utf8", "utf8"])  # the first two were a 500
def test_non_ascii_authorization_is_401(gateway: Gateway, auth: bytes) -> None:
    status, payload = post(gateway, "/v1/completions", b'{"model": "x", "prompt": "hi"}', auth=auth)
    assert status == 401, payload
    assert assert_openai_error(payload, "authentication_error")["code"] == "invalid_api_key"


def test_still_serves_after_the_bad_bodies(gateway: Gateway) -> None:
    status, _ = http_get(f"http://127.0.0.1:{gateway.port}/openapi.json")
    assert status == 200
    assert b'"unhandled"' not in gateway.log()


# ---------------------------------------------------------------------- 5: slow, idle and too many
def test_slowloris_closed_within_the_header_timeout(gateway: Gateway) -> None:
    before = gateway.metric("blink:http_connections_timed_out_total", "header")
    sock = gateway.connect()
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    for i in range(10):  # a header line every 0.3 s: each byte is in time, the head never ends
        time.sleep(0.3)
        try:
            sock.sendall(b"X-Trickle-%d: 1\r\n" % i)
        except OSError:
            break
    closed_s, got = answer(sock, 10)
    assert got == b"", got  # closed without an answer; the counter below says it was the header timeout
    assert gateway.metric("blink:http_connections_timed_out_total", "header") == before + 1


def test_idle_connections_closed_after_the_keepalive_timeout(gateway: Gateway) -> None:
    never_asked = gateway.connect()
    kept = gateway.connect()
    kept.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n")  # one answer, then idle on keep-alive
    for sock in (never_asked, kept):  # closed by the server (answer fails on a connection still open after 60 s)
        _, got = answer(sock, LIMITS["keepalive_timeout_s"] + 60)
    assert got.startswith(b"HTTP/1.1 200")


def test_never_ending_chunked_body_is_cut_off(gateway: Gateway) -> None:
    before = gateway.metric("blink:http_connections_timed_out_total", "body")
    sock = gateway.connect()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                 + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    start, got = time.monotonic(), b""
    sock.settimeout(0.2)
    try:
        while time.monotonic() - start < 15:  # a byte every 0.2 s, for ever; read what comes meanwhile
            sock.sendall(b"1\r\n \r\n")
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                break
            got += chunk
    except OSError:  # reset: the server closed it
        pass
    sock.close()
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    payload = json.loads(got.partition(b"\r\n\r\n")[2])
    assert assert_openai_error(payload, "invalid_request_error")["code"] == "request_timeout"
    assert gateway.metric("blink:http_connections_timed_out_total", "body") == before + 1


def hold(gateway: Gateway) -> socket.socket:
    """A connection with a request head begun: not idle, so not closed to make room for a new one (an idle one
    is: ``tests/test_lifecycle.py``); the header timeout closes it."""
    sock = gateway.connect()
    sock.sendall(b"GET /openapi.json HTTP/1.1\r\n")
    return sock


def test_over_the_cap_a_new_client_gets_a_quick_503(gateway: Gateway) -> None:
    for _ in range(20):  # a try counts when the probe went out while every held head was surely still held
        first = time.monotonic()
        held = [hold(gateway) for _ in range(LIMITS["max_connections"])]
        try:
            time.sleep(0.2)  # every one accepted (each is closed 1 s after its first byte: header timeout)
            sock = gateway.connect()
            sock.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n")
            sent = time.monotonic()
            _, got = answer(sock, 5)  # refused, not queued behind the held connections
        finally:
            for held_sock in held:
                held_sock.close()
        if sent - first < 0.8 * LIMITS["header_timeout_s"]:
            break
        time.sleep(0.5)  # a slow host: the held heads may have timed out before the probe; again
    else:
        pytest.fail("the host was too slow for 20 tries to send 9 connections within 0.8 s")
    assert got.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in got, got[:200]
    assert assert_openai_error(json.loads(got.partition(b"\r\n\r\n")[2]), "service_unavailable")
    deadline = time.monotonic() + 60  # the closed connections leave the count (at once, or after a loaded moment)
    while http_get(f"http://127.0.0.1:{gateway.port}/openapi.json")[0] != 200:
        assert time.monotonic() < deadline, "still refused after the held connections closed"
        time.sleep(0.1)
    assert gateway.metric("blink:http_connections_refused_total") >= 1


# ---------------------------------------------------------------------- 8: secrets never reach the log
def test_secrets_in_overlong_or_bad_requests_never_reach_the_log(gateway: Gateway) -> None:
    time.sleep(2)  # the held connections of the test before are gone: room under the cap
    long_value = SECRET + "A" * 9000
    heads = [
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + long_value.encode() + b"\r\n\r\n",
        b"GET /v1/models?api_key=" + long_value.encode() + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /v1/models?api_key=" + SECRET.encode() + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + SECRET.encode() + b"\x01\r\n\r\n",
        b"GET /v1/models?api_key=" + SECRET.encode() + b"\x01 HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Api-Key: " + long_value.encode() + b"\r\n\r\n",
    ]
    for head in heads:
        sock = gateway.connect()
        sock.sendall(head)
        assert answer(sock, 10)[1].startswith(b"HTTP/1.0 400"), head[:60]
    time.sleep(0.5)
    log = gateway.log()
    assert SECRET.encode() not in log
    # the bad requests were logged (repeats of one kind collapsed), without their bytes
    assert log.count(b"Error handling request") >= 2, log[-3000:]


def test_a_flood_over_the_cap_keeps_the_log_small(gateway: Gateway) -> None:
    size = len(gateway.log())
    refused = "blink:http_connections_refused_total"
    start = gateway.metric(refused)
    # rounds of: the cap held (afresh each round: held heads time out after 1 s), 250 more connections, until
    # 2,000 were refused; a round slower than the header timeout (a loaded host) frees places early and refuses
    # fewer, so the rounds are counted by refusals, not by time
    for _ in range(100):
        if gateway.metric(refused) - start >= 2000:
            break
        held = [hold(gateway) for _ in range(LIMITS["max_connections"])]
        try:
            for _ in range(250):
                socket.create_connection(("127.0.0.1", gateway.port), timeout=5).close()
        finally:
            for sock in held:
                sock.close()
    assert gateway.metric(refused) - start >= 2000
    for _ in range(300):  # a bad request head: aiohttp logs a traceback for each
        sock = gateway.connect()
        sock.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\nBad\x01Header: 1\r\n\r\n")
        answer(sock, 5)
    time.sleep(0.5)
    grown = gateway.log()[size:]
    assert len(grown) < 20_000, grown[-3000:]


def test_connection_cap_stays_under_the_descriptor_limit() -> None:
    """With a descriptor limit of 300 that cannot be raised, a cap of 1024 becomes 300 - FD_RESERVE."""
    code = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300))\n"
            "from dpu_gateway.server import FD_RESERVE, connection_cap\n"
            "print(connection_cap(1024), 300 - FD_RESERVE, connection_cap(10))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    cap, expected, small = done.stdout.split()
    assert cap == expected and small == "10"
