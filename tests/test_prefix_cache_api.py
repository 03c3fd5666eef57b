"""Prefix caching seen by a client: ``blink serve`` with the real CPU engine and the embedded model, the
official ``openai`` client. A repeated conversation reports its cached prompt tokens in
``usage.prompt_tokens_details`` and answers the same; a different ``cache_salt`` finds nothing;
``/metrics`` counts the hits."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import pytest
from helpers.e2e import start_real_stack, sync_client, wait_for
from helpers.stack import MODEL, Stack, stop_stack

SYSTEM = ("You are a terse assistant for a shipping company. Answer in one short sentence, never use lists, "
          "and do not greet the user. Prices are in euros; parcels up to 2 kg cost 5, up to 10 kg cost 9.")
TURN = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What does a 3 kg parcel cost?"}]
BLOCK = 16  # the engine's default --block-size


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_real_stack(tmp_path_factory.mktemp("prefix"))
    yield stack
    stop_stack(stack)


def ask(stack: Stack, **extra: object) -> tuple[str, int, int]:
    out = sync_client(stack).chat.completions.create(model=MODEL, messages=TURN, max_tokens=8, temperature=0,
                                                     extra_body=extra or None)
    details = out.usage.prompt_tokens_details
    assert out.usage is not None and details is not None
    return out.choices[0].message.content or "", out.usage.prompt_tokens, details.cached_tokens or 0


def metric(stack: Stack, name: str) -> float:
    with urllib.request.urlopen(stack.url + "/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))


def test_a_repeated_prompt_reports_its_cached_tokens_and_a_salt_isolates(real: Stack) -> None:
    hits_before = metric(real, "blink:prefix_cache_hits_total")
    first, plen, cached0 = ask(real, cache_salt="tenant-a")
    again, plen2, cached1 = ask(real, cache_salt="tenant-a")
    other, _, cached2 = ask(real, cache_salt="tenant-b")
    assert plen == plen2 > 2 * BLOCK
    assert cached0 == 0 and cached2 == 0, "a new salt finds nothing"
    assert cached1 == (plen - 1) // BLOCK * BLOCK, "every full block but the one holding the last token"
    assert first == again == other
    # the engine publishes its counters every 0.1 s
    wait_for(lambda: metric(real, "blink:prefix_cache_hits_total") - hits_before >= cached1, 60, 0.1)
    assert metric(real, "vllm:prefix_cache_queries_total") >= 3 * plen
