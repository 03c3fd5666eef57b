"""Grammars applied on the device by the persistent scheduler (`gpu_engine/csrc/sched_grammar.cuh`,
`gpu_engine/kernels/grammar.py`), against the CPU engine and the host-driven backend, through the ring.

The small fp32 Llama of test_persistent.py has no tokenizer, so its grammars are token DFAs built here over its
512 ids (random allowed sets, default and exception transitions, accepting states), stored where the frontend
stores compiled ones (`shared/token_dfa.store`). Every output must walk its DFA, end only where the DFA accepts,
and be the CPU engine's (greedy) and the host-driven backend's (seeded sampling too), under chunked prefill,
prefix caching, preemption and cancellation; a small arena evicts idle grammars and refuses one too large for
it. Marked gpu: skipped without CUDA.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path

import msgspec
import numpy as np
import pytest

from harness.ring_driver import Driver, Job, Result, start_engine, stop_engine, wait_ready
from persistent.test_persistent import CHUNK_ARGS, OUT, VOCAB, settled_header, tiny  # noqa: F401
from persistent.test_processors import same_tokens
from shared import ring_layout as L
from shared import token_dfa
from shared.messages import Sampling
from shared.token_dfa import TokenDFA

pytestmark = pytest.mark.gpu
F = L.FinishReason
EOS = 2  # the tiny model's


def random_dfa(rng: np.random.Generator, states: int, density: float) -> TokenDFA:
    """A DFA over the tiny vocabulary: each state allows a random set (never EOS, at least 3 ids), goes to a
    default state after most of them and elsewhere after a few; about a third of the states accept."""
    V = VOCAB
    allowed = rng.random((states, V)) < density
    allowed[:, EOS] = False
    for s in range(states):
        allowed[s, rng.choice(np.arange(3, V), size=3, replace=False)] = True
    default = rng.integers(0, states, size=states).astype(np.int32)
    offsets, toks, nxt = [0], [], []
    for s in range(states):
        ids = np.flatnonzero(allowed[s])
        exc = np.sort(rng.choice(ids, size=min(len(ids), int(rng.integers(0, 12))), replace=False))
        toks += exc.tolist()
        nxt += rng.integers(0, states, size=len(exc)).tolist()
        offsets.append(len(toks))
    accept = rng.random(states) < 0.35
    accept[0] = False
    return TokenDFA(0, V, np.packbits(allowed, axis=1), default, np.asarray(offsets, np.int64),
                    np.asarray(toks, np.int32), np.asarray(nxt, np.int32), accept)


@dataclasses.dataclass(frozen=True)
class GrammarJob(Job):
    grammar: int = 0  # the grammar id (0: none)
    eos_bias: float = 0.0  # logit_bias on EOS: the answer ends wherever its grammar lets it

    def sampling(self) -> Sampling:
        bias = ((EOS, self.eos_bias),) if self.eos_bias else ()
        # EOS honoured (the gateway refuses ignore_eos beside a grammar): the end tokens are what complete text allows
        return msgspec.structs.replace(super().sampling(), grammar_id=self.grammar, logit_bias=bias, ignore_eos=False)


def serve(model: Path, backend: str, jobs: list[GrammarJob], grammars: dict[int, TokenDFA], args: tuple[str, ...],
          tag: str) -> tuple[dict[int, Result], dict]:
    name = f"blink-gram-{backend}-{uuid.uuid4().hex[:6]}"
    for gid, dfa in grammars.items():
        token_dfa.store(name, gid, dfa)
    OUT.mkdir(parents=True, exist_ok=True)
    proc = start_engine(name, model, backend, *args, log=OUT / f"engine-grammar-{tag}-{backend}.log")
    ring = wait_ready(name, proc)
    try:
        features = ring.header_load32("sampling_features")
        arena = ring.header_load64("grammar_arena_bytes")
        results = Driver(ring, 32).run([*jobs], timeout=480)
        h = settled_header(ring)
        stats = {"features": features, "arena": arena, "preemptions": int(h["stats"]["preemptions"]),
                 "hits": int(h["prefix_cache_hits"]),
                 "blocks_back": int(h["stats"]["kv_blocks_free"]) == int(h["stats"]["kv_blocks_total"]),
                 "exit_code": stop_engine(ring, proc)}
    finally:
        if proc.poll() is None:
            proc.kill()
        ring.close()
        token_dfa.remove_store(name)
    return results, stats


def scheduler_counters(log: Path) -> dict:
    """The persistent scheduler's counters from the engine's "scheduler exited" log line (JSON lines)."""
    for line in log.read_text().splitlines():
        if "scheduler exited" in line:
            return json.loads(line)
    raise AssertionError(f"no 'scheduler exited' line in {log}")


def jobs_for(grammars: dict[int, TokenDFA], n: int, seed: int, max_new: int) -> list[GrammarJob]:
    """Requests over the grammars in turn (every fifth plain), prompts sharing prefixes (the prefix cache hits),
    a quarter seeded sampling, one in eight cancelled, a third with EOS pushed up by a logit bias (they end at
    the first state where their grammar accepts)."""
    rng = np.random.default_rng(seed)
    ids = sorted(grammars)
    stems = [rng.integers(3, VOCAB, size=64).astype(np.int32) for _ in range(4)]
    jobs = []
    for k in range(n):
        tail = rng.integers(3, VOCAB, size=int(rng.integers(1, 90))).astype(np.int32)
        prompt = np.concatenate([stems[k % 4], tail]) if k % 2 else tail
        sampled = {"temperature": 0.8, "seed": 500 + k, "top_k": 50} if k % 4 == 3 else {}
        jobs.append(GrammarJob(1000 + k, prompt, max_new, cancel_after=max_new // 2 if k % 8 == 5 else None,
                               grammar=0 if k % 5 == 4 else ids[k % len(ids)], eos_bias=8.0 if k % 3 == 0 else 0.0,
                               **sampled))  # type: ignore[arg-type]
    return jobs


def check_walks(jobs: list[GrammarJob], grammars: dict[int, TokenDFA], got: dict[int, Result], what: str) -> None:
    """Each constrained output walks its DFA; one ended by EOS (which the ring's output leaves out) ends where the
    DFA accepts."""
    for j in jobs:
        r = got[j.rid]
        if not j.grammar or r.reason in (F.ERROR, F.CANCELLED):
            continue
        dfa = grammars[j.grammar]
        state = dfa.walk(r.tokens)
        assert state >= 0, f"{what}: request {j.rid} left its grammar: {r.tokens}"
        if r.reason == F.EOS:
            assert dfa.accept[state], f"{what}: request {j.rid} ended where its grammar does not accept"


def test_constrained_rows_give_the_cpu_engines_tokens(tiny: Path) -> None:  # noqa: F811
    """64 requests over 6 grammars and plain ones, in chunks of a 96-token budget with a 64-block cache
    (preempted and recomputed), prompts sharing prefixes, with the prefix cache and without: the persistent
    backend's greedy tokens are the CPU engine's, its seeded draws the host-driven backend's, and every output
    keeps to its grammar."""
    rng = np.random.default_rng(31)
    grammars = {0x1000 + g: random_dfa(rng, int(rng.integers(2, 40)), float(rng.uniform(0.02, 0.4)))
                for g in range(6)}
    jobs = jobs_for(grammars, 64, seed=32, max_new=40)
    reference = [dataclasses.replace(j, cancel_after=None) for j in jobs]
    cpu, _ = serve(tiny, "cpu", reference, grammars, CHUNK_ARGS, "equal")
    check_walks(reference, grammars, cpu, "cpu")
    assert sum(cpu[j.rid].reason == F.EOS for j in reference if j.grammar) > 4, "few outputs reached an end"
    got = {}
    no_cache = (*CHUNK_ARGS, "--no-enable-prefix-caching")
    for backend, args, tag in (("host", CHUNK_ARGS, "host"), ("persistent", CHUNK_ARGS, "persistent"),
                               ("persistent", no_cache, "persistent-uncached")):
        got[tag], st = serve(tiny, backend, jobs, grammars, args, tag)
        assert st["features"] & L.SamplingFeatures.GRAMMAR, f"{tag} does not advertise grammars"
        assert (st["hits"] > 0) == (args is CHUNK_ARGS), st
        assert st["preemptions"] > 0 and st["blocks_back"] and st["exit_code"] == 0, st
        assert (st["arena"] > 0) == (backend == "persistent"), st
        check_walks(jobs, grammars, got[tag], tag)
        same_tokens(jobs, got[tag], cpu, f"{tag} against the CPU engine", greedy_only=True)
    for tag in ("persistent", "persistent-uncached"):
        same_tokens(jobs, got[tag], got["host"], f"{tag} against host-driven", greedy_only=False)


def test_a_small_arena_evicts_idle_grammars_and_refuses_one_too_large(tiny: Path) -> None:  # noqa: F811
    """A 1 MiB arena: 80 small grammars (more than the 64 entries of its table) and 6 of about 300 KB (3 fit at
    once) are loaded, evicted and loaded again as requests come, with the CPU engine's tokens; a grammar of
    1.3 MB is refused (the request ends in an error), the rest go on."""
    rng = np.random.default_rng(41)
    small = {0x2000 + g: random_dfa(rng, int(rng.integers(2, 12)), 0.2) for g in range(80)}
    big = {0x3000 + g: random_dfa(rng, 4000, 0.05) for g in range(6)}
    huge = {0x4000: random_dfa(rng, 20000, 0.01)}
    assert token_dfa.device_bytes(20000, huge[0x4000].num_exceptions, VOCAB) > 2**20
    grammars = {**small, **big, **huge}
    order = [*small, *big, *small, *big, 0x4000]
    jobs = [GrammarJob(2000 + k, rng.integers(3, VOCAB, size=int(rng.integers(1, 60))).astype(np.int32), 12,
                       grammar=gid) for k, gid in enumerate(order)]
    args = (*CHUNK_ARGS, "--grammar-cache-mb", "1")
    pers, st = serve(tiny, "persistent", jobs, grammars, args, "arena")
    assert st["arena"] == 2**20 and st["blocks_back"] and st["exit_code"] == 0, st
    assert pers[2000 + len(order) - 1].reason == F.ERROR
    served = jobs[:-1]
    assert all(pers[j.rid].reason != F.ERROR for j in served)
    check_walks(served, grammars, pers, "persistent, small arena")
    counters = scheduler_counters(OUT / "engine-grammar-arena-persistent.log")
    # every grammar loaded at least once, some of them again after an eviction; the huge one refused
    assert counters["grammar_loads"] > len(small) + len(big) and counters["grammar_evictions"] > 0, counters
    assert counters["grammar_failures"] == 1, counters
    cpu, _ = serve(tiny, "cpu", served, grammars, CHUNK_ARGS, "arena")
    same_tokens(served, pers, cpu, "persistent with a small arena against the CPU engine", greedy_only=True)
