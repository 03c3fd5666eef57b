"""The logits processors from device state (`gpu_engine/kernels/processors.py`, the persistent backend's path)
against the CPU engine's reference (`gpu_engine.sampling.process_row` / `sample`), on tiny shapes: through
Triton's interpreter on the CPU (the conftest turns it on without CUDA), on the GPU where there is one.

The slot tables hold what the scheduler leaves in them: a previous request's tokens past the history
length and its bias entries past the count (a reused slot), which must never count."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from gpu_engine.gpu.sched_structs import PROC_BAN_COL, PROC_COLS
from gpu_engine.kernels.processors import DeviceProcessors, device_processors, row_record
from gpu_engine.kernels.sampling import sample as device_sample
from gpu_engine.sampling import SamplingSpec, process_row
from gpu_engine.sampling import sample as reference_sample

DEV = "cuda" if torch.cuda.is_available() else "cpu"
V, SLOTS, WIDTH, NBIAS = 211, 8, 320, 8
STALE = 7  # a previous request's token left in every slot's history and bias table


def _specs() -> list[tuple[SamplingSpec, list[int], list[int]]]:
    """(spec, prompt, output) per row: each processor alone, all together, none."""
    return [
        (SamplingSpec(), [3, 4], [5]),
        (SamplingSpec(repetition_penalty=1.7, logit_bias=((7, 5.0), (8, -100.0)), temperature=0.8, seed=3),
         [7, 9, 9], [9, 11]),
        (SamplingSpec(frequency_penalty=0.9, presence_penalty=-0.5, min_tokens=4, stop_ids=frozenset({1, 10**6}),
                      eos_ids=frozenset({2})), [1, 2], [40, 40, 40]),
        (SamplingSpec(min_tokens=1, eos_ids=frozenset({0}), temperature=1.3, top_k=20, seed=-9), [0], []),
        (SamplingSpec(presence_penalty=1.0, repetition_penalty=0.6, temperature=0.5, top_p=0.8, seed=5,
                      logit_bias=((10, 3.0), (12, -2.5), (200, 1.0))), [10] * 4, [10, 12]),
        (SamplingSpec(min_tokens=2, stop_ids=frozenset({4}), logit_bias=((4, 50.0),)), [4, 4], [6, 6]),  # min reached
        (SamplingSpec(repetition_penalty=2.0, frequency_penalty=0.25), list(range(20, 60)), list(range(60, 66)) * 2),
        # a history longer than one block of the kernel, repeating itself
        (SamplingSpec(repetition_penalty=1.3, presence_penalty=0.5), [t % 150 for t in range(270)], [3] * 9),
    ]


def tables(rows: list[tuple[SamplingSpec, list[int], list[int]]], device: str) -> DeviceProcessors:
    """The scheduler's tables for these rows (row b in slot SLOTS - 1 - b % SLOTS), with stale entries."""
    B = len(rows)
    history = torch.full((SLOTS, WIDTH), STALE, dtype=torch.int32)
    btok = torch.full((SLOTS, NBIAS), STALE, dtype=torch.int32)
    bval = torch.full((SLOTS, NBIAS), 99.0)
    proc = torch.full((B, PROC_COLS), -1, dtype=torch.int32)
    pens = torch.zeros(B, 3)
    for b, (spec, prompt, output) in enumerate(rows):
        slot = SLOTS - 1 - b % SLOTS
        history[slot, : len(prompt) + len(output)] = torch.tensor(prompt + output, dtype=torch.int32)
        for k, (tok, bias) in enumerate(spec.logit_bias):
            btok[slot, k], bval[slot, k] = tok, bias
        row, pen = row_record(spec, slot, len(prompt), len(output))
        proc[b], pens[b] = torch.tensor(row, dtype=torch.int32), torch.tensor(pen)
    return DeviceProcessors(proc.to(device), pens.to(device), history.to(device), btok.to(device), bval.to(device),
                            torch.zeros(B + 2, V, dtype=torch.int32, device=device))


def _case(seed: int = 11):
    rows = _specs()
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(seed)) * 3
    logits[:, STALE] = 0.5  # the stale token has a logit a wrong count would change
    return rows, logits


