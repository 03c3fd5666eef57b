"""Prefix caching: the allocator's reference counts and LRU, the policy over 5,000 random requests with
shared prefixes, cancellations and preemption (every block back, no shared block written, each computed
position's KV the one its request would have written), and the CPU engine through a ring: the same greedy
tokens with the cache on and off for prefixes of every length around block boundaries, hit counts, the
salt, cached_tokens in the slot and the counters in /metrics."""

from __future__ import annotations

import collections
import random
from pathlib import Path

import numpy as np
import pytest

from gpu_engine.kv_cache import BlockAllocator, NoFreeBlocks
from gpu_engine.policy import Finish, Phase, Policy, Request, StepPlan
from gpu_engine.prefix_cache import extend_hashes
from tests.test_chunked_prefill import Harness, tiny_llama  # noqa: F401 - the module's fixture

BS = 4


# ------------------------------------------------------------------ allocator
def test_freed_cached_blocks_stay_findable_and_are_evicted_oldest_first() -> None:
    alloc = BlockAllocator(4)
    a, b = alloc.allocate(2)
    assert alloc.cache.register(a, 11) and alloc.cache.register(b, 12)
    alloc.free([a, b])
    assert alloc.num_free == 4 and alloc.num_held == 0 and alloc.cache.num_idle == 2
    assert alloc.cache.find([11, 12, 13]) == [a, b]
    alloc.share([a])
    assert alloc.refcount(a) == 1 and alloc.num_free == 3
    fresh = alloc.allocate(3)  # the two unused blocks, then the idle one (b): a is held
    assert b in fresh and a not in fresh and alloc.cache.stats.evictions == 1
    assert alloc.cache.find([11, 12]) == [a], "an evicted block is no longer found"
    with pytest.raises(NoFreeBlocks):
        alloc.allocate(1)
    alloc.free([a, *fresh])
    assert alloc.num_free == 4 and all(alloc.refcount(x) == 0 for x in range(4))


def test_lru_evicts_the_tail_of_a_prefix_before_its_head() -> None:
    alloc = BlockAllocator(3)
    blocks = alloc.allocate(3)
    for i, b in enumerate(blocks):
        alloc.cache.register(b, 100 + i)
    alloc.free(blocks)
    assert alloc.allocate(1) == [blocks[2]]
    assert alloc.cache.find([100, 101, 102]) == blocks[:2]


def test_frees_beyond_the_holders_are_refused_whole() -> None:
    alloc = BlockAllocator(3)
    a, b = alloc.allocate(2)
    alloc.cache.register(a, 1)
    alloc.share([a])
    with pytest.raises(ValueError, match="double free"):
        alloc.free([a, a, a])
    assert alloc.refcount(a) == 2, "a refused free changes nothing"
    alloc.free([a, a, b])
    assert alloc.num_free == 3
    with pytest.raises(ValueError, match="not cached"):
        alloc.share([b])


def test_hashes_chain_over_tokens_and_salt() -> None:
    h1: list[int] = []
    extend_hashes(h1, [1, 2, 3, 4, 5, 6, 7, 8, 9], BS, salt=0)
    h2: list[int] = []
    extend_hashes(h2, [1, 2, 3, 4, 5, 6, 7, 0], BS, salt=0)
    h3: list[int] = []
    extend_hashes(h3, [1, 2, 3, 4], BS, salt=7)
    assert len(h1) == 2 and h1[0] == h2[0] and h1[1] != h2[1] and h3[0] != h1[0]
    h4: list[int] = []
    extend_hashes(h4, [9, 9, 9, 9, 5, 6, 7, 8], BS, salt=0)
    assert h4[1] != h1[1], "a block's hash depends on the blocks before it"


