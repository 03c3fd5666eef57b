"""One random Llama-shaped model through two GPU runners, one over a KV cache of the model's dtype and one over an
FP8 cache (``--kv-cache-dtype fp8``), step by step on the same tokens: the logits of both at every step, and whether
their greedy tokens agree (tests/test_fp8_kv_config.py on the CPU, tests/gpu/test_gpu_fp8_kv.py at real sizes).

The logits' bound (``logit_bound``). Reading K/V from e4m3 moves each attention output by at most
(exp(2E) - 1 + u) max|v| + 2^-10 s_v, with u = 2^-4 and E the largest score times u
(tests/test_kernels_fp8_kv.py derives it). For a random model at its initial scale the scores stay below 1/2 in size,
so exp(2E) - 1 <= exp(u) - 1 < 1.04 u and an attention output moves by at most about 2u of its values' size. To first
order each layer's move reaches the logits through the residual stream with a gain of at most 1 (random weights of
std 0.02 shrink what they multiply), and the layers' moves add: the logits move by at most 2u L max|logit| for L
layers, which is what the tests hold them to. Greedy tokens agree wherever the top two logits are further apart than
twice that; the tests ask it of most steps (a near tie may flip).
"""

from __future__ import annotations

import torch

U = 2.0**-4


def logit_bound(num_layers: int, logits: torch.Tensor) -> float:
    return 2 * U * num_layers * float(logits.float().abs().max())


def steps(num_seqs: int, prompt: int, decodes: int, block_size: int) -> list[list[tuple[int, int, list[int]]]]:
    """A prefill of `num_seqs` prompts of `prompt` tokens, then `decodes` decode steps; each sequence owns the blocks
    its whole length needs."""
    per_seq = -(-(prompt + decodes) // block_size)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(num_seqs)]
    out = [[(0, prompt, tables[b]) for b in range(num_seqs)]]
    out += [[(prompt + i, 1, tables[b]) for b in range(num_seqs)] for i in range(decodes)]
    return out


def compare(plain, fp8, num_seqs: int, prompt: int, decodes: int, vocab: int, device: str, seed: int = 0):
    """Both runners through the same steps, the plain runner's greedy tokens fed to both: [(plain logits, fp8
    logits)] a step (float32, on the CPU)."""
    from gpu_engine.models.attention import build_metadata

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (num_seqs * prompt,), generator=g)
    bs, out = plain.kv.block_size, []
    for i, seqs in enumerate(steps(num_seqs, prompt, decodes, bs)):
        meta = build_metadata(seqs, bs, device=device)
        tokens = len(ids)
        pair = []
        for runner in (plain, fp8):
            runner.stage(ids.to(device), meta)
            runner.forward(num_seqs, tokens, i > 0)
            pair.append(runner.buffers.logits[:num_seqs].float().cpu().clone())
        out.append((pair[0], pair[1]))
        ids = pair[0].argmax(-1)
    return out
