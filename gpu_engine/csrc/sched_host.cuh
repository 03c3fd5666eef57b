// ------------------------------------------------------------------ host API (extern "C", ctypes)
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <vector>

namespace {

char g_error[512];

int fail(cudaError_t err, const char *what, const char *file, int line) {
  snprintf(g_error, sizeof(g_error), "%s:%d: %s: %s", file, line, what, cudaGetErrorString(err));
  return static_cast<int>(err);
}

#define BLINK_CHECK(call)                                                  \
  do {                                                                     \
    cudaError_t err_ = (call);                                             \
    if (err_ != cudaSuccess) return fail(err_, #call, __FILE__, __LINE__); \
  } while (0)

struct Handle {
  SchedState *dev = nullptr;  // device copy of the state header
  void *arena = nullptr;      // every device array of the state
  blink_sched_stats *host_stats = nullptr;
  cudaStream_t stream = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
};

__global__ void read_globaltimer(uint64_t *out) { *out = now_ns(); }

template <typename T>
T *carve(char **cursor, size_t count) {
  size_t bytes = (count * sizeof(T) + 255) / 256 * 256;
  T *p = reinterpret_cast<T *>(*cursor);
  *cursor += bytes;
  return p;
}

size_t arena_bytes(const blink_sched_config &c) {
  size_t n = 0;
  auto add = [&n](size_t b) { n += (b + 255) / 256 * 256; };
  add(sizeof(blink_sched_stats));
  add(sizeof(ReqInfo) * c.num_slots);
  add(sizeof(int32_t) * c.num_slots * c.max_context);
  add(sizeof(int32_t) * c.num_slots * c.max_blocks_per_seq);
  add(sizeof(uint32_t) * c.num_slots * 2);
  add(sizeof(uint32_t) * c.max_batch);
  add(sizeof(uint32_t) * c.num_blocks);
  add(sizeof(uint32_t) * c.num_graphs);
  add(sizeof(uint32_t) * c.max_batch * 3);
  return n;
}

int init_state(const blink_sched_config &c, Handle *h, SchedState *st) {
  size_t bytes = arena_bytes(c);
  BLINK_CHECK(cudaMalloc(&h->arena, bytes));
  BLINK_CHECK(cudaMemset(h->arena, 0, bytes));
  char *cur = static_cast<char *>(h->arena);
  memset(st, 0, sizeof(*st));
  st->cfg = c;
  st->stats = carve<blink_sched_stats>(&cur, 1);
  st->req = carve<ReqInfo>(&cur, c.num_slots);
  st->tokens = carve<int32_t>(&cur, static_cast<size_t>(c.num_slots) * c.max_context);
  st->blocks = carve<int32_t>(&cur, static_cast<size_t>(c.num_slots) * c.max_blocks_per_seq);
  st->waiting = carve<uint32_t>(&cur, c.num_slots);
  st->paused = carve<uint32_t>(&cur, c.num_slots);
  st->running = carve<uint32_t>(&cur, c.max_batch);
  st->free_blocks = carve<uint32_t>(&cur, c.num_blocks);
  st->copy_rr = carve<uint32_t>(&cur, c.num_graphs);
  st->plan_slot = carve<uint32_t>(&cur, c.max_batch);
  st->plan_cached = carve<uint32_t>(&cur, c.max_batch);
  st->plan_new = carve<uint32_t>(&cur, c.max_batch);
  std::vector<uint32_t> stack(c.num_blocks);  // popped from the end: low ids first, as in Python
  for (uint32_t k = 0; k < c.num_blocks; ++k) stack[k] = c.num_blocks - 1 - k;
  BLINK_CHECK(cudaMemcpy(st->free_blocks, stack.data(), sizeof(uint32_t) * c.num_blocks, cudaMemcpyHostToDevice));
  st->free_count = c.num_blocks;
  BLINK_CHECK(cudaHostAlloc(&h->host_stats, sizeof(blink_sched_stats), cudaHostAllocMapped));
  memset(h->host_stats, 0, sizeof(blink_sched_stats));
  BLINK_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void **>(&st->host_stats), h->host_stats, 0));
  BLINK_CHECK(cudaMalloc(&h->dev, sizeof(SchedState)));
  BLINK_CHECK(cudaMemcpy(h->dev, st, sizeof(SchedState), cudaMemcpyHostToDevice));
  return 0;
}

