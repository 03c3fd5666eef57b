// The scheduler's host API (extern "C", declared in sched.h, called through ctypes): create the
// state and the device-launchable graph that runs the kernel, start it, then only supervise;
// plus the diagnostics (the SM footprint probe, one-off launches, the guard report).
#ifndef BLINK_SCHED_HOST_CUH_
#define BLINK_SCHED_HOST_CUH_

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <vector>

#include "sched.h"
#include "sched_kernel.cuh"
#include "sched_memory.cuh"
#include "sched_state.cuh"

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

constexpr size_t kGuardBytes = 64 * 1024;
constexpr int kGuardByte = 0xA5;

struct Handle {
  void *dev_block = nullptr;   // guard band, state, guard band
  SchedState *dev = nullptr;   // device copy of the state header
  blink_sched_config initial;  // as created: the state's configuration must never change
  void *arena = nullptr;       // every device array of the state
  blink_sched_stats *host_stats = nullptr;
  cudaStream_t stream = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
};

__global__ void read_globaltimer(uint64_t *out) { *out = now_ns(); }

// Stand-in for the scheduler's footprint on its SM while a model graph runs (same block size,
// same shared memory): it says it is resident, then spins until the host releases it.
__global__ void __launch_bounds__(BLINK_SCHED_THREADS) probe_spin(uint32_t *flags) {
  extern __shared__ uint32_t pad[];
  pad[threadIdx.x] = threadIdx.x;
  __syncthreads();
  if (threadIdx.x == 0) {
    st_rel32(&flags[0], pad[0] + 1);
    while (!ld_acq32(&flags[1])) __nanosleep(1000);
  }
  __syncthreads();
}

// Launches one graph from the device and returns; the parent graph completes with its child.
__global__ void launch_child(uint64_t exec, int *err) {
  if (threadIdx.x == 0)
    *err = static_cast<int>(cudaGraphLaunch(reinterpret_cast<cudaGraphExec_t>(exec), cudaStreamGraphFireAndForget));
}

struct Probe {
  uint32_t *flags = nullptr;  // host-mapped: [0] resident, [1] release
  cudaStream_t stream = nullptr;
};

// Every device array of the state, carved from one arena in a fixed order, each 256-byte aligned.
// The same function sizes the arena (base 0) and then assigns the pointers, so the two cannot
// disagree (an arena smaller than its arrays let the last ones overwrite the next allocation).
template <typename T>
T *carve(uintptr_t base, size_t *cursor, size_t count) {
  T *p = reinterpret_cast<T *>(base + *cursor);
  *cursor += (count * sizeof(T) + 255) / 256 * 256;
  return p;
}

// The prefix cache's table: a power of two at least twice the blocks (each block holds one hash at most),
// so probe chains stay short; a single entry when caching is off.
size_t table_size(const blink_sched_config &c) {
  size_t n = 1;
  while (c.prefix_caching && n < 2 * static_cast<size_t>(c.num_blocks)) n *= 2;
  return n;
}

