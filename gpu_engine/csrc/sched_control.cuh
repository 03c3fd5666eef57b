// Cancellations, heartbeat, stats and shutdown: the scheduler's side of the ring's control fields.
#ifndef BLINK_SCHED_CONTROL_CUH_
#define BLINK_SCHED_CONTROL_CUH_

#include <stddef.h>
#include <stdint.h>

#include "blink_ring.h"
#include "sched.h"
#include "sched_memory.cuh"
#include "sched_policy.cuh"
#include "sched_state.cuh"

namespace {

// Cancellations finished per loop: a flag past these stays set and is read again on the next loop (its
// request is not free), so any number of running requests can be cancelled at once.
constexpr uint32_t kMaxCancels = 256;

// Cancel flags of every active request, read in parallel; thread 0 finishes them.
__device__ void apply_cancellations(SchedState *s) {
  __shared__ uint32_t n, list[kMaxCancels];
  if (s->stopped) return;
  if (threadIdx.x == 0) n = 0;
  __syncthreads();
  for (uint32_t i = threadIdx.x; i < s->cfg.num_slots; i += blockDim.x) {
    if (s->req[i].phase == kFree) continue;
    if (ld_relaxed32(&slot(s, i)->cancel) == 0) continue;
    uint32_t k = atomicAdd(&n, 1u);
    if (k < kMaxCancels) list[k] = i;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t m = n < kMaxCancels ? n : kMaxCancels;
    for (uint32_t k = 0; k < m; ++k) {
      finish_req(s, list[k], BLINK_FINISH_REASON_CANCELLED, BLINK_ERROR_CODE_OK);
      s->stats->cancels++;
      s->stats->last_cancel_slot = list[k];
    }
  }
  __syncthreads();
}

// Thread 0: the ring header's engine stats, and the host copy of every counter (the fields before
// the samples).
__device__ void publish_stats(SchedState *s) {
  blink_ring_header *h = header(s);
  h->stats.running = s->running_count;
  h->stats.waiting = s->wait_count + s->paused_count + (s->partial != kNoSlot);
  h->stats.kv_blocks_total = s->cfg.num_blocks;
  h->stats.kv_blocks_free = num_free(s);  // unused plus idle cached (evictable)
  h->stats.steps = s->stats->steps;
  h->stats.prompt_tokens = s->stats->prompt_tokens;
  h->stats.output_tokens = s->stats->output_tokens;
  h->stats.preemptions = s->stats->preemptions;
  h->stats.window_relaunches = s->stats->windows;
  h->stats.token_budget = s->cfg.max_prefill_tokens;
  for (uint32_t k = 0; k < 7; ++k) h->stats.step_fill[k] = s->stats->step_fill[k];
  h->prefix_cache_queries = s->cache_queries;
  h->prefix_cache_hits = s->cache_hits;
  h->prefix_cache_evictions = s->cache_evictions;
  h->step_tokens = s->stats->step_tokens;
  h->padded_tokens = s->stats->padded_tokens;
  s->stats->running = s->running_count;
  s->stats->waiting = s->wait_count + (s->partial != kNoSlot);
  s->stats->paused = s->paused_count;
  s->stats->kv_free = num_free(s);
  const uint32_t *src = reinterpret_cast<const uint32_t *>(s->stats);
  volatile uint32_t *dst = reinterpret_cast<volatile uint32_t *>(s->host_stats);
  for (uint32_t k = 0; k < offsetof(blink_sched_stats, launch_ns) / 4; ++k) dst[k] = src[k];
}

// Heartbeat, stats and the shutdown flag (thread 0). Draining stops claims; once nothing is
// left (or the drain time is over) the remaining requests are cancelled and the loop exits.
__device__ void maintenance(SchedState *s) {
  if (threadIdx.x != 0 || state_corrupted(s)) return;
  uint64_t t = now_ns();
  blink_ring_header *h = header(s);
  if (t - s->last_beat >= s->cfg.heartbeat_ns) {
    s->last_beat = t;
    publish_stats(s);
    st_rel64(&h->heartbeat_ns, t + s->cfg.clock_offset_ns);
    volatile uint64_t *beat = &h->heartbeat;  // single writer: no PCIe atomic needed
    *beat = *beat + 1;
  }
  if (!s->draining && ld_acq32(&h->shutdown)) {
    s->draining = 1;
    s->stats->exit_reason = BLINK_EXIT_SHUTDOWN;
    s->drain_deadline = t + s->cfg.drain_ns;
    st_rel32(&h->engine_state, BLINK_ENGINE_STATE_DRAINING);
  }
  bool empty = !s->running_count && !s->wait_count && !s->paused_count && s->partial == kNoSlot;
  if (s->draining && (empty || t > s->drain_deadline)) {
    while (s->running_count) finish_req(s, s->running[0], BLINK_FINISH_REASON_CANCELLED, BLINK_ERROR_CODE_OK);
    if (s->partial != kNoSlot) finish_req(s, s->partial, BLINK_FINISH_REASON_CANCELLED, BLINK_ERROR_CODE_OK);
    while (s->paused_count) finish_req(s, s->paused[0], BLINK_FINISH_REASON_CANCELLED, BLINK_ERROR_CODE_OK);
    while (s->wait_count) finish_req(s, s->waiting[s->wait_head], BLINK_FINISH_REASON_CANCELLED, BLINK_ERROR_CODE_OK);
    publish_stats(s);
    st_rel32(&h->engine_state, BLINK_ENGINE_STATE_STOPPED);
    s->stopped = 1;
  }
}

}  // namespace

#endif  // BLINK_SCHED_CONTROL_CUH_
