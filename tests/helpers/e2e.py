"""Helpers for the end-to-end tests against the real CPU engine and the embedded default model."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import openai

from helpers.procfs import processes
from helpers.stack import MODEL, Stack, start_stack

REAL_ENGINE = "gpu_engine.serve"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
# A small ring and context keep startup and the too-long prompt cheap on a 2-core machine.
ENGINE_FLAGS = ("--num-slots", "32", "--max-prompt-tokens", "1024", "--max-output-tokens", "256")
MAX_CONTEXT = 1024 + 256
# One torch thread: on a small shared machine, two threads that wait on each other while another process holds
# a core make a decode step 10x slower at times. The longer heartbeat timeout keeps a slow step (a packed prefill
# of 16 prompts while other jobs run) from being reported as a dead engine.
ENGINE_ENV = {"OMP_NUM_THREADS": "1", "BLINK_HEARTBEAT_TIMEOUT_S": "10"}


def start_real_stack(tmp: Path) -> Stack:
    """``blink serve`` with the real engine; the first request is made here (the engine's warm-up)."""
    stack = start_stack(tmp, *ENGINE_FLAGS, engine_module=REAL_ENGINE, timeout_s=180, env=ENGINE_ENV)
    sync_client(stack).chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=2, temperature=0)
    return stack


def sync_client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def async_client(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def wait_for(check: Callable[[], bool], timeout_s: float, every_s: float = 0.02) -> float:
    """Seconds until ``check()`` held; raises AssertionError after ``timeout_s``."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"condition still false after {timeout_s} s")
        time.sleep(every_s)
    return time.monotonic() - start


def idle_kv_usage(stack: Stack) -> float:
    """The KV usage gauge once nothing runs (the engine publishes its stats every 0.1 s)."""
    wait_for(lambda: stack.metric("blink:slots_in_use") == 0 and stack.metric("blink:num_requests_running") == 0,
             30)
    time.sleep(0.3)
    return stack.metric("blink:kv_cache_usage_perc")


def children_of(pid: int) -> list[int]:
    """Every descendant process of ``pid`` (from /proc)."""
    parents = {p.pid: p.parent for p in processes()}
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, parent in parents.items() if parent in frontier]
        found += kids
        frontier = kids
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def finished(stack: Stack, reason: str) -> float:
    """vllm:request_success_total for one finished_reason."""
    status, body = stack.get("/metrics")
    assert status == 200
    for line in body.decode().splitlines():
        if line.startswith("vllm:request_success_total{") and f'finished_reason="{reason}"' in line:
            return float(line.rpartition(" ")[2])
    return 0.0