// The scheduler runs inside a graph instantiated for device launch: that is what lets it
// fire-and-forget children and tail-launch itself.
int build_graph(Handle *h) {
  BLINK_CHECK(cudaStreamCreateWithFlags(&h->stream, cudaStreamNonBlocking));
  BLINK_CHECK(cudaGraphCreate(&h->graph, 0));
  blink_sched_stats *dev_host_stats = nullptr;
  BLINK_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void **>(&dev_host_stats), h->host_stats, 0));
  void *args[] = {&h->dev, &dev_host_stats};
  cudaKernelNodeParams p = {};
  p.func = reinterpret_cast<void *>(blink_scheduler);
  p.gridDim = dim3(1);
  p.blockDim = dim3(BLINK_SCHED_THREADS);
  p.kernelParams = args;
  cudaGraphNode_t node;
  BLINK_CHECK(cudaGraphAddKernelNode(&node, h->graph, nullptr, 0, &p));
  BLINK_CHECK(cudaGraphInstantiate(&h->exec, h->graph, cudaGraphInstantiateFlagDeviceLaunch));
  BLINK_CHECK(cudaGraphUpload(h->exec, h->stream));
  BLINK_CHECK(cudaStreamSynchronize(h->stream));
  return 0;
}

}  // namespace

extern "C" {

const char *blink_last_error(void) { return g_error; }
int blink_sched_config_size(void) { return static_cast<int>(sizeof(blink_sched_config)); }
int blink_sched_stats_size(void) { return static_cast<int>(sizeof(blink_sched_stats)); }

// Pin and map a host range (the ring) for the GPU; returns its device address.
int blink_register_host(void *ptr, size_t size, void **dev_ptr) {
  BLINK_CHECK(cudaHostRegister(ptr, size, cudaHostRegisterPortable | cudaHostRegisterMapped));
  BLINK_CHECK(cudaHostGetDevicePointer(dev_ptr, ptr, 0));
  return 0;
}

int blink_unregister_host(void *ptr) {
  BLINK_CHECK(cudaHostUnregister(ptr));
  return 0;
}

// CLOCK_REALTIME minus globaltimer, so device timestamps in the ring share the host's clock.
int blink_clock_offset(int64_t *offset) {
  uint64_t *d = nullptr, g = 0;
  BLINK_CHECK(cudaMalloc(&d, sizeof(uint64_t)));
  timespec a, b;
  clock_gettime(CLOCK_REALTIME, &a);
  read_globaltimer<<<1, 1>>>(d);
  BLINK_CHECK(cudaDeviceSynchronize());
  clock_gettime(CLOCK_REALTIME, &b);
  BLINK_CHECK(cudaMemcpy(&g, d, sizeof(g), cudaMemcpyDeviceToHost));
  BLINK_CHECK(cudaFree(d));
  int64_t mid = (static_cast<int64_t>(a.tv_sec) * 1000000000 + a.tv_nsec + static_cast<int64_t>(b.tv_sec) * 1000000000 +
                 b.tv_nsec) /
                2;
  *offset = mid - static_cast<int64_t>(g);
  return 0;
}

int blink_sched_create(const blink_sched_config *cfg, void **handle, blink_sched_stats **host_stats) {
  if (cfg->max_batch > BLINK_SCHED_THREADS || cfg->copies == 0 || cfg->num_graphs == 0 ||
      cfg->num_slots > BLINK_SCHED_THREADS * kMaxPerThread) {
    snprintf(g_error, sizeof(g_error),
             "invalid scheduler config: max_batch %u (<= %d), copies %u, graphs %u, slots %u (<= %u)", cfg->max_batch,
             BLINK_SCHED_THREADS, cfg->copies, cfg->num_graphs, cfg->num_slots, BLINK_SCHED_THREADS * kMaxPerThread);
    return -1;
  }
  Handle *h = new Handle();
  SchedState st;
  int rc = init_state(*cfg, h, &st);
  if (rc == 0) rc = build_graph(h);
  if (rc != 0) {
    delete h;
    return rc;
  }
  *handle = h;
  *host_stats = h->host_stats;
  return 0;
}

int blink_sched_start(void *handle) {
  Handle *h = static_cast<Handle *>(handle);
  BLINK_CHECK(cudaGraphLaunch(h->exec, h->stream));
  return 0;
}

// 0 while running, 1 once finished, a CUDA error code otherwise. No device-wide sync.
int blink_sched_query(void *handle) {
  cudaError_t err = cudaStreamQuery(static_cast<Handle *>(handle)->stream);
  if (err == cudaErrorNotReady) return 0;
  if (err == cudaSuccess) return 1;
  return fail(err, "cudaStreamQuery", __FILE__, __LINE__);
}

int blink_sched_wait(void *handle) {
  BLINK_CHECK(cudaStreamSynchronize(static_cast<Handle *>(handle)->stream));
  return 0;
}

int blink_sched_destroy(void *handle) {
  Handle *h = static_cast<Handle *>(handle);
  if (h->exec) cudaGraphExecDestroy(h->exec);
  if (h->graph) cudaGraphDestroy(h->graph);
  if (h->stream) cudaStreamDestroy(h->stream);
  if (h->arena) cudaFree(h->arena);
  if (h->dev) cudaFree(h->dev);
  if (h->host_stats) cudaFreeHost(h->host_stats);
  delete h;
  return 0;
}

}  // extern "C"
