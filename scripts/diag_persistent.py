"""Serve a few requests through the persistent scheduler on one model shape; print OK or the failure."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from harness.models import LLAMA3_8B, MEDIUM_LLAMA, SMALL_LLAMA, TINY_LLAMA3, write_config
from harness.ring_driver import Driver, Job, start_engine, stop_engine, wait_ready

CONFIGS = {"8b": LLAMA3_8B, "medium": MEDIUM_LLAMA, "small": SMALL_LLAMA, "tiny3": TINY_LLAMA3}


def main() -> None:
    shape, dtype, max_batch, plen = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    cfg = CONFIGS[shape]
    model = write_config(Path(tempfile.mkdtemp()) / "model", cfg)
    log = Path(tempfile.mkdtemp()) / "engine.log"
    name = f"blink-diag-{int(time.time() * 1000) % 100000}"
    slots = str(max(16, int(max_batch)))  # a running sequence holds a slot: at least the batch
    proc = start_engine(name, model, "persistent", "--random-weights", "--dtype", dtype, "--num-slots", slots,
                        "--max-prompt-tokens", "512", "--max-output-tokens", "64", "--max-batch", max_batch,
                        log=log)
    t0 = time.time()
    try:
        ring = wait_ready(name, proc, timeout=300)
        rng = np.random.default_rng(0)
        jobs = [Job(k + 1, rng.integers(10, cfg["vocab_size"], plen).astype(np.int32), 16) for k in range(4)]
        res = Driver(ring, 4).run(jobs, timeout=20)
        print("OK", shape, dtype, max_batch, plen, {k: len(v.tokens) for k, v in res.items()}, flush=True)
        stop_engine(ring, proc)
    except Exception as exc:  # noqa: BLE001
        print("FAIL", shape, dtype, max_batch, plen, repr(exc)[:300], flush=True)
    finally:
        if proc.poll() is None:
            proc.kill()
        print(f"  ({time.time() - t0:.0f} s)")
        for line in log.read_text(errors="replace").splitlines():
            if any(k in line for k in ("illegal", "stalled", "stuck", "error", "Error", "checked", "exited")):
                print("  ", line[:400])


if __name__ == "__main__":
    main()
