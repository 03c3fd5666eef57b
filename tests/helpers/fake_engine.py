"""A fake engine process for frontend tests, built on ``shared.engine_slots.SlotEngine``.

It takes the flags of ``python -m gpu_engine.serve`` (ignoring those it has no use for) and
serves the ring the same way: READY plus a heartbeat every 100 ms, shutdown flag or SIGTERM
to drain and exit, the segment unlinked at exit. Its "model" echoes the prompt (without the
first token) one token per step, then stops with EOS; with ``ignore_eos`` it keeps echoing
until ``max_new_tokens``. A seed rotates where the echo starts. Logprobs are fixed numbers. With
``--standby`` it is a spare, as the real engine's: it waits for blink serve's go and serves the ring it names.
``FAKE_ENGINE_LOAD_S`` in its environment: seconds it waits before creating its ring (a model's load);
``FAKE_ENGINE_HANG_ONCE``: see ``hang_now``. ``FAKE_ENGINE_STEP_MS``: a step's time, in place of ``--step-ms``.
``--rdma-listen`` exports the ring as the real engine's does (``shared.remote_ring.ExportServer``, checked before
the "load").
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time

import numpy as np

from shared import ring_layout as L
from shared.engine_slots import SlotEngine
from shared.log import get_logger, setup_logging
from shared.remote_ring import ExportServer
from shared.ring import Ring, RingGeometry, create_shm_ring
from shared.standby import wait_for_go
from shared.transport import RingError, ShmTransport

S, F, E = L.SlotState, L.FinishReason, L.ErrorCode


@dataclasses.dataclass(slots=True)
class Job:
    idx: int
    meta: np.void
    prompt: np.ndarray
    made: int = 0

    def next_token(self) -> int | None:
        """The token for this step, or None for EOS."""
        body = self.prompt[1:] if len(self.prompt) > 1 else self.prompt
        sp = self.meta["sampling"]
        shift = int(sp["seed"]) % len(body) if int(sp["flags"]) & L.SamplingFlags.HAS_SEED else 0
        if self.made >= len(body) and not int(sp["flags"]) & L.SamplingFlags.IGNORE_EOS:
            return None
        return int(body[(self.made + shift) % len(body)])


class FakeEngine:
    def __init__(self, ring: Ring, max_context: int, step_s: float) -> None:
        self.ring, self.engine = ring, SlotEngine(ring)
        self.max_context, self.step_s = max_context, step_s
        self.jobs: dict[int, Job] = {}
        self.stop = False

    def admit(self) -> None:
        for idx, seq in self.engine.scan_pending():
            meta = self.engine.claim(idx, seq)
            if meta is None:
                continue
            if int(meta["prompt_len"]) + int(meta["max_new_tokens"]) > self.max_context:
                self.engine.complete(idx, F.ERROR, E.PROMPT_TOO_LONG)
                continue
            self.engine.set_state(idx, S.DECODE_PROCESSING)
            self.jobs[idx] = Job(idx, meta, self.engine.prompt(idx, int(meta["prompt_len"])))

    def step(self) -> None:
        cancel = self.engine.cancel_flags()
        for idx, job in list(self.jobs.items()):
            if cancel[idx]:
                self._done(idx, F.CANCELLED)
                continue
            tok = job.next_token()
            if tok is None:
                self._done(idx, F.EOS)
                continue
            self._publish(job, tok)
            sp = job.meta["sampling"]
            if tok in sp["stop_ids"][: int(sp["num_stop_ids"])]:
                self._done(idx, F.STOP_ID, tok)
            elif job.made >= int(job.meta["max_new_tokens"]):
                self._done(idx, F.LENGTH)

    def _publish(self, job: Job, tok: int) -> None:
        want = int(job.meta["sampling"]["flags"]) & L.SamplingFlags.WANT_LOGPROBS
        lps = top = None
        if want:
            lps = np.array([-0.5], np.float32)
            top = np.zeros((1, max(self.ring.geometry.top_logprobs, 1)), L.TOPLOGPROB_DTYPE)
            top["token"][0] = [tok + i for i in range(top.shape[1])]
            top["logprob"][0] = [-0.5 - i for i in range(top.shape[1])]
        self.engine.publish(job.idx, job.made, np.array([tok], np.int32), lps, top)
        job.made += 1

    def _done(self, idx: int, reason: int, stop_token: int = -1) -> None:
        self.engine.complete(idx, reason, stop_token=stop_token)
        del self.jobs[idx]

    def stats(self) -> None:
        self.ring.stats_store("running", len(self.jobs))
        self.ring.stats_store("kv_blocks_total", 1000)
        self.ring.stats_store("kv_blocks_free", 1000 - 10 * len(self.jobs))

    def serve(self) -> None:
        next_beat = 0.0
        while not (self.stop or self.ring.header_load32("shutdown")):
            now = time.monotonic()
            if now >= next_beat:
                if hang_now():  # a deadlock: the process runs on, its loop and its beat stop
                    time.sleep(3600)
                self.engine.beat()
                self.stats()
                next_beat = now + 0.1
            self.admit()
            self.step()
            time.sleep(self.step_s)


def hang_now() -> bool:
    """Whether this engine's loop hangs now (``FAKE_ENGINE_HANG_ONCE``: a file path; once a test creates the file,
    the first serving engine that takes it, by renaming it away, hangs; the others never). The test says when,
    so a slow host cannot make the hang come before the server is ready."""
    path = os.environ.get("FAKE_ENGINE_HANG_ONCE")
    if not path:
        return False
    try:
        os.rename(path, path + ".taken")
    except FileNotFoundError:
        return False
    return True


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="fake engine for frontend tests")
    ap.add_argument("--ring", required=True)
    ap.add_argument("--num-slots", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-output-tokens", type=int, default=1024)
    ap.add_argument("--max-context", type=int, default=1536)
    ap.add_argument("--step-ms", type=float, default=2.0)
    ap.add_argument("--vocab-size", type=int, default=49152)
    ap.add_argument("--standby", action="store_true")
    ap.add_argument("--standby-gpu-known", action="store_true")  # the real spare's: no GPU here
    ap.add_argument("--rdma-listen", default=None)
    args, _ = ap.parse_known_args(argv)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.standby:
        setup_logging("engine")
        get_logger("engine").info("standby engine ready", pid=os.getpid())  # what the real spare says
        if (go := wait_for_go(sys.stdin.buffer)) is None:
            return
        args.ring = go.ring
    try:
        export = ExportServer(args.rdma_listen) if args.rdma_listen else None
    except (ValueError, RingError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    time.sleep(float(os.environ.get("FAKE_ENGINE_LOAD_S", "0")))  # a model load's time, before the ring exists
    geo = RingGeometry(args.num_slots, args.max_prompt_tokens, args.max_output_tokens, top_logprobs=5)
    ring = create_shm_ring(args.ring, geo)
    if export is not None:
        setup_logging("engine")
        export.start(ring)
    fake = FakeEngine(ring, args.max_context, float(os.environ.get("FAKE_ENGINE_STEP_MS", args.step_ms)) / 1000)
    signal.signal(signal.SIGTERM, lambda *_: setattr(fake, "stop", True))
    signal.signal(signal.SIGINT, lambda *_: setattr(fake, "stop", True))
    ring.header_store32("vocab_size", args.vocab_size)
    ring.header_store32("max_context", args.max_context)
    ring.header_store32("engine_state", L.EngineState.READY)
    try:
        fake.serve()
    finally:
        ring.header_store32("engine_state", L.EngineState.STOPPED)
        if export is not None:
            export.close()
        ShmTransport.unlink_name(args.ring)


if __name__ == "__main__":
    main()