# ------------------------------------------------------------------ policy
class KVOracle:
    """What each cache position holds: a fingerprint of the token prefix (and salt) of the request that
    wrote it. A row may only read positions whose fingerprint is its own prefix's."""

    def __init__(self, num_blocks: int) -> None:
        self.kv: list[list[int | None]] = [[None] * BS for _ in range(num_blocks)]

    @staticmethod
    def prints(req: Request, upto: int) -> list[int]:
        out, h = [], hash(("salt", req.salt))
        for t in req.tokens[:upto]:
            h = hash((h, t))
            out.append(h)
        return out

    def step(self, plan: StepPlan, alloc: BlockAllocator) -> None:
        for w in plan.work:
            req, end = w.req, w.num_cached + w.num_new
            fp = self.prints(req, end)
            for p in range(w.num_cached, end):          # written: held by this request alone, never cached
                b = req.blocks[p // BS]
                assert alloc.refcount(b) == 1 and not alloc.cache.holds(b), "a shared or cached block written"
                self.kv[b][p % BS] = fp[p]
            start = 0 if w.prefill else max(0, w.num_cached - BS)
            for p in range(start, end):                  # read
                assert self.kv[req.blocks[p // BS]][p % BS] == fp[p], f"position {p} holds another prefix's KV"


def next_token(req: Request) -> int:
    """A token that depends only on the context, so equal contexts continue equally (multi-turn reuse)."""
    return hash((req.salt, tuple(req.tokens[-6:]))) % 5 + 3


def random_prompt(rng: random.Random, systems: list[list[int]]) -> list[int]:
    head = rng.choice(systems)[: rng.randint(0, 40)]
    return head + [rng.randint(3, 7) for _ in range(rng.randint(0 if head else 1, 60))]


def test_policy_over_5000_random_requests_with_shared_prefixes() -> None:
    rng = random.Random(24)
    total = 120
    alloc = BlockAllocator(total)
    policy = Policy(alloc, BS, max_batch=12, token_budget=32, prefix_caching=True)
    oracle = KVOracle(total)
    systems = [[rng.randint(3, 9) for _ in range(40)] for _ in range(4)]
    live: list[Request] = []
    arrival = cancels = 0
    while arrival < 5000 or live:
        for _ in range(min(rng.randint(0, 2), 5000 - arrival)):
            req = Request(slot=arrival, seq=0, request_id=arrival, prompt=random_prompt(rng, systems),
                          max_new_tokens=rng.randint(1, 30), arrival=arrival, salt=rng.choice((0, 0, 0, 5)))
            assert policy.can_ever_fit(len(req.prompt), req.max_new_tokens)
            policy.add(req)
            live.append(req)
            arrival += 1
        if live and rng.random() < 0.03:
            victim = rng.choice(live)
            policy.finish(victim, Finish.CANCELLED)
            cancels += 1
        plan = policy.schedule()
        if plan is not None:
            oracle.step(plan, alloc)
            policy.commit(plan, [next_token(w.req) for w in plan.work], eos_ids=())
        live = [r for r in live if r.phase != Phase.FINISHED]
        held = collections.Counter(b for r in live for b in r.blocks)
        assert all(alloc.refcount(b) == n for b, n in held.items())
        assert alloc.num_held == len(held) and alloc.num_held + alloc.num_free == total
    stats = alloc.cache.stats
    assert policy.num_unfinished == 0 and alloc.num_free == total
    assert all(alloc.refcount(b) == 0 for b in range(total))
    assert policy.preemptions > 0 and cancels > 0
    assert stats.hits > stats.queries // 10 and stats.evictions > 0


def drive(policy: Policy, reqs: list[Request]) -> None:
    for r in reqs:
        policy.add(r)
    while policy.num_unfinished:
        plan = policy.schedule()
        assert plan is not None
        policy.commit(plan, [9] * len(plan.work), eos_ids=())


def test_admission_shares_the_leading_full_blocks_and_computes_the_rest() -> None:
    alloc = BlockAllocator(64)
    policy = Policy(alloc, BS, max_batch=4, token_budget=64, prefix_caching=True)
    drive(policy, [Request(0, 0, 0, list(range(10, 23)), 1, 0)])  # 13 tokens: 3 full blocks
    for plen, cached in ((3, 0), (4, 0), (5, 4), (8, 4), (9, 8), (12, 8), (13, 12), (20, 12)):
        req = Request(1, 0, 1, list(range(10, 10 + plen)), 1, 1)
        policy.add(req)
        plan = policy.schedule()
        assert plan is not None and plan.work[0].num_cached == cached, plen
        assert plan.work[0].num_new == plen - cached
        policy.commit(plan, [9], eos_ids=())
        assert req.cached_tokens == cached and req.phase == Phase.FINISHED
    assert alloc.num_free == 64


def test_without_the_flag_nothing_is_cached() -> None:
    alloc = BlockAllocator(64)
    policy = Policy(alloc, BS, max_batch=4, token_budget=64)
    drive(policy, [Request(i, 0, i, list(range(10, 30)), 2, i) for i in range(3)])
    assert alloc.cache.num_cached == 0 and alloc.cache.stats.queries == 0


# ------------------------------------------------------------------ engine through a ring
BASE = [int(t) for t in np.random.default_rng(24).integers(3, 200, size=40)]
SHARED = (3, 4, 5, 7, 8, 9, 11, 12, 13, 16, 17)


def family(shared: int) -> list[list[int]]:
    """Two prompts sharing their first ``shared`` tokens (then differing), and the first one again."""
    a = BASE[:shared] + [201, 202, 203]
    b = BASE[:shared] + [205, 206]
    return [a, b, a]


def run_in_order(h: Harness, prompts: list[list[int]], max_new: int, **kw: object) -> list[list[int]]:
    """One request at a time, so each finds what the earlier ones cached."""
    out = []
    for i, p in enumerate(prompts):
        h.submit(i, p, max_new, ignore_eos=True, **kw)
        h.run()
        out.append(h.result(i)[0])
    return out


def test_greedy_tokens_identical_with_the_cache_on_and_off(tiny_llama: Path) -> None:  # noqa: F811
    prompts = [p for n in SHARED for p in family(n)]
    off = Harness(tiny_llama, kv_blocks=256, budget=16, prefix_caching=False)
    on = Harness(tiny_llama, kv_blocks=256, budget=16)
    want = [run_in_order(off, prompts[i : i + 3], 6) for i in range(0, len(prompts), 3)]
    got = [run_in_order(on, prompts[i : i + 3], 6) for i in range(0, len(prompts), 3)]
    assert got == want
    stats = on.policy.alloc.cache.stats
    assert stats.hits > 0 and off.policy.alloc.cache.stats.queries == 0
    on.check_blocks_returned()
    off.check_blocks_returned()


def test_hits_and_cached_tokens_are_the_full_blocks_found(tiny_llama: Path) -> None:  # noqa: F811
    h = Harness(tiny_llama, kv_blocks=256, budget=64)
    first = BASE[:18]                                    # 18 tokens + 3 outputs: 5 full blocks computed
    run_in_order(h, [first], 4)
    stats = h.policy.alloc.cache.stats
    assert (stats.queries, stats.hits) == (18, 0)
    h.submit(1, BASE[:18] + [7, 7], 1, ignore_eos=True)  # 20 tokens: 4 blocks of the first are found
    h.run()
    assert int(h.ring.slots[1]["cached_tokens"]) == 16
    h.result(1)
    h.submit(2, BASE[:3], 1, ignore_eos=True)             # shorter than a block: nothing to find
    h.run()
    assert int(h.ring.slots[2]["cached_tokens"]) == 0
    h.result(2)
    assert (stats.queries, stats.hits) == (18 + 20 + 3, 16)
    h.engine.publish_stats()
    assert h.ring.header_load64("prefix_cache_queries") == 41 and h.ring.header_load64("prefix_cache_hits") == 16
    h.check_blocks_returned()


def test_a_salt_prevents_sharing(tiny_llama: Path) -> None:  # noqa: F811
    h = Harness(tiny_llama, kv_blocks=256, budget=64)
    prompt = BASE[:21]
    outs = [run_in_order(h, [prompt], 3, cache_salt=salt)[0] for salt in (11, 22, 11, 0)]
    stats = h.policy.alloc.cache.stats
    assert stats.hits == 20, "only the second request of salt 11 found blocks (5 of them)"
    assert len(set(map(tuple, outs))) == 1
    h.check_blocks_returned()


def test_the_counters_reach_the_metrics(tiny_llama: Path) -> None:  # noqa: F811
    from dpu_gateway.engines import EngineView, engine_samples, total_stats
    from shared.metrics import FrontendMetrics

    h = Harness(tiny_llama, kv_blocks=256, budget=64)
    run_in_order(h, [BASE[:13], BASE[:13]], 2)
    h.engine.publish_stats()
    stats = {name: h.ring.header_load64(name) for name in ("prefix_cache_queries", "prefix_cache_hits",
                                                           "prefix_cache_evictions")}
    raw = h.ring.read_header()["stats"]
    views = [EngineView(i, True, "", {**{n: raw[n] for n in raw.dtype.names}, **stats}) for i in range(2)]
    text = FrontendMetrics("m").render(total_stats(views), engine_samples(views)).decode()
    assert 'blink:prefix_cache_queries_total{model_name="m"} 52.0' in text
    assert 'blink:prefix_cache_hits_total{model_name="m"} 24.0' in text
    for engine in (0, 1):  # vLLM's, per engine
        assert f'vllm:prefix_cache_queries_total{{engine="{engine}",model_name="m"}} 26.0' in text
        assert f'vllm:prefix_cache_hits_total{{engine="{engine}",model_name="m"}} 12.0' in text
    assert 'blink:prefix_cache_evictions_total{model_name="m"} 0.0' in text


# ------------------------------------------------------------------ flags
def test_flags_vllm_names_on_by_default_and_off_without_chunking() -> None:
    from blink.cli import build_parser
    from shared.config import EngineConfig

    def config(*argv: str) -> EngineConfig:
        return EngineConfig.from_namespace(build_parser().parse_args(["serve", *argv]))

    assert config().prefix_caching and config("--enable-prefix-caching").prefix_caching
    off = config("--no-enable-prefix-caching")
    assert not off.prefix_caching and "--no-enable-prefix-caching" in off.to_argv()
    assert not config("--no-enable-chunked-prefill").prefix_caching, "a cached prefix needs chunked prefill"
    assert not Policy(BlockAllocator(8), BS, 2, 8, chunked=False, prefix_caching=True).prefix_caching
