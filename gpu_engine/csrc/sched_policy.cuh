// The shared policy on the device (thread 0 only). Mirrors gpu_engine/policy.py function by
// function; docs/POLICY.md maps one to the other.
#ifndef BLINK_SCHED_POLICY_CUH_
#define BLINK_SCHED_POLICY_CUH_

#include <stdint.h>

#include "blink_ring.h"
#include "sched_memory.cuh"
#include "sched_prefix.cuh"
#include "sched_state.cuh"

namespace {

__device__ uint32_t blocks_for(SchedState *s, uint32_t ntok) {
  return (ntok + s->cfg.block_size - 1) / s->cfg.block_size;
}

__device__ uint32_t ctx_len(const ReqInfo *r) { return r->prompt_len + r->out_len; }

// A request may start: it has no grammar, or holds its grammar's reference (sched_grammar.cuh's gate).
__device__ bool grammar_held(const ReqInfo *r) { return !r->grammar_id || r->gentry != kNoGrammar; }

// All-or-nothing: grow request i's block table to n blocks.
__device__ bool grow_blocks(SchedState *s, uint32_t i, uint32_t n) {
  ReqInfo *r = &s->req[i];
  if (n <= r->num_blocks) return true;
  uint32_t need = n - r->num_blocks;
  if (need > num_free(s) || n > s->cfg.max_blocks_per_seq) return false;
  int32_t *tab = req_blocks(s, i);
  for (uint32_t k = 0; k < need; ++k) tab[r->num_blocks + k] = static_cast<int32_t>(take_block(s));
  r->num_blocks = n;
  return true;
}

__device__ void free_blocks(SchedState *s, uint32_t i) {
  ReqInfo *r = &s->req[i];
  release_blocks(s, req_blocks(s, i), r->num_blocks);
  r->num_blocks = 0;
  r->num_registered = 0;
}

__device__ void remove_from(uint32_t *arr, uint32_t *count, uint32_t i) {
  for (uint32_t k = 0; k < *count; ++k) {
    if (arr[k] != i) continue;
    for (uint32_t m = k + 1; m < *count; ++m) arr[m - 1] = arr[m];
    --*count;
    return;
  }
}

__device__ void remove_waiting(SchedState *s, uint32_t i) {
  uint32_t n = s->cfg.num_slots, kept = 0;
  for (uint32_t k = 0; k < s->wait_count; ++k) {
    uint32_t v = s->waiting[(s->wait_head + k) % n];
    if (v != i) s->waiting[(s->wait_head + kept++) % n] = v;
  }
  s->wait_count = kept;
}

// Slot.schedule_ns (schema minor 6): when the request's first prompt chunk goes into a step. A preempted
// request scheduled again keeps its first time (the frontend zeroes the word when it publishes the slot).
__device__ void stamp_scheduled(SchedState *s, uint32_t i) {
  blink_slot *sl = slot(s, i);
  volatile uint64_t *word = &sl->schedule_ns;
  if (*word == 0) *word = now_ns() + s->cfg.clock_offset_ns;
}

// Ring side of a completion: reason and error first, then the state word (release).
__device__ void complete_slot(SchedState *s, uint32_t i, uint32_t reason, uint32_t error) {
  blink_slot *sl = slot(s, i);
  sl->finish_reason = reason;
  sl->error_code = error;
  __threadfence_system();
  st_rel32(&sl->state, BLINK_SLOT_STATE_DECODE_COMPLETED);
  s->stats->completions++;
}

// Policy.finish but for `running`, which keeps a finished request until compact_running: a step's rows that
// finish together leave it in one pass, not in one shift of the array each (up to max_batch of them).
__device__ void finish_in_place(SchedState *s, uint32_t i, uint32_t reason, uint32_t error) {
  ReqInfo *r = &s->req[i];
  if (r->phase == kPaused) remove_from(s->paused, &s->paused_count, i);
  if (r->phase == kWaiting) remove_waiting(s, i);
  if (s->partial == i) s->partial = kNoSlot;
  free_blocks(s, i);
  if (r->gentry != kNoGrammar) s->gram[r->gentry].refs--;  // its grammar may be evicted once unreferenced
  r->gentry = kNoGrammar;
  r->phase = kFree;
  complete_slot(s, i, reason, error);
}

// `running` without the requests that finish_in_place finished, in the same order.
__device__ void compact_running(SchedState *s) {
  uint32_t kept = 0;
  for (uint32_t k = 0; k < s->running_count; ++k)
    if (s->req[s->running[k]].phase == kRunning) s->running[kept++] = s->running[k];
  s->running_count = kept;
}

// Policy.finish: remove from wherever it is, free its blocks, complete the slot.
__device__ void finish_req(SchedState *s, uint32_t i, uint32_t reason, uint32_t error) {
  if (s->req[i].phase == kRunning) remove_from(s->running, &s->running_count, i);
  finish_in_place(s, i, reason, error);
}

// Policy._pause: into `paused`, kept in arrival order.
__device__ void pause(SchedState *s, uint32_t i) {
  ReqInfo *r = &s->req[i];
  r->phase = kPaused;
  uint32_t k = s->paused_count;
  while (k > 0 && s->req[s->paused[k - 1]].arrival > r->arrival) {
    s->paused[k] = s->paused[k - 1];
    --k;
  }
  s->paused[k] = i;
  s->paused_count++;
  st_rel32(&slot(s, i)->state, BLINK_SLOT_STATE_DECODE_PAUSED);
}

// Policy._preempt: free a request's blocks. A running one is paused (it resumes in arrival order);
// the partial prefill goes back to the head of its queue (paused if it has output, else waiting).
__device__ void preempt(SchedState *s, uint32_t i) {
  ReqInfo *r = &s->req[i];
  if (s->partial == i) {
    s->partial = kNoSlot;
    if (r->out_len) {
      pause(s, i);
    } else {
      r->phase = kWaiting;
      s->wait_head = (s->wait_head + s->cfg.num_slots - 1) % s->cfg.num_slots;
      s->waiting[s->wait_head] = i;
      s->wait_count++;
    }
  } else {
    remove_from(s->running, &s->running_count, i);
    pause(s, i);
  }
  free_blocks(s, i);
  r->cached = 0;
  s->stats->preemptions++;
}

__device__ void plan_row(SchedState *s, uint32_t row, uint32_t i, uint32_t cached, uint32_t fresh) {
  s->plan_slot[row] = i;
  s->plan_cached[row] = cached;
  s->plan_new[row] = fresh;
}

// Policy.prefill_fits: a captured prefill graph (of the filtering variant, which always exists)
// holds n sequences and this many tokens.
__device__ bool prefill_fits(SchedState *s, uint32_t n, uint32_t tokens) {
  const blink_sched_config &c = s->cfg;
  uint32_t col = (tokens + c.token_grain - 1) / c.token_grain;
  if (n > c.max_batch || col >= c.prefill_cols) return false;
  int32_t g = c.prefill_table[(c.max_batch + 1 + n) * c.prefill_cols + col];
  return g >= 0 && static_cast<uint32_t>(c.graph_batch[g]) >= n && static_cast<uint32_t>(c.graph_tokens[g]) >= tokens;
}

// Policy._admit: inline prefill when (i) prefills are pending, (ii) the batch has room,
// (iii) blocks, the token budget and the captured graphs allow (window headroom is checked by
// the caller).
__device__ bool plan_prefill(SchedState *s) {
  uint32_t n = 0, tokens = 0;
  while ((s->paused_count || s->wait_count) && s->running_count + n < s->cfg.max_batch) {
    bool from_paused = s->paused_count > 0;
    uint32_t i = from_paused ? s->paused[0] : s->waiting[s->wait_head];
    ReqInfo *r = &s->req[i];
    uint32_t need = ctx_len(r);
    if (!grammar_held(r)) break;                                // its grammar is still loading
    if (n && tokens + need > s->cfg.max_prefill_tokens) break;  // the first one may use it all
    if (tokens + need > s->cfg.max_tokens) break;
    if (n && !prefill_fits(s, n + 1, tokens + need)) break;
    if (!grow_blocks(s, i, blocks_for(s, need + 1))) break;
    if (from_paused) {
      remove_from(s->paused, &s->paused_count, i);
    } else {
      s->wait_head = (s->wait_head + 1) % s->cfg.num_slots;
      s->wait_count--;
    }
    r->phase = kPrefilling;  // in flight in this prefill; joins `running` after it
    r->cached = 0;
    stamp_scheduled(s, i);
    plan_row(s, n++, i, 0, need);
    tokens += need;
  }
  s->plan_n = n;
  s->plan_tokens = tokens;
  return n > 0;
}

// Policy._youngest_active: the youngest of the running requests and the partial prefill.
__device__ uint32_t youngest_active(SchedState *s) {
  uint32_t best = s->partial;
  for (uint32_t k = 0; k < s->running_count; ++k)
    if (best == kNoSlot || s->req[s->running[k]].arrival > s->req[best].arrival) best = s->running[k];
  return best;
}

// Policy._grow_running: every running request gets a slot for one more token, oldest first,
// preempting the youngest active request while blocks run out. `running` is kept in arrival
// order. Returns the number of preemptions.
__device__ uint32_t grow_running(SchedState *s) {
  uint32_t preempted = 0;
  for (uint32_t k = 0; k < s->running_count; ++k) {
    uint32_t i = s->running[k];
    ReqInfo *r = &s->req[i];
    while (!grow_blocks(s, i, blocks_for(s, ctx_len(r)))) {
      uint32_t victim = youngest_active(s);
      preempt(s, victim);
      ++preempted;
      if (victim == i) break;
    }
    if (r->phase != kRunning) break;  // it was the youngest: nothing after it
  }
  return preempted;
}

// Policy._next_chunk: the next prefill chunk in FCFS order (the partial prefill, else the head of
// `paused`, else of `waiting`) within the budget left, its blocks grown; false when nothing is
// pending or the head cannot take a chunk now. The window headroom is checked by the caller.
__device__ bool next_chunk(SchedState *s, uint32_t row, uint32_t tokens) {
  bool from_paused = false;
  uint32_t i = s->partial;
  if (i == kNoSlot && s->paused_count) {
    i = s->paused[0];
    from_paused = true;
  } else if (i == kNoSlot && s->wait_count) {
    i = s->waiting[s->wait_head];
  }
  if (i == kNoSlot) return false;
  ReqInfo *r = &s->req[i];
  bool first = s->partial != i;
  if (!grammar_held(r)) return false;  // its grammar is still loading
  uint32_t ctx = ctx_len(r), hit = first ? cached_prefix(s, i, ctx) : 0;
  uint32_t start = first ? hit * s->cfg.block_size : r->cached;
  uint32_t todo = ctx - start, left = s->cfg.max_prefill_tokens - tokens;
  uint32_t n = todo < left ? todo : left;
  bool last = n == todo;
  if (!prefill_fits(s, row + 1, tokens + n)) return false;
  uint32_t blocks = blocks_for(s, start + n + (last ? 1 : 0));
  if (!(first ? take_with_hit(s, i, hit, blocks) : grow_blocks(s, i, blocks))) return false;
  if (first) {
    if (from_paused) {
      remove_from(s->paused, &s->paused_count, i);
    } else {
      s->wait_head = (s->wait_head + 1) % s->cfg.num_slots;
      s->wait_count--;
    }
    r->cached = start;
    r->num_registered = hit;
    count_lookup(s, r, ctx, start);
    stamp_scheduled(s, i);
  }
  r->phase = kPrefilling;
  s->partial = last ? kNoSlot : i;
  plan_row(s, row, i, r->cached, n);
  return true;
}

// Policy._chunked_step: the running decodes first, then prefill chunks filling the token budget
// (none in a step that preempted). The rows' kind is read back from the request's phase.
__device__ bool plan_chunked(SchedState *s) {
  uint32_t preempted = grow_running(s);
  for (uint32_t k = 0; k < s->running_count; ++k) {
    uint32_t i = s->running[k];
    plan_row(s, k, i, ctx_len(&s->req[i]) - 1, 1);
  }
  uint32_t n = s->running_count, tokens = n;
  while (!preempted && tokens < s->cfg.max_prefill_tokens && n < s->cfg.max_batch && next_chunk(s, n, tokens)) {
    tokens += s->plan_new[n];
    ++n;
  }
  s->plan_n = n;
  s->plan_tokens = tokens;
  return n > 0;
}

// Policy._decode: every running request gets a slot for one more token (no chunking).
__device__ bool plan_decode(SchedState *s) {
  grow_running(s);
  for (uint32_t k = 0; k < s->running_count; ++k) {
    uint32_t i = s->running[k];
    plan_row(s, k, i, ctx_len(&s->req[i]) - 1, 1);
  }
  s->plan_n = s->running_count;
  s->plan_tokens = s->running_count;
  return s->plan_n > 0;
}

// A request joins the decode batch, which is kept in arrival order.
__device__ void join_running(SchedState *s, uint32_t i) {
  uint32_t k = s->running_count;
  while (k > 0 && s->req[s->running[k - 1]].arrival > s->req[i].arrival) {
    s->running[k] = s->running[k - 1];
    --k;
  }
  s->running[k] = i;
  s->running_count++;
  s->req[i].phase = kRunning;
}

__device__ bool finish_reason_stop(const ReqInfo *r, int32_t tok) {
  for (uint32_t k = 0; k < r->num_stop; ++k)
    if (r->stop_ids[k] == tok) return true;
  return false;
}

// finish_reason() of the policy: stop ids, then EOS (unless ignored), then length.
__device__ uint32_t finish_reason(SchedState *s, const ReqInfo *r, int32_t tok) {
  if (finish_reason_stop(r, tok)) return BLINK_FINISH_REASON_STOP_ID;
  if (!(r->flags & BLINK_SAMPLING_FLAGS_IGNORE_EOS))
    for (uint32_t k = 0; k < s->cfg.num_eos; ++k)
      if (s->cfg.eos_ids[k] == tok) return BLINK_FINISH_REASON_EOS;
  if (r->out_len + 1 >= r->max_new_tokens) return BLINK_FINISH_REASON_LENGTH;
  return BLINK_FINISH_REASON_NONE;
}

}  // namespace

#endif  // BLINK_SCHED_POLICY_CUH_
