// The persistent GPU scheduler: one block of 256 threads, started once inside a device-launchable
// graph, that runs the serving loop with the host off the path.
//
// Each iteration: claim new prompts from the ring (parallel scan, only when the doorbell moved),
// apply cancellations, plan a step with the shared policy (gpu_engine/policy.py; mapping in
// docs/POLICY.md), stage the step into the graphs' static buffers, fire-and-forget launch the
// graph for that shape, scan the ring again while it runs, poll its completion counter, then
// publish tokens and completions to the ring. Before the 120-launch limit of one execution it
// tail-launches itself; all state lives in global memory so the next execution resumes.
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "blink_ring.h"
#include "sched.h"

namespace {

enum Phase : uint32_t { kFree = 0, kWaiting = 1, kRunning = 2, kPaused = 3 };
enum Finish : uint32_t { kNone = 0, kEos = 1, kLength = 2, kStopId = 3, kCancelled = 4, kError = 5 };
enum PlanKind : uint32_t { kIdle = 0, kPrefill = 1, kDecode = 2 };
constexpr uint32_t kMaxClaims = 256;
constexpr uint32_t kMaxPerThread = 32;  // slots per scanning thread: num_slots <= 8192
constexpr uint32_t kFlipWords = 64;     // RingHeader.pending_flips: one bit per slot, slots 0..4095

struct ReqInfo {
  uint64_t request_id, seed;
  uint32_t seq, phase, arrival, prompt_len, max_new, out_len, num_blocks, flags;
  uint32_t num_stop, num_top;
  float temp, top_p, min_p;
  int32_t top_k;
  int32_t stop_ids[8];
};

struct SchedState {
  blink_sched_config cfg;
  blink_sched_stats *stats;                      // device memory: counters and samples
  blink_sched_stats *host_stats;                 // host-mapped copy, refreshed at each heartbeat and at exit
  ReqInfo *req;                                  // [num_slots]
  int32_t *tokens;                               // [num_slots * max_context]: prompt then outputs
  int32_t *blocks;                               // [num_slots * max_blocks_per_seq]
  uint32_t *waiting;                             // FIFO ring [num_slots]
  uint32_t *paused;                              // sorted by arrival [num_slots]
  uint32_t *running;                             // [max_batch]
  uint32_t *free_blocks;                         // stack [num_blocks]
  uint32_t *copy_rr;                             // [num_graphs] next executable copy
  uint32_t *plan_slot, *plan_cached, *plan_new;  // [max_batch]
  uint32_t wait_head, wait_count, paused_count, running_count, free_count, arrivals;
  uint32_t plan_kind, plan_n, plan_tokens, plan_graph, draining, stopped;
  uint64_t last_doorbell, drain_deadline, last_beat;
  uint8_t *ring_check;  // a second copy of cfg.ring: the state's integrity check
  uint32_t pending;     // a step launched by the previous execution, which then yielded its SM
  int64_t pending_expect;
  uint64_t pending_launch_ns;
  uint64_t flips_seen[kFlipWords];  // the header's pending_flips as of the last scan
  uint32_t flips_synced;            // 0: the next scan reads every slot (at start, after an overflow)
  int64_t flip_credit;              // flips seen minus doorbell increments seen since the last full scan
};

// ------------------------------------------------------------------ memory access to the ring
__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ uint32_t ld_acq32(const void *p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t ld_acq64(const void *p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t ld_relaxed64(const void *p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t ld_relaxed32(const void *p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_rel32(void *p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_rel64(void *p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ int64_t ld_volatile64(const int64_t *p) { return *(volatile const int64_t *)p; }

__device__ __forceinline__ blink_ring_header *header(SchedState *s) {
  return reinterpret_cast<blink_ring_header *>(s->cfg.ring);
}
__device__ __forceinline__ blink_slot *slot(SchedState *s, uint32_t i) {
  return reinterpret_cast<blink_slot *>(s->cfg.ring + s->cfg.slots_off) + i;
}
__device__ __forceinline__ uint64_t word(uint32_t state, uint32_t seq) {
  return (static_cast<uint64_t>(seq) << 32) | state;
}
__device__ __forceinline__ int32_t *req_tokens(SchedState *s, uint32_t i) {
  return s->tokens + static_cast<size_t>(i) * s->cfg.max_context;
}
__device__ __forceinline__ int32_t *req_blocks(SchedState *s, uint32_t i) {
  return s->blocks + static_cast<size_t>(i) * s->cfg.max_blocks_per_seq;
}
__device__ __forceinline__ void sample_into(uint32_t *arr, uint32_t *n, uint64_t v) {
  uint32_t k = *n;
  arr[k % BLINK_SAMPLES] = static_cast<uint32_t>(v > 0xFFFFFFFFull ? 0xFFFFFFFFull : v);
  *n = k + 1;
}

// Order matters: the policy, then claiming (uses it), then the step (uses both).
// Order matters: the policy, then claiming (uses it), then the step (uses both).
// clang-format off
#include "sched_policy.cuh"
#include "sched_claim.cuh"
#include "sched_step.cuh"
// clang-format on

}  // namespace

// ------------------------------------------------------------------ the kernel
__device__ void on_start(SchedState *s) {
  blink_sched_stats *st = s->stats;
  if (st->tail_start_ns) sample_into(st->tail_ns, &st->n_tail_samples, now_ns() - st->tail_start_ns);
  st->tail_start_ns = 0;
}

__global__ void __launch_bounds__(BLINK_SCHED_THREADS) blink_scheduler(SchedState *s, blink_sched_stats *host_stats) {
  __shared__ uint32_t launches, action, cu[BLINK_SCHED_THREADS + 1];
  __shared__ int64_t expect;
  __shared__ uint64_t t_launch;
  if (threadIdx.x == 0) {
    launches = 0;
    on_start(s);
  }
  __syncthreads();
  if (s->pending) {  // the graph launched before the yield is complete: a tail launch waits for it
    wait_and_postprocess(s, s->pending_expect, s->pending_launch_ns);
    __syncthreads();
    if (threadIdx.x == 0) s->pending = 0;
    __syncthreads();
  }
  while (true) {
    maintenance(s);
    __syncthreads();
    claim_new(s);
    apply_cancellations(s);
    if (threadIdx.x == 0) action = plan_step(s, &launches);
    __syncthreads();
    if (action == kActionRelaunch) return;
    if (action == kActionExit) break;
    if (action == kActionIdle) {
      if (threadIdx.x == 0) s->stats->idle_loops++;
      __nanosleep(200);
      continue;
    }
    stage(s, cu);
    __syncthreads();
    if (threadIdx.x == 0) {
      launches++;
      if (!launch(s, &expect, &t_launch)) {
        s->stopped = 1;
        st_rel32(&header(s)->engine_state, BLINK_ENGINE_STATE_FAILED);
        action = kActionExit;
      }
    }
    __syncthreads();
    if (action == kActionExit) break;
    if (s->cfg.graph_yield[s->plan_graph]) {  // leave the SM to the graph; resume after it
      if (threadIdx.x == 0) {
        s->pending = 1;
        s->pending_expect = expect;
        s->pending_launch_ns = t_launch;
        s->stats->yield_steps++;
        action = relaunch_self(s) ? kActionRelaunch : kActionExit;
      }
      __syncthreads();
      if (action == kActionRelaunch) return;
      break;
    }
    claim_new(s);  // overlapped with the running graph
    wait_and_postprocess(s, expect, t_launch);
    __syncthreads();
  }
  // Final copy of every counter and sample for the host (which makes no CUDA call meanwhile).
  const uint32_t *src = reinterpret_cast<const uint32_t *>(s->stats);
  uint32_t *dst = reinterpret_cast<uint32_t *>(host_stats);
  for (uint32_t k = threadIdx.x; k < sizeof(blink_sched_stats) / 4; k += blockDim.x) dst[k] = src[k];
  __threadfence_system();
  if (threadIdx.x == 0) st_rel32(&host_stats->exited, 1);
}

#include "sched_host.cuh"
