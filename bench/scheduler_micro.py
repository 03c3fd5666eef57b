"""Persistent-scheduler micro-benchmarks on the GPU: device vs host graph launch, tail relaunch,
scan of 4096 slots (through the header's flip bits, reading every state word, and through the flip
bits claiming by a store), admission latency (a frontend-side publish until the GPU claims it), all
three ways; and the engine host process's CPU time per minute while it serves (``bench.fig3``'s
batches on the same model).

    python -m bench.scheduler_micro --out bench/results/scheduler_micro.json
"""

from __future__ import annotations

import os

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.fig3 import makespans  # noqa: E402
from gpu_engine.gpu.persistent import PersistentScheduler  # noqa: E402
from gpu_engine.gpu.serve_gpu import GpuParts, build_parts  # noqa: E402
from harness.models import SMALL_LLAMA, write_config  # noqa: E402
from shared import ring_layout as L  # noqa: E402
from shared.config import EngineConfig  # noqa: E402
from shared.messages import Sampling  # noqa: E402
from shared.ring import Ring, RingGeometry, create_shm_ring  # noqa: E402
from shared.slots import SlotRequest, SlotWriter, split_word  # noqa: E402

S = L.SlotState


def host_launch_us(parts: GpuParts, reps: int = 300) -> tuple[float, float]:
    """Host cudaGraphLaunch call time (replay, no sync) and launch + sync, decode batch 1."""
    idx, _ = parts.cache.lookup(True, 1, 1, filtered=False)
    g = parts.cache.graphs[idx]
    assert g is not None
    call, full = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        parts.cache.launcher(g)()  # the engine's own executable, launched from the host
        t1 = time.perf_counter_ns()
        torch.cuda.synchronize()
        t2 = time.perf_counter_ns()
        call.append((t1 - t0) / 1e3)
        full.append((t2 - t0) / 1e3)
    return float(np.median(call)), float(np.median(full))


def admission(ring: Ring, n: int) -> np.ndarray:
    """Publish one-token requests one at a time; time until the state word leaves PENDING."""
    w, t = SlotWriter(ring), ring.transport
    lat = []
    for k in range(n):
        idx = k % ring.geometry.num_slots
        seq = w.try_reserve(idx, int(ring.slots[idx]["seq"]))
        assert seq is not None
        w.publish(idx, seq, SlotRequest(k + 1, np.array([5, 6, 7], np.int32), Sampling(1)))
        t0 = time.perf_counter_ns()
        while split_word(t.load64(ring.slot_offset(idx)))[0] == S.PREFILL_PENDING:
            pass
        lat.append((time.perf_counter_ns() - t0) / 1e3)
        while split_word(t.load64(ring.slot_offset(idx)))[0] != S.DECODE_COMPLETED:
            pass
        assert w.release(idx, seq)
    return np.array(lat)


def long_generation(ring: Ring, tokens: int) -> None:
    w = SlotWriter(ring)
    seq = w.try_reserve(0, int(ring.slots[0]["seq"]))
    assert seq is not None
    w.publish(0, seq, SlotRequest(99_999, np.array([9, 10], np.int32), Sampling(tokens, ignore_eos=True)))
    while ring.slots[0]["state"] != S.DECODE_COMPLETED:
        time.sleep(0.01)
    assert int(ring.slots[0]["generated"]) == tokens
    assert w.release(0, seq)


