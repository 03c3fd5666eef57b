// Diagnostics for running two model graphs at once (bench/overlap_probe.py): a pair of device-launch
// executables launched from the device, together (both fire-and-forget) or one after the other (the
// second as the parent's tail launch), timed with events around the parent graph; and the device's SMs
// split into two green contexts, one stream each, to capture each graph on its own share of SMs.
// A library of its own (built by bench/overlap_probe.py through persistent.build_library): the scheduler's
// translation unit, so its graphs and host API are the engine's, with these entry points added; the
// engine's library carries none of them.
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#include <vector>

#include "sched.h"
#include "sched_host.cuh"
#include "sched_kernel.cuh"

extern "C" {
// Two executables launched from the device, together or the second as the parent's tail launch, `reps`
// timed launches (ms each); and the SMs split into two green contexts.
int blink_launch_pair(uint64_t first, uint64_t second, int sequential, int reps, double timeout_s, float *ms,
                      int *launch_err);
int blink_green_split(int device, unsigned first_sms, void **handle, uint64_t *streams, unsigned *sms);
int blink_priority_range(int *least, int *greatest);
int blink_priority_exec(uint64_t graph, int priority, uint64_t stream, uint64_t *exec, int *kernels);
int blink_green_enter(void *handle, int which);
int blink_green_leave(void);
int blink_green_destroy(void *handle);
}

namespace {

// Thread 0 launches `first` fire-and-forget, then `second` fire-and-forget (the two may run at once) or,
// with `sequential`, as the parent's tail launch (it starts once `first` finished); an executable of 0
// is skipped. err[0], err[1]: each launch's status.
__global__ void launch_pair(uint64_t first, uint64_t second, int sequential, int *err) {
  if (threadIdx.x != 0) return;
  err[0] =
      first ? static_cast<int>(cudaGraphLaunch(reinterpret_cast<cudaGraphExec_t>(first), cudaStreamGraphFireAndForget))
            : 0;
  cudaStream_t how = sequential ? cudaStreamGraphTailLaunch : cudaStreamGraphFireAndForget;
  err[1] = second ? static_cast<int>(cudaGraphLaunch(reinterpret_cast<cudaGraphExec_t>(second), how)) : 0;
}

struct PairLaunch {
  cudaStream_t stream = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;  // the parent: one launch_pair node, instantiated for device launch
  cudaEvent_t start = nullptr;
  cudaEvent_t end = nullptr;
  int *err = nullptr;  // host-mapped, the two launches' status
};

int pair_build(PairLaunch *p, uint64_t first, uint64_t second, int sequential) {
  BLINK_CHECK(cudaStreamCreateWithFlags(&p->stream, cudaStreamNonBlocking));
  BLINK_CHECK(cudaEventCreate(&p->start));
  BLINK_CHECK(cudaEventCreate(&p->end));
  BLINK_CHECK(cudaHostAlloc(&p->err, 2 * sizeof(int), cudaHostAllocMapped));
  int *dev_err = nullptr;
  BLINK_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void **>(&dev_err), p->err, 0));
  void *args[] = {&first, &second, &sequential, &dev_err};
  cudaKernelNodeParams k = {};
  k.func = reinterpret_cast<void *>(launch_pair);
  k.gridDim = dim3(1);
  k.blockDim = dim3(32);
  k.kernelParams = args;
  BLINK_CHECK(cudaGraphCreate(&p->graph, 0));
  cudaGraphNode_t node;
  BLINK_CHECK(cudaGraphAddKernelNode(&node, p->graph, nullptr, 0, &k));
  BLINK_CHECK(cudaGraphInstantiate(&p->exec, p->graph, cudaGraphInstantiateFlagDeviceLaunch));
  BLINK_CHECK(cudaGraphUpload(p->exec, p->stream));
  BLINK_CHECK(cudaStreamSynchronize(p->stream));
  return 0;
}

