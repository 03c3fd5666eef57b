"""One staged prefill of a Llama-3-shaped model, run three ways: torch replay, the device-launch
executable launched from the host, and the same executable launched from the device."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from gpu_engine.gpu.graph_cache import GraphCache
from gpu_engine.gpu.persistent import library
from gpu_engine.gpu.runner import GpuModelRunner, RunnerLimits
from gpu_engine.gpu.sm_share import reserve_sms
from gpu_engine.kv_cache import KVCache
from gpu_engine.models.attention import SeqStep, build_metadata
from gpu_engine.models.loader import load_model
from harness.models import LLAMA3_8B, MEDIUM_LLAMA, TINY_LLAMA3, write_config


def main() -> None:
    shape = sys.argv[1]
    cfg = {"8b": LLAMA3_8B, "medium": MEDIUM_LLAMA, "tiny3": TINY_LLAMA3}[shape]
    model, mcfg = load_model(write_config(Path(tempfile.mkdtemp()) / "m", cfg), dtype=torch.bfloat16,
                             device="cuda", random_weights=True)
    kv = KVCache(mcfg, 512, 16, dtype=torch.bfloat16, device="cuda")
    runner = GpuModelRunner(model, kv, RunnerLimits(max_batch=4, max_tokens=512, max_blocks_per_seq=32))
    reserve_sms(1)
    cache = GraphCache(runner, [4], [(4, 512)], copies=1, device_launch=True)
    cache.capture(progress=False)
    lib = library()
    steps = [SeqStep(0, 100, list(range(8 * k, 8 * k + 8))) for k in range(4)]
    ids = torch.randint(10, cfg["vocab_size"], (400,))
    for g, shape_ in enumerate(cache.shapes):
        if shape_.decode:
            continue
        results = {}
        for how in ("replay", "host", "device"):
            runner.stage(ids, build_metadata(steps, 16, "cpu"))
            runner.buffers.next_tokens.fill_(-7)
            torch.cuda.synchronize()
            try:
                if how == "replay":
                    cache.launcher(cache.graphs[g])()
                else:
                    err = lib.launch_once(cache.exec_handles(g)[0], device=how == "device")
                    print(how, "device-side launch status", err, flush=True)
                torch.cuda.synchronize()
                results[how] = runner.buffers.next_tokens[:4].tolist()
            except Exception as exc:  # noqa: BLE001
                print("FAIL", how, repr(exc)[:300], flush=True)
                break
            print(shape, shape_, how, results[how], flush=True)
        print("equal" if len({str(v) for v in results.values()}) == 1 else "DIFFER", flush=True)


if __name__ == "__main__":
    main()
