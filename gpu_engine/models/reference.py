"""A minimal greedy generation loop over the paged cache: the reference the engine is checked against.

All prompts are prefilled together in one packed step, then decoded together one token per step.
Blocks are taken from ``kv_cache.allocator`` as sequences grow and all returned at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_engine.kv_cache import KVCache
from gpu_engine.models.attention import SeqStep, build_metadata
from gpu_engine.models.decoder import CausalLM


@dataclass
class GreedyResult:
    tokens: list[list[int]]  # generated tokens per prompt
    logits: torch.Tensor  # [steps, B, vocab] float32, the logits each token was chosen from


def _grow(kv_cache: KVCache, tables: list[list[int]], lengths: list[int]) -> None:
    for table, length in zip(tables, lengths, strict=True):
        extra = kv_cache.blocks_needed(length) - len(table)
        if extra > 0:
            table.extend(kv_cache.allocator.allocate(extra))


def greedy_generate(model: CausalLM, kv_cache: KVCache, prompts: list[list[int]],
                    max_new_tokens: int) -> GreedyResult:
    """Greedy-decode ``max_new_tokens`` tokens for every prompt (no stop tokens)."""
    device = kv_cache.k[0].device
    tables: list[list[int]] = [[] for _ in prompts]
    cached = [0] * len(prompts)
    step_ids = [list(p) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    all_logits = []
    try:
        for _ in range(max_new_tokens):
            _grow(kv_cache, tables, [c + len(s) for c, s in zip(cached, step_ids, strict=True)])
            steps = [SeqStep(c, len(s), t) for c, s, t in zip(cached, step_ids, tables, strict=True)]
            meta = build_metadata(steps, kv_cache.block_size, device)
            ids = torch.tensor([t for s in step_ids for t in s], dtype=torch.int64, device=device)
            logits = model(ids, meta, kv_cache)
            all_logits.append(logits.cpu())
            chosen = torch.argmax(logits, dim=-1).tolist()
            for b, tok in enumerate(chosen):
                cached[b] += len(step_ids[b])
                step_ids[b] = [tok]
                out[b].append(tok)
    finally:
        for table in tables:
            kv_cache.allocator.free(table)
    return GreedyResult(out, torch.stack(all_logits) if all_logits else torch.empty(0))
