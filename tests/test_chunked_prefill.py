"""Chunked prefill: the policy's budget and FCFS chunks, and the CPU engine through a ring with prompts
much longer than the budget: same greedy tokens as without chunking, preemption and cancellation
mid-prefill, every block returned, and other streams served while a long prompt prefills."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.ring_engine import RingHarness

from gpu_engine.kv_cache import BlockAllocator
from gpu_engine.policy import Finish, Phase, Policy, Request, StepPlan
from gpu_engine.runner import Runner, StepOutput
from shared import ring_layout as L
from shared.config import EngineConfig
from shared.ring import RingGeometry

transformers = pytest.importorskip("transformers")
S = L.SlotState
GEO = RingGeometry(16, 240, 32, 4)
LONG = [list(np.random.default_rng(k).integers(3, 200, size=40 + 23 * k)) for k in range(8)]  # 40..201 tokens


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(11)
    cfg = transformers.LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=320,
                                   initializer_range=0.3, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("tiny_llama_chunked")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def _fresh_seed() -> Iterator[None]:
    torch.manual_seed(0)
    yield


class Harness(RingHarness):
    """The CPU engine through a private ring, keeping every plan the policy made."""

    def __init__(self, model: Path | None, kv_blocks: int, budget: int, chunked: bool = True,
                 geometry: RingGeometry = GEO, max_batch: int = 8, block_size: int = 4, dtype: str = "float32",
                 prefix_caching: bool = True) -> None:
        super().__init__(EngineConfig(ring_name="local", model=None if model is None else str(model),
                                      geometry=geometry, kv_blocks=kv_blocks, block_size=block_size,
                                      max_batch=max_batch, dtype=dtype, max_num_batched_tokens=budget,
                                      no_enable_chunked_prefill=not chunked,
                                      no_enable_prefix_caching=not prefix_caching))
        self.plans: list[StepPlan] = []
        schedule = self.policy.schedule

        def recording() -> StepPlan | None:  # keeps each plan for the assertions; the policy decides
            plan = schedule()
            if plan is not None:
                self.plans.append(plan)
            return plan

        self.policy.schedule = recording  # type: ignore[method-assign]

    def check_blocks_returned(self) -> None:
        super().check_blocks_returned()
        assert self.policy.num_unfinished == 0 and self.policy.partial is None


def run_together(h: Harness, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    for i, p in enumerate(prompts):
        h.submit(i, p, max_new, ignore_eos=True)
    h.run()
    return [h.result(i)[0] for i in range(len(prompts))]


def check_plans(h: Harness) -> None:
    """Every step: within the budget and the batch, the decodes first, at most one chunk cut short."""
    for plan in h.plans:
        assert plan.num_tokens <= h.policy.token_budget and len(plan.work) <= h.policy.max_batch
        kinds = [w.prefill for w in plan.work]
        assert kinds == sorted(kinds), "decode rows come before the prompt chunks"
        assert sum(1 for w in plan.work if not w.samples) <= 1
        assert all(w.samples for w in plan.work[:-1]), "only the step's last chunk may stop short of its prompt"


def test_greedy_tokens_identical_with_chunking_on_and_off(tiny_llama: Path) -> None:
    whole = run_together(Harness(tiny_llama, kv_blocks=512, budget=0, chunked=False), LONG, 12)
    h = Harness(tiny_llama, kv_blocks=512, budget=16)
    assert run_together(h, LONG, 12) == whole
    assert all(len(o) == 12 for o in whole)
    cut = [w for plan in h.plans for w in plan.work if not w.samples]
    assert len(cut) >= sum(len(p) // 16 for p in LONG) - len(LONG), "prompts of up to 201 tokens took many chunks"
    assert any(plan.kind == "prefill" and not plan.work[0].prefill for plan in h.plans), "no mixed step was run"
    check_plans(h)
    h.check_blocks_returned()


def test_preemption_mid_prefill_keeps_tokens_and_returns_blocks(tiny_llama: Path) -> None:
    whole = run_together(Harness(tiny_llama, kv_blocks=512, budget=0, chunked=False), LONG, 12)
    h = Harness(tiny_llama, kv_blocks=60, budget=16)  # 240 token slots; the longest request needs 213
    victims: list[bool] = []
    preempt = h.policy._preempt

    def watching(req: Request) -> None:  # records whether the victim was the partial prefill
        victims.append(req is h.policy.partial)
        preempt(req)

    h.policy._preempt = watching  # type: ignore[method-assign]
    assert run_together(h, LONG, 12) == whole
    assert any(victims), "no partial prefill was preempted"
    check_plans(h)
    h.check_blocks_returned()


def test_cancellation_mid_prefill_frees_its_blocks(tiny_llama: Path) -> None:
    h = Harness(tiny_llama, kv_blocks=512, budget=16)
    h.submit(0, LONG[7], 8, ignore_eos=True)
    h.submit(1, LONG[0][:10], 8, ignore_eos=True)
    for _ in range(4):
        h.engine.step()
    partial = h.policy.partial
    assert partial is not None and partial.slot == 0 and 0 < partial.num_cached < len(LONG[7])
    assert partial.blocks, "a partial prefill holds the blocks of its chunks"
    assert h.writer.cancel(0, h.seqs[0])
    h.run()
    assert h.result(0)[1] == Finish.CANCELLED
    out, reason = h.result(1)
    assert len(out) == 8 and reason == Finish.LENGTH
    h.check_blocks_returned()


def test_policy_keeps_its_rules_over_5000_random_requests() -> None:
    """The policy alone (no model): random prompts, outputs, cancellations and a cache small enough to
    preempt; every step within the budget, FCFS chunks, and at the end every block free."""
    rng = random.Random(5)
    alloc = BlockAllocator(300)
    policy = Policy(alloc, 4, max_batch=16, token_budget=48)
    done, arrival, steps, mid_cancels = 0, 0, 0, 0
    holders: dict[int, Request] = {}
    while done < 5000:
        for _ in range(rng.randint(0, 3) if arrival < 5000 else 0):
            req = Request(slot=arrival, seq=0, request_id=arrival, prompt=[5] * rng.randint(1, 300),
                          max_new_tokens=rng.randint(1, 40), arrival=arrival)
            assert policy.can_ever_fit(len(req.prompt), req.max_new_tokens)
            policy.add(req)
            arrival += 1
        if policy.partial is not None and rng.random() < 0.02:
            policy.finish(policy.partial, Finish.CANCELLED)
            mid_cancels += 1
            done += 1
        plan = policy.schedule()
        if plan is None:
            continue
        steps += 1
        assert plan.num_tokens <= 48 and len(plan.work) <= 16
        # blocks go only to the requests a plan schedules: those not finished hold every block not free
        holders.update((w.req.request_id, w.req) for w in plan.work)
        holders = {k: r for k, r in holders.items() if r.phase != Phase.FINISHED}
        assert sum(len(r.blocks) for r in holders.values()) + alloc.num_free == 300
        for w in plan.work:
            assert len(w.req.blocks) * 4 >= w.num_cached + w.num_new
        results = policy.commit(plan, [7] * len(plan.work), eos_ids=())
        done += sum(1 for _, _, reason in results if reason != Finish.NONE)
    assert policy.num_unfinished == 0 and alloc.num_free == 300
    assert policy.preemptions > 0 and mid_cancels > 0 and steps > 5000


def test_short_streams_keep_receiving_tokens_while_a_long_prompt_prefills() -> None:
    """The embedded model: a 2,048-token prompt arrives while 4 short streams decode. Its prefill is
    cut into chunks that share steps with the streams, so every stream gets a token in every step of the
    long prompt's prefill (counted in engine steps, not seconds: a busy host slows every step alike). The
    prompt is 16 budgets long (2,048 tokens in chunks of 128); ``test_long_prompt_serve`` sends 4,096
    through the server."""
    geo = RingGeometry(8, 4096, 128, 4)
    h = Harness(None, kv_blocks=0, budget=128, geometry=geo, block_size=16, dtype="auto")
    for i in range(4):
        h.submit(i, [1, 28, 1234 + i, 77, 13, 29, 9, 512], 100, ignore_eos=True)
    while min(int(h.ring.slots[i]["generated"]) for i in range(4)) < 2:
        h.engine.step()
    h.submit(4, list(np.random.default_rng(3).integers(100, 40000, size=2048)), 4, ignore_eos=True)
    steps, got = 0, {i: [] for i in range(4)}  # per stream, how many tokens each step of the prefill gave it
    counts = {i: int(h.ring.slots[i]["generated"]) for i in range(4)}
    while int(h.ring.slots[4]["generated"]) == 0:
        h.engine.step()
        steps += 1
        for i in range(4):
            n = int(h.ring.slots[i]["generated"])
            got[i].append(n - counts[i])
            counts[i] = n
    assert steps >= 16, f"a 2,048-token prompt prefilled in {steps} steps of a 128-token budget"
    assert all(given == [1] * steps for given in got.values()), f"tokens a step, per stream: {got}"
    h.run()
    assert all(len(h.result(i)[0]) == 100 for i in range(4))
    assert len(h.result(4)[0]) == 4
    check_plans(h)
    h.check_blocks_returned()


def test_budget_and_step_fill_reach_the_metrics(tiny_llama: Path) -> None:
    """The engine publishes its token budget and how full each step was; /metrics shows them as a gauge,
    a histogram of tokens / budget and a count of full steps."""
    from shared.metrics import FrontendMetrics

    h = Harness(tiny_llama, kv_blocks=512, budget=16)
    run_together(h, LONG[:3], 4)
    h.engine.publish_stats()
    stats = h.ring.read_header()["stats"]
    fill = [int(c) for c in stats["step_fill"]]
    assert int(stats["token_budget"]) == 16 and sum(fill) == len(h.plans) == h.engine.steps
    assert fill[6] == sum(1 for p in h.plans if p.num_tokens == 16) > 0
    assert fill[0] == sum(1 for p in h.plans if p.num_tokens == 1) > 0  # one decode of a 16-token budget
    text = FrontendMetrics("m").render(stats).decode()
    assert 'blink:engine_token_budget{model_name="m"} 16.0' in text
    assert f'blink:engine_step_budget_use_bucket{{le="+Inf",model_name="m"}} {float(sum(fill))}' in text
    assert f'blink:engine_step_budget_use_bucket{{le="0.0625",model_name="m"}} {float(fill[0])}' in text
    assert f'blink:engine_steps_budget_full_total{{model_name="m"}} {float(fill[6])}' in text


class PaddingRunner:
    """The CPU runner as if each step ran a graph of the next multiple of 16 tokens (``StepOutput.graph_tokens``)."""

    def __init__(self, inner: Runner) -> None:
        self.inner = inner

    def run(self, plan: StepPlan) -> StepOutput:
        return dataclasses.replace(self.inner.run(plan), graph_tokens=-(-plan.num_tokens // 16) * 16)


@pytest.mark.parametrize("padded", [False, True])
def test_step_tokens_and_padding_reach_the_metrics(tiny_llama: Path, padded: bool) -> None:
    """The engine counts the tokens its steps carried and those their graphs computed past them (none on the CPU
    runner, which runs each step at its own size); the gateway reads both from the ring header, and /metrics
    shows them as counters."""
    from dpu_gateway.engines import ring_view, total_stats
    from shared.metrics import FrontendMetrics

    h = Harness(tiny_llama, kv_blocks=512, budget=16)
    if padded:
        h.engine.runner = PaddingRunner(h.engine.runner)
    run_together(h, LONG[:3], 4)
    h.engine.publish_stats()
    real = sum(p.num_tokens for p in h.plans)
    pad = sum(-(-p.num_tokens // 16) * 16 - p.num_tokens for p in h.plans) if padded else 0
    assert real == sum(len(p) for p in LONG[:3]) + 3 * 3 and (pad > 0) == padded  # prompts, then 3 decodes each
    assert h.ring.header_load64("step_tokens") == real and h.ring.header_load64("padded_tokens") == pad
    stats = total_stats([ring_view(0, h.ring, 10.0, with_slots=False)])
    assert stats is not None and (stats["step_tokens"], stats["padded_tokens"]) == (real, pad)
    text = FrontendMetrics("m").render(stats).decode()
    assert f'blink:step_tokens_total{{model_name="m"}} {float(real)}' in text
    assert f'blink:padded_tokens_total{{model_name="m"}} {float(pad)}' in text
