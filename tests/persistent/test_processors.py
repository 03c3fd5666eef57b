"""The logits processors (presence / frequency / repetition penalties, logit_bias, min_tokens) in both GPU
backends against the CPU engine, on the small fp32 Llama of test_persistent.py, through the ring.

The persistent backend applies them from the scheduler's device state (`gpu_engine/kernels/processors.py`):
these requests run beside plain ones, with cancellations, on few slots (every slot is reused many times by
requests with other processors or none), and with a step budget and KV cache small enough that prompts are
prefilled in chunks and requests are preempted and recomputed. Marked gpu: skipped without CUDA.
"""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

import msgspec
import numpy as np
import pytest

from harness.ring_driver import Driver, Result, start_engine, stop_engine, wait_ready
from persistent.test_persistent import CHUNK_ARGS, OUT, VOCAB, FieldJob, settled_header, tiny  # noqa: F401
from shared import ring_layout as L
from shared.messages import Sampling


@pytest.fixture(autouse=True)
def device_processors(monkeypatch: pytest.MonkeyPatch) -> None:
    """The persistent scheduler's device processors on (the default) even where the environment turned them
    off: the engines these tests start inherit the switch."""
    monkeypatch.setenv("BLINK_DEVICE_PROCESSORS", "1")


pytestmark = pytest.mark.gpu
F = L.FinishReason
EOS = 2  # the tiny model's
FEATURES = L.SamplingFeatures.PENALTIES | L.SamplingFeatures.LOGIT_BIAS | L.SamplingFeatures.MIN_TOKENS
# 32 slots for 32 requests in flight: every slot serves many requests in turn
FEW_SLOTS = ("--dtype", "float32", "--num-slots", "32", "--max-prompt-tokens", "256", "--max-output-tokens", "64",
             "--max-batch", "32", "--kv-blocks", "2000", "--block-size", "16", "--top-logprobs", "1")


@dataclasses.dataclass(frozen=True)
class ProcJob(FieldJob):
    """A driver job with the processor fields, EOS honoured unless `ignore_eos`."""

    ignore_eos: bool = True

    def sampling(self) -> Sampling:
        return msgspec.structs.replace(super().sampling(), ignore_eos=self.ignore_eos)


def serve(model: Path, backend: str, jobs: list[ProcJob], args: tuple[str, ...], tag: str,
          window: int = 32) -> tuple[dict[int, Result], dict]:
    """Run the jobs through one engine; results by id, and the header's features and counters at the end."""
    name = f"blink-procs-{backend}-{uuid.uuid4().hex[:6]}"
    OUT.mkdir(parents=True, exist_ok=True)
    proc = start_engine(name, model, backend, *args, log=OUT / f"engine-procs-{tag}-{backend}.log")
    ring = wait_ready(name, proc)
    try:
        features = ring.header_load32("sampling_features")
        results = Driver(ring, window).run([*jobs], timeout=480)
        h = settled_header(ring)
        stats = {"features": features, "preemptions": int(h["stats"]["preemptions"]),
                 "blocks_back": int(h["stats"]["kv_blocks_free"]) == int(h["stats"]["kv_blocks_total"]),
                 "exit_code": stop_engine(ring, proc)}
    finally:
        if proc.poll() is None:
            proc.kill()
        ring.close()
    return results, stats


def prompts(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=int(rng.integers(4, 120))).astype(np.int32) for _ in range(n)]


def groups(plain: dict[int, Result], ps: list[np.ndarray], max_new: int) -> list[ProcJob]:
    """Per prompt g (ids 10 g + k): k=0 plain; 1 its most frequent plain token banned (-100) and another
    boosted; 2 EOS forced (+100) but held back by min_tokens; 3 repetition; 4 frequency + presence; 5 all of
    them, seeded sampling; 6 a grammar id (no backend here knows it: refused)."""
    jobs = []
    for g, p in enumerate(ps):
        out = plain[10 * g].tokens
        banned = max(set(out), key=out.count)
        boost = VOCAB - 1 if banned != VOCAB - 1 else VOCAB - 3
        m = 3 + g % 5
        fields = {
            0: (), 1: (("logit_bias", tuple(sorted(((banned, -100.0), (boost, 3.0))))),),
            2: (("logit_bias", ((EOS, 100.0),)), ("min_tokens", m), ("stop_ids", (VOCAB - 2,))),
            3: (("repetition_penalty", 1.8),), 4: (("frequency_penalty", 1.5), ("presence_penalty", 0.5)),
            5: (("repetition_penalty", 1.3), ("frequency_penalty", 0.4), ("presence_penalty", -0.3),
                ("logit_bias", ((banned, -100.0),)), ("min_tokens", m)),
            6: (("grammar_id", 12345),),
        }
        for k, f in fields.items():
            seeded = {"temperature": 0.9, "seed": 77 + g, "top_k": 40} if k == 5 else {}
            cancel = max_new // 2 if k == 4 and g % 4 == 0 else None
            jobs.append(ProcJob(10 * g + k, p, max_new, cancel_after=cancel, ignore_eos=k != 2, fields=f,
                                **seeded))  # type: ignore[arg-type]
    return jobs