def run_scheduler(parts: GpuParts, cfg: EngineConfig, scan_flips: bool, cas: bool = True) -> dict[str, float]:
    """One scheduler on a fresh 4,096-slot ring: admissions one at a time, then one long generation."""
    geo = cfg.geometry
    ring = create_shm_ring(f"{cfg.ring_name}-{int(scan_flips)}{int(cas)}", geo)
    sched = PersistentScheduler(ring.transport.base, ring.transport.size, geo, parts.cache.scheduler_view(),  # type: ignore[attr-defined]
                                parts.kv, parts.limits, parts.eos_ids, cfg.max_batch, parts.max_context,
                                parts.vocab_size, claim_with_cas=cas, scan_flips=scan_flips,
                                # scan_phase_ns: a library built with the phase clocks
                                phase_clocks=True, chunked=parts.chunked, token_budget=parts.token_budget)
    ring.header_store32("engine_state", L.EngineState.READY)
    sched.start()
    try:
        lat = admission(ring, 2000)
        long_generation(ring, 3000)
    finally:
        ring.header_store32("shutdown", 1)
        while not sched.exited():
            time.sleep(0.01)
        sched.wait()
        ring.transport.unlink()  # type: ignore[attr-defined]
    st = sched.stats
    result = {
        "device_launch_us_p50": float(np.median(st.samples("launch"))) / 1e3,
        "tail_relaunch_us": float(np.median(st.samples("tail"))) / 1e3,
        "scan_4096_us": float(np.median(st.samples("scan"))) / 1e3,
        "admission_us_p50": float(np.percentile(lat, 50)),
        "admission_us_p99": float(np.percentile(lat, 99)),
        "step_us_p50_small_model": float(np.median(st.samples("step"))) / 1e3,
        "windows": int(st.windows), "launches": int(st.launches), "launch_retries": int(st.launch_retries),
        "launch_failures": int(st.launch_failures),
        # Mean of each phase over the scans that claimed through the flips (stats.scan_phase_ns).
        "scan_phases_us": {name: round(int(st.scan_phase_ns[k]) / max(1, int(st.scan_phase_n)) / 1e3, 3)
                           for k, name in enumerate(("flip_words", "state_word", "claim", "rest"))},
        "scan_phase_scans": int(st.scan_phase_n),
    }
    sched.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/scheduler_micro.json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    geo = RingGeometry(4096, 256, 4096, 1)
    cfg = EngineConfig(ring_name="blink-micro", model=str(write_config(tmp / "m", SMALL_LLAMA)), random_weights=True,
                       backend="persistent", dtype="bfloat16", geometry=geo, kv_blocks=2048, max_batch=16)
    parts = build_parts(cfg)
    host_call, host_full = host_launch_us(parts)
    # The default scan (the header's flip bits, then only the slots that flipped), then, each on a fresh
    # ring, the scan that reads all 4,096 state words (BLINK_SCHED_FULL_SCAN=1) and the default scan
    # claiming by a store instead of a CAS (BLINK_SCHED_PLAIN_CLAIM=1).
    flips = run_scheduler(parts, cfg, scan_flips=True)
    other: dict[str, dict] = {}
    for name, kw in (("full", {"scan_flips": False}), ("plain", {"scan_flips": True, "cas": False})):
        try:
            other[name] = run_scheduler(parts, cfg, **kw)
        except Exception as exc:  # noqa: BLE001 - the first run's figures are kept either way
            other[name] = {"error": f"{type(exc).__name__}: {exc}"}
    full, plain = other["full"], other["plain"]
    # The engine host process (gpu_engine.serve, persistent) serving Fig. 3's batches: its CPU time per minute.
    _, engine_cpu = makespans(Path(cfg.model), "persistent", 3, tmp, int(SMALL_LLAMA["vocab_size"]))
    result = {"device": torch.cuda.get_device_name(), **flips, "host_launch_us_p50": host_call,
              "host_launch_sync_us_p50": host_full, "scan_4096_full_us": full.get("scan_4096_us"),
              "admission_full_scan_us_p50": full.get("admission_us_p50"),
              "admission_full_scan_us_p99": full.get("admission_us_p99"), "full_scan_error": full.get("error"),
              "scan_4096_plain_claim_us": plain.get("scan_4096_us"),
              "admission_plain_claim_us_p50": plain.get("admission_us_p50"),
              "admission_plain_claim_us_p99": plain.get("admission_us_p99"), "plain_claim_error": plain.get("error"),
              "scan_phases_plain_claim_us": plain.get("scan_phases_us"),
              "engine_host_cpu_s_per_min": round(engine_cpu, 3)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for k, v in result.items():
        print(f"{k:28s} {v}")


if __name__ == "__main__":
    main()
