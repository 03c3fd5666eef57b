"""CPU engine throughput on the embedded default model against `transformers` generate.

Output tokens/s at batch 1 and 16, greedy, fixed prompt and output lengths, both on the same
SmolLM2-135M-Instruct weights (our GGUF loader for Blink; transformers' own GGUF loader for
the reference), same machine, same thread count, measured side by side in one run.

    python -m bench.cpu_bench --out bench/results/cpu_engine.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from gpu_engine.engine import RingEngine
from gpu_engine.models.loader import default_model_path
from gpu_engine.serve import build_cpu_backend
from shared.config import EngineConfig
from shared.messages import Sampling
from shared.ring import RingGeometry, local_ring
from shared.slots import SlotRequest, SlotWriter

PROMPT_LEN, OUTPUT_LEN = 64, 64


def prompts(batch: int, vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(100, vocab - 100, PROMPT_LEN).astype(np.int32) for _ in range(batch)]


def blink_tok_s(batch: int) -> float:
    geo = RingGeometry(32, 256, 256, 1)
    backend = build_cpu_backend(EngineConfig(ring_name="bench", geometry=geo, kv_blocks=1024, max_batch=32))
    ring = local_ring(geo)
    engine = RingEngine(ring, backend.runner, backend.policy, backend.eos_ids, backend.max_context,
                        backend.vocab_size)
    writer = SlotWriter(ring)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts(batch, backend.vocab_size)):
        seq = writer.try_reserve(i, int(ring.slots[i]["seq"]))
        assert seq is not None
        writer.publish(i, seq, SlotRequest(i + 1, p, Sampling(OUTPUT_LEN, ignore_eos=True)))
    while engine.step() or engine.by_slot:
        pass
    elapsed = time.perf_counter() - t0
    assert int(ring.slots["generated"][:batch].sum()) == batch * OUTPUT_LEN
    return batch * OUTPUT_LEN / elapsed


def hf_tok_s(batch: int) -> float:
    import transformers

    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    ids = torch.tensor(np.stack(prompts(batch, model.config.vocab_size)), dtype=torch.int64)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=OUTPUT_LEN,
                             min_new_tokens=OUTPUT_LEN, do_sample=False, pad_token_id=0)
        elapsed = time.perf_counter() - t0
    assert out.shape[1] == PROMPT_LEN + OUTPUT_LEN
    return batch * OUTPUT_LEN / elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/cpu_engine.json")
    ap.add_argument("--batches", default="1,16")
    args = ap.parse_args()
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        ours, theirs = blink_tok_s(b), hf_tok_s(b)
        rows.append({"batch": b, "prompt": PROMPT_LEN, "output": OUTPUT_LEN, "blink_tok_s": ours,
                     "transformers_tok_s": theirs, "ratio": ours / theirs})
        print(f"batch {b:3d}: blink {ours:8.1f} tok/s   transformers {theirs:8.1f} tok/s   x{ours / theirs:.2f}",
              flush=True)
    result = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "cores": os.cpu_count(),
              "model": "SmolLM2-135M-Instruct (GGUF Q4_1; --dtype auto: fp16-packed linears, int8 embedding, fp16 KV)",
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
