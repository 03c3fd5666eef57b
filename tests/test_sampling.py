"""Sampling: greedy, filters, seeded counter-based draws, logprobs."""

from __future__ import annotations

import dataclasses
import math

import msgspec
import numpy as np
import pytest
import torch

from gpu_engine.sampling import SamplingSpec, filter_logits, fmix32, request_seed, sample, uniform_noise
from shared.messages import Sampling
from shared.slots import SlotRequest

V = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def _run(logits: torch.Tensor, specs: list[SamplingSpec], step: int = 0) -> torch.Tensor:
    seeds = torch.tensor([s.seed for s in specs], dtype=torch.int64)
    steps = torch.full((len(specs),), step, dtype=torch.int64)
    return sample(logits, specs, steps, seeds).tokens


def test_greedy_is_argmax() -> None:
    logits = _logits(6)
    tokens = _run(logits, [SamplingSpec()] * 6)
    assert torch.equal(tokens, logits.argmax(-1))


def test_top_k_one_is_greedy() -> None:
    logits = _logits(6)
    specs = [SamplingSpec(temperature=1.5, top_k=1, seed=i) for i in range(6)]
    assert torch.equal(_run(logits, specs), logits.argmax(-1))


def test_seeded_rows_ignore_their_batch() -> None:
    logits = _logits(5, seed=1)
    spec = SamplingSpec(temperature=1.0, top_p=0.9, seed=1234)
    alone = [_run(logits[2:3], [spec], step).item() for step in range(20)]
    mates = [SamplingSpec(temperature=0.7, seed=9), SamplingSpec(), spec,
             SamplingSpec(temperature=2.0, top_k=5, seed=-3), SamplingSpec()]
    batched = [_run(logits, mates, step)[2].item() for step in range(20)]
    assert alone == batched
    assert len(set(alone)) > 1  # the step counter really changes the draw


def test_draws_follow_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    spec = SamplingSpec(temperature=1.0, seed=42)
    counts = torch.zeros(3)
    for step in range(3000):
        counts[sample(logits, [spec], torch.tensor([step]), torch.tensor([42])).tokens[0]] += 1
    assert torch.allclose(counts / 3000, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


def test_filters_on_hand_made_distribution() -> None:
    probs = torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]])
    logits = probs.log()

    def kept(top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> list[int]:
        out = filter_logits(logits, torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))
        return torch.isfinite(out[0]).nonzero().squeeze(1).tolist()

    assert kept() == [0, 1, 2, 3, 4]
    assert kept(top_k=2) == [1, 3]
    assert kept(top_p=0.4) == [1]
    assert kept(top_p=0.5) == [1, 3]  # 0.4 alone is short of 0.5
    assert kept(top_p=0.84) == [1, 3, 4]
    assert kept(top_p=0.0) == [1]
    assert kept(min_p=0.3) == [1, 3, 4]  # threshold 0.12
    assert kept(min_p=0.9) == [1]
    assert kept(top_k=3, top_p=0.6) == [1, 3]  # top-k renormalises: 0.4/0.85 < 0.6
    assert kept(top_k=3, min_p=0.5) == [1, 3]


def test_logprobs_are_log_softmax_of_raw_logits() -> None:
    logits = _logits(4, seed=2)
    specs = [SamplingSpec(num_top_logprobs=3), SamplingSpec(temperature=0.5, seed=1),
             SamplingSpec(temperature=2.0, top_k=4, seed=2, num_top_logprobs=1), SamplingSpec()]
    result = sample(logits, specs, torch.zeros(4, dtype=torch.int64), torch.tensor([0, 1, 2, 0]))
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(result.logprobs, ref.gather(-1, result.tokens[:, None]).squeeze(1))
    assert result.top_ids.shape == (4, 3) and result.logprobs.dtype == torch.float32
    assert torch.equal(result.top_ids, ref.topk(3).indices)
    assert torch.allclose(result.top_logprobs, ref.topk(3).values)


