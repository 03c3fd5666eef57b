"""Drive an engine process through its ring: random requests, cancellations, outputs by id.

Used by the benchmarks and the persistent-scheduler tests; plays the slot tracker and token reader
with the real slot transitions of shared/slots.py.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from shared import ring_layout as L
from shared.messages import Sampling
from shared.ring import Ring, attach_shm_ring
from shared.slots import SlotRequest, SlotWriter, split_word

S = L.SlotState
ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Job:
    rid: int
    prompt: np.ndarray
    max_new: int
    cancel_after: int | None = None  # cancel once this many tokens were seen
    temperature: float = 0.0
    seed: int | None = None
    top_p: float = 1.0
    top_k: int = 0
    top_logprobs: int = 0  # alternatives read back per token (Result.tops)

    def sampling(self) -> Sampling:
        """The job's sampling record: it always runs to ``max_new`` tokens (EOS ignored)."""
        return Sampling(self.max_new, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                        seed=self.seed, ignore_eos=True, logprobs=self.top_logprobs > 0,
                        top_logprobs=self.top_logprobs)


@dataclasses.dataclass
class Result:
    tokens: list[int]
    reason: int
    submit_s: float = 0.0
    first_s: float = 0.0
    done_s: float = 0.0
    tops: np.ndarray | None = None  # [tokens, k] (token, logprob) alternatives, where the job asked
    prompt: tuple[np.ndarray, np.ndarray] | None = None  # prompt positions' (entries, alternatives), where asked
    clocks: tuple[int, ...] = ()  # the slot's admit_ns, schedule_ns, first_token_ns and last_token_ns at the end
    stop_token: int = -1  # the stop id the engine wrote as the one that ended it (schema minor 6), else -1


def start_engine(ring: str, model: Path | None, backend: str, *extra: str, log: Path | None = None) -> subprocess.Popen:
    args = [sys.executable, "-m", "gpu_engine.serve", "--ring", ring, "--backend", backend, *extra]
    if model is not None:
        args += ["--model", str(model)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_ready(name: str, proc: subprocess.Popen, timeout: float = 600) -> Ring:
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited with {proc.returncode} before it was ready")
        try:
            ring = attach_shm_ring(name)
        except Exception:  # noqa: BLE001 - not created yet
            time.sleep(0.2)
            continue
        if ring.header_load32("engine_state") == L.EngineState.READY:
            return ring
        ring.close()
        time.sleep(0.2)
    raise TimeoutError("engine not ready")


def stop_engine(ring: Ring, proc: subprocess.Popen, timeout: float = 60) -> int:
    ring.header_store32("shutdown", 1)
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()


class Driver:
    """Keeps up to ``window`` jobs in flight; returns every job's tokens and finish reason.

    ``burst``: the jobs published in one pass ring the doorbell once, after the last of them, so the engine
    finds them all at its next look, as if they had arrived together; otherwise each rings on its own, as the
    slot tracker's do (the engine then starts steps while the later ones are still being written)."""

    def __init__(self, ring: Ring, window: int, minor0_every: int = 0, burst: bool = False) -> None:
        self.ring, self.w, self.t = ring, SlotWriter(ring), ring.transport
        self.window, self.burst = window, burst
        # Every n-th job (by id) is published as a frontend of schema minor 0 does: no pending_flips.
        self.minor0_every, self.flips = minor0_every, self.w.flips
        self.inflight: dict[int, tuple[Job, int, int, float]] = {}  # slot -> (job, seq, seen, submit time)
        self.results: dict[int, Result] = {}
        self.firsts: dict[int, float] = {}

    def _submit(self, job: Job, snap: np.ndarray) -> bool:
        for idx in np.flatnonzero(snap["state"] == S.EMPTY):
            if int(idx) in self.inflight:
                continue
            seq = self.w.try_reserve(int(idx), int(snap["seq"][idx]))
            if seq is None:
                continue
            req = SlotRequest(job.rid, job.prompt, job.sampling())
            self.w.flips = self.flips and not (self.minor0_every and job.rid % self.minor0_every == 0)
            self.w.publish(int(idx), seq, req, doorbell=not self.burst)
            self.inflight[int(idx)] = (job, seq, 0, time.perf_counter())
            return True
        return False

    def _collect(self) -> None:
        for idx, (job, seq, _seen, t0) in list(self.inflight.items()):
            state, _ = split_word(self.t.load64(self.ring.slot_offset(idx)))
            gen = self.t.load32(self.ring.slot_field(idx, "generated"))
            if gen and job.rid not in self.firsts:
                self.firsts[job.rid] = time.perf_counter()
            if job.cancel_after is not None and gen >= job.cancel_after:
                self.w.cancel(idx, seq)
            if state != S.DECODE_COMPLETED:
                continue
            gen = self.t.load32(self.ring.slot_field(idx, "generated"))
            reason = self.t.load32(self.ring.slot_field(idx, "finish_reason"))
            toks = self.ring.read_output(idx, 0, gen).tolist()
            tops = self.ring.read_logprobs(idx, 0, gen)[1] if job.top_logprobs else None
            asked = job.sampling().prompt_logprobs >= 0
            prompt = self.ring.read_prompt_logprobs(idx, 0, len(job.prompt)) if asked else None
            clocks = tuple(self.t.load64(self.ring.slot_field(idx, f))
                           for f in ("admit_ns", "schedule_ns", "first_token_ns", "last_token_ns"))
            self.results[job.rid] = Result(toks, reason, t0, self.firsts.get(job.rid, 0.0), time.perf_counter(),
                                           tops, prompt, clocks, self.ring.stop_token(idx))
            assert self.w.release(idx, seq)
            del self.inflight[idx]

    def describe(self) -> str:
        """Ring state for error messages: engine state, shutdown flag, slot states in flight."""
        h = self.ring.read_header()
        snap = self.ring.read_slots()
        states = {int(i): (int(snap["state"][i]), int(snap["generated"][i]), int(snap["cancel"][i]))
                  for i in list(self.inflight)[:8]}
        return (f"engine_state={int(h['engine_state'])} shutdown={int(h['shutdown'])} "
                f"doorbell={int(h['doorbell'])} slots(state, generated, cancel)={states}")

    def run(self, jobs: list[Job], timeout: float = 600) -> dict[int, Result]:
        todo = list(reversed(jobs))
        end = time.time() + timeout
        while todo or self.inflight:
            if time.time() > end:
                raise TimeoutError(f"{len(todo)} jobs not submitted, {len(self.inflight)} in flight; "
                                   f"{self.describe()}")
            snap = self.ring.read_slots()
            published = 0
            while todo and len(self.inflight) < self.window and self._submit(todo[-1], snap):
                todo.pop()
                published += 1
            if self.burst and published:
                self.w.ring_doorbell(published)
            self._collect()
        return self.results


def random_jobs(n: int, vocab: int, seed: int, max_prompt: int, max_new: int, cancel_frac: float) -> list[Job]:
    rng = np.random.default_rng(seed)
    jobs = []
    for rid in range(1, n + 1):
        plen = int(rng.integers(1, max_prompt + 1))
        new = int(rng.integers(1, max_new + 1))
        cancel = int(rng.integers(0, new)) if rng.random() < cancel_frac else None
        jobs.append(Job(rid, rng.integers(3, vocab, size=plen).astype(np.int32), new, cancel))
    return jobs
