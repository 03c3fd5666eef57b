// Prompt log-probs on the device: after a prefill step, the positions of its prompts that asked for them
// are scored by the score graph (GpuModelRunner.score_positions: the LM head over the hidden states the
// prefill graph kept, then gpu_engine/prompt_logprobs.score), score_rows positions per launch, and the
// entries written to the slots' prompt-logprob rows before any token of the step is published (a request's
// first token publishes them, as in the Python engine).
//
// As gpu_engine/prompt_logprobs.prompt_spans: a prefill row of a request that asked and has no output yet
// scores its chunk's tokens that predict a prompt token (token q predicts prompt position q + 1); a chunk
// computed again after a preemption rewrites what no reader has seen yet. Such requests skip the prefix
// cache (sched_prefix.cuh), so every position is computed.
#ifndef BLINK_SCHED_SCORE_CUH_
#define BLINK_SCHED_SCORE_CUH_

#include <stddef.h>
#include <stdint.h>

#include "blink_ring.h"
#include "sched.h"
#include "sched_launch.cuh"
#include "sched_memory.cuh"
#include "sched_state.cuh"

namespace {

// The positions a step scores, in row order: row r's entries e in [acc[r], acc[r + 1]) are its packed
// tokens first[r] + (e - acc[r]), at prompt positions lo[r] + (e - acc[r]). The arrays are the state's
// per-row scratch (global memory, [max_batch] and [max_batch + 1]).
struct ScorePlan {
  uint32_t *first, *lo, *acc;
};

// Thread 0: the plan of the step just run; returns how many positions it scores.
__device__ uint32_t plan_scores(SchedState *s, ScorePlan *p) {
  uint32_t at = 0, total = 0;
  for (uint32_t r = 0; r < s->plan_n; ++r) {
    const ReqInfo *q = &s->req[s->plan_slot[r]];
    uint32_t a = s->plan_cached[r], b = a + s->plan_new[r];
    if (b > q->prompt_len - 1) b = q->prompt_len - 1;
    bool want =
        q->phase == kPrefilling && (q->flags & BLINK_SAMPLING_FLAGS_WANT_PROMPT_LOGPROBS) && q->out_len == 0 && b > a;
    p->first[r] = at;
    p->lo[r] = a;
    p->acc[r] = total;
    total += want ? b - a : 0;
    at += s->plan_new[r];
  }
  p->acc[s->plan_n] = total;
  return total;
}

// All threads: the score graph's inputs for entries base .. base + score_rows; entries past `total` score
// kept row 0 against token 0, and are not written back.
__device__ void stage_scores(SchedState *s, const ScorePlan *p, uint32_t base, uint32_t total) {
  const blink_sched_config &c = s->cfg;
  for (uint32_t e = threadIdx.x; e < c.score_rows; e += blockDim.x) {
    uint32_t j = base + e;
    int32_t index = 0;
    int64_t target = 0;
    if (j < total) {
      uint32_t r = row_of(p->acc, s->plan_n, j), off = j - p->acc[r];
      index = static_cast<int32_t>(p->first[r] + off);
      target = req_tokens(s, s->plan_slot[r])[p->lo[r] + off + 1];
    }
    c.score_index[e] = index;
    c.score_targets[e] = target;
  }
}

// All threads: entries base .. min(base + score_rows, total) into the ring: each position's log-prob and
// rank, and as many of its alternatives as the request asked for.
__device__ void write_scores(SchedState *s, const ScorePlan *p, uint32_t base, uint32_t total) {
  const blink_sched_config &c = s->cfg;
  uint32_t kk = c.ring_top_k ? c.ring_top_k : 1;
  for (uint32_t e = threadIdx.x; e < c.score_rows && base + e < total; e += blockDim.x) {
    uint32_t j = base + e, r = row_of(p->acc, s->plan_n, j), i = s->plan_slot[r];
    size_t at = static_cast<size_t>(i) * c.prompt_logprob_rows + p->lo[r] + (j - p->acc[r]) + 1;
    blink_prompt_logprob *dst = reinterpret_cast<blink_prompt_logprob *>(c.ring + c.prompt_logprob_off) + at;
    dst->logprob = c.score_logprobs[e];
    dst->rank = static_cast<uint32_t>(c.score_ranks[e]);
    uint32_t m = s->req[i].num_prompt_top;
    m = m < c.score_top ? m : c.score_top;
    m = m < kk ? m : kk;
    blink_top_logprob *top = reinterpret_cast<blink_top_logprob *>(c.ring + c.prompt_top_logprob_off) + at * kk;
    for (uint32_t k = 0; k < m; ++k) {
      top[k].token = static_cast<int32_t>(c.score_top_ids[static_cast<size_t>(e) * c.score_top + k]);
      top[k].logprob = c.score_top_logprobs[static_cast<size_t>(e) * c.score_top + k];
    }
  }
}

// Thread 0: launch the score graph on the staged inputs and wait for it; false (the scheduler stopped, its
// exit reason set) when the launch fails or the graph does not complete within the step timeout.
__device__ bool run_score_graph(SchedState *s, uint32_t *launches) {
  const blink_sched_config &c = s->cfg;
  int64_t expect = ld_volatile64(c.score_counter) + 1;
  uint64_t t_launch = 0;
  ++*launches;  // within the headroom plan_step keeps (score_max_pieces)
  if (launch_copy(s, c.score_exec, &s->score_rr, false, &t_launch) != cudaSuccess) {
    s->stopped = 1;
    return false;
  }
  if (!await_counter(s, c.score_counter, expect, t_launch)) return false;
  __threadfence();
  return true;
}

// All threads: the step's prompt log-probs into the ring, visible before any of its tokens; false when the
// scheduler stopped on the way (nothing of the step is then published).
__device__ bool score_prompts(SchedState *s, uint32_t *launches) {
  __shared__ uint32_t total, ok;
  ScorePlan plan = {s->score_first, s->score_lo, s->score_acc};
  const blink_sched_config &c = s->cfg;
  if (!c.score_rows || s->plan_kind != kPrefill) return true;
  if (threadIdx.x == 0) {
    total = plan_scores(s, &plan);
    ok = 1;
  }
  __syncthreads();  // also makes thread 0's plan (global memory) visible to the block
  for (uint32_t base = 0; base < total; base += c.score_rows) {
    stage_scores(s, &plan, base, total);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) ok = run_score_graph(s, launches);
    __syncthreads();
    if (!ok) return false;
    write_scores(s, &plan, base, total);
    __syncthreads();
  }
  if (threadIdx.x == 0 && total && s->done_ns) s->done_ns = now_ns();  // the score graphs were GPU work, not a gap
  __threadfence_system();
  __syncthreads();
  return true;
}

}  // namespace

#endif  // BLINK_SCHED_SCORE_CUH_