size_t carve_arena(const blink_sched_config &c, SchedState *st, uintptr_t base) {
  size_t cur = 0;
  st->stats = carve<blink_sched_stats>(base, &cur, 1);
  st->req = carve<ReqInfo>(base, &cur, c.num_slots);
  // the token history: the graphs' own table when they apply processors from it (config.history)
  st->tokens = c.history ? c.history : carve<int32_t>(base, &cur, static_cast<size_t>(c.num_slots) * c.max_context);
  st->blocks = carve<int32_t>(base, &cur, static_cast<size_t>(c.num_slots) * c.max_blocks_per_seq);
  st->waiting = carve<uint32_t>(base, &cur, c.num_slots);
  st->paused = carve<uint32_t>(base, &cur, c.num_slots);
  st->running = carve<uint32_t>(base, &cur, c.max_batch);
  st->free_blocks = carve<uint32_t>(base, &cur, c.num_blocks);
  st->refs = carve<uint32_t>(base, &cur, c.num_blocks);
  st->registered = carve<uint32_t>(base, &cur, c.num_blocks);
  st->block_hash = carve<uint64_t>(base, &cur, c.num_blocks);
  st->lru_prev = carve<int32_t>(base, &cur, c.num_blocks);
  st->lru_next = carve<int32_t>(base, &cur, c.num_blocks);
  st->table_key = carve<uint64_t>(base, &cur, table_size(c));
  st->table_block = carve<int32_t>(base, &cur, table_size(c));
  st->req_hashes = carve<uint64_t>(base, &cur, static_cast<size_t>(c.num_slots) * c.max_blocks_per_seq);
  st->copy_rr = carve<uint32_t>(base, &cur, c.num_graphs);
  st->plan_slot = carve<uint32_t>(base, &cur, c.max_batch);
  st->plan_cached = carve<uint32_t>(base, &cur, c.max_batch);
  st->plan_new = carve<uint32_t>(base, &cur, c.max_batch);
  st->row_cu = carve<uint32_t>(base, &cur, c.max_batch + 1);
  st->row_reason = carve<uint32_t>(base, &cur, c.max_batch);
  st->score_first = carve<uint32_t>(base, &cur, c.max_batch);
  st->score_lo = carve<uint32_t>(base, &cur, c.max_batch);
  st->score_acc = carve<uint32_t>(base, &cur, c.max_batch + 1);
  st->gram = carve<GramEntry>(base, &cur, BLINK_GRAMMAR_ENTRIES);
  return cur;
}

int init_state(const blink_sched_config &c, Handle *h, SchedState *st) {
  memset(st, 0, sizeof(*st));
  st->cfg = c;
  size_t bytes = carve_arena(c, st, 0);
  BLINK_CHECK(cudaMalloc(&h->arena, bytes));
  BLINK_CHECK(cudaMemset(h->arena, 0, bytes));
  carve_arena(c, st, reinterpret_cast<uintptr_t>(h->arena));
  std::vector<uint32_t> stack(c.num_blocks);  // popped from the end: low ids first, as in Python
  for (uint32_t k = 0; k < c.num_blocks; ++k) stack[k] = c.num_blocks - 1 - k;
  BLINK_CHECK(cudaMemcpy(st->free_blocks, stack.data(), sizeof(uint32_t) * c.num_blocks, cudaMemcpyHostToDevice));
  st->free_count = c.num_blocks;
  BLINK_CHECK(cudaMemset(st->table_block, 0xFF, sizeof(int32_t) * table_size(c)));  // every entry empty (-1)
  st->table_mask = static_cast<uint32_t>(table_size(c) - 1);
  st->lru_head = st->lru_tail = -1;
  st->partial = kNoSlot;
  BLINK_CHECK(cudaHostAlloc(&h->host_stats, sizeof(blink_sched_stats), cudaHostAllocMapped));
  memset(h->host_stats, 0, sizeof(blink_sched_stats));
  BLINK_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void **>(&st->host_stats), h->host_stats, 0));
  st->ring_check = c.ring;
  // The state sits between two guard bands of a known pattern, so that a kernel writing out of
  // bounds is caught (blink_sched_guard_report) instead of silently steering the scheduler.
  BLINK_CHECK(cudaMalloc(&h->dev_block, sizeof(SchedState) + 2 * kGuardBytes));
  BLINK_CHECK(cudaMemset(h->dev_block, kGuardByte, sizeof(SchedState) + 2 * kGuardBytes));
  h->dev = reinterpret_cast<SchedState *>(static_cast<char *>(h->dev_block) + kGuardBytes);
  BLINK_CHECK(cudaMemcpy(h->dev, st, sizeof(SchedState), cudaMemcpyHostToDevice));
  h->initial = st->cfg;
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

