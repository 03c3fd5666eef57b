"""The peer study's points replayed in simulated time: the scheduling policy against a step-time model.

The engine's own policy (``gpu_engine.policy.Policy``, which the persistent scheduler mirrors rule for rule) plans
every step of the peer study's workload: the same Poisson arrivals and log-normal lengths as
``bench.peers.load.build_schedule`` draws for a rate (its seeds, without the tokenizer; ``--arrivals independent``
for the draws of the runs before one stream served every rate), the same window, drain and
plateau test (``bench.peers.measure``). A step's time comes from a model of its kernels, not from a GPU:

- GEMMs: the larger of reading the weights and computing the step's tokens at the matmul rate (a mixed step's
  tokens padded to its captured graph's size, ``gpu_engine.gpu.graph_grid``, unless ``pad=0``);
- decode attention: every decode row's context read at ``attn_gbps``;
- prefill attention: per (chunk token, attended token) pair;
- norms and the rest: a fixed part and a part per token;

all times ``scale``, one factor per engine fitted to its served TPOT (what the parts leave out: a card's own
speed, another engine's kernels). The dense constants are the per-kernel trace and roofline of the Llama-3-8B
shape on an H100 (``bench/results/trace_h100.json``, ``roofline_h100.json``); the MoE's are estimates from its
shape. Another engine (vLLM) is the same policy with its batch, budget and cache, which is how its scheduler
admits (FCFS, decodes first, chunked prefill, the youngest preempted); its own kernels are in its ``scale``.

What it is for: saying which limit ends a plateau (rows, budget, KV blocks or step time), and which settings
deserve a GPU run. It measures nothing: settings enter the product on a GPU measurement only (BENCHMARKS.md,
"What ends a plateau").

    python -m bench.admission_sim --rates 17,18,19,20 --engine blink:seqs=256,budget=1024,kv=438608,scale=1.1 \\
        --engine vllm:seqs=1024,budget=8192,kv=463312,scale=1.03,pad=0
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from bench import serve_bench as sb
from bench.peers.load import QUEUE_EVERY_S, peer_limits, rate_seed, stream_draws
from bench.peers.measure import keeps_up, pct_ms, queue_growth
from bench.peers.report import bracket
from bench.workloads import WORKLOADS, Limits, draw_lengths
from gpu_engine.gpu.graph_grid import mixed_tokens
from gpu_engine.kv_cache import BlockAllocator
from gpu_engine.policy import Policy, Request, StepPlan
from gpu_engine.sampling import SamplingSpec

BLOCK = 16
PEERS_LIMITS = peer_limits()
WORKLOAD = WORKLOADS["paper"]  # the peer study's


@dataclasses.dataclass(frozen=True)
class StepModel:
    """One step's time, in ms, from its shape. Defaults: Llama-3-8B shape, bf16, NVIDIA H100 80GB HBM3."""

    weights_ms: float = 5.8            # the GEMMs of a step of a few rows: reading 16 GB of weights
    gemm_us_per_token: float = 17.7    # past that, the matmul rate: 18.17 ms for a 1,024-token step
    attn_gbps: float = 2630.0          # decode attention on served contexts (2,630 GB/s, 128 rows)
    kv_bytes_per_token: int = 131072   # 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes
    prefill_ns_per_pair: float = 3.0   # prefill attention per (chunk token, attended token)
    fixed_ms: float = 0.6              # norms, sampling, gaps of a step of a few rows
    us_per_token: float = 1.4          # norms, SiLU, q/k/v preparation per token
    scale: float = 1.0                 # the whole step, for what the parts above leave out (fitted to served TPOT)

    def ms(self, plan: StepPlan, graph_tokens: int) -> float:
        decode_ctx = sum(w.num_cached + 1 for w in plan.work if not w.prefill)
        pairs = sum(w.num_new * (w.num_cached + (w.num_new + 1) / 2) for w in plan.work if w.prefill)
        gemm = max(self.weights_ms, graph_tokens * self.gemm_us_per_token / 1e3)
        attn = decode_ctx * self.kv_bytes_per_token / (self.attn_gbps * 1e9) * 1e3
        return self.scale * (gemm + attn + pairs * self.prefill_ns_per_pair / 1e6 + self.fixed_ms
                             + graph_tokens * self.us_per_token / 1e3)


# Step models by shape and card. The MoE's: a step past a few dozen rows touches nearly every expert, so it reads
# about all 57 GiB of expert weights (19 ms at the H100's 3.0 TB/s); 3.3 B active parameters a token; 96 KiB of KV
# a token (48 layers x 4 KV heads); attention over 48 layers of 32 query heads. Its constants are estimates from the
# shape, not a trace (none exists for this model yet); an engine's scale fits them to its served TPOT.
MODELS = {
    "llama3-8b-h100": StepModel(),
    "qwen3-30b-a3b-h100": StepModel(weights_ms=19.0, gemm_us_per_token=13.0, kv_bytes_per_token=98304,
                                    prefill_ns_per_pair=4.5, fixed_ms=1.0, us_per_token=2.0),
}


