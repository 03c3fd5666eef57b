"""CPU engine step time, A/B: several engine variants loaded in one process, their steps interleaved.

Each variant is an engine config (``--variant NAME:key=value,key=value``, keys of
``shared.config.EngineConfig``: ``cpu_weights``, ``dtype``, ``threads``). Every variant gets the same
``--batch`` greedy requests of a ``--prompt``-token prompt, prefilled, then the rounds run: in each round
every variant, in turn, times ``--steps`` whole engine steps (admit, schedule, forward, sample, publish)
of decode. A shared, noisy machine moves all variants alike within a round, so the per-round minimum and
median compare them fairly. ``--prefill N`` also times one N-token prefill step per round.
``--profile NAME`` prints the torch profiler's table of one variant's decode steps instead.

    python -m bench.cpu_step --variant fp16:cpu_weights=fp16 --variant auto:cpu_weights=auto --batch 1
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np
import torch

from gpu_engine.engine import RingEngine
from gpu_engine.kernels.cpu_linear import GroupInt8Embedding, KernelThreads, Q4Linear, _cpu_quant
from gpu_engine.models.cpu_pack import fuse_small_ops
from gpu_engine.serve import build_cpu_backend
from shared.config import EngineConfig
from shared.messages import Sampling
from shared.ring import RingGeometry, local_ring
from shared.slots import SlotRequest, SlotWriter

GEOMETRY = RingGeometry(16, 4096, 2048, 1)


@dataclasses.dataclass
class Variant:
    name: str
    cfg: EngineConfig
    engine: RingEngine
    writer: SlotWriter
    kthreads: int = 0
    next_slot: int = 0
    decode_ms: list[float] = dataclasses.field(default_factory=list)
    decode_cpu_ms: list[float] = dataclasses.field(default_factory=list)
    prefill_ms: list[float] = dataclasses.field(default_factory=list)


def parse_variant(spec: str) -> tuple[str, EngineConfig, bool, int, bool, bool, bool]:
    """``NAME:key=value,...``: engine config fields, ``unfused=1`` for the small ops in torch, ``kthreads=N``
    for the quantized kernels' threads apart from torch's, ``tail=0`` for a greedy step's norm, head and argmax
    through ``logits_at`` and ``sample`` (``TorchRunner.greedy_tail`` off), ``lookup=0`` for the token table's
    lookup in torch (``GroupInt8Embedding.fused`` off), ``huge=0`` for the quantized weights copied back from their
    huge pages (``cpu_pack.move_to_huge_pages``) to plain ones."""
    name, _, rest = spec.partition(":")
    fields: dict[str, object] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        fields[key] = int(value) if value.isdigit() else value
    unfused = bool(fields.pop("unfused", 0))
    kthreads = int(fields.pop("kthreads", 0))  # type: ignore[call-overload]
    tail, lookup, huge = (bool(fields.pop(key, 1)) for key in ("tail", "lookup", "huge"))
    cfg = EngineConfig(ring_name=f"step-{name}", geometry=GEOMETRY, kv_blocks=2048, max_batch=16, **fields)
    return name, cfg, unfused, kthreads, tail, lookup, huge


def build(name: str, cfg: EngineConfig, unfused: bool, kthreads: int, tail: bool = True,
          lookup: bool = True, huge: bool = True) -> Variant:
    backend = build_cpu_backend(cfg)
    if unfused:
        fuse_small_ops(backend.runner.model, on=False)  # type: ignore[union-attr]
    if not tail:
        backend.runner.greedy_tail = False  # type: ignore[union-attr]
    if not lookup:
        backend.runner.model.embed.fused = False  # type: ignore[union-attr]
    if not huge:  # before the first step, whose stack takes its weights' addresses
        for module in backend.runner.model.modules():  # type: ignore[union-attr]
            if isinstance(module, (Q4Linear, GroupInt8Embedding)):
                for key, buf in list(module.named_buffers(recurse=False)):
                    setattr(module, key, buf.clone())
    ring = local_ring(GEOMETRY)
    assert backend.runner is not None
    engine = RingEngine(ring, backend.runner, backend.policy, backend.eos_ids, backend.max_context,
                        backend.vocab_size)
    return Variant(name, cfg, engine, SlotWriter(ring), kthreads)


def submit(v: Variant, prompt: np.ndarray, max_new: int) -> None:
    ring, i = v.engine.ring, v.next_slot % GEOMETRY.num_slots
    v.next_slot += 1
    seq = v.writer.try_reserve(i, int(ring.slots[i]["seq"]))
    assert seq is not None, "slot busy"
    v.writer.publish(i, seq, SlotRequest(v.next_slot, prompt, Sampling(max_new, ignore_eos=True)))


def prompt_of(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(100, 40000, n).astype(np.int32)


def start_decodes(v: Variant, batch: int, prompt: int) -> None:
    """``batch`` requests, prefilled, so that every later step is a decode step of ``batch`` rows."""
    use_threads(v)
    for b in range(batch):
        submit(v, prompt_of(prompt, b), GEOMETRY.max_output_tokens - 1)
    while any(len(r.output) == 0 for r in v.engine.by_slot.values()) or len(v.engine.by_slot) < batch:
        v.engine.step()


def use_threads(v: Variant) -> None:
    torch.set_num_threads(v.cfg.cpu_threads)
    KernelThreads.count = v.kthreads


def timed_steps(v: Variant, steps: int) -> tuple[float, float]:
    """Wall and process CPU milliseconds per step (CPU time: what a loaded machine disturbs least)."""
    use_threads(v)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        v.engine.step()
    return (time.perf_counter() - t0) * 1e3 / steps, (time.process_time() - c0) * 1e3 / steps


def timed_prefill(v: Variant, tokens: int, seed: int) -> float:
    """One step that prefills a ``tokens``-token prompt alone (the running decodes paused)."""
    use_threads(v)
    saved = list(v.engine.policy.running)
    v.engine.policy.running.clear()
    submit(v, prompt_of(tokens, 1000 + seed), 1)
    v.engine.admit()
    t0 = time.perf_counter()
    v.engine.step()
    ms = (time.perf_counter() - t0) * 1e3
    while v.engine.policy.running or v.engine.policy.num_pending:
        v.engine.step()
    v.engine.policy.running[:] = saved
    return ms


def profile(v: Variant, steps: int) -> None:
    from torch.profiler import ProfilerActivity  # noqa: PLC0415
    from torch.profiler import profile as tprofile

    timed_steps(v, 3)
    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        timed_steps(v, steps)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))


def report(variants: list[Variant]) -> None:
    base = statistics.median(variants[0].decode_ms)
    for v in variants:
        d, c = v.decode_ms, v.decode_cpu_ms
        line = (f"{v.name:>12}: decode step wall min {min(d):7.2f} median {statistics.median(d):7.2f} ms "
                f"(x{statistics.median(d) / base:.2f} of {variants[0].name}), CPU min {min(c):7.2f} "
                f"median {statistics.median(c):7.2f} ms")
        if v.prefill_ms:
            p = v.prefill_ms
            line += f"   prefill min {min(p):8.1f} median {statistics.median(p):8.1f} ms"
        print(line, flush=True)
    if _cpu_quant is not None:  # (late jobs in a row, jobs left on the caller alone, spells alone): contention
        print(f"kernel pool state after the rounds: {_cpu_quant.pool_state()}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", required=True, help="NAME:key=value,... (repeatable)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=33)
    ap.add_argument("--steps", type=int, default=10, help="decode steps per variant per round")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--prefill", type=int, default=0, help="tokens of one timed prefill step per round (0: none)")
    ap.add_argument("--profile", default="", help="profile this variant's decode steps instead of timing")
    args = ap.parse_args()
    variants = [build(*parse_variant(s)) for s in args.variant]
    for v in variants:
        start_decodes(v, args.batch, args.prompt)
        timed_steps(v, 3)
    if args.profile:
        profile(next(v for v in variants if v.name == args.profile), args.steps)
        return
    for r in range(args.rounds):
        for v in variants:
            wall, cpu = timed_steps(v, args.steps)
            v.decode_ms.append(wall)
            v.decode_cpu_ms.append(cpu)
            if args.prefill:
                v.prefill_ms.append(timed_prefill(v, args.prefill, r))
    report(variants)


if __name__ == "__main__":
    main()