def test_hash_is_exact_uint32_arithmetic() -> None:
    # MurmurHash3 fmix32 reference values, computed with Python's unbounded ints.
    def ref(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x85EBCA6B) & 0xFFFFFFFF
        x ^= x >> 13
        x = (x * 0xC2B2AE35) & 0xFFFFFFFF
        return x ^ (x >> 16)

    xs = [0, 1, 0xDEADBEEF, 0xFFFFFFFF, 123456789]
    assert fmix32(torch.tensor(xs)).tolist() == [ref(x) for x in xs]
    u = uniform_noise(torch.tensor([7, -7, 2**62]), torch.tensor([0, 0, 5]), 1000)
    assert u.dtype == torch.float32 and float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.02
    assert not torch.equal(u[0], u[1])


def _through_ring(s: Sampling, request_id: int) -> SamplingSpec:
    """The frontend's record as the tracker writes it, decoded as the engine reads it at claim."""
    rec = SlotRequest(request_id, np.array([1, 2], np.int32), s).sampling_record()
    return SamplingSpec.from_ring(rec[0], request_id)


def test_every_field_of_the_record_reaches_the_engine() -> None:
    s = Sampling(9, temperature=0.5, top_p=0.75, top_k=40, min_p=0.125, seed=-3, ignore_eos=True,
                 logprobs=True, top_logprobs=4, stop_ids=(7, 11))
    assert _through_ring(s, 5) == SamplingSpec(
        temperature=0.5, top_p=0.75, top_k=40, min_p=0.125, seed=(-3) & (2**63 - 1), num_top_logprobs=4,
        stop_ids=frozenset({7, 11}), ignore_eos=True, want_logprobs=True)


def test_record_defaults_through_the_ring() -> None:
    """No seed: the engine derives it from the request id (as the CUDA scheduler does); alternatives
    asked for without ``logprobs`` still turn logprobs on."""
    assert _through_ring(Sampling(3), 77) == SamplingSpec(seed=request_seed(77))
    assert 0 <= request_seed(77) < 2**63 and request_seed(77) != request_seed(78)
    assert _through_ring(Sampling(3, top_logprobs=2), 1).want_logprobs


def test_the_two_records_hold_the_same_fields() -> None:
    """A field added to the frontend's record and not to the engine's spec (or back) fails here:
    ``docs/DESIGN.md`` lists the files a new field goes through."""
    renamed = {"logprobs": "want_logprobs", "top_logprobs": "num_top_logprobs",
               "grammar_id": "grammar"}  # the id names the tables the engine loads at claim
    # the slot's own words, not SamplingParams: the engine reads them into policy.Request at claim
    slot_fields = {"max_new_tokens", "cache_salt"}
    frontend = {renamed.get(f, f) for f in Sampling.__struct_fields__} - slot_fields
    engine_only = {"eos_ids"}  # the model's, resolved at claim
    assert frontend == {f.name for f in dataclasses.fields(SamplingSpec)} - engine_only


def test_record_survives_the_tracker_link() -> None:
    s = Sampling(9, temperature=0.5, seed=2**63 - 1, logprobs=True, top_logprobs=2, stop_ids=(3,))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(s), type=Sampling) == s


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_masked_vocab_never_chosen(temperature: float) -> None:
    logits = _logits(3)
    logits[:, :-1] = -math.inf
    specs = [SamplingSpec(temperature=temperature, seed=i) for i in range(3)]
    assert _run(logits, specs).tolist() == [V - 1] * 3