void pair_free(PairLaunch *p) {
  if (p->exec) cudaGraphExecDestroy(p->exec);
  if (p->graph) cudaGraphDestroy(p->graph);
  if (p->start) cudaEventDestroy(p->start);
  if (p->end) cudaEventDestroy(p->end);
  if (p->err) cudaFreeHost(p->err);
  if (p->stream) cudaStreamDestroy(p->stream);
}

// Wait for a stream's work at most `timeout_s` seconds: 0 once done, -2 past the bound (the work may
// never finish: two graphs whose kernels each wait for all their blocks can starve each other).
int await_stream(cudaStream_t stream, double timeout_s) {
  timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (;;) {
    cudaError_t err = cudaStreamQuery(stream);
    if (err == cudaSuccess) return 0;
    if (err != cudaErrorNotReady) return fail(err, "cudaStreamQuery", __FILE__, __LINE__);
    clock_gettime(CLOCK_MONOTONIC, &t);
    if ((t.tv_sec - t0.tv_sec) + 1e-9 * (t.tv_nsec - t0.tv_nsec) > timeout_s) {
      snprintf(g_error, sizeof(g_error), "the launched graphs did not finish within %.1f s", timeout_s);
      return -2;
    }
    timespec nap = {0, 50000};
    nanosleep(&nap, nullptr);
  }
}

// One timed launch of the parent graph: its milliseconds in *ms, the device-side status of each child
// launch in launch_err[0..1]; -3 when either launch was refused.
int pair_rep(PairLaunch *p, double timeout_s, float *ms, int *launch_err) {
  volatile int *err = p->err;
  err[0] = err[1] = -1;
  BLINK_CHECK(cudaEventRecord(p->start, p->stream));
  BLINK_CHECK(cudaGraphLaunch(p->exec, p->stream));
  BLINK_CHECK(cudaEventRecord(p->end, p->stream));
  int rc = await_stream(p->stream, timeout_s);
  if (rc != 0) return rc;
  launch_err[0] = err[0];
  launch_err[1] = err[1];
  if (launch_err[0] != 0 || launch_err[1] != 0) {
    snprintf(g_error, sizeof(g_error), "device-side cudaGraphLaunch returned %d and %d", launch_err[0], launch_err[1]);
    return -3;
  }
  BLINK_CHECK(cudaEventElapsedTime(ms, p->start, p->end));
  return 0;
}

