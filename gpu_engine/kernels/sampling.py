"""Sampling on the device with no host round trip, mirroring `gpu_engine.sampling` exactly.

Filtering (top-k, top-p, min-p) runs sort-free by default: `sampling_select.filter_boundary` finds
each row's kept prefix of the temperature-scaled logits as a (key, count) boundary, and the draw
kernel masks tokens by it as it scans (the same tokens as the reference's `filter_logits`).
`sort_free=False` keeps the reference's sort-based torch function, for comparison. `filtered=False`
skips filtering altogether: bit-identical whenever no row sets top-k, top-p or min-p (the filter is
then the identity), which is what a decode graph without such a row runs. The kernel regenerates
the reference's counter hash noise per vocab entry (no [B, V] noise tensor) and takes the
Gumbel-max argmax, lowest index on ties. Rows with temperature <= 0 take the argmax of the
processed logits. Log-probs are of the raw logits, computed only for the rows whose
`want_logprobs` is set (`kernels.logprobs`).

The logits processors (logit bias, min_tokens, repetition / frequency / presence penalties, in
the reference's order, `gpu_engine.sampling.process_logits`) have one arithmetic
(`kernels.processors`) fed two ways: dense per-row columns (`Processors`) that the host stages
(`processor_columns`; at their identity values, bias 0, no counts, nothing seen, repetition 1, they
leave every logit bit for bit as is), or the device state of the persistent scheduler
(`DeviceProcessors`: each row's slot, token history and bias table), which edits only the tokens a
row's processors touch in the temperature-scaled logits, rows without any costing one load.
Greedy rows take their argmax of those scaled logits too (their temperature divisor is 1, exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from gpu_engine.kernels._checks import check
from gpu_engine.kernels.grammar import DeviceGrammar, grammar_mask
from gpu_engine.kernels.logprobs import token_logprobs
from gpu_engine.kernels.processors import DeviceProcessors, dense_processors, device_processors
from gpu_engine.kernels.sampling_select import _key, filter_boundary
from gpu_engine.sampling import History, SamplingSpec, filter_logits

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
def _keep(x, idx, mask, bkey, bcnt, seen):
    """The boundary's mask over one block of a row scanned in index order; `seen`: its ties so far."""
    k = _key(x)
    eq = (k == bkey) & mask
    rank = seen + tl.cumsum(eq.to(tl.int32), axis=0) - 1
    return (k > bkey) | (eq & (rank < bcnt)), seen + tl.sum(eq.to(tl.int32), axis=0)


@triton.jit
def _gumbel_argmax_kernel(raw_ptr, filt_ptr, temp_ptr, seed_ptr, step_ptr, out_ptr, bkey_ptr, bcnt_ptr, V,
                          s_raw, s_filt, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr, BOUNDARY: tl.constexpr):
    b = tl.program_id(0)
    random = tl.load(temp_ptr + b) > 0
    bkey = tl.load(bkey_ptr + b) if BOUNDARY else 0
    bcnt = tl.load(bcnt_ptr + b) if BOUNDARY else 0
    seen = tl.full([], 0, tl.int32)
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
            if BOUNDARY:
                keep, seen = _keep(x, idx, mask, bkey, bcnt, seen)
                x = tl.where(keep, x, float("-inf"))
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


@dataclass(frozen=True, slots=True)
class Processors:
    """Per-row logits-processor columns, on the logits' device."""

    logit_add: torch.Tensor  # [B, V] f32: logit_bias, and -inf on stop / EOS ids below min_tokens
    counts: torch.Tensor  # [B, V] f32: occurrences in the output
    seen: torch.Tensor  # [B, V] f32: 1 where the token is in the prompt or the output
    repetition: torch.Tensor  # [B] f32, 1 = off
    frequency: torch.Tensor  # [B] f32
    presence: torch.Tensor  # [B] f32

    IDENTITY = {"logit_add": 0.0, "counts": 0.0, "seen": 0.0, "repetition": 1.0, "frequency": 0.0,
                "presence": 0.0}

    def rows(self, b: int) -> Processors:
        return Processors(*(getattr(self, f)[:b] for f in self.IDENTITY))

    def check(self, B: int, V: int, dev) -> None:
        for name in ("logit_add", "counts", "seen"):
            check(name, getattr(self, name), dtype=torch.float32, shape=(B, V), device=dev)
        for name in ("repetition", "frequency", "presence"):
            check(name, getattr(self, name), dtype=torch.float32, shape=(B,), device=dev)