def check_effects(jobs: list[ProcJob], got: dict[int, Result], what: str) -> None:
    """What a user of each field sees: the banned token never appears, min_tokens holds EOS back exactly that
    long, the penalties change a repetitive greedy output, an unknown grammar is refused."""
    changed = 0
    for j in jobs:
        r, k, fields = got[j.rid], j.rid % 10, dict(j.fields)
        if "logit_bias" in fields and k != 2:
            banned = next(t for t, b in j.sampling().logit_bias if b < 0)
            assert banned not in r.tokens, f"{what}: request {j.rid} sampled its banned token {banned}"
        if k == 2:
            assert (len(r.tokens), r.reason) == (fields["min_tokens"], F.EOS), f"{what}: request {j.rid}: {r}"
        if k == 6:
            assert r.reason == F.ERROR, f"{what}: request {j.rid} with an unknown grammar was served"
        if k == 3:
            changed += r.tokens != got[j.rid - 3].tokens  # the plain request of the same prompt
    plain = [got[j.rid].tokens for j in jobs if j.rid % 10 == 0]
    # about half of the tiny model's plain outputs repeat a token within 24 (19 of 40 on the CPU engine)
    assert sum(len(set(t)) < len(t) for t in plain) > 0.25 * len(plain), "the tiny model should repeat itself"
    assert changed >= 0.8 * len(plain), f"{what}: repetition_penalty changed {changed} of {len(plain)} outputs"


def same_tokens(jobs: list[ProcJob], got: dict[int, Result], ref: dict[int, Result], what: str,
                greedy_only: bool) -> None:
    """Tokens equal to the reference's. Where either side was cancelled (the two runs hang up at moments of
    their own), the shorter output is a prefix of the longer."""
    diff = []
    for j in jobs:
        if greedy_only and j.temperature > 0:
            continue
        g, r = got[j.rid], ref[j.rid]
        if F.CANCELLED in (g.reason, r.reason):
            n = min(len(g.tokens), len(r.tokens))
            ok = g.tokens[:n] == r.tokens[:n] and (g.reason == F.CANCELLED or len(g.tokens) >= len(r.tokens))
        else:
            ok = (g.tokens, g.reason) == (r.tokens, r.reason)
        if not ok:
            diff.append(j.rid)
    assert not diff, f"{what}: {len(diff)} of {len(jobs)} requests differ, e.g. {diff[:8]}"


def test_both_gpu_backends_give_the_cpu_engines_tokens_with_every_processor(tiny: Path) -> None:  # noqa: F811
    ps = prompts(40, seed=21)
    max_new = 24
    plain, _ = serve(tiny, "cpu", [ProcJob(10 * g, p, max_new) for g, p in enumerate(ps)], FEW_SLOTS, "plain")
    jobs = groups(plain, ps, max_new)
    reference = [dataclasses.replace(j, cancel_after=None) for j in jobs]
    cpu, _ = serve(tiny, "cpu", reference, FEW_SLOTS, "cpu")
    check_effects(reference, cpu, "cpu")
    got = {}
    for backend in ("host", "persistent"):
        got[backend], stats = serve(tiny, backend, jobs, FEW_SLOTS, backend)
        assert stats["features"] & FEATURES == FEATURES, f"{backend} does not advertise the processors"
        same_tokens(jobs, got[backend], cpu, f"{backend} against the CPU engine", greedy_only=True)
        check_effects([j for j in jobs if j.cancel_after is None], got[backend], backend)
        assert stats["blocks_back"] and stats["exit_code"] == 0, stats
    # seeded sampling as well: the persistent backend draws what the host-driven one draws
    same_tokens(jobs, got["persistent"], got["host"], "persistent against host-driven", greedy_only=False)


def test_processors_survive_chunked_prefill_and_preemption(tiny: Path) -> None:  # noqa: F811
    """Long prompts in chunks of a 96-token budget and a 64-block cache: requests are preempted and their
    prompt and output recomputed; the counts the penalties use come from the same history every time."""
    ps = prompts(48, seed=22)
    ps = [np.concatenate([p, p[: 120]]) for p in ps]  # repeated text: the penalties have much to count
    max_new = 40
    plain, _ = serve(tiny, "host", [ProcJob(10 * g, p, max_new) for g, p in enumerate(ps)], CHUNK_ARGS, "cplain",
                     window=64)
    jobs = [j for j in groups(plain, ps, max_new) if j.rid % 10 != 6]
    host, hstats = serve(tiny, "host", jobs, CHUNK_ARGS, "chunked", window=64)
    pers, pstats = serve(tiny, "persistent", jobs, CHUNK_ARGS, "chunked", window=64)
    same_tokens(jobs, pers, host, "persistent against host-driven, chunked", greedy_only=False)
    check_effects([j for j in jobs if j.cancel_after is None], pers, "persistent, chunked")
    for st in (hstats, pstats):
        assert st["preemptions"] > 0 and st["blocks_back"] and st["exit_code"] == 0, st
