"""Decode step time with the logits processors on, against off, for both GPU backends' graphs.

Random bf16 models (SmolLM2-135M's shape, where the sampler is the largest share of a step, and
Llama-3-8B's), decode graphs replayed from the host (the graphs the persistent scheduler launches from
the device are the same captures). Per batch size, at a context of 512 tokens:

- `off_ms`: the graphs of a runner without processors (what every step ran before).
- `persistent_off_ms`: the persistent backend's graphs (`RunnerLimits.device_tables`: the masked
  device-state kernel in every graph) with no row using a processor, what a plain request pays.
- `persistent_on_ms`: the same graphs with every row using all of them: the three penalties over its
  512-token history, 300 logit_bias entries, and min_tokens banning 8 stop ids and EOS.
- `persistent_grammar_ms`: the same graphs with every row constrained by a grammar on the device
  (`kernels.grammar`: a 200-state token DFA in the arena, each row in a state of its own, its end tokens
  allowed) and no processor; `tables_off_ms` the graphs with the processors' tables but no grammar arena, so
  `persistent_off_ms / tables_off_ms` is what the masked grammar path costs a step without constrained rows.
- `host_on_ms`: the host-driven backend's graphs (`RunnerLimits.processors`: dense [B, V] columns), and
  `host_stage_ms` the host's work per step to build and copy those columns (`processor_columns` + stage).

Usage: python -m bench.processors [--out bench/results/processors.json] [--models small,8b] [--iters 30]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.roofline import BLOCK, LLAMA3_8B, _time_ms, stage_step

SMOLLM2_135M = {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
                "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
                "max_position_embeddings": 8192, "tie_word_embeddings": True}
MODELS = {"small": SMOLLM2_135M, "8b": LLAMA3_8B}
BATCHES = (1, 8, 32, 64, 128)
CONTEXT = 512
MAX_BIAS = 300
GRAMMAR_ARENA = 64 << 20
GRAMMAR_STATES = 200


def build(hf: dict, kind: str):
    """A runner of `kind` (off / persistent / host) with decode graphs for BATCHES."""
    from bench.roofline import random_model
    from gpu_engine.gpu.graph_cache import GraphCache
    from gpu_engine.gpu.runner import DeviceTables, GpuModelRunner, RunnerLimits
    from gpu_engine.kv_cache import KVCache

    cfg, model = random_model(hf)
    per_seq = CONTEXT // BLOCK + 1
    B = max(BATCHES)
    kv = KVCache(cfg, B * per_seq, BLOCK, dtype=torch.bfloat16, device="cuda")
    arena = GRAMMAR_ARENA if kind == "persistent" else 0
    tables = DeviceTables(B, per_seq * BLOCK, MAX_BIAS, arena) if kind in ("persistent", "tables") else None
    limits = RunnerLimits(B, B, per_seq, processors=kind == "host", device_tables=tables)
    runner = GpuModelRunner(model, kv, limits)
    graphs = GraphCache(runner, list(BATCHES), [], device_launch=False)
    graphs.capture(progress=False)
    return cfg, runner, graphs, per_seq


def fill_device_rows(runner, batch: int, on: bool) -> None:
    """What the scheduler stages: row b in slot b with its history, bias table, bans and penalties (on),
    or every row off."""
    from gpu_engine.gpu.sched_structs import PROC_BAN_COL

    buf = runner.buffers
    buf.proc_rows.fill_(-1)
    if not on:
        return
    V = runner.config.vocab_size
    g = torch.Generator(device="cuda").manual_seed(0)
    buf.history[:batch, :CONTEXT] = torch.randint(0, V, (batch, CONTEXT), device="cuda", generator=g,
                                                  dtype=torch.int32)
    bias_ids = torch.linspace(0, V - 1, MAX_BIAS, device="cuda").to(torch.int32)
    buf.bias_tokens[:batch] = bias_ids
    buf.bias_values[:batch] = 1.5
    rows = buf.proc_rows[:batch]
    rows[:, 0] = torch.arange(batch, device="cuda", dtype=torch.int32)
    rows[:, 1], rows[:, 2], rows[:, 3], rows[:, 4] = CONTEXT // 2, CONTEXT, MAX_BIAS, 9
    rows[:, PROC_BAN_COL: PROC_BAN_COL + 9] = torch.arange(9, device="cuda", dtype=torch.int32)
    buf.proc_penalties[:batch] = torch.tensor([1.2, 0.5, 0.3], device="cuda")


def fill_grammar_rows(runner, batch: int, on: bool) -> None:
    """Every row constrained (on): a random 200-state DFA's tables at the arena's start, row b in state b % 200,
    its text complete (EOS allowed); or every row without a grammar."""
    import numpy as np

    from shared.token_dfa import TokenDFA, device_row_bytes

    buf = runner.buffers
    buf.gram_bits.fill_(-1)
    if not on:
        return
    V, S = runner.config.vocab_size, GRAMMAR_STATES
    rng = np.random.default_rng(0)
    dfa = TokenDFA(0, V, np.packbits(rng.random((S, V)) < 0.3, axis=1), np.zeros(S, np.int32),
                   np.zeros(S + 1, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int32), np.ones(S, bool))
    layout = torch.from_numpy(dfa.device_layout())
    buf.gram_arena[: len(layout)].copy_(layout)
    buf.gram_bits[:batch] = torch.arange(batch, device="cuda") % S * device_row_bytes(V)
    buf.gram_ends[:batch, 0], buf.gram_ends[:batch, 1], buf.gram_ends[:batch, 2] = 1, 1, 8


def host_columns(cfg, batch: int) -> dict:
    """The host-driven backend's per-step work for `batch` rows with every processor on."""
    from gpu_engine.kernels.sampling import processor_columns
    from gpu_engine.sampling import SamplingSpec

    V = cfg.vocab_size
    spec = SamplingSpec(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3, min_tokens=600,
                        logit_bias=tuple((int(t), 1.5) for t in torch.linspace(0, V - 1, MAX_BIAS).long()),
                        stop_ids=frozenset(range(8)), eos_ids=frozenset({8}))
    history = [(list(range(CONTEXT // 2)), list(range(CONTEXT // 2)))] * batch
    return processor_columns([spec] * batch, [CONTEXT // 2] * batch, history, V)


def run_kind(hf: dict, kind: str, iters: int) -> dict[int, dict]:
    cfg, runner, graphs, per_seq = build(hf, kind)
    out: dict[int, dict] = {}
    for b in BATCHES:
        replay = lambda b=b: graphs.replay((True, b, b), filtered=False)  # noqa: E731
        stage_step(runner, b, CONTEXT, 1, per_seq)
        if kind == "off":
            out[b] = {"off_ms": _time_ms(replay, iters)}
        elif kind == "tables":
            fill_device_rows(runner, b, on=False)
            out[b] = {"tables_off_ms": _time_ms(replay, iters)}
        elif kind == "persistent":
            fill_device_rows(runner, b, on=False)
            fill_grammar_rows(runner, b, on=False)
            off = _time_ms(replay, iters)
            fill_device_rows(runner, b, on=True)
            on = _time_ms(replay, iters)
            fill_device_rows(runner, b, on=False)
            fill_grammar_rows(runner, b, on=True)
            grammar = _time_ms(replay, iters)
            out[b] = {"persistent_off_ms": off, "persistent_on_ms": on, "persistent_grammar_ms": grammar}
            fill_grammar_rows(runner, b, on=False)
            assert not runner.buffers.proc_scratch.any(), "the scratch is not zero after the steps"
        else:
            cols = host_columns(cfg, b)
            t0 = time.perf_counter()
            for _ in range(3):
                stage_step(runner, b, CONTEXT, 1, per_seq)
                runner._stage_processors(b, cols)
            torch.cuda.synchronize()
            out[b] = {"host_on_ms": _time_ms(replay, iters),
                      "host_stage_ms": (time.perf_counter() - t0) / 3 * 1e3}
    graphs.close()
    torch.cuda.empty_cache()
    return out


def run(models: list[str], iters: int) -> list[dict]:
    rows = []
    for name in models:
        per_kind = [run_kind(MODELS[name], kind, iters) for kind in ("off", "tables", "persistent", "host")]
        for b in BATCHES:
            row = {"model": name, "batch": b, "context": CONTEXT}
            for k in per_kind:
                row |= k[b]
            row["persistent_on_over_off"] = row["persistent_on_ms"] / row["off_ms"]
            row["persistent_off_over_off"] = row["persistent_off_ms"] / row["off_ms"]
            row["grammar_path_over_tables"] = row["persistent_off_ms"] / row["tables_off_ms"]
            row["grammar_on_over_off"] = row["persistent_grammar_ms"] / row["persistent_off_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/processors.json"))
    parser.add_argument("--models", default="small,8b", help="comma-separated, of: " + ", ".join(MODELS))
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    rows = run(args.models.split(","), args.iters)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"context": CONTEXT, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