@pytest.mark.parametrize("spec,filters", [
    (SamplingSpec(), False),
    (SamplingSpec(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2), False),  # greedy ignores the filters
    (SamplingSpec(temperature=0.8), False),
    (SamplingSpec(temperature=0.8, top_k=-1, top_p=1.5, min_p=-0.1), False),  # all three off
    (SamplingSpec(temperature=0.8, top_k=40), True),
    (SamplingSpec(temperature=0.8, top_p=0.9), True),
    (SamplingSpec(temperature=0.8, min_p=0.05), True),
    (SamplingSpec(temperature=0.8, top_p=math.nan), True),  # not off, so filtered (the exact path)
])
def test_needs_filter_is_exactly_when_filter_logits_acts(spec: SamplingSpec, filters: bool) -> None:
    from gpu_engine.policy import needs_filter

    assert needs_filter(spec) is filters
    if spec.temperature > 0 and not filters:  # then filter_logits leaves the scaled logits alone
        logits = _logits(4, seed=3) / spec.temperature
        out = filter_logits(logits, torch.full((4,), spec.top_k), torch.full((4,), spec.top_p),
                            torch.full((4,), spec.min_p))
        assert torch.equal(out, logits)


def test_step_filters_picks_the_graph_variant() -> None:
    from gpu_engine.policy import Request, SeqWork, StepPlan, needs_filter, step_filters

    def plan(kind: str, *specs: SamplingSpec) -> StepPlan:
        reqs = [Request(slot=i, seq=0, request_id=i, prompt=[1], max_new_tokens=4, arrival=i, sampling=s)
                for i, s in enumerate(specs)]
        return StepPlan(kind, [SeqWork(r, 0, 1) for r in reqs])

    plain, sorting = SamplingSpec(temperature=1.0, seed=1), SamplingSpec(temperature=1.0, top_p=0.9, seed=2)
    assert not needs_filter(SamplingSpec())
    assert not step_filters(plan("decode", SamplingSpec(), plain))
    assert step_filters(plan("decode", SamplingSpec(), plain, sorting))
    # a prefill step picks its variant the same way (without chunking the lookup gives the filtering
    # graph for both); a chunk that does not end its prompt samples nothing, so its filters do not count
    assert not step_filters(plan("prefill", SamplingSpec(), plain))
    mid = plan("prefill", plain, sorting)
    mid.work[1].samples = False
    assert not step_filters(mid)
    mid.work[1].samples = True
    assert step_filters(mid)


def test_prefill_never_holds_more_than_a_captured_graph() -> None:
    """With a graph grid whose prefill graphs hold at most 4 prompts, 10 short pending prompts are
    admitted 4 at a time (never more), and all of them in the end."""
    from gpu_engine.kv_cache import BlockAllocator
    from gpu_engine.policy import Policy, Request

    def fits(n: int, tokens: int) -> bool:
        return n <= 4 and tokens <= 96

    policy = Policy(BlockAllocator(1000), 16, max_batch=32, token_budget=96, chunked=False, prefill_fits=fits)
    for i in range(10):
        policy.add(Request(slot=i, seq=0, request_id=i, prompt=[5] * 12, max_new_tokens=4, arrival=i))
    sizes = []
    while len(sizes) < 3:
        plan = policy.schedule()
        assert plan is not None and plan.kind == "prefill"
        sizes.append(len(plan.work))
        assert fits(len(plan.work), sum(w.num_new for w in plan.work))
        for w in plan.work:
            policy.running.append(w.req)
    assert sizes == [4, 4, 2]


def test_no_log_softmax_where_no_row_asks() -> None:
    """A batch where no request wants logprobs skips the log-softmax (a CPU decode step's cost): the tokens are
    those of the full path, the logprobs zero, and no top entries."""
    logits = _logits(3, seed=4)
    specs = [SamplingSpec(), SamplingSpec(temperature=0.7, seed=3), SamplingSpec(temperature=1.5, top_p=0.5, seed=9)]
    steps, seeds = torch.zeros(3, dtype=torch.int64), torch.tensor([0, 3, 9])
    quick = sample(logits, specs, steps, seeds)
    full = sample(logits, [dataclasses.replace(s, want_logprobs=True) for s in specs], steps, seeds)
    assert torch.equal(quick.tokens, full.tokens)
    assert torch.equal(quick.logprobs, torch.zeros(3)) and quick.top_ids.shape == (3, 0)
    assert bool((full.logprobs < 0).all())
