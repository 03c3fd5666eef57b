"""The scheduling policy, written once: FCFS continuous batching with chunked prefill.

Plain Python, no model code. The CPU engine and the host-driven GPU engine call it every step;
the persistent CUDA scheduler (``gpu_engine/csrc/sched_policy.cuh``) implements the same rules, and
``docs/POLICY.md`` maps each function here to its place there.

**Chunked prefill** (the default). Every step has a token budget (``--max-num-batched-tokens``).
Every running request gets its decode token first; the rest of the budget goes to prefill chunks
in FCFS order: the request whose prefill is under way (at most one: only the last request admitted
to a step can be cut short, and it is first in line at the next step), then paused requests (they
resume by recomputing prompt + generated tokens), then waiting ones. A request's KV blocks are
allocated chunk by chunk (a prompt that is still waiting holds nothing the decodes could use); the
chunk that ends a prompt also gets the block of the first generated token, and only that chunk's
sampled token is used. A step with at least one chunk is a *prefill* step (its rows: the decodes,
then the chunks); one without is a *decode* step. New prompts take chunks when

  (i)   prefills are pending (a partial prefill, paused or waiting requests),
  (ii)  the batch has free places, counting the completions of the step just finished,
  (iii) there is headroom: budget tokens left after the decodes, KV blocks for the chunk, a
        captured graph for the step's shape and (persistent scheduler only) launch-window room;
  (iv)  the step preempted nobody (the blocks a preemption frees go to the decodes).

When a decode needs a block and none is free, the youngest of the running requests and the
partial prefill is preempted (its blocks freed), until the allocation succeeds; a preempted
running request is paused (state DECODE_PAUSED) and resumes in arrival order before any new
prompt is admitted; a preempted partial prefill goes back to the head of its queue.

**Without chunking** (``--no-enable-chunked-prefill``) a step is either a prefill of whole prompts,
admitted while their tokens fit the budget (the first may exceed it alone), or a decode of the
running batch; a prompt gets the blocks of its whole context plus one token at admission.

**Prefix caching** (``prefix_caching``, with chunked prefill only: ``--no-enable-prefix-caching`` turns
it off). A full block of a request's tokens is identified by a hash chained over its tokens from the
request's salt (``gpu_engine.prefix_cache``); a block is registered when the tokens computed fill it
(after a chunk or a decode). When a request's first chunk is taken (admission, or resumption after a
preemption) its leading full blocks are looked up, at most up to the block before the one holding its
last token (a token must be computed to sample), and the blocks found are shared (their reference counts
raised): the chunk starts after them, and the request never writes them (it writes only past its cached
prefix). The chunk's new blocks and the shared idle ones must all be free, else nothing is taken. A block
whose count drops to 0 (finish, cancellation, preemption) keeps its content and stays findable until an
allocation evicts it, least recently used first (``gpu_engine.kv_cache.BlockAllocator``). A request that
asks for prompt log-probs looks nothing up (every prompt position's logits must be computed); its blocks
are registered as any other's.

A step in which no row uses top-k, top-p or min-p runs the sort-free variant of its graph
(``step_filters``; without chunking, prefill graphs exist in the filtering variant only); its tokens
are the same as the filtering variant's.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import enum
from collections.abc import Callable, Iterable

from gpu_engine.kv_cache import BlockAllocator, NoFreeBlocks
from gpu_engine.prefix_cache import extend_hashes
from gpu_engine.sampling import SamplingSpec
from shared.ring_layout import FinishReason as Finish


class Phase(enum.IntEnum):
    WAITING = 0   # claimed, not yet prefilled
    RUNNING = 1   # in the decode batch
    PAUSED = 2    # preempted, waiting to be resumed
    FINISHED = 3
    PREFILL = 4   # in a prefill: a chunk in flight, or between chunks (``Policy.partial``)


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
    salt: int = 0                     # the prefix cache's salt: requests of different salts share no block
    hashes: list[int] = dataclasses.field(default_factory=list)  # of the full blocks of ``tokens`` so far
    num_registered: int = 0           # leading blocks of ``blocks`` that are in the prefix cache
    cached_tokens: int = -1           # prompt tokens found in the prefix cache at first admission (-1: not yet)
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
    """One request's share of a step: ``num_new`` tokens starting after ``num_cached``.

    ``prefill``: the row is a prompt chunk (else a decode row); ``samples``: its sampled token is used
    (a decode row, or the chunk that ends the prompt).
    """

    req: Request
    num_cached: int
    num_new: int
    prefill: bool = False
    samples: bool = True


@dataclasses.dataclass(slots=True)
class StepPlan:
    kind: str                          # "prefill" | "decode"
    work: list[SeqWork]
    preempted: list[Request] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(w.num_new for w in self.work)

    @property
    def prompt_tokens(self) -> int:
        """Tokens of the step that are prompt (or recomputed) tokens, not decode tokens."""
        return sum(w.num_new for w in self.work if w.prefill)


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
    """Which graph variant a step runs: True for the filtering one (a row whose token is used
    ``needs_filter``), False for the sort-free one (same tokens for such rows). Without chunking
    prefill graphs exist in the filtering variant only, which the lookup then gives for both."""
    return any(w.samples and needs_filter(w.req.sampling) for w in plan.work)


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
    """FCFS continuous batching over one block allocator; chunked prefill unless ``chunked=False``.

    ``token_budget`` is the step's token budget (``--max-num-batched-tokens``): decodes plus prefill
    chunks with chunking, the prefill tokens of a step without (where the first prompt may exceed it
    alone). With chunking it must hold one token for every sequence of a full batch.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int, max_batch: int,
                 token_budget: int, window_headroom: Callable[[], bool] | None = None,
                 prefill_fits: Callable[[int, int], bool] | None = None, chunked: bool = True,
                 prefix_caching: bool = False) -> None:
        if chunked and token_budget < max_batch:
            raise ValueError(f"a token budget of {token_budget} cannot hold the decodes of {max_batch} "
                             "sequences: --max-num-batched-tokens must be >= --max-num-seqs")
        self.alloc = allocator
        # (sequences, tokens) -> whether one prefill step of that shape can run (a captured graph
        # holds it); None: any shape (the CPU engine)
        self.prefill_fits = prefill_fits or (lambda n, t: True)
        self.block_size = block_size
        self.max_batch = max_batch
        self.token_budget = token_budget
        self.chunked = chunked
        self.prefix_caching = prefix_caching and chunked  # a cached prefix is a prefill starting after it
        self.window_headroom = window_headroom or (lambda: True)
        self.waiting: collections.deque[Request] = collections.deque()
        self.paused: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.partial: Request | None = None  # the request whose chunked prefill is under way
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
        return len(self.waiting) + len(self.paused) + len(self.running) + (self.partial is not None)

    @property
    def num_pending(self) -> int:
        """Requests waiting for (the rest of) their prefill."""
        return len(self.waiting) + len(self.paused) + (self.partial is not None)

    def schedule(self) -> StepPlan | None:
        """Choose the next step (see the module's docstring for the two policies)."""
        if self.chunked:
            return self._chunked_step()
        plan = self._admit()
        if plan is not None:
            return plan
        if self.running:
            return self._decode()
        return None

    # ------------------------------------------------------------------ chunked prefill
    def _chunked_step(self) -> StepPlan | None:
        preempted = self._grow_running()
        work = [SeqWork(r, r.context_len - 1, 1) for r in self.running]
        tokens = len(work)
        # a step that had to preempt admits no chunk: the blocks it freed go to the decodes
        while not preempted and tokens < self.token_budget and len(work) < self.max_batch:
            chunk = self._next_chunk(len(work), tokens)
            if chunk is None:
                break
            work.append(chunk)
            tokens += chunk.num_new
        if not work:
            return StepPlan("decode", [], preempted) if preempted else None
        kind = "prefill" if any(w.prefill for w in work) else "decode"
        return StepPlan(kind, work, preempted)

    def _next_chunk(self, rows: int, tokens: int) -> SeqWork | None:
        """The next prefill chunk in FCFS order within the budget left, its blocks allocated; None when
        nothing is pending or the head request cannot take a chunk now (strict FCFS: no overtaking)."""
        req = self.partial or (self.paused[0] if self.paused else self.waiting[0] if self.waiting else None)
        if req is None or not self.window_headroom():
            return None
        first = req is not self.partial
        hit = self._cached_prefix(req) if first else []
        start = len(hit) * self.block_size if first else req.num_cached
        todo = req.context_len - start
        n = min(todo, self.token_budget - tokens)
        last = n == todo
        if not self.prefill_fits(rows + 1, tokens + n):
            return None
        if not self._take_blocks(req, hit, self.blocks_for(start + n + (1 if last else 0))):
            return None
        if first:
            (self.paused if req.phase == Phase.PAUSED else self.waiting).popleft()
            req.num_cached, req.num_registered = start, len(hit)
            self._count_lookup(req, start)
        req.phase = Phase.PREFILL
        self.partial = None if last else req
        return SeqWork(req, req.num_cached, n, prefill=True, samples=last)

    def _take_blocks(self, req: Request, hit: list[int], blocks: int) -> bool:
        """All-or-nothing: share the cached blocks ``hit`` (a request being admitted, holding none) and
        grow ``req``'s block table to ``blocks`` blocks; False (nothing taken) when they are not free.
        An idle cached block of ``hit`` counts as taken: sharing it makes it unevictable."""
        new = blocks - len(req.blocks) - len(hit)
        idle = sum(1 for b in hit if self.alloc.refcount(b) == 0)
        if new > self.alloc.num_free - idle:
            return False
        if hit:
            self.alloc.share(hit)
            req.blocks += hit
        if new > 0:
            req.blocks += self.alloc.allocate(new)
        return True

    # ------------------------------------------------------------------ prefix cache
    def _cached_prefix(self, req: Request) -> list[int]:
        """The cached blocks of ``req``'s leading full blocks, leaving at least its last token to compute
        (the step samples from it)."""
        if not self.prefix_caching or req.sampling.prompt_logprobs >= 0:  # prompt log-probs need every position
            return []
        tokens = req.tokens
        extend_hashes(req.hashes, tokens, self.block_size, req.salt)
        return self.alloc.cache.find(req.hashes[: (len(tokens) - 1) // self.block_size])

    def _count_lookup(self, req: Request, cached: int) -> None:
        """An admission's lookup in the counters (vLLM's: every admission, resumptions too); the first one
        of a request is what its usage reports as cached prompt tokens."""
        if not self.prefix_caching:
            return
        stats = self.alloc.cache.stats
        stats.queries += req.context_len
        stats.hits += cached
        if req.cached_tokens < 0:
            req.cached_tokens = cached

    def _register_full(self, req: Request) -> None:
        """Register the blocks that ``req``'s computed tokens filled since the last call."""
        full = req.num_cached // self.block_size
        if not self.prefix_caching or full <= req.num_registered:
            return
        extend_hashes(req.hashes, req.tokens, self.block_size, req.salt)
        for i in range(req.num_registered, full):
            self.alloc.cache.register(req.blocks[i], req.hashes[i])
        req.num_registered = full

    def _grow_running(self) -> list[Request]:
        """Blocks for one more token of every running request, oldest first, preempting the youngest
        of the running requests and the partial prefill while the allocator is empty."""
        preempted: list[Request] = []
        for req in sorted(self.running, key=lambda r: r.arrival):
            if req.phase != Phase.RUNNING:
                continue                      # preempted below in this same pass
            while len(req.blocks) * self.block_size < req.context_len:
                try:
                    req.blocks += self.alloc.allocate(1)
                except NoFreeBlocks:
                    victim = self._youngest_active()
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is req:
                        break
        return preempted

    def _youngest_active(self) -> Request:
        active = [*self.running, *([self.partial] if self.partial is not None else [])]
        return max(active, key=lambda r: r.arrival)

    # ------------------------------------------------------------------ whole prompts (no chunking)
    def _admit(self) -> StepPlan | None:
        work: list[SeqWork] = []
        tokens = 0
        while (self.paused or self.waiting) and len(self.running) + len(work) < self.max_batch:
            queue = self.paused if self.paused else self.waiting
            req = queue[0]
            need = req.context_len            # recompute everything not cached
            # the first one may exceed the token budget alone
            if work and (tokens + need > self.token_budget or not self.prefill_fits(len(work) + 1, tokens + need)):
                break
            if not self.window_headroom():
                break
            try:
                req.blocks = self.alloc.allocate(self.blocks_for(need + 1))
            except NoFreeBlocks:
                break
            queue.popleft()
            req.num_cached = 0
            req.phase = Phase.PREFILL
            work.append(SeqWork(req, 0, need, prefill=True))
            tokens += need
        return StepPlan("prefill", work) if work else None

    def _decode(self) -> StepPlan:
        preempted = self._grow_running()
        work = [SeqWork(r, r.context_len - 1, 1) for r in self.running]
        return StepPlan("decode", work, preempted)

    def _preempt(self, req: Request) -> None:
        """Free ``req``'s blocks: a running request is paused (resumed oldest first); the partial
        prefill goes back to the head of the queue it came from (paused if it has output)."""
        if req is self.partial:
            self.partial = None
            if req.output:
                self._pause(req)
            else:
                req.phase = Phase.WAITING
                self.waiting.appendleft(req)
        else:
            self.running.remove(req)
            self._pause(req)
        self.alloc.free(req.blocks)
        req.blocks, req.num_cached, req.num_registered = [], 0, 0
        self.preemptions += 1

    def _pause(self, req: Request) -> None:
        req.phase = Phase.PAUSED
        idx = sum(1 for p in self.paused if p.arrival < req.arrival)
        self.paused.insert(idx, req)

    # ------------------------------------------------------------------ after a step
    def commit(self, plan: StepPlan, tokens: list[int], eos_ids: Iterable[int]) -> list[tuple[Request, int, Finish]]:
        """Apply one sampled token per sequence; returns (request, token, finish) per sequence.

        Tokens that end a request by EOS or a stop id are not appended to its output; the token of a
        chunk that does not end its prompt is dropped (finish NONE, nothing appended).
        """
        eos = frozenset(eos_ids)
        out: list[tuple[Request, int, Finish]] = []
        for w, tok in zip(plan.work, tokens, strict=True):
            req = w.req
            req.num_cached = w.num_cached + w.num_new
            self._register_full(req)
            if not w.samples:
                out.append((req, tok, Finish.NONE))
                continue
            reason = finish_reason(req, tok, eos)
            if reason in (Finish.NONE, Finish.LENGTH):
                req.output.append(tok)
            if w.prefill:
                req.phase = Phase.RUNNING
                bisect.insort(self.running, req, key=lambda r: r.arrival)  # kept in arrival order, as on the device
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
        elif req is self.partial:
            self.partial = None
        if req.blocks:
            self.alloc.free(req.blocks)
            req.blocks, req.num_registered = [], 0
        req.phase, req.finish = Phase.FINISHED, reason

    def all_requests(self) -> list[Request]:
        return [*self.running, *([self.partial] if self.partial is not None else []), *self.paused, *self.waiting]
