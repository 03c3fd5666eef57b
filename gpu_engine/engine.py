"""The engine's side of the ring for Python-driven backends (CPU, and host-driven GPU).

One step is three calls: ``admit`` (claim pending slots, apply cancellations), ``schedule +
run`` (policy picks a plan, the runner executes it), ``postprocess`` (publish tokens, complete
and free). ``serve`` loops over steps, beats the heartbeat and stops on the shutdown flag.
"""

from __future__ import annotations

import select
import threading
import time

import numpy as np

from gpu_engine.grammar_mask import GrammarCache
from gpu_engine.policy import Finish, Phase, Policy, Request, StepPlan
from gpu_engine.prompt_logprobs import PromptLogprobs
from gpu_engine.runner import Runner, StepOutput
from gpu_engine.sampling import SamplingSpec
from shared import ring_layout as L
from shared.engine_slots import SlotEngine
from shared.log import get_logger
from shared.notify import Notifier
from shared.ring import STEP_FILL_BOUNDS, Ring, step_fill_bucket
from shared.slots import MAX_LOGIT_BIAS

S = L.SlotState
log = get_logger("engine")
FEATURES = (L.SamplingFeatures.PENALTIES | L.SamplingFeatures.LOGIT_BIAS | L.SamplingFeatures.MIN_TOKENS
            | L.SamplingFeatures.GRAMMAR | L.SamplingFeatures.PROMPT_LOGPROBS)
# When the heartbeat thread stops beating (the frontend then takes the engine for dead): the loop has not
# come round for STALL_S outside a step, or one step has run for longer than STALL_S plus STALL_PER_TOKEN_S
# for each token it computes. A 4,096-token prefill on a loaded CPU takes minutes and is progress, not a
# hang; the per-token bound is generous (a 4,096-token step may run 470 s, over three times what one took
# on a loaded 2-core machine) so only a stuck step trips it.
STALL_S = 60.0
STALL_PER_TOKEN_S = 0.1


def features(ring: Ring) -> int:
    """The ``SamplingFeatures`` this engine serves on ``ring``: PROMPT_LOGPROBS only where the ring has
    prompt-logprob rows (``--max-prompt-logprobs-tokens 0`` leaves none), so the gateway says the backend does
    not compute them rather than that a prompt is too long."""
    rows = ring.geometry.prompt_logprob_rows
    return int(FEATURES if rows else FEATURES & ~L.SamplingFeatures.PROMPT_LOGPROBS)


