"""Sampling on the device with no host round trip, mirroring `gpu_engine.sampling` exactly.

Filtering (top-k, top-p, min-p) reuses the reference's torch function (sort-based, sync-free) on
the temperature-scaled logits. `filtered=False` skips it: the sort-free variant, bit-identical
whenever no row sets top-k, top-p or min-p (the filter is then the identity), which is what a
decode graph without such a row runs. The kernel regenerates the reference's counter hash noise
per vocab entry (no [B, V] noise tensor) and takes the Gumbel-max argmax, lowest index on ties.
Rows with temperature <= 0 take the argmax of the raw logits. Log-probs are of the raw logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from gpu_engine.kernels._checks import check
from gpu_engine.sampling import filter_logits

_M32 = 0xFFFFFFFF


@triton.jit
def _fmix32(x):
    x ^= x >> 16
    x *= 0x85EBCA6B
    x ^= x >> 13
    x *= 0xC2B2AE35
    x ^= x >> 16
    return x


@triton.jit
def _gumbel_argmax_kernel(raw_ptr, filt_ptr, temp_ptr, seed_ptr, step_ptr, out_ptr, V, s_raw, s_filt,
                          BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    b = tl.program_id(0)
    random = tl.load(temp_ptr + b) > 0
    seed = tl.load(seed_ptr + b)
    s_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    s_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key = _fmix32(s_lo ^ _fmix32(s_hi ^ 0x243F6A88))
    step = (tl.load(step_ptr + b) & 0xFFFFFFFF).to(tl.uint32)
    kn = _fmix32(key ^ _fmix32(step ^ 0x85A308D3))
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], 2147483647, tl.int32)
    for v0 in range(0, V, BLOCK):
        idx = v0 + tl.arange(0, BLOCK)
        mask = idx < V
        if random:
            h = _fmix32(kn ^ (idx.to(tl.uint32) * 0x9E3779B1))
            u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
            x = tl.load(filt_ptr + b * s_filt + idx, mask=mask, other=float("-inf"))
            if LIBDEVICE:
                x = x - libdevice.log(-libdevice.log(u))
            else:
                x = x - tl.log(-tl.log(u))
        else:
            x = tl.load(raw_ptr + b * s_raw + idx, mask=mask, other=float("-inf"))
        x = tl.where(mask, x, float("-inf"))
        better = (x > best_val) | ((x == best_val) & (idx < best_idx))
        best_val = tl.where(better, x, best_val)
        best_idx = tl.where(better, idx, best_idx)
    top = tl.max(best_val, axis=0)
    winner = tl.min(tl.where(best_val == top, best_idx, 2147483647), axis=0)
    tl.store(out_ptr + b, winner.to(tl.int64))


def sample(logits, temperature, top_k, top_p, min_p, seeds, steps, out_tokens, out_logprobs,
           out_top_ids, out_top_logprobs, filtered: bool = True) -> None:
    """One token per row of fp32 `logits` [B, V]; every output is written in place, no sync.

    temperature/top_p/min_p [B] f32, top_k [B] int32, seeds/steps [B] int64 (the reference's `seeds`
    and `steps`); outputs tokens [B] int64, logprobs [B] f32, top ids/logprobs [B, K].
    `filtered=False` ignores top_k/top_p/min_p (no sort): only for rows where they are all off
    (`gpu_engine.policy.needs_filter`), for which it gives the same outputs bit for bit.
    """
    check("logits", logits, dtype=torch.float32, shape=(None, None))
    B, V = logits.shape
    dev = logits.device
    for name, t, dt in (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int32),
                        ("top_p", top_p, torch.float32), ("min_p", min_p, torch.float32),
                        ("seeds", seeds, torch.int64), ("steps", steps, torch.int64),
                        ("out_tokens", out_tokens, torch.int64), ("out_logprobs", out_logprobs, torch.float32)):
        check(name, t, dtype=dt, shape=(B,), device=dev)
    check("out_top_ids", out_top_ids, dtype=torch.int64, shape=(B, None), device=dev)
    check("out_top_logprobs", out_top_logprobs, dtype=torch.float32, shape=tuple(out_top_ids.shape), device=dev)
    if B == 0:
        return
    temps = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits / temps[:, None]
    if filtered:
        scaled = filter_logits(scaled, top_k.long(), top_p, min_p)
    _gumbel_argmax_kernel[(B,)](logits, scaled, temperature, seeds, steps, out_tokens, V,
                                logits.stride(0), scaled.stride(0), BLOCK=1024, num_warps=4,
                                LIBDEVICE=logits.is_cuda)
    logp = torch.log_softmax(logits, dim=-1)
    out_logprobs.copy_(logp.gather(-1, out_tokens[:, None]).squeeze(1))
    k = out_top_ids.shape[1]
    if k:
        vals, ids = torch.topk(logp, k, dim=-1)
        out_top_ids.copy_(ids)
        out_top_logprobs.copy_(vals)
