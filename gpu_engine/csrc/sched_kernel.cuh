// The persistent scheduler kernel: one block of BLINK_SCHED_THREADS threads, started once inside a
// device-launchable graph, that runs the serving loop with the host off the path. A step holds up to
// max_batch rows (at most BLINK_MAX_BATCH, more than the threads): the threads loop over the rows, and
// the per-row scratch lives in the state's arena, not in shared memory.
//
// Each iteration: claim new prompts from the ring (parallel scan, only when the doorbell moved),
// apply cancellations, plan a step with the shared policy (gpu_engine/policy.py; mapping in
// docs/POLICY.md), stage the step into the graphs' static buffers, fire-and-forget launch the
// graph for that shape, scan the ring again while it runs, poll its completion counter, then
// publish tokens and completions to the ring. Before the 120-launch limit of one execution it
// tail-launches itself; all state lives in global memory so the next execution resumes.
//
// Barriers: every __syncthreads below and in the functions it calls is reached by all threads;
// each branch around one tests a value every thread reads alike (shared memory written before a
// barrier, or the state in global memory that thread 0 wrote before one).
#ifndef BLINK_SCHED_KERNEL_CUH_
#define BLINK_SCHED_KERNEL_CUH_

#include <cuda_runtime.h>
#include <stdint.h>

#include "blink_ring.h"
#include "sched.h"
#include "sched_claim.cuh"
#include "sched_control.cuh"
#include "sched_memory.cuh"
#include "sched_state.cuh"
#include "sched_step.cuh"

namespace {

// Thread 0, at the start of each execution: how long the tail launch took to run.
__device__ void on_start(SchedState *s) {
  blink_sched_stats *st = s->stats;
  if (st->tail_start_ns) sample_into(st->tail_ns, &st->n_tail_samples, now_ns() - st->tail_start_ns);
  st->tail_start_ns = 0;
}

// All threads: the step the previous execution launched before it yielded its SM is complete (a
// tail launch starts only then): publish its results.
__device__ void finish_pending(SchedState *s, uint32_t *launches) {
  wait_and_postprocess(s, s->pending_expect, s->pending_launch_ns, launches);
  __syncthreads();
  if (threadIdx.x == 0) s->pending = 0;
  __syncthreads();
}

// Thread 0: launch the staged step; kActionRun, or kActionExit (the host, seeing the exit reason,
// fails the in-flight requests, then marks the engine failed).
// A step launched straight after the previous one's completion adds the time between them to stats gap_ns.
__device__ uint32_t launch_step(SchedState *s, uint32_t *launches, int64_t *expect, uint64_t *t_launch) {
  ++*launches;
  if (launch(s, expect, t_launch)) {
    if (s->done_ns && *t_launch > s->done_ns) {
      s->stats->gap_ns += *t_launch - s->done_ns;
      s->stats->gap_steps++;
    }
    s->done_ns = 0;
    return kActionRun;
  }
  s->stopped = 1;
  return kActionExit;
}

// Thread 0: leave the SM to the graph just launched; the next execution, which starts once that
// graph is complete, publishes its results. kActionRelaunch, or kActionExit if refused.
__device__ uint32_t yield_to_graph(SchedState *s, int64_t expect, uint64_t t_launch) {
  s->pending = 1;
  s->pending_expect = expect;
  s->pending_launch_ns = t_launch;
  s->stats->yield_steps++;
  return relaunch_self(s) ? kActionRelaunch : kActionExit;
}

// All threads, on exit: the final copy of every counter and sample for the host (which makes no
// CUDA call meanwhile), then `exited`.
__device__ void copy_stats_out(SchedState *s, blink_sched_stats *host_stats) {
  const uint32_t *src = reinterpret_cast<const uint32_t *>(s->stats);
  uint32_t *dst = reinterpret_cast<uint32_t *>(host_stats);
  for (uint32_t k = threadIdx.x; k < sizeof(blink_sched_stats) / 4; k += blockDim.x) dst[k] = src[k];
  __threadfence_system();
  if (threadIdx.x == 0) st_rel32(&host_stats->exited, 1);
}

}  // namespace

__global__ void __launch_bounds__(BLINK_SCHED_THREADS) blink_scheduler(SchedState *s, blink_sched_stats *host_stats) {
  __shared__ uint32_t launches, action;
  __shared__ int64_t expect;
  __shared__ uint64_t t_launch;
  if (threadIdx.x == 0) {
    launches = 0;
    on_start(s);
  }
  __syncthreads();
  if (s->pending) finish_pending(s, &launches);
  while (true) {
    maintenance(s);
    __syncthreads();
    claim_new(s);
    apply_cancellations(s);
    if (threadIdx.x == 0) {
      grammar_service(s);
      grammar_gate(s);
      action = plan_step(s, &launches);
    }
    __syncthreads();
    if (action == kActionRelaunch) return;
    if (action == kActionExit) break;
    if (action == kActionIdle) {
      if (threadIdx.x == 0) {
        s->stats->idle_loops++;
        s->done_ns = 0;  // the GPU waited for work, not for the scheduler
      }
      __nanosleep(200);
      continue;
    }
    stage(s);
    __syncthreads();
    if (threadIdx.x == 0) action = launch_step(s, &launches, &expect, &t_launch);
    __syncthreads();
    if (action == kActionExit) break;
    if (s->cfg.graph_yield[s->plan_graph]) {  // leave the SM to the graph; resume after it
      if (threadIdx.x == 0) action = yield_to_graph(s, expect, t_launch);
      __syncthreads();
      if (action == kActionRelaunch) return;
      break;
    }
    claim_new(s);  // overlapped with the running graph
    wait_and_postprocess(s, expect, t_launch, &launches);
    __syncthreads();
  }
  copy_stats_out(s, host_stats);
}

#endif  // BLINK_SCHED_KERNEL_CUH_
