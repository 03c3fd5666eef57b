"""Runs one step plan of the policy through the PyTorch model: the CPU backend's model runner."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np
import torch

from gpu_engine.kv_cache import KVCache
from gpu_engine.models.attention import SeqStep, build_metadata
from gpu_engine.models.decoder import CausalLM
from gpu_engine.policy import StepPlan
from gpu_engine.prompt_logprobs import PromptLogprobs, fetch, prompt_spans, score_spans
from gpu_engine.sampling import SamplingSpec, sample


@dataclasses.dataclass(slots=True)
class StepOutput:
    tokens: list[int]
    logprobs: np.ndarray        # [B] float32, chosen token
    top_ids: np.ndarray         # [B, K] int32
    top_logprobs: np.ndarray    # [B, K] float32
    prompt: list[PromptLogprobs] = dataclasses.field(default_factory=list)  # of the rows that asked
    # rows whose request failed alone (the device ran out of memory for its prompt log-probs): the engine ends them
    failed: tuple[int, ...] = ()
    # the tokens the step's graph computed, the step's own and its padding (0: no graph, nothing padded);
    # RingHeader.padded_tokens counts what exceeds the plan's tokens
    graph_tokens: int = 0


class Runner(Protocol):
    """What the engine needs from a backend: run a plan, return one sampled token per sequence."""

    def run(self, plan: StepPlan) -> StepOutput: ...


def step_inputs(plan: StepPlan) -> tuple[list[SeqStep], list[int]]:
    """The attention layout of each sequence in the step, and the token ids the step feeds, packed."""
    steps = [SeqStep(w.num_cached, w.num_new, w.req.blocks) for w in plan.work]
    ids: list[int] = []
    for w in plan.work:
        ids += w.req.tokens[w.num_cached : w.num_cached + w.num_new]
    return steps, ids


class TorchRunner:
    """Packs a plan into one forward pass (prefills packed without padding, or a decode batch)."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, top_k_max: int = 20) -> None:
        self.model = model
        self.kv = kv_cache
        self.device = next(model.parameters()).device
        self.top_k_max = top_k_max
        self.greedy_tail = True  # steps whose every row is ``plain_greedy`` skip ``sample`` (off: for comparisons)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepOutput:
        steps, ids = step_inputs(plan)
        meta = build_metadata(steps, self.kv.block_size, self.device)
        hidden = self.model.hidden_states(torch.tensor(ids, dtype=torch.int64, device=self.device), meta, self.kv)
        rows = [b for b, w in enumerate(plan.work) if w.samples]  # a chunk short of its prompt's end samples nothing
        last = meta.cu_seqlens_q[1:].long() - 1  # each sequence's last packed token
        if self.greedy_tail and all(plain_greedy(w.req.sampling) for w in plan.work):
            return self._greedy(plan, hidden, rows, last)
        logits = self.model.logits_at(hidden, last)
        work = [plan.work[b] for b in rows]
        specs = [w.req.sampling for w in work]
        positions = torch.tensor([len(w.req.output) for w in work], dtype=torch.int64)
        seeds = torch.tensor([s.seed for s in specs], dtype=torch.int64)
        history = [(w.req.prompt, w.req.output) for w in work]
        res = sample(logits[rows].float(), specs, positions, seeds, history)
        n, k = len(plan.work), res.top_ids.shape[1]
        out = StepOutput(tokens=[-1] * n, logprobs=np.zeros(n, np.float32), top_ids=np.zeros((n, k), np.int32),
                         top_logprobs=np.zeros((n, k), np.float32))
        for b, t in zip(rows, res.tokens.tolist(), strict=True):
            out.tokens[b] = int(t)
        out.logprobs[rows] = res.logprobs.float().cpu().numpy()
        out.top_ids[rows] = res.top_ids.to(torch.int32).cpu().numpy()
        out.top_logprobs[rows] = res.top_logprobs.float().cpu().numpy()

        def logits_of(first: int, n: int) -> torch.Tensor:
            return self.model.logits_at(hidden, torch.arange(first, first + n, device=self.device))

        out.prompt = fetch(score_spans(prompt_spans(plan), logits_of))
        return out

    def _greedy(self, plan: StepPlan, hidden: torch.Tensor, rows: list[int], last: torch.Tensor) -> StepOutput:
        """A step whose every row is ``plain_greedy``: each sampling row's argmax token (``CausalLM.greedy_at``,
        the tokens ``sample`` picks there), zero log-probs and no alternatives, as ``sample`` gives when no row
        asks for them."""
        n = len(plan.work)
        out = StepOutput(tokens=[-1] * n, logprobs=np.zeros(n, np.float32), top_ids=np.zeros((n, 0), np.int32),
                         top_logprobs=np.zeros((n, 0), np.float32))
        if not rows:
            return out
        # one token per sequence, every one sampling: hidden's rows as they are
        every = len(rows) == n and hidden.shape[0] == n
        tokens = self.model.greedy_at(hidden, None if every else last[rows].tolist())
        for b, t in zip(rows, tokens, strict=True):
            out.tokens[b] = int(t)
        return out


def plain_greedy(spec: SamplingSpec) -> bool:
    """Whether ``sample`` takes this row's token as the argmax of its raw logits and returns nothing else: greedy,
    no logits processor, no log-probs of the output or of the prompt."""
    return (not spec.temperature > 0 and not spec.processed and spec.num_top_logprobs == 0 and not spec.want_logprobs
            and spec.prompt_logprobs < 0)