#if CUDA_VERSION >= 12050
#define BLINK_DRIVER(call)                                                                           \
  do {                                                                                               \
    CUresult res_ = (call);                                                                          \
    if (res_ != CUDA_SUCCESS) {                                                                      \
      snprintf(g_error, sizeof(g_error), "%s:%d: %s: CUresult %d", __FILE__, __LINE__, #call, res_); \
      return static_cast<int>(res_);                                                                 \
    }                                                                                                \
  } while (0)

// The driver's green-context calls, found through the runtime (the library links no libcuda).
struct GreenApi {
  decltype(&cuDeviceGet) device_get = nullptr;
  decltype(&cuDeviceGetDevResource) resource = nullptr;
  decltype(&cuDevSmResourceSplitByCount) split = nullptr;
  decltype(&cuDevResourceGenerateDesc) desc = nullptr;
  decltype(&cuGreenCtxCreate) create = nullptr;
  decltype(&cuCtxFromGreenCtx) as_ctx = nullptr;
  decltype(&cuGreenCtxStreamCreate) stream = nullptr;
  decltype(&cuCtxPushCurrent) push = nullptr;
  decltype(&cuCtxPopCurrent) pop = nullptr;
  decltype(&cuStreamDestroy) stream_destroy = nullptr;
  decltype(&cuGreenCtxDestroy) destroy = nullptr;
};

template <typename F>
int driver_entry(const char *name, F *fn) {
  cudaDriverEntryPointQueryResult found;
  BLINK_CHECK(
      cudaGetDriverEntryPointByVersion(name, reinterpret_cast<void **>(fn), CUDA_VERSION, cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || *fn == nullptr) {
    snprintf(g_error, sizeof(g_error), "the driver has no %s (query result %d)", name, static_cast<int>(found));
    return -1;
  }
  return 0;
}

int green_api(GreenApi *a) {
  int rc = driver_entry("cuDeviceGet", &a->device_get);
  if (rc == 0) rc = driver_entry("cuDeviceGetDevResource", &a->resource);
  if (rc == 0) rc = driver_entry("cuDevSmResourceSplitByCount", &a->split);
  if (rc == 0) rc = driver_entry("cuDevResourceGenerateDesc", &a->desc);
  if (rc == 0) rc = driver_entry("cuGreenCtxCreate", &a->create);
  if (rc == 0) rc = driver_entry("cuCtxFromGreenCtx", &a->as_ctx);
  if (rc == 0) rc = driver_entry("cuGreenCtxStreamCreate", &a->stream);
  if (rc == 0) rc = driver_entry("cuCtxPushCurrent", &a->push);
  if (rc == 0) rc = driver_entry("cuCtxPopCurrent", &a->pop);
  if (rc == 0) rc = driver_entry("cuStreamDestroy", &a->stream_destroy);
  if (rc == 0) rc = driver_entry("cuGreenCtxDestroy", &a->destroy);
  return rc;
}

GreenApi g_green;

struct GreenSplit {
  CUgreenCtx green[2] = {};
  CUcontext ctx[2] = {};  // each green context as a context to make current
  CUstream stream[2] = {};
};

int green_part(GreenSplit *g, int i, CUdevice dev, CUdevResource *part) {
  CUdevResourceDesc desc;
  BLINK_DRIVER(g_green.desc(&desc, part, 1));
  BLINK_DRIVER(g_green.create(&g->green[i], desc, dev, CU_GREEN_CTX_DEFAULT_STREAM));
  BLINK_DRIVER(g_green.as_ctx(&g->ctx[i], g->green[i]));
  BLINK_DRIVER(g_green.stream(&g->stream[i], g->green[i], CU_STREAM_NON_BLOCKING, 0));
  return 0;
}

void green_free(GreenSplit *g) {
  for (int i = 0; i < 2; ++i) {
    if (g->stream[i]) g_green.stream_destroy(g->stream[i]);
    if (g->green[i]) g_green.destroy(g->green[i]);
  }
  delete g;
}

int green_split(int device, unsigned first_sms, GreenSplit *g, unsigned *sms) {
  CUdevice dev;
  BLINK_DRIVER(g_green.device_get(&dev, device));
  CUdevResource whole, parts[2];
  BLINK_DRIVER(g_green.resource(dev, &whole, CU_DEV_RESOURCE_TYPE_SM));
  unsigned groups = 1;
  BLINK_DRIVER(g_green.split(&parts[0], &groups, &whole, &parts[1], 0, first_sms));
  if (groups != 1 || parts[1].sm.smCount == 0) {
    snprintf(g_error, sizeof(g_error), "%u of %u SMs leave no second share (%u groups)", first_sms, whole.sm.smCount,
             groups);
    return -1;
  }
  for (int i = 0; i < 2; ++i) {
    int rc = green_part(g, i, dev, &parts[i]);
    if (rc != 0) return rc;
    sms[i] = parts[i].sm.smCount;
  }
  return 0;
}
#endif  // CUDA_VERSION >= 12050

}  // namespace

extern "C" {

int blink_launch_pair(uint64_t first, uint64_t second, int sequential, int reps, double timeout_s, float *ms,
                      int *launch_err) {
  PairLaunch p;
  launch_err[0] = launch_err[1] = 0;
  int rc = pair_build(&p, first, second, sequential);
  for (int r = 0; rc == 0 && r < reps; ++r) rc = pair_rep(&p, timeout_s, &ms[r], launch_err);
  if (rc != -2) pair_free(&p);  // past the bound the graphs may still run: what they use stays
  return rc;
}

// The device's launch priorities: `least` urgent (0) to `greatest` (a negative number; lower is more urgent).
int blink_priority_range(int *least, int *greatest) {
  BLINK_CHECK(cudaDeviceGetStreamPriorityRange(least, greatest));
  return 0;
}

// Every kernel node of `graph` (a captured step, as cudaGraph_t) given launch priority `priority`, then the graph
// instantiated for device launch with its nodes' priorities in force rather than its launch stream's
// (cudaGraphInstantiateFlagUseNodePriority) and uploaded on `stream`: *exec, and in *kernels how many nodes took it.
int blink_priority_exec(uint64_t graph, int priority, uint64_t stream, uint64_t *exec, int *kernels) {
  cudaGraph_t g = reinterpret_cast<cudaGraph_t>(graph);
  size_t n = 0;
  BLINK_CHECK(cudaGraphGetNodes(g, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  BLINK_CHECK(cudaGraphGetNodes(g, nodes.data(), &n));
  cudaLaunchAttributeValue value = {};
  value.priority = priority;
  *kernels = 0;
  for (size_t i = 0; i < n; ++i) {
    cudaGraphNodeType type;
    BLINK_CHECK(cudaGraphNodeGetType(nodes[i], &type));
    if (type != cudaGraphNodeTypeKernel) continue;
    BLINK_CHECK(cudaGraphKernelNodeSetAttribute(nodes[i], cudaLaunchAttributePriority, &value));
    ++*kernels;
  }
  cudaGraphExec_t e = nullptr;
  BLINK_CHECK(
      cudaGraphInstantiate(&e, g, cudaGraphInstantiateFlagDeviceLaunch | cudaGraphInstantiateFlagUseNodePriority));
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  cudaError_t err = cudaGraphUpload(e, st);
  if (err == cudaSuccess) err = cudaStreamSynchronize(st);
  if (err != cudaSuccess) {
    cudaGraphExecDestroy(e);
    return fail(err, "cudaGraphUpload", __FILE__, __LINE__);
  }
  *exec = reinterpret_cast<uint64_t>(e);
  return 0;
}

#if CUDA_VERSION >= 12050
int blink_green_split(int device, unsigned first_sms, void **handle, uint64_t *streams, unsigned *sms) {
  static int api = green_api(&g_green);
  if (api != 0) return api;
  GreenSplit *g = new GreenSplit();
  int rc = green_split(device, first_sms, g, sms);
  if (rc != 0) {
    green_free(g);
    return rc;
  }
  streams[0] = reinterpret_cast<uint64_t>(g->stream[0]);
  streams[1] = reinterpret_cast<uint64_t>(g->stream[1]);
  *handle = g;
  return 0;
}

int blink_green_enter(void *handle, int which) {
  BLINK_DRIVER(g_green.push(static_cast<GreenSplit *>(handle)->ctx[which & 1]));
  return 0;
}

int blink_green_leave(void) {
  CUcontext popped;
  BLINK_DRIVER(g_green.pop(&popped));
  return 0;
}

int blink_green_destroy(void *handle) {
  green_free(static_cast<GreenSplit *>(handle));
  return 0;
}
#else
int green_unavailable() {
  snprintf(g_error, sizeof(g_error), "green contexts need CUDA 12.5 or later (built with %d)", CUDA_VERSION);
  return -1;
}
int blink_green_split(int, unsigned, void **, uint64_t *, unsigned *) { return green_unavailable(); }
int blink_green_enter(void *, int) { return green_unavailable(); }
int blink_green_leave(void) { return green_unavailable(); }
int blink_green_destroy(void *) { return green_unavailable(); }
#endif

}  // extern "C"
