"""Prompt log-probs: for every prompt token of a request that asks, its log-prob and rank under the raw
distribution the model gave at the position before it, and that distribution's top k.

Written once for the Python-driven backends: ``prompt_spans`` says which packed tokens of a step predict a
prompt token of such a request, ``score_spans`` turns their logits into entries on the logits' device without
waiting for them (the host-driven GPU runner enqueues them inside its bounded step wait), ``fetch`` copies
them to the host. Each runner only says how to get the logits of given packed tokens (the CPU model's hidden
states, or the host-driven GPU runner's kept final hidden states) and computes nothing for a step without
such a request.

The log-probs are those of the raw logits, before temperature, penalties, bias and grammar, as vLLM's
default ``logprobs_mode``. The rank is vLLM's: the number of vocabulary tokens at least as likely as the
prompt token, itself included (1: no other token is as likely; a tie counts against it). Entries are written
only until the request's first output token is published (``not req.output``): a chunk computed again after
a preemption rewrites what no reader has seen yet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from gpu_engine.policy import StepPlan

PIECE = 256  # positions scored at once: bounds the [positions, vocab] float32 temporaries


@dataclasses.dataclass(frozen=True, slots=True)
class PromptSpan:
    """The tokens of one step row that predict prompt tokens: packed tokens ``first .. first + len(targets)``
    give the distributions of prompt positions ``start .. start + len(targets)``."""

    row: int
    first: int
    start: int
    targets: tuple[int, ...]
    k: int  # alternatives per position


@dataclasses.dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """One span's entries, position ``start`` first."""

    row: int
    start: int
    logprobs: np.ndarray      # [n] float32
    ranks: np.ndarray         # [n] int32
    top_ids: np.ndarray       # [n, k] int32, best first
    top_logprobs: np.ndarray  # [n, k] float32


def prompt_spans(plan: StepPlan) -> list[PromptSpan]:
    """The spans of a step's prompt chunks whose request asked for prompt log-probs (none: nothing to do)."""
    spans, first = [], 0
    for b, w in enumerate(plan.work):
        req, k = w.req, w.req.sampling.prompt_logprobs
        if w.prefill and k >= 0 and not req.output:
            lo, hi = w.num_cached, min(w.num_cached + w.num_new, len(req.prompt) - 1)  # token q predicts q + 1
            if hi > lo:
                spans.append(PromptSpan(b, first, lo + 1, tuple(req.prompt[lo + 1 : hi + 1]), k))
        first += w.num_new
    return spans


def score(logits: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """(log-prob, rank, top ids, top log-probs) of ``targets`` [n] under ``logits`` [n, V]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    actual = logp.gather(1, targets[:, None])
    ranks = (logp >= actual).sum(dim=1)  # vLLM's batched_count_greater_than: ties count against the token
    top_logprobs, top_ids = torch.topk(logp, k, dim=-1)
    return actual.squeeze(1), ranks, top_ids, top_logprobs


@dataclasses.dataclass(frozen=True, slots=True)
class Scored:
    """One span's entries as ``score`` left them, on the logits' device, perhaps not computed yet."""

    row: int
    start: int
    columns: tuple[torch.Tensor, ...]  # log-probs, ranks, top ids, top log-probs


def score_spans(spans: list[PromptSpan], logits_of: Callable[[int, int], torch.Tensor]) -> list[Scored]:
    """Every span's entries, enqueued without a synchronization; ``logits_of(first, n)`` gives the logits
    [n, V] of packed tokens ``first .. first + n``, asked PIECE positions at a time."""
    out = []
    for s in spans:
        parts = []
        for a in range(0, len(s.targets), PIECE):
            n = min(PIECE, len(s.targets) - a)
            logits = logits_of(s.first + a, n)
            targets = torch.tensor(s.targets[a : a + n], dtype=torch.int64).to(logits.device, non_blocking=True)
            parts.append(score(logits, targets, s.k))
        out.append(Scored(s.row, s.start, tuple(torch.cat(col) for col in zip(*parts, strict=True))))
    return out


def fetch(scored: list[Scored]) -> list[PromptLogprobs]:
    """The entries on the host (a device's once its step completed)."""
    out = []
    for s in scored:
        lp, rank, ids, top = (c.cpu().numpy() for c in s.columns)
        out.append(PromptLogprobs(s.row, s.start, lp.astype(np.float32), rank.astype(np.int32), ids.astype(np.int32),
                                  top.astype(np.float32)))
    return out