def processor_columns(specs: list[SamplingSpec], steps: list[int], history: History, vocab: int) -> dict:
    """Host (CPU) tensors of `Processors`' fields for one step's rows, from the specs and histories."""
    B = len(specs)
    cols = {name: torch.full((B, vocab) if name in ("logit_add", "counts", "seen") else (B,), pad,
                             dtype=torch.float32) for name, pad in Processors.IDENTITY.items()}
    for b, spec in enumerate(specs):
        if spec.logit_bias:
            ids, vals = zip(*spec.logit_bias, strict=True)
            cols["logit_add"][b, list(ids)] = torch.tensor(vals, dtype=torch.float32)
        if steps[b] < spec.min_tokens and (spec.stop_ids or spec.eos_ids):
            cols["logit_add"][b, sorted(t for t in spec.stop_ids | spec.eos_ids if 0 <= t < vocab)] = float("-inf")
        allowed = spec.grammar_allowed(history[b][1], vocab)
        if allowed is not None:
            cols["logit_add"][b, torch.from_numpy(~allowed)] = float("-inf")
        if spec.penalized:
            prompt, output = history[b]
            out = torch.tensor(list(output), dtype=torch.int64)
            cols["counts"][b].index_add_(0, out, torch.ones(len(out)))
            cols["seen"][b, torch.tensor(list(prompt), dtype=torch.int64)] = 1.0
            cols["seen"][b, out] = 1.0
            cols["repetition"][b] = spec.repetition_penalty
            cols["frequency"][b], cols["presence"][b] = spec.frequency_penalty, spec.presence_penalty
    return cols


def apply_processors(logits: torch.Tensor, p: Processors) -> torch.Tensor:
    """The reference's `process_logits` over dense columns, sync-free (capturable); a new tensor."""
    return dense_processors(logits, p.logit_add, p.counts, p.seen, p.repetition, p.frequency, p.presence)


def sample(logits, temperature, top_k, top_p, min_p, seeds, steps, out_tokens, out_logprobs,
           out_top_ids, out_top_logprobs, filtered: bool = True, processors: Processors | None = None,
           want_logprobs: torch.Tensor | None = None, sort_free: bool = True,
           device_procs: DeviceProcessors | None = None, device_grammar: DeviceGrammar | None = None) -> None:
    """One token per row of fp32 `logits` [B, V]; every output is written in place, no sync.

    temperature/top_p/min_p [B] f32, top_k [B] int32, seeds/steps [B] int64 (the reference's `seeds`
    and `steps`); outputs tokens [B] int64, logprobs [B] f32, top ids/logprobs [B, K].
    `filtered=False` ignores top_k/top_p/min_p: only for rows where they are all off
    (`gpu_engine.policy.needs_filter`), for which it gives the same outputs bit for bit.
    `sort_free=False` filters through the reference's sort instead of the boundary search.
    `processors` (rows [B]) applies the logits processors before the draw and the greedy argmax;
    `device_procs` (rows [B]) applies them from the persistent scheduler's device state, and `device_grammar`
    (rows [B]) its grammar masks after them (`kernels.grammar`).
    `want_logprobs` [B] int32 (None: every row) picks the rows whose log-prob outputs are computed;
    the others get zeros.
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
    if processors is not None:
        processors.check(B, V, dev)
    if want_logprobs is None:
        want_logprobs = torch.ones(B, dtype=torch.int32, device=dev)
    check("want_logprobs", want_logprobs, dtype=torch.int32, shape=(B,), device=dev)
    if B == 0:
        return
    proc = logits if processors is None else apply_processors(logits, processors)
    temps = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = proc / temps[:, None]
    if device_procs is not None:
        device_processors(proc, scaled, temps, device_procs)
    if device_grammar is not None:
        grammar_mask(scaled, device_grammar)
    unfiltered = scaled  # what greedy rows take the argmax of (their divisor is 1)
    boundary = filtered and sort_free
    if boundary:
        bkey, bcnt = filter_boundary(scaled, temperature, top_k, top_p, min_p)
    else:
        bkey = bcnt = out_tokens  # not read
        if filtered:
            scaled = filter_logits(scaled, top_k.long(), top_p, min_p)
    _gumbel_argmax_kernel[(B,)](unfiltered, scaled, temperature, seeds, steps, out_tokens, bkey, bcnt, V,
                                unfiltered.stride(0), scaled.stride(0), BLOCK=1024, num_warps=4,
                                LIBDEVICE=logits.is_cuda, BOUNDARY=boundary)
    token_logprobs(logits, want_logprobs, out_tokens, out_logprobs, out_top_ids, out_top_logprobs)
