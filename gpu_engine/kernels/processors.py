"""The logits processors on the device: one definition of their arithmetic, two ways to feed it.

The arithmetic (`_processed`, per logit, the reference's order, `gpu_engine.sampling.process_row`):
add the bias; a token banned below `min_tokens` becomes -inf; a token seen in the prompt or the
output has a positive logit divided by the repetition penalty, a negative one multiplied; a token
in the output loses `frequency * count`, then `presence`. Every operation rounds once (IEEE, no
fused multiply-add and no approximate division on the GPU), as torch's do, so the result is the
reference's bit for bit.

- **Dense** (`dense_processors`, the host-driven backend): per-row [B, V] columns that the host
  builds each step (`sampling.Processors`); every logit goes through `_processed`.
- **From device state** (`device_processors`, the persistent backend): nothing is built per step
  on the host. Each row names its ring slot in `proc_rows` (staged by the CUDA scheduler, -1: no
  processor); its token history (prompt then outputs, kept by the scheduler in `history`) and its
  logit-bias table (copied from the ring at admission into `bias_tokens` / `bias_values`) are read
  where they are. One program per row marks the tokens it touches in a zero-at-rest scratch word
  each (output count, prompt bit, ban bit, bias entry), then takes each word back by atomic
  exchange: the one lane that gets it non-zero writes `_processed(raw) / T` into the row's
  temperature-scaled logits, and the scratch is zero again. A row costs O(history + bias + bans);
  a row without processors costs one load (the masked path: no graph variant, no [B, V] pass).

  Counts are rebuilt from the history at every step rather than kept per slot: a cancelled,
  preempted (recomputed: its outputs stay in the history) or reused slot can hold no stale count,
  because there is none to hold; `hist_len` and `n_bias` bound what is read of a slot's rows, so
  a previous request's tokens and bias entries past them are never seen.

`proc_rows` columns ([max_batch, PROC_COLS] int32; the layout is `schema/sched_structs.py`'s):
slot (-1: off), prompt_len, hist_len (0 unless a penalty is on), n_bias, n_ban, then up to
PROC_MAX_BAN banned ids (the stop ids and EOS while fewer than min_tokens were generated).
`proc_penalties` [max_batch, 3] f32: repetition (1: off), frequency, presence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from gpu_engine.gpu.sched_structs import PROC_BAN_COL, PROC_COLS, PROC_MAX_BAN
from gpu_engine.kernels._checks import check
from gpu_engine.sampling import SamplingSpec

# The scratch word of one (row, token): output count in the low bits, then the flags.
COUNT_BITS = 16
PROMPT_BIT = 1 << 16
BAN_BIT = 1 << 17
BIAS_SHIFT = 18  # bias entry index + 1 in bits 18..27
BIAS_MASK = (1 << 10) - 1
MAX_COUNT = (1 << COUNT_BITS) - 1


@triton.jit
def _add(a, b, LIBDEVICE: tl.constexpr):
    return libdevice.add_rn(a, b) if LIBDEVICE else a + b


@triton.jit
def _sub(a, b, LIBDEVICE: tl.constexpr):
    return libdevice.sub_rn(a, b) if LIBDEVICE else a - b


@triton.jit
def _mul(a, b, LIBDEVICE: tl.constexpr):
    return libdevice.mul_rn(a, b) if LIBDEVICE else a * b


@triton.jit
def _div(a, b, LIBDEVICE: tl.constexpr):
    return libdevice.div_rn(a, b) if LIBDEVICE else a / b


@triton.jit
def _processed(x, bias, banned, seen, count, rep, freq, pres, LIBDEVICE: tl.constexpr):
    """One logit after its processors (module docstring); `count` f32 output occurrences."""
    x = _add(x, bias, LIBDEVICE)
    x = tl.where(banned, float("-inf"), x)
    x = tl.where(seen, tl.where(x > 0, _div(x, rep, LIBDEVICE), _mul(x, rep, LIBDEVICE)), x)
    x = _sub(x, _mul(freq, count, LIBDEVICE), LIBDEVICE)
    return _sub(x, _mul(pres, (count > 0).to(tl.float32), LIBDEVICE), LIBDEVICE)


# ------------------------------------------------------------------ dense columns (host-driven)
@triton.jit
def _dense_kernel(x_ptr, add_ptr, cnt_ptr, seen_ptr, rep_ptr, freq_ptr, pres_ptr, out_ptr, V, s_x, s_add, s_out,
                  BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    b = tl.program_id(0)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = idx < V
    x = tl.load(x_ptr + b * s_x + idx, mask=m)
    add = tl.load(add_ptr + b * s_add + idx, mask=m)
    cnt = tl.load(cnt_ptr + b * s_add + idx, mask=m)
    seen = tl.load(seen_ptr + b * s_add + idx, mask=m) > 0
    rep, freq, pres = tl.load(rep_ptr + b), tl.load(freq_ptr + b), tl.load(pres_ptr + b)
    y = _processed(x, add, False, seen, cnt, rep, freq, pres, LIBDEVICE)
    tl.store(out_ptr + b * s_out + idx, y, mask=m)


def dense_processors(logits: torch.Tensor, logit_add: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor,
                     repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """`logits` [B, V] f32 through the dense columns ([B, V] f32 each, [B] f32 penalties); a new tensor."""
    check("logits", logits, dtype=torch.float32, shape=(None, None))
    B, V = logits.shape
    for name, t in (("logit_add", logit_add), ("counts", counts), ("seen", seen)):
        check(name, t, dtype=torch.float32, shape=(B, V), device=logits.device)
    if not (logit_add.stride() == counts.stride() == seen.stride()) or logit_add.stride(1) != 1:
        raise ValueError("logit_add, counts and seen must share one row-major layout")
    for name, t in (("repetition", repetition), ("frequency", frequency), ("presence", presence)):
        check(name, t, dtype=torch.float32, shape=(B,), device=logits.device)
    out = torch.empty_like(logits)
    if B:
        BLOCK = 1024
        _dense_kernel[(B, triton.cdiv(V, BLOCK))](logits, logit_add, counts, seen, repetition, frequency, presence,
                                                  out, V, logits.stride(0), logit_add.stride(0), out.stride(0),
                                                  BLOCK=BLOCK, LIBDEVICE=logits.is_cuda)
    return out


# ------------------------------------------------------------------ from device state (persistent)
@dataclass(frozen=True, slots=True)
class DeviceProcessors:
    """What `device_processors` reads: the staged rows and the slot-indexed tables (module docstring)."""

    rows: torch.Tensor  # [B, PROC_COLS] int32
    penalties: torch.Tensor  # [B, 3] f32: repetition, frequency, presence
    history: torch.Tensor  # [num_slots, max_context] int32: prompt then outputs
    bias_tokens: torch.Tensor  # [num_slots, max_bias] int32, ascending within a request's n_bias
    bias_values: torch.Tensor  # [num_slots, max_bias] f32
    scratch: torch.Tensor  # [>= B, V] int32, zero at rest

    def check(self, B: int, V: int, dev) -> None:
        check("proc_rows", self.rows, dtype=torch.int32, shape=(B, PROC_COLS), device=dev)
        check("proc_penalties", self.penalties, dtype=torch.float32, shape=(B, 3), device=dev)
        check("history", self.history, dtype=torch.int32, shape=(None, None), device=dev)
        check("bias_tokens", self.bias_tokens, dtype=torch.int32, shape=(self.history.shape[0], None), device=dev)
        check("bias_values", self.bias_values, dtype=torch.float32, shape=tuple(self.bias_tokens.shape), device=dev)
        check("scratch", self.scratch, dtype=torch.int32, shape=(None, V), device=dev)
        if self.scratch.shape[0] < B or not all(t.is_contiguous() for t in (self.rows, self.penalties, self.history,
                                                                            self.bias_tokens, self.bias_values,
                                                                            self.scratch)):
            raise ValueError(f"device processor tables must be contiguous, the scratch at least {B} rows")
        if self.bias_tokens.shape[1] > BIAS_MASK - 1 or self.history.shape[1] > MAX_COUNT:
            raise ValueError(f"at most {BIAS_MASK - 1} bias entries and {MAX_COUNT} history tokens per slot")


@triton.jit
def _mark(scr, tok, m, val, OR: tl.constexpr):
    if OR:
        tl.atomic_or(scr + tok, val, mask=m)
    else:
        tl.atomic_add(scr + tok, val, mask=m)


@triton.jit
def _take(raw, out, scr, tok, m, bias_val, rep, freq, pres, T, V, LIBDEVICE: tl.constexpr):
    """Take back the scratch words of `tok`; the lanes that got one non-zero write the processed logit."""
    m = m & (tok >= 0) & (tok < V)
    tok = tl.where(m, tok, 0)
    v = tl.atomic_xchg(scr + tok, tl.zeros_like(tok), mask=m)
    win = m & (v != 0)
    e = (v >> 18) & 1023
    bias = tl.load(bias_val + tl.where(win & (e > 0), e - 1, 0), mask=win & (e > 0), other=0.0)
    count = (v & 65535).to(tl.float32)
    seen = (v & (65536 | 65535)) != 0
    x = tl.load(raw + tok, mask=win, other=0.0)
    y = _processed(x, bias, ((v >> 17) & 1) != 0, seen, count, rep, freq, pres, LIBDEVICE)
    tl.store(out + tok, _div(y, T, LIBDEVICE), mask=win)


@triton.jit
def _device_kernel(raw_ptr, out_ptr, temps_ptr, rows_ptr, pen_ptr, hist_ptr, btok_ptr, bval_ptr, scr_ptr, V,
                   s_raw, s_out, s_hist, s_bias, NCOL: tl.constexpr, BAN_COL: tl.constexpr, MAX_BAN: tl.constexpr,
                   BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    b = tl.program_id(0)
    row = rows_ptr + b * NCOL
    slot = tl.load(row)
    if slot >= 0:
        plen, hlen, nbias, nban = tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)
        rep, freq, pres = tl.load(pen_ptr + b * 3), tl.load(pen_ptr + b * 3 + 1), tl.load(pen_ptr + b * 3 + 2)
        T = tl.load(temps_ptr + b)
        scr = scr_ptr + b.to(tl.int64) * V
        hist = hist_ptr + slot.to(tl.int64) * s_hist
        btok, bval = btok_ptr + slot.to(tl.int64) * s_bias, bval_ptr + slot.to(tl.int64) * s_bias
        lanes = tl.arange(0, BLOCK)
        bans = tl.arange(0, MAX_BAN)
        ban = tl.load(row + BAN_COL + bans, mask=bans < nban, other=-1)
        ban_ok = (bans < nban) & (ban >= 0) & (ban < V)
        # mark: every touched token's word (the history's counts and prompt bit, bias entries, bans)
        for j0 in range(0, hlen, BLOCK):
            j = j0 + lanes
            tok = tl.load(hist + j, mask=j < hlen, other=-1)
            ok = (j < hlen) & (tok >= 0) & (tok < V)
            _mark(scr, tl.where(ok, tok, 0), ok & (j < plen), 65536, True)
            _mark(scr, tl.where(ok, tok, 0), ok & (j >= plen), 1, False)
        for e0 in range(0, nbias, BLOCK):
            e = e0 + lanes
            tok = tl.load(btok + e, mask=e < nbias, other=-1)
            ok = (e < nbias) & (tok >= 0) & (tok < V)
            _mark(scr, tl.where(ok, tok, 0), ok, (e + 1) << 18, True)
        _mark(scr, tl.where(ban_ok, ban, 0), ban_ok, 131072, True)
        tl.debug_barrier()
        # take: each word once, by whichever lane exchanges it first
        raw, out = raw_ptr + b * s_raw, out_ptr + b * s_out
        for j0 in range(0, hlen, BLOCK):
            j = j0 + lanes
            tok = tl.load(hist + j, mask=j < hlen, other=-1)
            _take(raw, out, scr, tok, j < hlen, bval, rep, freq, pres, T, V, LIBDEVICE)
        for e0 in range(0, nbias, BLOCK):
            e = e0 + lanes
            tok = tl.load(btok + e, mask=e < nbias, other=-1)
            _take(raw, out, scr, tok, e < nbias, bval, rep, freq, pres, T, V, LIBDEVICE)
        _take(raw, out, scr, ban, bans < nban, bval, rep, freq, pres, T, V, LIBDEVICE)


def device_processors(logits: torch.Tensor, scaled: torch.Tensor, temps: torch.Tensor, dp: DeviceProcessors) -> None:
    """Write `_processed(logits) / temps` into `scaled` [B, V] (which holds `logits / temps`) at every token a
    row's processors touch; rows whose slot is -1 are left as they are. No sync, capturable."""
    check("logits", logits, dtype=torch.float32, shape=(None, None))
    B, V = logits.shape
    check("scaled", scaled, dtype=torch.float32, shape=(B, V), device=logits.device)
    check("temps", temps, dtype=torch.float32, shape=(B,), device=logits.device)
    if logits.stride(1) != 1 or scaled.stride(1) != 1:
        raise ValueError("logits and scaled must be row-major")
    dp.check(B, V, logits.device)
    if B:
        _device_kernel[(B,)](logits, scaled, temps, dp.rows, dp.penalties, dp.history, dp.bias_tokens,
                             dp.bias_values, dp.scratch, V, logits.stride(0), scaled.stride(0), dp.history.stride(0),
                             dp.bias_tokens.stride(0), NCOL=PROC_COLS, BAN_COL=PROC_BAN_COL, MAX_BAN=PROC_MAX_BAN,
                             BLOCK=256, num_warps=4, LIBDEVICE=logits.is_cuda)


def row_record(spec: SamplingSpec, slot: int, prompt_len: int, out_len: int) -> tuple[list[int], list[float]]:
    """One row's `proc_rows` and `proc_penalties` entries, by the CUDA scheduler's rules (`stage_processors` in
    `gpu_engine/csrc/sched_step.cuh`) for a row whose token is used; `spec.eos_ids` is empty with ignore_eos."""
    ban = sorted(spec.stop_ids) + sorted(spec.eos_ids) if out_len < spec.min_tokens else []
    if len(ban) > PROC_MAX_BAN:
        raise ValueError(f"{len(ban)} banned ids; a row holds {PROC_MAX_BAN}")
    row = [-1] * PROC_COLS
    if not (spec.penalized or spec.logit_bias or ban):
        return row, [1.0, 0.0, 0.0]
    row[:5] = [slot, prompt_len, prompt_len + out_len if spec.penalized else 0, len(spec.logit_bias), len(ban)]
    row[PROC_BAN_COL: PROC_BAN_COL + len(ban)] = ban
    return row, [spec.repetition_penalty, spec.frequency_penalty, spec.presence_penalty]