// A configuration the scheduler cannot serve: its message in g_error, true.
bool config_refused(const blink_sched_config *cfg) {
  if (cfg->processors && !(cfg->history && cfg->bias_tokens && cfg->bias_values && cfg->proc_rows &&
                           cfg->proc_penalties && cfg->max_bias)) {
    snprintf(g_error, sizeof(g_error), "invalid scheduler config: processors on without their tables");
    return true;
  }
  bool score_parts = cfg->score_exec && cfg->score_counter && cfg->score_index && cfg->score_targets &&
                     cfg->score_logprobs && cfg->score_ranks && cfg->score_top_ids && cfg->score_top_logprobs;
  if (cfg->score_rows && !(score_parts && cfg->score_top && cfg->prompt_logprob_rows && cfg->score_max_pieces &&
                           cfg->score_max_pieces + 3 <= BLINK_WINDOW_LIMIT)) {
    snprintf(g_error, sizeof(g_error),
             "invalid scheduler config: the score graph without its buffers, or %u score launches a step "
             "(at most %d)",
             cfg->score_max_pieces, BLINK_WINDOW_LIMIT - 3);
    return true;
  }
  return false;
}

int blink_sched_create(const blink_sched_config *cfg, void **handle, blink_sched_stats **host_stats) {
  if (config_refused(cfg)) return -1;
  if (cfg->max_batch > BLINK_MAX_BATCH || cfg->copies == 0 || cfg->num_graphs == 0 ||
      cfg->num_slots > BLINK_SCHED_THREADS * kMaxPerThread || (cfg->scan_flips && cfg->num_slots > kFlipWords * 64)) {
    snprintf(g_error, sizeof(g_error),
             "invalid scheduler config: max_batch %u (<= %d), copies %u, graphs %u, slots %u (<= %u; <= %u with "
             "scan_flips)",
             cfg->max_batch, BLINK_MAX_BATCH, cfg->copies, cfg->num_graphs, cfg->num_slots,
             BLINK_SCHED_THREADS * kMaxPerThread, kFlipWords * 64);
    return -1;
  }
  if (cfg->max_batch == 0 || cfg->block_size == 0 || cfg->token_grain == 0) {  // divisors on the device
    snprintf(g_error, sizeof(g_error),
             "invalid scheduler config: max_batch %u, block_size %u, token_grain %u (each >= 1)", cfg->max_batch,
             cfg->block_size, cfg->token_grain);
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

// Occupy one SM as the scheduler would (a block of BLINK_SCHED_THREADS threads with the
// scheduler's shared memory) and wait until it runs; blink_probe_release ends it. Used to check
// that every model graph can finish while the scheduler holds its SM (a kernel whose CTAs wait on
// each other and that sizes its grid to every SM would hang).
int blink_probe_hold(void **probe) {
  Probe *p = new Probe();
  cudaFuncAttributes attr;
  BLINK_CHECK(cudaFuncGetAttributes(&attr, blink_scheduler));
  size_t smem = attr.sharedSizeBytes > BLINK_SCHED_THREADS * 4 ? attr.sharedSizeBytes : BLINK_SCHED_THREADS * 4;
  BLINK_CHECK(cudaHostAlloc(&p->flags, 2 * sizeof(uint32_t), cudaHostAllocMapped));
  p->flags[0] = p->flags[1] = 0;
  uint32_t *dev = nullptr;
  BLINK_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void **>(&dev), p->flags, 0));
  BLINK_CHECK(cudaStreamCreateWithFlags(&p->stream, cudaStreamNonBlocking));
  probe_spin<<<1, BLINK_SCHED_THREADS, smem, p->stream>>>(dev);
  BLINK_CHECK(cudaGetLastError());
  timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  while (!reinterpret_cast<volatile uint32_t *>(p->flags)[0]) {
    clock_gettime(CLOCK_MONOTONIC, &t);
    if (t.tv_sec - t0.tv_sec > 10) {
      blink_probe_release(p);  // lets the block finish once it runs, then frees what it holds
      snprintf(g_error, sizeof(g_error), "probe block did not start within 10 s");
      return -1;
    }
  }
  *probe = p;
  return 0;
}

int blink_probe_release(void *probe) {
  Probe *p = static_cast<Probe *>(probe);
  reinterpret_cast<volatile uint32_t *>(p->flags)[1] = 1;
  BLINK_CHECK(cudaStreamSynchronize(p->stream));
  BLINK_CHECK(cudaStreamDestroy(p->stream));
  BLINK_CHECK(cudaFreeHost(p->flags));
  delete p;
  return 0;
}

