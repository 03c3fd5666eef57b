"""bench/admission_sim.py: the peer study's points replayed against a step-time model (no GPU)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from bench import admission_sim as sim
from bench import serve_bench as sb
from bench.peers.load import rate_seed
from bench.workloads import WORKLOADS, draw_lengths

DENSE = sim.MODELS["llama3-8b-h100"]


def engine(seqs: int = 256, budget: int = 1024, kv: int = 438608, scale: float = 1.0) -> sim.Engine:
    return sim.Engine("e", seqs, budget, kv, sim.StepModel(scale=scale))


def test_a_light_load_completes_every_request_and_keeps_up() -> None:
    rec = sim.run_rate(engine(), 2.0, warmup_s=2, window_s=10, drain_s=60)
    assert rec["arrived"] > 0 and rec["completed"] == rec["arrived"]
    assert rec["preemptions"] == 0
    assert rec["keeps_up"], rec["keeps_up_why"]
    assert rec["ttft_ms"]["p50"] < rec["tpot_ms"]["p50"] * 10  # admitted at once: a step or two


def test_a_small_cache_preempts_and_the_queue_grows() -> None:
    big = sim.run_rate(engine(seqs=256), 18.0, warmup_s=5, window_s=15, drain_s=5)
    small = sim.run_rate(engine(seqs=256, kv=40_000), 18.0, warmup_s=5, window_s=15, drain_s=5)
    assert small["preemptions"] > 0 and big["preemptions"] == 0
    assert small["queue_growth"] > big["queue_growth"]
    assert not small["keeps_up"]


def test_the_batch_limit_caps_the_rows_of_every_step() -> None:
    rec = sim.run_rate(engine(seqs=8, budget=1024), 6.0, warmup_s=2, window_s=8, drain_s=2)
    assert 0 < rec["mean_rows"] <= 8
    assert not rec["keeps_up"]  # 8 rows cannot carry 6 requests a second of 463 tokens each


def test_a_slower_step_is_slower_per_token() -> None:
    fast = sim.run_rate(engine(scale=1.0), 8.0, warmup_s=2, window_s=10, drain_s=30)
    slow = sim.run_rate(engine(scale=1.5), 8.0, warmup_s=2, window_s=10, drain_s=30)
    assert slow["tpot_ms"]["p50"] > fast["tpot_ms"]["p50"] * 1.3


def test_it_draws_the_peer_studys_arrivals_and_lengths() -> None:
    """The peer study's draws: its schedule's arrival times and lengths (build_schedule, without the prompts' text),
    and, for the runs before one stream served every rate, each rate's own draw."""
    from bench.peers.load import Window, build_schedule
    from bench.workloads import Limits

    class Chars:  # text of any length: one token a character
        def encode(self, text: str) -> list[int]:
            return [ord(c) for c in text]

        def decode(self, ids: list[int]) -> str:
            return "".join(chr(i) for i in ids)

    w, limits = (3.0, 7.0, 2.0), Limits(3000, 512, 3200)
    schedule = build_schedule(5.0, Window(*w), WORKLOADS["paper"], limits, Chars(), 4)
    offsets, lengths = sim.draws(5.0, 4, sum(w), limits)
    assert offsets == list(schedule.offsets)
    assert lengths == [(r.prompt_len, r.output_len) for r in schedule.specs]
    s = rate_seed(4, 5.0)
    before = sb.arrival_offsets(5.0, np.random.default_rng(s), None, sum(w))
    old_offsets, old_lengths = sim.draws(5.0, 4, sum(w), limits, "independent")
    assert old_offsets == before and old_lengths == draw_lengths(WORKLOADS["paper"], len(before), limits, s)
    rec = sim.run_rate(engine(), 5.0, *w, seed=4, limits=limits)
    assert rec["arrived"] == schedule.arrived


def test_the_step_model_matches_the_trace_it_was_fitted_to() -> None:
    """The 128-row decode step at served contexts (mean 1,207 tokens) and the mixed step with an 896-token chunk
    (bench/results/trace_h100.json: 14.28 and 29.65 ms), within 10%."""
    from gpu_engine.policy import Request, SeqWork, StepPlan

    def req() -> Request:
        return Request(slot=0, seq=0, request_id=0, prompt=[0], max_new_tokens=1, arrival=0)

    decode = [SeqWork(req(), 1206, 1) for _ in range(128)]
    assert DENSE.ms(StepPlan("decode", decode), 128) == pytest.approx(14.28, rel=0.1)
    mixed = StepPlan("prefill", [*decode, SeqWork(req(), 0, 896, prefill=True)])
    assert DENSE.ms(mixed, 1024) == pytest.approx(29.65, rel=0.1)


def test_engines_parse_and_bad_ones_are_refused() -> None:
    name, fields = sim.parse_engine("v:seqs=1024,budget=8192,kv=463312,scale=1.03,pad=0")
    e = sim.engine_of(name, fields)
    assert (e.max_num_seqs, e.budget, e.kv_tokens, e.model.scale, e.pad_to_graphs) == (1024, 8192, 463312, 1.03, False)
    for bad in ("v", "v:seqs=1", "v:seqs=1,budget=2,kv=3,colour=4", "v:seqs=1,budget=2,kv=3,model=gpt"):
        with pytest.raises(argparse.ArgumentTypeError):
            sim.parse_engine(bad)


def test_the_command_writes_a_table_and_json(tmp_path, capsys) -> None:
    out = tmp_path / "sim.json"
    assert sim.main(["--rates", "2", "--warmup-s", "1", "--window-s", "4", "--drain-s", "30",
                     "--engine", "a:seqs=64,budget=1024,kv=100000", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["engines"]["a"]["plateau"] == 2.0 and len(doc["records"]) == 1
    assert "| a | 2 |" in capsys.readouterr().out
