"""The paper's Fig. 3 on our engine: the same graphs and policy, persistent vs host-driven.

Makespan of 16 concurrent requests for four configurations (short/long prompt x short/long
output) on a Llama-3-8B-shaped random bf16 model. Also reports the engine host process's CPU
time per minute of serving in each mode.

    python -m bench.fig3 --out bench/results/fig3.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from harness.models import LLAMA3_8B, MEDIUM_LLAMA, SMALL_LLAMA, write_config
from harness.ring_driver import Driver, Job, start_engine, stop_engine, wait_ready
from harness.serve_proc import CpuMeter

CONFIGS = {"short-prompt/short-out": (128, 32), "short-prompt/long-out": (128, 512),
           "long-prompt/short-out": (2048, 32), "long-prompt/long-out": (2048, 512)}
BATCH = 16
ENGINE_ARGS = ("--random-weights", "--dtype", "bfloat16", "--num-slots", "64", "--max-prompt-tokens", "2048",
               "--max-output-tokens", "512", "--max-batch", "16", "--top-logprobs", "1")


def makespans(model: Path, backend: str, reps: int, log_dir: Path, vocab: int) -> tuple[dict[str, float], float]:
    name = f"blink-fig3-{uuid.uuid4().hex[:6]}"
    proc = start_engine(name, model, backend, *ENGINE_ARGS, log=log_dir / f"fig3-{backend}.log")
    ring = wait_ready(name, proc)
    rng = np.random.default_rng(0)
    out: dict[str, float] = {}
    meter = CpuMeter(lambda: {"engine": proc.pid})
    meter.begin()
    try:
        for label, (plen, olen) in CONFIGS.items():
            runs = []
            for r in range(reps):
                jobs = [Job(1000 * r + k + 1, rng.integers(10, vocab, plen).astype(np.int32), olen)
                        for k in range(BATCH)]
                t0 = time.perf_counter()
                results = Driver(ring, BATCH).run(jobs, timeout=90)
                runs.append(time.perf_counter() - t0)
                lengths = {len(res.tokens) for res in results.values()}
                assert lengths == {olen}, f"{backend} {label}: output lengths {lengths}, expected {olen}"
            out[label] = float(np.median(runs))
            print(f"{backend:10s} {label:24s} {out[label]:.3f} s", flush=True)
        cpu_per_min = meter.end()[0].get("engine", 0.0)
    finally:
        stop_engine(ring, proc)
        ring.close()
    return out, cpu_per_min


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/fig3.json")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default="8b", choices=["small", "medium", "8b"],
                    help="Llama-3 shape: 8b, medium (16 layers, hidden 2048) or small (2 layers, CPU smoke test)")
    ap.add_argument("--backends", default="persistent,host")
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {"small": SMALL_LLAMA, "medium": MEDIUM_LLAMA, "8b": LLAMA3_8B}[args.model]
    model = write_config(Path(tempfile.mkdtemp()) / "model", config)
    backends = args.backends.split(",")
    pers, pers_cpu = makespans(model, backends[0], args.reps, out.parent, config["vocab_size"])
    print(f"{backends[0]} done", flush=True)
    if len(backends) == 1:  # a check that the model serves in this mode, no comparison
        out.write_text(json.dumps({"model": args.model, "backend": backends[0], "makespans_s": pers,
                                   "engine_host_cpu_s_per_min": pers_cpu}, indent=1))
        return
    host, host_cpu = makespans(model, backends[1], args.reps, out.parent, config["vocab_size"])
    rows = [{"config": k, "persistent_s": pers[k], "host_s": host[k], "host_over_persistent": host[k] / pers[k]}
            for k in CONFIGS]
    result = {"model": f"Llama-3 shape ({args.model}), random bf16", "batch": BATCH, "rows": rows,
              "engine_host_cpu_s_per_min": {"persistent": pers_cpu, "host": host_cpu}}
    out.write_text(json.dumps(result, indent=1))
    print(f"{'config':24s} {'persistent s':>12s} {'host s':>8s} {'host/pers':>9s}")
    for r in rows:
        print(f"{r['config']:24s} {r['persistent_s']:12.3f} {r['host_s']:8.3f} {r['host_over_persistent']:9.2f}")
    print(f"engine host CPU s/min: persistent {pers_cpu:.2f}, host {host_cpu:.2f}")


if __name__ == "__main__":
    main()