@dataclasses.dataclass(frozen=True)
class Engine:
    """The admission settings of one simulated server."""

    name: str
    max_num_seqs: int
    budget: int
    kv_tokens: int
    model: StepModel = StepModel()
    pad_to_graphs: bool = True          # mixed steps run the captured graph's tokens (Blink's graph grid)


@dataclasses.dataclass
class Sim:
    arrival: float
    prompt: int
    output: int
    first: float | None = None
    last: float | None = None
    tokens: int = 0


ARRIVAL_DRAWS = ("scaled", "independent")  # the peer study's draws now (bench.peers.load.stream_draws), and before


def draws(rate: float, seed: int, hard_end: float, limits: Limits,
          arrivals: str = "scaled") -> tuple[list[float], list[tuple[int, int]]]:
    """A rate's arrival times and (prompt, output) lengths as the peer study draws them: `scaled`, one stream of
    `seed` at every rate (``bench.peers.load.build_schedule``); `independent`, each rate's own draw (its runs
    before the stream, which the committed measurements used)."""
    if arrivals == "scaled":
        return stream_draws(rate, seed, hard_end, WORKLOAD, limits)
    if arrivals != "independent":
        raise ValueError(f"arrivals {arrivals!r}: one of {ARRIVAL_DRAWS}")
    s = rate_seed(seed, rate)
    offsets = sb.arrival_offsets(rate, np.random.default_rng(s), None, hard_end)
    return offsets, draw_lengths(WORKLOAD, max(1, len(offsets)), limits, s)


