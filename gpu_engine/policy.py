"""The scheduling policy, written once: FCFS continuous batching with inline prefill.

Plain Python, no model code. The CPU engine and the host-driven GPU engine call it every step;
the persistent CUDA scheduler (``gpu_engine/csrc/scheduler.cu``) implements the same rules, and
``docs/POLICY.md`` maps each function here to its place there.

A step is either a **prefill** of newly admitted (or resumed) requests or a **decode** of the
running batch. New prompts are admitted inline, ahead of the next decode, when

  (i)   prefills are pending (claimed requests waiting, or preempted ones paused),
  (ii)  the batch has free places, counting the completions of the step just finished,
  (iii) there is headroom: KV blocks for the whole prompt plus one token, the step's prefill
        token budget, and (persistent scheduler only) device-launch-window room.

When a decode step needs a block and none is free, the youngest running request is preempted
(its blocks freed, state DECODE_PAUSED) until the allocation succeeds; paused requests resume
in arrival order before any new prompt is admitted. Resumption recomputes the KV of
prompt + generated tokens in a prefill.

A decode step in which no row uses top-k, top-p or min-p runs the sort-free variant of the decode
graph (``step_filters``); its tokens are the same as the filtering variant's.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Callable, Iterable

from gpu_engine.kv_cache import BlockAllocator, NoFreeBlocks
from gpu_engine.sampling import SamplingSpec
from shared.ring_layout import FinishReason as Finish


class Phase(enum.IntEnum):
    WAITING = 0   # claimed, not yet prefilled
    RUNNING = 1   # in the decode batch
    PAUSED = 2    # preempted, waiting to be resumed
    FINISHED = 3


@dataclasses.dataclass(slots=True, eq=False)
class Request:
    """The engine's view of one slot's request."""

    slot: int
    seq: int
    request_id: int
    prompt: list[int]
    max_new_tokens: int
    arrival: int                      # FCFS order: claim order
    sampling: SamplingSpec = SamplingSpec()  # stop ids, ignore_eos and the graph variant are read here
    output: list[int] = dataclasses.field(default_factory=list)
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_cached: int = 0               # tokens whose KV is in the cache
    phase: Phase = Phase.WAITING
    finish: Finish = Finish.NONE

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def context_len(self) -> int:
        return len(self.prompt) + len(self.output)


@dataclasses.dataclass(slots=True)
class SeqWork:
    """One request's share of a step: ``num_new`` tokens starting after ``num_cached``."""

    req: Request
    num_cached: int
    num_new: int


@dataclasses.dataclass(slots=True)
class StepPlan:
    kind: str                          # "prefill" | "decode"
    work: list[SeqWork]
    preempted: list[Request] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(w.num_new for w in self.work)


def needs_filter(sampling: SamplingSpec) -> bool:
    """Whether a row's draw goes through the top-k / top-p / min-p filter (the sort over the vocabulary).

    A row filters iff it samples (temperature > 0) and any of the three is on; "off" is exactly what
    ``gpu_engine.sampling.filter_logits`` treats as off (top_k <= 0, top_p >= 1, min_p <= 0), so a
    value that is none of these (NaN included) counts as on: the filtered path is always exact.
    """
    if not sampling.temperature > 0:
        return False
    return not (sampling.top_k <= 0 and sampling.top_p >= 1.0 and sampling.min_p <= 0.0)


def step_filters(plan: StepPlan) -> bool:
    """Which graph variant a step runs: True for the filtering one (every prefill, and a decode with
    a row that ``needs_filter``), False for the sort-free decode graph (same tokens for such rows)."""
    return plan.kind != "decode" or any(needs_filter(w.req.sampling) for w in plan.work)


def finish_reason(req: Request, token: int, eos_ids: Iterable[int]) -> Finish:
    """Why ``req`` stops after sampling ``token`` (NONE to go on). EOS / stop ids are not emitted."""
    if token in req.sampling.stop_ids:
        return Finish.STOP_ID
    if not req.sampling.ignore_eos and token in eos_ids:
        return Finish.EOS
    if len(req.output) + 1 >= req.max_new_tokens:
        return Finish.LENGTH
    return Finish.NONE