// Diagnostics: launch a device-launch executable once from the host (device == 0) or from a
// one-thread kernel inside a device-launched parent graph (device == 1), and wait for it.
int blink_launch_once(uint64_t exec, int device, int *launch_err) {
  cudaStream_t stream;
  BLINK_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  *launch_err = 0;
  if (!device) {
    BLINK_CHECK(cudaGraphLaunch(reinterpret_cast<cudaGraphExec_t>(exec), stream));
  } else {
    int *err = nullptr;
    BLINK_CHECK(cudaHostAlloc(&err, sizeof(int), cudaHostAllocMapped));
    *err = -1;
    int *dev_err = nullptr;
    BLINK_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void **>(&dev_err), err, 0));
    cudaGraph_t g;
    cudaGraphExec_t ge;
    BLINK_CHECK(cudaGraphCreate(&g, 0));
    void *args[] = {&exec, &dev_err};
    cudaKernelNodeParams p = {};
    p.func = reinterpret_cast<void *>(launch_child);
    p.gridDim = dim3(1);
    p.blockDim = dim3(32);
    p.kernelParams = args;
    cudaGraphNode_t node;
    BLINK_CHECK(cudaGraphAddKernelNode(&node, g, nullptr, 0, &p));
    BLINK_CHECK(cudaGraphInstantiate(&ge, g, cudaGraphInstantiateFlagDeviceLaunch));
    BLINK_CHECK(cudaGraphUpload(ge, stream));
    BLINK_CHECK(cudaGraphLaunch(ge, stream));
    BLINK_CHECK(cudaStreamSynchronize(stream));
    *launch_err = *err;
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    cudaFreeHost(err);
  }
  BLINK_CHECK(cudaStreamSynchronize(stream));
  BLINK_CHECK(cudaStreamDestroy(stream));
  return 0;
}

// After the scheduler stopped: describe every byte range of the guard bands and of the state's
// configuration that no longer holds what was written at creation. Returns the number of ranges.
int blink_sched_guard_report(void *handle, char *out, size_t out_size) {
  Handle *h = static_cast<Handle *>(handle);
  size_t total = sizeof(SchedState) + 2 * kGuardBytes;
  std::vector<uint8_t> now(total), was(total, static_cast<uint8_t>(kGuardByte));
  BLINK_CHECK(cudaMemcpy(now.data(), h->dev_block, total, cudaMemcpyDeviceToHost));
  memcpy(was.data() + kGuardBytes, &h->initial, sizeof(h->initial));
  size_t cfg_end = kGuardBytes + sizeof(blink_sched_config), state_end = kGuardBytes + sizeof(SchedState);
  int ranges = 0;
  size_t used = 0;
  out[0] = 0;
  for (size_t k = 0; k < total;) {
    bool checked = k < cfg_end || k >= state_end;
    if (!checked || now[k] == was[k]) {
      ++k;
      continue;
    }
    size_t e = k;
    while (e < total && (e < cfg_end || e >= state_end) && now[e] != was[e]) ++e;
    ++ranges;
    if (used + 160 < out_size) {
      used += snprintf(out + used, out_size - used, "[%+ld, %zu bytes]",
                       static_cast<long>(k) - static_cast<long>(kGuardBytes), e - k);
      for (size_t b = k; b < e && b < k + 16 && used + 4 < out_size; ++b)
        used += snprintf(out + used, out_size - used, " %02x", now[b]);
      used += snprintf(out + used, out_size - used, "; ");
    }
    k = e;
  }
  return ranges;
}

int blink_sched_destroy(void *handle) {
  Handle *h = static_cast<Handle *>(handle);
  if (h->exec) cudaGraphExecDestroy(h->exec);
  if (h->graph) cudaGraphDestroy(h->graph);
  if (h->stream) cudaStreamDestroy(h->stream);
  if (h->arena) cudaFree(h->arena);
  if (h->dev_block) cudaFree(h->dev_block);
  if (h->host_stats) cudaFreeHost(h->host_stats);
  delete h;
  return 0;
}

}  // extern "C"

#endif  // BLINK_SCHED_HOST_CUH_
