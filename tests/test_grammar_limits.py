"""Grammar compiles cannot pin the gateway: a budget refuses an over-large grammar while its automaton is
built, refusals are cached, compiles run in worker processes behind a bounded queue, a client that leaves
cancels its compile, and SIGTERM is not held up by one. ``blink serve`` with the real CPU engine (the only
backend that enforces grammars), plain HTTP from threads, the gateway's log and ``/proc`` observed."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from helpers.e2e import ENGINE_ENV, REAL_ENGINE, alive, wait_for
from helpers.procfs import processes
from helpers.stack import MODEL, Stack, start_stack, stop_stack


def nested(depth: int, max_items: int = 16) -> dict:
    """Integers in arrays ``depth`` deep, each array of at most ``max_items``."""
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "maxItems": max_items, "items": schema}
    return schema


def heavy_choice(seed: int) -> list[str]:
    """A legal grammar that takes a worker a while (about 1,600 states to walk the vocabulary through)."""
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefgh ") for _ in range(800)) for _ in range(2)]


def post(stack: Stack, body: dict, timeout_s: float = 120.0) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a chat completion."""
    req = urllib.request.Request(stack.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def ask(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Answer."}], "max_tokens": 4,
            "temperature": 0, **kw}


def log_events(stack: Stack, event: str) -> list[dict]:
    out = []
    for line in stack.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            out.append(json.loads(line))
    return out


def started(stack: Stack) -> int:
    """Compiles the gateway has handed to a worker so far."""
    return len(log_events(stack, "grammar_compile_started"))


def gateway_pid(stack: Stack) -> int:
    return next(pid for role, pid in stack.children().items() if role.startswith("gateway"))


def grammar_workers(stack: Stack) -> list[int]:
    gw = gateway_pid(stack)
    return [p.pid for p in processes() if p.parent == gw and "dpu_gateway.grammar_pool" in p.cmdline]


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Prompts up to 6,144 tokens: 64 tools written into the prompt take about 4,400."""
    stack = start_stack(tmp_path_factory.mktemp("grammar_limits"), "--num-slots", "16", "--max-prompt-tokens", "6144",
                        "--max-output-tokens", "64", engine_module=REAL_ENGINE, timeout_s=180, env=ENGINE_ENV)
    yield stack
    stop_stack(stack)


def test_an_over_budget_schema_is_refused_naming_the_limit_then_refused_from_the_cache(real: Stack) -> None:
    body = ask(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": nested(3)}})
    first = post(real, body)
    second = post(real, body)
    assert first[0] == second[0] == 400
    assert first[1] == second[1]
    err = first[1]["error"]
    limit = err["param"].removeprefix("response_format.")
    assert limit in ("nfa_states", "dfa_states", "subset_work", "token_states"), err
    assert f"limit {limit} = " in err["message"]
    results = [e["result"] for e in log_events(real, "grammar_compile") if e.get("reason") == limit]
    assert results[-2:] == ["refused", "refused_cached"]


def test_guided_choice_of_two_long_strings_is_refused_naming_the_limit(real: Stack) -> None:
    status, body, _ = post(real, ask(guided_choice=["a" * 20_000, "b" * 20_000]))
    assert status == 400 and body["error"]["param"].startswith("guided_choice."), body


def test_tool_choice_required_with_64_tools_is_served(real: Stack) -> None:
    params = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city"]}
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": f"Tool number {i}.",
                                               "parameters": params}} for i in range(64)]
    status, body, _ = post(real, ask(tools=tools, tool_choice="required", max_tokens=32))
    assert status == 200, body


def test_a_message_of_10000_text_parts_is_served(real: Stack) -> None:
    parts = [{"type": "text", "text": "Say hi. " if i == 0 else ""} for i in range(10_000)]
    status, body, _ = post(real, ask(messages=[{"role": "user", "content": parts}]))
    assert status == 200 and body["usage"]["prompt_tokens"] < 100, body


def test_health_and_other_requests_answer_while_compiles_run(real: Stack) -> None:
    """Four heavy compiles at once (one worker: they queue); /health and a plain request answer meanwhile."""
    bodies = [ask(guided_choice=heavy_choice(100 + i)) for i in range(4)]
    before = started(real)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(post, real, b) for b in bodies]
        during = []
        wait_for(lambda: started(real) > before, 60)
        while not all(f.done() for f in futures):
            during.append((real.get("/health")[0], post(real, ask(), timeout_s=30)[0]))
        statuses = [f.result()[0] for f in futures]
    assert statuses == [200] * 4
    assert during and all(d == (200, 200) for d in during), during


def test_a_full_compile_queue_answers_429_with_retry_after(real: Stack) -> None:
    bodies = [ask(guided_choice=heavy_choice(200 + i)) for i in range(14)]
    with concurrent.futures.ThreadPoolExecutor(14) as pool:
        results = list(pool.map(lambda b: post(real, b), bodies))
    busy = [r for r in results if r[0] == 429]
    assert busy and all(r[0] in (200, 429) for r in results), [r[:2] for r in results]
    assert all(int(r[2]["Retry-After"]) >= 1 and r[1]["error"]["code"] == "grammar_queue_full" for r in busy)


def test_a_client_that_leaves_cancels_its_compile(real: Stack) -> None:
    body = json.dumps(ask(guided_choice=heavy_choice(300))).encode()
    before = started(real)
    with socket.create_connection(("127.0.0.1", real.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: started(real) > before, 60)
    wait_for(lambda: bool(log_events(real, "grammar_compile_cancelled")), 60)


def test_sigterm_is_not_held_up_by_a_running_compile(real: Stack) -> None:
    """Last in the module: the gateway is stopped (the supervisor may start another)."""
    gateway = gateway_pid(real)
    thread = threading.Thread(target=post, args=(real, ask(guided_choice=heavy_choice(400))), daemon=True)
    before = started(real)
    thread.start()
    wait_for(lambda: started(real) > before, 60)
    workers = grammar_workers(real)
    os.kill(gateway, signal.SIGTERM)
    wait_for(lambda: not alive(gateway) and not any(alive(w) for w in workers), 30)