class Policy:
    """FCFS continuous batching over one block allocator."""

    def __init__(self, allocator: BlockAllocator, block_size: int, max_batch: int,
                 max_prefill_tokens: int, window_headroom: Callable[[], bool] | None = None,
                 prefill_fits: Callable[[int, int], bool] | None = None) -> None:
        self.alloc = allocator
        # (sequences, tokens) -> whether one prefill step of that shape can run (a captured graph
        # holds it); None: any shape (the CPU engine)
        self.prefill_fits = prefill_fits or (lambda n, t: True)
        self.block_size = block_size
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.window_headroom = window_headroom or (lambda: True)
        self.waiting: collections.deque[Request] = collections.deque()
        self.paused: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.preemptions = 0

    # ------------------------------------------------------------------ admission
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, prompt_len: int, max_new_tokens: int) -> bool:
        """A request larger than the whole cache could never run: refuse it at the door."""
        return self.blocks_for(prompt_len + max_new_tokens) <= self.alloc.num_total

    def add(self, req: Request) -> None:
        req.phase = Phase.WAITING
        self.waiting.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.paused) + len(self.running)

    def schedule(self) -> StepPlan | None:
        """Choose the next step: inline prefill when the three conditions hold, else decode."""
        plan = self._admit()
        if plan is not None:
            return plan
        if self.running:
            return self._decode()
        return None

    def _admit(self) -> StepPlan | None:
        work: list[SeqWork] = []
        tokens = 0
        while (self.paused or self.waiting) and len(self.running) + len(work) < self.max_batch:
            queue = self.paused if self.paused else self.waiting
            req = queue[0]
            need = req.context_len            # recompute everything not cached
            # the first one may exceed the token budget alone
            if work and (tokens + need > self.max_prefill_tokens or not self.prefill_fits(len(work) + 1,
                                                                                          tokens + need)):
                break
            if not self.window_headroom():
                break
            try:
                req.blocks = self.alloc.allocate(self.blocks_for(need + 1))
            except NoFreeBlocks:
                break
            queue.popleft()
            req.num_cached = 0
            work.append(SeqWork(req, 0, need))
            tokens += need
        return StepPlan("prefill", work) if work else None

    def _decode(self) -> StepPlan:
        preempted: list[Request] = []
        for req in sorted(self.running, key=lambda r: r.arrival):
            if req.phase != Phase.RUNNING:
                continue                      # preempted below in this same pass
            while len(req.blocks) * self.block_size < req.context_len:
                try:
                    req.blocks += self.alloc.allocate(1)
                except NoFreeBlocks:
                    victim = self._youngest_running()
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is req:
                        break
        work = [SeqWork(r, r.context_len - 1, 1) for r in self.running]
        return StepPlan("decode", work, preempted)

    def _youngest_running(self) -> Request:
        return max(self.running, key=lambda r: r.arrival)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.alloc.free(req.blocks)
        req.blocks, req.num_cached, req.phase = [], 0, Phase.PAUSED
        # Paused requests resume oldest first.
        idx = sum(1 for p in self.paused if p.arrival < req.arrival)
        self.paused.insert(idx, req)
        self.preemptions += 1

    # ------------------------------------------------------------------ after a step
    def commit(self, plan: StepPlan, tokens: list[int], eos_ids: Iterable[int]) -> list[tuple[Request, int, Finish]]:
        """Apply one sampled token per sequence; returns (request, token, finish) per sequence.

        Tokens that end a request by EOS or a stop id are not appended to its output.
        """
        eos = frozenset(eos_ids)
        out: list[tuple[Request, int, Finish]] = []
        for w, tok in zip(plan.work, tokens, strict=True):
            req = w.req
            req.num_cached = w.num_cached + w.num_new
            reason = finish_reason(req, tok, eos)
            if reason in (Finish.NONE, Finish.LENGTH):
                req.output.append(tok)
            if plan.kind == "prefill" and req.phase != Phase.RUNNING:
                req.phase = Phase.RUNNING
                self.running.append(req)
            if reason != Finish.NONE:
                self.finish(req, reason)
            out.append((req, tok, reason))
        return out

    def finish(self, req: Request, reason: Finish) -> None:
        """Remove a request from wherever it is and free its blocks (completion or cancel)."""
        if req.phase == Phase.RUNNING and req in self.running:
            self.running.remove(req)
        elif req.phase == Phase.PAUSED and req in self.paused:
            self.paused.remove(req)
        elif req.phase == Phase.WAITING and req in self.waiting:
            self.waiting.remove(req)
        if req.blocks:
            self.alloc.free(req.blocks)
            req.blocks = []
        req.phase, req.finish = Phase.FINISHED, reason

    def all_requests(self) -> list[Request]:
        return [*self.running, *self.paused, *self.waiting]
