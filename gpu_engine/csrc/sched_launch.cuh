// Launching a graph from the device and waiting for it: shared by the step's graph and the score graph.
#ifndef BLINK_SCHED_LAUNCH_CUH_
#define BLINK_SCHED_LAUNCH_CUH_

#include <cuda_runtime.h>
#include <stdint.h>

#include "sched.h"
#include "sched_memory.cuh"
#include "sched_state.cuh"

namespace {

// Thread 0: fire-and-forget launch of one of a graph's `copies` executables (`execs`), rotating with *rr;
// *t_launch is when the call returned. A graph relaunched right after completion can be refused for a few
// microseconds with the same error code as the window limit (cudaErrorInvalidValue): that code alone is
// retried, a bounded number of times; any other fails the launch at once (`fail` injects one). A failure
// is counted and becomes the scheduler's exit reason; the caller stops.
__device__ cudaError_t launch_copy(SchedState *s, const uint64_t *execs, uint32_t *rr, bool fail, uint64_t *t_launch) {
  cudaError_t err = cudaErrorInvalidValue;
  for (uint32_t attempt = 0; attempt < 256; ++attempt) {
    uint32_t copy = (*rr)++ % s->cfg.copies;
    uint64_t t0 = now_ns();
    err = fail ? cudaErrorLaunchFailure
               : cudaGraphLaunch(reinterpret_cast<cudaGraphExec_t>(execs[copy]), cudaStreamGraphFireAndForget);
    uint64_t t1 = now_ns();
    if (err == cudaSuccess) {
      sample_into(s->stats->launch_ns, &s->stats->n_launch_samples, t1 - t0);
      *t_launch = t1;
      s->stats->launches++;
      return err;
    }
    if (err != cudaErrorInvalidValue) break;
    s->stats->launch_retries++;
    __nanosleep(500);
  }
  s->stats->launch_failures++;
  s->stats->exit_reason = BLINK_EXIT_LAUNCH_FAILED;
  s->stats->error = static_cast<uint32_t>(err);
  return err;
}

// Thread 0: wait until a graph's completion counter reaches `expect`, at most step_timeout_ns after its
// launch; past that it is taken for hung: false, the exit reason set and the scheduler stopped.
__device__ bool await_counter(SchedState *s, const int64_t *ctr, int64_t expect, uint64_t t_launch) {
  uint64_t bound = s->cfg.step_timeout_ns;
  while (ld_volatile64(ctr) < expect) {
    if (bound && now_ns() - t_launch > bound) {
      s->stats->exit_reason = BLINK_EXIT_STEP_TIMEOUT;
      s->stopped = 1;
      return false;
    }
  }
  return true;
}

}  // namespace

#endif  // BLINK_SCHED_LAUNCH_CUH_