class RingEngine:
    """Drives a runner from the ring under the shared policy."""

    def __init__(self, ring: Ring, runner: Runner, policy: Policy, eos_ids: tuple[int, ...],
                 max_context: int, vocab_size: int) -> None:
        self.ring = ring
        self.slots = SlotEngine(ring)
        self.runner = runner
        self.policy = policy
        self.eos_ids = frozenset(eos_ids)
        self.max_context = max_context
        self.vocab_size = vocab_size
        self.grammars = GrammarCache(ring.name, vocab_size)
        self.by_slot: dict[int, Request] = {}
        self.scheduled: set[int] = set()  # slots whose request has its schedule_ns (the first prompt chunk's step)
        self.arrivals = 0
        self.steps = self.prompt_tokens = self.output_tokens = 0
        # EngineStats.step_fill: steps by tokens / the policy's token budget (shared.ring.step_fill_bucket)
        self.step_fill = [0] * len(STEP_FILL_BOUNDS) + [0]
        # RingHeader.step_tokens / padded_tokens: the steps' tokens, and those their graphs computed past them
        self.step_tokens = self.padded_tokens = 0
        self.draining = False
        self._loop_seen = 0.0
        self._in_step: tuple[float, int] | None = None  # (started, tokens) while the runner computes a step
        self._stopped = threading.Event()
        # shared/notify.py: the token reader's wake-up after a step that published or ended anything, and the
        # tracker's to this engine when it publishes a slot (None: the other side polls, as over RDMA)
        self.tokens_out: Notifier | None = None
        self.work_in: Notifier | None = None
        self._news = False  # a token published or a request ended since the reader was last woken

    # ------------------------------------------------------------------ admit
    def admit(self) -> None:
        if not self.draining:
            for idx, seq in self.slots.scan_pending():
                meta = self.slots.claim(idx, seq)
                if meta is not None:
                    self._accept(idx, seq, meta)
        if self.by_slot:
            flags = self.slots.cancel_flags()
            for idx in [i for i in self.by_slot if flags[i]]:
                self._end(self.by_slot[idx], Finish.CANCELLED)

    def _accept(self, idx: int, seq: int, meta: np.void) -> None:
        plen, max_new_tokens = int(meta["prompt_len"]), int(meta["max_new_tokens"])
        if plen + max_new_tokens > self.max_context or not self.policy.can_ever_fit(plen, max_new_tokens):
            self._refuse(idx, L.ErrorCode.NO_CAPACITY)
            return
        prompt, bias = self.slots.prompt(idx, plen), self._logit_bias(idx, plen, meta["sampling"])
        if prompt.min() < 0 or prompt.max() >= self.vocab_size or bias is None:
            self._refuse(idx, L.ErrorCode.BAD_PARAMS)
            return
        gid = int(meta["sampling"]["grammar_id"])
        grammar = self.grammars.get(gid) if gid else None
        if gid and grammar is None:
            self._refuse(idx, L.ErrorCode.BAD_PARAMS)
            return
        rid = int(meta["request_id"])
        spec = SamplingSpec.from_ring(meta["sampling"], rid, bias, self.eos_ids, grammar,
                                      int(meta["num_prompt_logprobs"]))
        if spec.prompt_logprobs >= 0 and not self._prompt_logprobs_fit(plen, spec.prompt_logprobs):
            self._refuse(idx, L.ErrorCode.BAD_PARAMS)
            return
        req = Request(slot=idx, seq=seq, request_id=rid, prompt=prompt.tolist(), max_new_tokens=max_new_tokens,
                      arrival=self.arrivals, sampling=spec, salt=int(meta["cache_salt"]))
        self.arrivals += 1
        self.by_slot[idx] = req
        self.policy.add(req)

    def _refuse(self, idx: int, code: int) -> None:
        self.slots.complete(idx, L.FinishReason.ERROR, code)
        self._news = True

    def _prompt_logprobs_fit(self, plen: int, k: int) -> bool:
        """Whether the slot's prompt-logprob rows hold a prompt of ``plen`` tokens with ``k`` alternatives."""
        g = self.ring.geometry
        return plen <= g.prompt_logprob_rows and k <= g.top_logprobs

    def _logit_bias(self, idx: int, plen: int, sp: np.void) -> np.ndarray | None:
        """The slot's ``LogitBias`` entries (the tail of its prompt row); None when they are malformed."""
        n, row = int(sp["num_logit_bias"]), self.ring.geometry.max_prompt_tokens
        if n > MAX_LOGIT_BIAS or plen + 2 * n > row:
            return None
        table = np.empty(n, L.LOGITBIAS_DTYPE)
        if n:
            self.ring.transport.read_into(self.ring.prompt_offset(idx) + 4 * row - table.nbytes, table)
        ok = (table["token"] >= 0) & (table["token"] < self.vocab_size) & (np.abs(table["bias"]) <= 100)
        return table if bool(ok.all()) else None

    # ------------------------------------------------------------------ step
    def step(self) -> bool:
        """Run one step; False when there was nothing to do."""
        self.admit()
        plan = self.policy.schedule()
        if plan is None:
            return False
        for req in plan.preempted:  # a partial prefill sent back to `waiting` keeps its PREFILL state
            if req.phase == Phase.PAUSED:
                self.slots.set_state(req.slot, S.DECODE_PAUSED)
        if not plan.work:
            return True
        self._stamp_scheduled(plan)
        self._in_step = (time.monotonic(), plan.num_tokens)
        try:
            out = self.runner.run(plan)
        finally:
            self._in_step = None
        self.postprocess(plan, out)
        return True

    def _stamp_scheduled(self, plan: StepPlan) -> None:
        """Slot.schedule_ns of each request whose first prompt chunk this step carries (a preempted request that
        comes back keeps its first time): the end of its wait in this engine's queue."""
        now = 0
        for w in plan.work:
            if w.prefill and w.req.slot not in self.scheduled:
                now = now or time.time_ns()
                self.ring.transport.store64(self.ring.slot_field(w.req.slot, "schedule_ns"), now)
                self.scheduled.add(w.req.slot)

    def postprocess(self, plan: StepPlan, out: StepOutput) -> None:
        starts = [len(w.req.output) for w in plan.work]
        results = self.policy.commit(plan, out.tokens, self.eos_ids)
        self.steps += 1
        self.prompt_tokens += plan.prompt_tokens
        self.step_fill[step_fill_bucket(plan.num_tokens, self.policy.token_budget)] += 1
        self.step_tokens += plan.num_tokens
        self.padded_tokens += max(0, out.graph_tokens - plan.num_tokens)
        for entries in out.prompt:  # before token 0's release, which publishes them
            self._write_prompt_logprobs(plan.work[entries.row].req, entries)
        for b, ((req, tok, reason), start, w) in enumerate(zip(results, starts, plan.work, strict=True)):
            if b in out.failed:  # its token is not published: the request ends with the error alone
                self.policy.finish(req, Finish.ERROR)
                self.slots.complete(req.slot, L.FinishReason.ERROR, L.ErrorCode.OUT_OF_MEMORY)
                self.by_slot.pop(req.slot, None)
                self.scheduled.discard(req.slot)
                self._news = True
                continue
            if len(req.output) > start:
                self._publish(req, b, start, tok, out)
            if w.prefill and w.samples and reason == Finish.NONE:
                self.slots.set_state(req.slot, S.DECODE_PROCESSING)
            if reason != Finish.NONE:
                self._complete(req, reason, tok)

    def _write_prompt_logprobs(self, req: Request, e: PromptLogprobs) -> None:
        n, k = len(e.logprobs), max(self.ring.geometry.top_logprobs, 1)
        entries = np.zeros(n, L.PROMPTLOGPROB_DTYPE)
        entries["logprob"], entries["rank"] = e.logprobs, e.ranks
        top = np.zeros((n, k), L.TOPLOGPROB_DTYPE)
        m = min(k, e.top_ids.shape[1])
        top["token"][:, :m], top["logprob"][:, :m] = e.top_ids[:, :m], e.top_logprobs[:, :m]
        self.slots.write_prompt_logprobs(req.slot, e.start, entries, top)

    def _publish(self, req: Request, b: int, start: int, tok: int, out: StepOutput) -> None:
        k = max(self.ring.geometry.top_logprobs, 1)
        top = None
        if req.sampling.want_logprobs:
            top = np.zeros((1, k), L.TOPLOGPROB_DTYPE)
            n = min(k, out.top_ids.shape[1])
            top["token"][0, :n], top["logprob"][0, :n] = out.top_ids[b, :n], out.top_logprobs[b, :n]
        if start == 0:  # before token 0's release: the reader sees it with the first token
            self.ring.transport.store32(self.ring.slot_field(req.slot, "cached_tokens"), max(req.cached_tokens, 0))
        self.slots.publish(req.slot, start, np.array([tok], np.int32), out.logprobs[b : b + 1], top)
        self._news = True
        self.output_tokens += 1

    def _complete(self, req: Request, reason: Finish, token: int = -1) -> None:
        """The slot's completion; ``token``, the one that ended it (the stop id, with ``STOP_ID``)."""
        self.slots.complete(req.slot, int(reason), stop_token=token)
        self.by_slot.pop(req.slot, None)
        self.scheduled.discard(req.slot)
        self._news = True

    def wake_reader(self) -> None:
        """Tell the token reader to look at the ring, once per step that changed what it reads."""
        if self._news:
            self._news = False
            if self.tokens_out is not None:
                self.tokens_out.notify()

    def wait_for_work(self, timeout_s: float) -> None:
        """Idle: sleep ``timeout_s``, or until the tracker says it published a slot."""
        if self.work_in is None or timeout_s <= 0:
            time.sleep(timeout_s)
            return
        ready, _, _ = select.select([self.work_in], [], [], timeout_s)
        if ready:
            self.work_in.drain()

    def _end(self, req: Request, reason: Finish) -> None:
        self.policy.finish(req, reason)
        self._complete(req, reason)

    # ------------------------------------------------------------------ loop
    def publish_stats(self) -> None:
        p = self.policy
        self.ring.stats_store("running", len(p.running))
        self.ring.stats_store("waiting", p.num_pending)
        self.ring.stats_store("kv_blocks_total", p.alloc.num_total)
        self.ring.stats_store("kv_blocks_free", p.alloc.num_free)
        self.ring.stats_store("steps", self.steps)
        self.ring.stats_store("prompt_tokens", self.prompt_tokens)
        self.ring.stats_store("output_tokens", self.output_tokens)
        self.ring.stats_store("preemptions", p.preemptions)
        self.ring.stats_store("token_budget", p.token_budget)
        for k, n in enumerate(self.step_fill):
            self.ring.stats_store("step_fill", n, k)
        self.ring.header_store64("step_tokens", self.step_tokens)
        self.ring.header_store64("padded_tokens", self.padded_tokens)
        cache = p.alloc.cache.stats
        self.ring.header_store64("prefix_cache_queries", cache.queries)
        self.ring.header_store64("prefix_cache_hits", cache.hits)
        self.ring.header_store64("prefix_cache_evictions", cache.evictions)

    def cancel_all(self) -> None:
        for req in list(self.by_slot.values()):
            self._end(req, Finish.CANCELLED)

    def making_progress(self, now: float, stall_s: float, per_token_s: float) -> bool:
        """The stall rule (see STALL_S): inside a step, its bound grows with its tokens; outside, the loop
        must come round within ``stall_s``."""
        step = self._in_step
        if step is not None:
            started, tokens = step
            return now - started < stall_s + tokens * per_token_s
        return now - self._loop_seen < stall_s

    def _beat_forever(self, every_s: float, stall_s: float, per_token_s: float) -> None:
        """Heartbeat from a thread, so a long step (a big prefill on a loaded CPU) does not look like
        a dead engine; it stops beating when the loop is stuck (``making_progress``)."""
        while not self._stopped.wait(every_s):
            if self.making_progress(time.monotonic(), stall_s, per_token_s):
                self.slots.beat()

    def serve(self, beat_every_s: float = 0.1, drain_timeout_s: float = 5.0, stall_s: float = STALL_S,
              stall_per_token_s: float = STALL_PER_TOKEN_S) -> None:
        """Step until the shutdown flag; then drain (no new claims) and cancel what is left."""
        self.ring.header_store32("sampling_features", int(features(self.ring)))
        if self.tokens_out is None:  # made before READY: a frontend that sees READY finds them
            self.tokens_out = Notifier.create(self.ring.transport, "tokens")
            self.work_in = Notifier.create(self.ring.transport, "work")
            if self.work_in is not None and not self.work_in.take():
                self.work_in.close()
                self.work_in = None
        self.ring.header_store32("engine_state", L.EngineState.READY)
        self.slots.beat()
        self._loop_seen, self._stopped = time.monotonic(), threading.Event()
        beater = threading.Thread(target=self._beat_forever, args=(beat_every_s, stall_s, stall_per_token_s),
                                  name="heartbeat", daemon=True)
        beater.start()
        try:
            self._loop(beat_every_s, drain_timeout_s)
        finally:
            self._stopped.set()
            beater.join()
        self.cancel_all()
        self.wake_reader()
        self.publish_stats()
        self.ring.header_store32("engine_state", L.EngineState.STOPPED)
        for notifier in (self.tokens_out, self.work_in):
            if notifier is not None:
                notifier.close()
        self.tokens_out = self.work_in = None

    def _loop(self, beat_every_s: float, drain_timeout_s: float) -> None:
        last_beat, idle, drain_deadline = 0.0, 0, float("inf")
        while True:
            now = self._loop_seen = time.monotonic()
            if now - last_beat >= beat_every_s:
                self.publish_stats()
                last_beat = now
                if not self.draining and self.ring.header_load32("shutdown"):
                    self.draining, drain_deadline = True, now + drain_timeout_s
                    self.ring.header_store32("engine_state", L.EngineState.DRAINING)
            if self.draining and (not self.by_slot or now > drain_deadline):
                break
            if self.step():
                idle = 0
                self.wake_reader()
            else:
                self.wake_reader()  # an admission that ended at once (a refused request)
                idle = min(idle + 1, 40)
                self.wait_for_work(0 if idle < 8 else 25e-6 * idle)