def run_rate(engine: Engine, rate: float, warmup_s: float, window_s: float, drain_s: float, seed: int = 0,
             limits: Limits = PEERS_LIMITS, arrivals: str = "scaled") -> dict[str, Any]:
    """One rate's record, with the keys of ``bench.peers.measure``'s that the plateau test reads."""
    start, end, hard_end = warmup_s, warmup_s + window_s, warmup_s + window_s + drain_s
    offsets, lengths = draws(rate, seed, hard_end, limits, arrivals)
    sims = [Sim(t, p, o) for t, (p, o) in zip(offsets, lengths, strict=False)]
    policy = Policy(BlockAllocator(engine.kv_tokens // BLOCK), BLOCK, engine.max_num_seqs, engine.budget)
    sizes = mixed_tokens(engine.budget)
    nxt, now, steps, rows, queue = 0, 0.0, 0, 0, []
    sample_at = start
    spec = SamplingSpec(ignore_eos=True)
    while now < hard_end:
        while nxt < len(sims) and sims[nxt].arrival <= now:
            sm = sims[nxt]
            req = Request(slot=nxt, seq=nxt, request_id=nxt, prompt=[0] * sm.prompt, max_new_tokens=sm.output,
                          arrival=nxt, sampling=spec)
            policy.add(req)
            nxt += 1
        while sample_at <= min(now, end):
            queue.append((sample_at, float(len(policy.waiting) + len(policy.paused))))
            sample_at += QUEUE_EVERY_S
        plan = policy.schedule()
        if plan is None or not plan.work:
            if nxt >= len(sims):
                break
            now = max(now, sims[nxt].arrival)
            continue
        tokens = plan.num_tokens
        graph = tokens
        if engine.pad_to_graphs and plan.kind == "prefill":
            graph = next((t for t in sizes if t >= tokens), tokens)
        now += engine.model.ms(plan, graph) / 1e3
        steps += 1
        rows += len(plan.work)
        for req, _tok, _finish in policy.commit(plan, [1] * len(plan.work), eos_ids=()):
            sm = sims[req.request_id]
            if len(req.output) > sm.tokens:
                sm.tokens = len(req.output)
                sm.first = now if sm.first is None else sm.first
                sm.last = now
    measured = [sm for sm in sims if start <= sm.arrival < end]
    done = [sm for sm in measured if sm.last is not None and sm.tokens >= sm.output and sm.last <= hard_end]
    ttft = [sm.first - sm.arrival for sm in done if sm.first is not None]
    tpot = [(sm.last - sm.first) / (sm.tokens - 1) for sm in done if sm.tokens >= 2 and sm.first is not None]

    rec: dict[str, Any] = {
        "system": engine.name, "rate": rate, "arrived": len(measured), "completed": len(done),
        "ttft_ms": pct_ms(ttft), "tpot_ms": pct_ms(tpot), "queue_growth": queue_growth(queue, window_s),
        "queue_start": queue[0][1] if queue else None, "queue_end": queue[-1][1] if queue else None,
        "preemptions": policy.preemptions, "steps": steps, "mean_rows": round(rows / max(1, steps), 1),
        "max_num_seqs": engine.max_num_seqs, "budget": engine.budget, "kv_tokens": engine.kv_tokens, "seed": seed,
        "arrived_req_s": round(len(measured) / window_s, 3)}
    rec["keeps_up"], rec["keeps_up_why"] = keeps_up(rec)
    return rec


def parse_engine(spec: str) -> tuple[str, dict[str, Any]]:
    """``NAME:key=value,...`` with keys seqs, budget, kv (tokens), scale, pad (0 or 1) and model (a MODELS name)."""
    name, _, rest = spec.partition(":")
    if not name or not rest:
        raise argparse.ArgumentTypeError(f"an engine is NAME:seqs=..,budget=..,kv=..[,scale=..][,pad=0][,model=..], "
                                         f"got {spec!r}")
    fields: dict[str, Any] = {}
    for item in rest.split(","):
        key, _, val = item.partition("=")
        if key not in ("seqs", "budget", "kv", "scale", "pad", "model") or not val:
            raise argparse.ArgumentTypeError(f"unknown or empty engine field {item!r} in {spec!r}")
        fields[key] = val
    missing = {"seqs", "budget", "kv"} - set(fields)
    if missing:
        raise argparse.ArgumentTypeError(f"engine {name!r} lacks {', '.join(sorted(missing))}")
    if fields.get("model", "llama3-8b-h100") not in MODELS:
        raise argparse.ArgumentTypeError(f"engine {name!r}: no step model {fields['model']!r} ({', '.join(MODELS)})")
    return name, fields


def engine_of(name: str, fields: dict[str, Any]) -> Engine:
    model = dataclasses.replace(MODELS[fields.get("model", "llama3-8b-h100")], scale=float(fields.get("scale", 1.0)))
    return Engine(name, int(fields["seqs"]), int(fields["budget"]), int(fields["kv"]), model,
                  fields.get("pad", "1") != "0")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", action="append", type=parse_engine, required=True,
                    help="NAME:seqs=N,budget=N,kv=TOKENS[,scale=X][,pad=0][,model=NAME], repeated: one engine each")
    ap.add_argument("--rates", default="17,18,19,20")
    ap.add_argument("--warmup-s", type=float, default=10.0)
    ap.add_argument("--window-s", type=float, default=30.0)
    ap.add_argument("--drain-s", type=float, default=15.0)
    ap.add_argument("--arrivals", choices=ARRIVAL_DRAWS, default="scaled",
                    help="scaled: the peer study's draws now; independent: each rate its own, as before")
    ap.add_argument("--seeds", default="0", help="comma-separated: each rate drawn once per seed (the peer "
                    "study's runs are seed 0); an engine's plateau is the median of its seeds'")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    doc: dict[str, Any] = {"window": {"warmup_s": args.warmup_s, "window_s": args.window_s, "drain_s": args.drain_s},
                           "seeds": seeds, "arrivals": args.arrivals, "engines": {}, "records": []}
    print("| engine | rate | TPOT p50 / p99 (ms) | TTFT p50 / p99 (ms) | queue growth | preemptions | mean rows | "
          "keeps up |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, fields in args.engine:
        engine = engine_of(name, fields)
        found = []
        for seed in seeds:
            recs = [run_rate(engine, r, args.warmup_s, args.window_s, args.drain_s, seed, arrivals=args.arrivals)
                    for r in rates]
            tag = f" (seed {seed})" if len(seeds) > 1 else ""
            for rec in recs:
                print(f"| {name}{tag} | {rec['rate']:g} | {rec['tpot_ms']['p50']} / {rec['tpot_ms']['p99']} | "
                      f"{rec['ttft_ms']['p50']} / {rec['ttft_ms']['p99']} | {rec['queue_growth']} | "
                      f"{rec['preemptions']} | {rec['mean_rows']} | {'yes' if rec['keeps_up'] else 'no'} |")
            found.append(bracket(recs)[0])  # the highest rate kept up below every one that was not
            doc["records"] += recs
        median = statistics.median(p or 0.0 for p in found)
        print(f"| {name} | plateau {median:g} (by seed: {', '.join(str(p) for p in found)}) | | | | | | |")
        doc["engines"][name] = {**dataclasses.asdict(engine), "model_name": fields.get("model", "llama3-8b-h100"),
                                "plateau": median, "plateau_by_seed": found}
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
