"""The grammar store in shared memory is bounded (--grammar-store-mb): a client that sends a new schema with every
request cannot fill the host's memory. The least recently used grammars go first, never one a request holds, nor
one used within the grace another gateway relies on; a grammar asked for again after it went is compiled again.
Real files in /dev/shm, the gateway's real compiler and worker pool over the embedded tokenizer, and ``blink serve``
with the real CPU engine. Time passing is written into the files' modification times, never waited for."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.e2e import ENGINE_ENV, REAL_ENGINE
from helpers.stack import MODEL, Stack, start_stack, stop_stack

from dpu_gateway.constrain import GRACE_S, REQUEST_HOLDS, GrammarCompiler
from dpu_gateway.textio import TextCodec
from shared import token_dfa
from shared.token_dfa import grammar_dir, grammar_path, prune


@pytest.fixture
def ring() -> Iterator[str]:
    name = f"blink-test-store-{uuid.uuid4().hex[:8]}"
    yield name
    token_dfa.remove_store(name)


def age(folder: Path, seconds: float) -> None:
    """Every stored grammar last used ``seconds`` earlier than it was (their order kept; the grace long past)."""
    for f in folder.iterdir():
        then = f.stat().st_mtime - seconds
        os.utime(f, (then, then))


def stored(folder: Path) -> dict[int, int]:
    """Grammar id -> bytes of each stored grammar."""
    return {int(f.name[:16], 16): f.stat().st_size for f in folder.iterdir() if f.suffix == ".npz"}


def write(ring: str, gid: int, size: int, used_s_ago: float) -> None:
    path = grammar_path(ring, gid)
    token_dfa.private_dir(path.parent)
    path.write_bytes(b"\0" * size)
    then = time.time() - used_s_ago
    os.utime(path, (then, then))


def test_prune_removes_the_least_recently_used_first_and_spares_those_in_use_and_recent(ring: str) -> None:
    for gid, used_s_ago in [(1, 500), (2, 400), (3, 300), (4, 200), (5, 5)]:
        write(ring, gid, 1000, used_s_ago)
    pruned = prune(ring, 3500, in_use={1}, grace_s=60)
    # 5000 bytes for 3500: 1 is in use, so 2 and 3 go (the oldest others), and 4 and 5 fit
    assert set(stored(grammar_dir(ring))) == {1, 4, 5}
    assert (pruned.removed, pruned.freed, pruned.left, pruned.kept) == (2, 2000, 3000, 1)
    pruned = prune(ring, 0, in_use=set(), grace_s=60)  # all may go but the one used 5 s ago
    assert set(stored(grammar_dir(ring))) == {5}
    assert (pruned.removed, pruned.left, pruned.kept) == (2, 1000, 1)


def test_prune_removes_what_a_killed_compile_left_once_the_grace_is_past(ring: str) -> None:
    write(ring, 1, 1000, 500)
    folder = grammar_dir(ring)
    old, fresh = folder / f".{1:016x}.npz.4242.tmp", folder / f".{2:016x}.npz.4343.tmp"
    for path, used_s_ago in ((old, 500), (fresh, 5)):
        path.write_bytes(b"\0" * 700)
        os.utime(path, (time.time() - used_s_ago,) * 2)
    pruned = prune(ring, 10_000, grace_s=60)  # within the limit: only the leftover goes
    assert not old.exists() and fresh.exists() and set(stored(folder)) == {1}
    assert (pruned.removed, pruned.freed, pruned.left) == (1, 700, 1700)


def test_prune_of_a_store_never_written_is_a_no_op(ring: str) -> None:
    assert prune(ring, 0).removed == 0
    assert not grammar_dir(ring).exists()


def choice_key(i: int) -> str:
    """A guided_choice constraint's key (dpu_gateway/structured.py) of two words of ``i``'s own."""
    return json.dumps(["choice", [f"alpha{i:03d} beta", f"gamma{i:03d} delta"]], separators=(",", ":"))


def test_the_compiler_keeps_its_store_bounded_and_a_held_grammar_in_it(ring: str) -> None:
    codec = TextCodec(None)  # type: ignore[arg-type]  # the embedded model's tokenizer
    vocab = codec.tokenizer.vocab_size

    async def main() -> None:
        compiler = GrammarCompiler(codec, ring)
        try:
            holds: list[int] = []
            token = REQUEST_HOLDS.set(holds)  # what the app's middleware does for each request
            first = await compiler.compile(choice_key(0), vocab, "guided_choice")
            REQUEST_HOLDS.reset(token)
            assert holds == [first] and compiler.held[first] == 1
            one = stored(grammar_dir(ring))[first]
            compiler.store_bytes = 3 * one + one // 2  # room for three grammars of about this size
            try:  # the request lives on (its prompt tokenizing, its stream) while other compiles come and go
                ids = [first]
                for i in range(1, 8):
                    age(grammar_dir(ring), 2 * GRACE_S)
                    ids.append(await compiler.compile(choice_key(i), vocab, "guided_choice"))
                    now = stored(grammar_dir(ring))
                    assert first in now  # held: its request may not have been loaded by the engine yet
                    assert ids[-1] in now  # just compiled
                    assert sum(now.values()) <= compiler.store_bytes or len(now) == 2, now
                assert len(stored(grammar_dir(ring))) == 3  # the held one, the last two compiled
                assert set(stored(grammar_dir(ring))) == {first, ids[-2], ids[-1]}
            finally:
                compiler.release(holds)  # the request ended
            assert first not in compiler.held
            age(grammar_dir(ring), 2 * GRACE_S)
            again = await compiler.compile(choice_key(8), vocab, "guided_choice")
            assert first not in stored(grammar_dir(ring))  # released and the least recently used: gone
            # the first grammar asked for again is compiled again, and the same tables come back
            assert await compiler.compile(choice_key(0), vocab, "guided_choice") == first
            assert first in stored(grammar_dir(ring)) and again in stored(grammar_dir(ring))
            tables = token_dfa.load(ring, first)
            assert tables.vocab_size == vocab and tables.num_states > 1
        finally:
            compiler.close()

    asyncio.run(main())


def test_a_grammar_used_again_is_the_last_to_go(ring: str) -> None:
    codec = TextCodec(None)  # type: ignore[arg-type]
    vocab = codec.tokenizer.vocab_size

    async def main() -> None:
        compiler = GrammarCompiler(codec, ring)
        try:
            a = await compiler.compile(choice_key(10), vocab, "guided_choice")
            b = await compiler.compile(choice_key(11), vocab, "guided_choice")
            sizes = stored(grammar_dir(ring))
            compiler.store_bytes = sizes[a] + sizes[b]  # room for two of these
            age(grammar_dir(ring), 3 * GRACE_S)
            os.utime(grammar_path(ring, b), (time.time() - 2 * GRACE_S,) * 2)  # b used after a
            assert await compiler.compile(choice_key(10), vocab, "guided_choice") == a  # a asked for again: used now
            age_b = grammar_path(ring, b).stat().st_mtime
            assert grammar_path(ring, a).stat().st_mtime > age_b
            c = await compiler.compile(choice_key(12), vocab, "guided_choice")
            assert set(stored(grammar_dir(ring))) >= {a, c} and b not in stored(grammar_dir(ring))
        finally:
            compiler.close()

    asyncio.run(main())


@pytest.fixture(scope="module")
def small_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("grammar_store"), "--grammar-store-mb", "1",
                        "--max-output-tokens", "16", engine_module=REAL_ENGINE, timeout_s=180, env=ENGINE_ENV)
    yield stack
    stop_stack(stack)


def test_a_server_with_a_small_store_serves_a_new_schema_each_request_within_it(small_store: Stack) -> None:
    """Sixteen requests, each with choices of its own, through the real client; the store stays within its MiB (the
    files aged between requests, as if each came a while after the one before), and the first choices asked for
    again, after their grammar was removed, are served again."""
    from openai import OpenAI

    client = OpenAI(base_url=small_store.url + "/v1", api_key="none", max_retries=0, timeout=120)
    folder = grammar_dir(small_store.ring)

    def ask(i: int) -> str:
        choices = [f"alpha{i:03d} beta", f"gamma{i:03d} delta"]
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick one."}],
                                             max_tokens=16, temperature=0, extra_body={"guided_choice": choices})
        text = out.choices[0].message.content
        assert text in choices, (i, text)
        return text

    for i in range(16):
        ask(i)
        assert sum(stored(folder).values()) <= 2**20, stored(folder)
        age(folder, 2 * GRACE_S)
    def compiled() -> list[str]:
        return [e["grammar_id"] for e in log_events(small_store, "grammar_compile") if e["result"] == "compiled"]

    first = compiled()[0]
    assert f"{int(first, 16):016x}.npz" not in {f.name for f in folder.iterdir()}  # removed long ago
    ask(0)
    assert compiled().count(first) == 2  # compiled again, and served
    pruned = log_events(small_store, "grammar_store_pruned")
    assert pruned and all(e["store_bytes"] <= 2**20 for e in pruned)


def log_events(stack: Stack, event: str) -> list[dict]:
    return [json.loads(line) for line in stack.log_path.read_text(errors="replace").splitlines()
            if line.startswith("{") and f'"{event}"' in line]