def test_every_touched_logit_is_the_references_and_the_rest_untouched() -> None:
    rows, logits = _case()
    temps = torch.tensor([s.temperature if s.temperature > 0 else 1.0 for s, _, _ in rows])
    dp = tables(rows, DEV)
    base = logits / temps[:, None]
    scaled = base.clone().to(DEV)
    device_processors(logits.to(DEV), scaled, temps.to(DEV), dp)
    got = scaled.cpu()
    for b, (spec, prompt, output) in enumerate(rows):
        ref = process_row(logits[b], spec, len(output), prompt, output) / temps[b]
        assert torch.equal(got[b], ref), (b, (got[b] != ref).nonzero().flatten().tolist())
    assert torch.equal(got[0], base[0])  # a row without processors is left alone
    assert not dp.scratch.any(), "the scratch must be zero again after every row"


def test_sampled_tokens_are_the_cpu_engines() -> None:
    """Greedy and seeded rows (with top-k / top-p) through the whole device sampler, twice in a row (the
    scratch the first call used is clean for the second), against the CPU engine's sampler."""
    rows, logits = _case(5)
    specs = [s for s, _, _ in rows]
    history = [(p, o) for _, p, o in rows]
    steps = torch.tensor([len(o) for _, _, o in rows])
    seeds = torch.tensor([s.seed for s in specs], dtype=torch.int64)
    asked = [dataclasses.replace(s, want_logprobs=True) for s in specs]  # the device sampler computes every row's
    ref = reference_sample(logits, asked, steps, seeds, history)
    dp = tables(rows, DEV)
    d = torch.device(DEV)
    B = len(rows)

    def col(name: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([getattr(s, name) for s in specs], dtype=dtype, device=d)

    for _ in range(2):
        out, lp = torch.zeros(B, dtype=torch.int64, device=d), torch.zeros(B, device=d)
        device_sample(logits.to(d), col("temperature", torch.float32), col("top_k", torch.int32),
                      col("top_p", torch.float32), col("min_p", torch.float32), seeds.to(d), steps.to(d), out, lp,
                      torch.zeros(B, 0, dtype=torch.int64, device=d), torch.zeros(B, 0, device=d), device_procs=dp)
        assert out.cpu().tolist() == ref.tokens.tolist()
        assert torch.allclose(lp.cpu(), ref.logprobs, atol=1e-5)  # log-probs stay those of the raw logits


def test_a_slot_reused_by_a_request_without_processors_is_untouched() -> None:
    """The previous request's history and bias table are still in the slot; the new request's row is off."""
    rows, logits = _case(2)
    dp = tables(rows, DEV)
    rows_off = DeviceProcessors(torch.full_like(dp.rows, -1), dp.penalties, dp.history, dp.bias_tokens,
                                dp.bias_values, dp.scratch)
    scaled = logits.clone().to(DEV)
    device_processors(logits.to(DEV), scaled, torch.ones(len(rows), device=DEV), rows_off)
    assert torch.equal(scaled.cpu(), logits)


def test_row_record_follows_the_schedulers_rules() -> None:
    spec = SamplingSpec(min_tokens=3, stop_ids=frozenset({9, 4}), eos_ids=frozenset({2}), logit_bias=((5, 1.0),))
    row, pen = row_record(spec, 3, 10, 2)
    assert row[:5] == [3, 10, 0, 1, 3] and row[PROC_BAN_COL: PROC_BAN_COL + 3] == [4, 9, 2] and pen == [1.0, 0.0, 0.0]
    assert row_record(spec, 3, 10, 3)[0][4] == 0  # min_tokens reached: nothing banned
    assert row_record(SamplingSpec(min_tokens=3), 3, 10, 0)[0][0] == -1  # nothing to ban, nothing else: off
    pen_row, pens = row_record(SamplingSpec(frequency_penalty=0.5), 1, 4, 6)
    assert pen_row[2] == 10 and pens == [1.0, 0.5, 0.0]  # the penalties count prompt and output


def test_tables_are_checked() -> None:
    rows, logits = _case()
    dp = tables(rows, DEV)
    bad = DeviceProcessors(dp.rows[:, :5], dp.penalties, dp.history, dp.bias_tokens, dp.bias_values, dp.scratch)
    with pytest.raises(ValueError, match="proc_rows"):
        device_processors(logits.to(DEV), logits.clone().to(DEV), torch.ones(len(rows), device=DEV), bad)
    small = DeviceProcessors(dp.rows, dp.penalties, dp.history, dp.bias_tokens, dp.bias_values, dp.scratch[:2])
    with pytest.raises(ValueError, match="scratch"):
        device_processors(logits.to(DEV), logits.clone().to(DEV), torch.ones(len(rows), device=DEV), small)


# ------------------------------------------------------------------ GPU compilation without a GPU
ROOT = Path(__file__).resolve().parent.parent


def _ttir(kernel: str, signature: dict[str, str], constexprs: Mapping[str, object]) -> str:
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    spec = json.dumps({"signature": signature, "constexprs": constexprs})
    res = subprocess.run([sys.executable, "-m", "helpers.ttir", "gpu_engine.kernels.processors", kernel, spec],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    return res.stdout.strip() + res.stderr[-3000:]


def test_device_kernel_compiles_for_sm90() -> None:
    ptrs = {"raw_ptr": "*fp32", "out_ptr": "*fp32", "temps_ptr": "*fp32", "rows_ptr": "*i32", "pen_ptr": "*fp32",
            "hist_ptr": "*i32", "btok_ptr": "*i32", "bval_ptr": "*fp32", "scr_ptr": "*i32"}
    signature = ptrs | dict.fromkeys(("V", "s_raw", "s_out", "s_hist", "s_bias"), "i32")
    consts = {"NCOL": PROC_COLS, "BAN_COL": PROC_BAN_COL, "MAX_BAN": 16, "BLOCK": 256, "LIBDEVICE": True}
    out = _ttir("_device_kernel", signature, consts)
    assert out.startswith("True"), out


def test_dense_kernel_compiles_for_sm90() -> None:
    ptrs = dict.fromkeys(("x_ptr", "add_ptr", "cnt_ptr", "seen_ptr", "rep_ptr", "freq_ptr", "pres_ptr", "out_ptr"),
                         "*fp32")
    signature = ptrs | dict.fromkeys(("V", "s_x", "s_add", "s_out"), "i32")
    out = _ttir("_dense_kernel", signature, {"BLOCK": 1024, "LIBDEVICE": True})
    assert out.startswith("True"), out


# ------------------------------------------------------------------ the runner's buffers, as the scheduler fills them
def test_runner_with_device_tables_samples_the_cpu_engines_tokens() -> None:
    """A `GpuModelRunner` built for the persistent scheduler (`RunnerLimits.device_tables`): its graphs' sampler
    reads the rows, history and bias tables from its static buffers; a decode step whose buffers are filled
    as the scheduler fills them gives the CPU engine's tokens on the step's logits."""
    from gpu_engine.gpu.runner import DeviceTables, GpuModelRunner, RunnerLimits  # noqa: PLC0415
    from gpu_engine.kv_cache import KVCache  # noqa: PLC0415
    from gpu_engine.models.attention import build_metadata  # noqa: PLC0415
    from gpu_engine.models.config import ModelConfig  # noqa: PLC0415
    from gpu_engine.models.loader import build_empty, init_random  # noqa: PLC0415

    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": V, "hidden_size": 32,
                               "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
                               "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                               "max_position_embeddings": 64})
    model = build_empty(cfg, torch.float32, DEV)
    init_random(model, 0)
    limits = RunnerLimits(4, 8, 4, device_tables=DeviceTables(SLOTS, WIDTH, NBIAS))
    runner = GpuModelRunner(model, KVCache(cfg, 16, 4, device=DEV), limits)
    forced = (SamplingSpec(logit_bias=((17, 100.0),), repetition_penalty=1.5), [3, 17], [17])
    rows = [forced] + [_specs()[k] for k in (2, 0)]  # bias + repetition; frequency / presence + min_tokens; none
    dp = tables(rows, DEV)
    buf = runner.buffers
    for name in ("history", "bias_tokens", "bias_values"):
        getattr(buf, name).copy_(getattr(dp, name))
    meta = build_metadata([(len(p) + len(o) - 1, 1, [4 * b, 4 * b + 1]) for b, (_, p, o) in enumerate(rows)], 4,
                          device=DEV)
    specs = [s for s, _, _ in rows]
    sampling = {"temperature": torch.tensor([s.temperature for s in specs]),
                "seeds": torch.tensor([s.seed for s in specs], dtype=torch.int64),
                "sample_index": torch.tensor([len(o) for _, _, o in rows], dtype=torch.int64)}
    runner.stage(torch.tensor([o[-1] if o else p[-1] for _, p, o in rows], device=DEV), meta, sampling)
    buf.proc_rows[: len(rows)].copy_(dp.rows)
    buf.proc_penalties[: len(rows)].copy_(dp.penalties)
    runner.forward(4, 4, True)
    logits = buf.logits[: len(rows)].cpu()
    ref = reference_sample(logits, specs, sampling["sample_index"], sampling["seeds"], [(p, o) for _, p, o in rows])
    assert buf.next_tokens[: len(rows)].cpu().tolist() == ref.tokens.tolist()
    assert ref.tokens[0] == 17 and not buf.proc_scratch.any()
