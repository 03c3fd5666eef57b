// The persistent scheduler's device state: one SchedState in global memory (so that the next
// execution after a tail launch resumes where this one stopped), per-request ReqInfo, and the
// accessors of the ring and of the state's arrays.
//
// Every .cuh of the scheduler is one part of the single translation unit scheduler.cu (the kernel
// that launches graphs from the device and tail-launches itself is one module) and includes what it
// uses, so each also compiles alone. Device code lives in an unnamed namespace: internal linkage
// lets the compiler see every caller of a function and inline it, as in one file.
#ifndef BLINK_SCHED_STATE_CUH_
#define BLINK_SCHED_STATE_CUH_

#include <stddef.h>
#include <stdint.h>

#include "blink_ring.h"
#include "sched.h"
#include "sched_memory.cuh"

namespace {

// A request's place in the scheduler's queues (the ring's slot state is BLINK_SLOT_STATE_*).
// kPrefilling: in a prefill (a chunk in flight, or between chunks as SchedState::partial).
enum Phase : uint32_t { kFree = 0, kWaiting = 1, kRunning = 2, kPaused = 3, kPrefilling = 4 };
// What the planned step is.
enum PlanKind : uint32_t { kIdle = 0, kPrefill = 1, kDecode = 2 };

constexpr uint32_t kMaxClaims = 256;    // slots claimed per scan; the rest wait for the next one
constexpr uint32_t kMaxPerThread = 32;  // slots per scanning thread: num_slots <= 8192
constexpr uint32_t kFlipWords = 64;     // RingHeader.pending_flips: one bit per slot, slots 0..4095
constexpr uint32_t kMaxStopIds = sizeof(blink_sampling_params::stop_ids) / sizeof(int32_t);
constexpr uint32_t kNoSlot = 0xFFFFFFFFu;
constexpr uint32_t kNoGrammar = 0xFFFFFFFFu;  // ReqInfo.gentry of a request without a resident grammar

// A grammar's entry in the device arena's table (sched_grammar.cuh): the tables are loaded in two round trips
// with the engine's host thread (kGramMeta: their sizes; kGramCopy: the copy to `offset`), then kGramReady
// until evicted (least recently admitted first, only without references). kGramFailed keeps the id, so
// further requests for it fail at once, until the entry is reused.
enum GramStatus : uint32_t {
  kGramFree = 0,
  kGramMeta = 1,
  kGramSized = 2,
  kGramCopy = 3,
  kGramReady = 4,
  kGramFailed = 5
};

struct GramEntry {
  uint64_t id, offset, bytes, seq;  // seq: the last mailbox request posted for this entry
  uint32_t status, refs, states, exceptions, start, last_use, error;
};

struct ReqInfo {
  uint64_t request_id, seed;
  uint32_t seq, phase, arrival, prompt_len, max_new_tokens, out_len, num_blocks, flags;
  uint32_t cached;                      // tokens whose KV is in the cache (a chunked prefill's progress)
  uint64_t salt;                        // the prefix cache's salt (Slot.cache_salt)
  uint32_t num_hashed, num_registered;  // blocks of req_hashes computed; leading blocks in the prefix cache
  int32_t cached_tokens;                // prompt tokens found at the first admission (-1: not yet)
  uint32_t num_stop, num_top;
  float temperature, top_p, min_p;
  int32_t top_k;
  int32_t stop_ids[kMaxStopIds];
  float rep, freq, pres;          // the penalties (rep 1: off; an older writer's 0 read as 1)
  uint32_t min_tokens, num_bias;  // num_bias: LogitBias entries, copied to the device bias table at admission
  uint32_t num_prompt_top;        // Slot.num_prompt_logprobs: alternatives per prompt position (with the flag)
  uint64_t grammar_id;            // SamplingParams.grammar_id (0: none)
  uint32_t gentry;                // its GramEntry while the request holds a reference, else kNoGrammar
  int32_t gstate;                 // the DFA state after the outputs so far (-1: left the grammar)
};

struct SchedState {
  blink_sched_config cfg;
  blink_sched_stats *stats;       // device memory: counters and samples
  blink_sched_stats *host_stats;  // host-mapped copy, refreshed at each heartbeat and at exit
  ReqInfo *req;                   // [num_slots]
  int32_t *tokens;                // [num_slots * max_context]: prompt then outputs
  int32_t *blocks;                // [num_slots * max_blocks_per_seq]
  uint32_t *waiting;              // FIFO ring [num_slots]
  uint32_t *paused;               // sorted by arrival [num_slots]
  uint32_t *running;              // [max_batch]
  uint32_t *free_blocks;          // stack [num_blocks]: unused blocks
  // The prefix cache (sched_prefix.cuh): reference counts, the hash each registered block holds, the LRU
  // of idle cached blocks (count 0, still findable; a doubly linked list, oldest at lru_head), the table
  // hash -> block (linear probing, backward-shift deletion) and each request's block hashes.
  uint32_t *refs;                // [num_blocks]
  uint32_t *registered;          // [num_blocks] 1: in the table under block_hash
  uint64_t *block_hash;          // [num_blocks]
  int32_t *lru_prev, *lru_next;  // [num_blocks]
  uint64_t *table_key;           // [table_size]
  int32_t *table_block;          // [table_size], -1: empty
  uint64_t *req_hashes;          // [num_slots * max_blocks_per_seq]
  int32_t lru_head, lru_tail;
  uint32_t idle_count, table_mask;
  uint64_t cache_queries, cache_hits, cache_evictions;
  uint32_t *copy_rr;                             // [num_graphs] next executable copy
  uint32_t score_rr;                             // the score graph's next executable copy
  uint32_t *plan_slot, *plan_cached, *plan_new;  // [max_batch]
  // Per-row scratch of a step, in global memory (max_batch rows, up to BLINK_MAX_BATCH, outnumber the threads,
  // which loop over them; shared memory stays small for the model graphs beside the scheduler on its SM).
  uint32_t *row_cu;      // [max_batch + 1] each row's first packed token, then the step's tokens (stage)
  uint32_t *row_reason;  // [max_batch] each row's finish reason (wait_and_postprocess)
  uint32_t *score_first, *score_lo, *score_acc;  // [max_batch], [max_batch], [max_batch + 1]: ScorePlan
  uint32_t wait_head, wait_count, paused_count, running_count, free_count, arrivals;
  uint32_t plan_kind, plan_n, plan_tokens, plan_graph, draining, stopped;
  uint32_t partial;  // the request whose chunked prefill is under way, or kNoSlot
  uint64_t last_doorbell, drain_deadline, last_beat;
  uint8_t *ring_check;  // a second copy of cfg.ring: the state's integrity check
  uint32_t pending;     // a step launched by the previous execution, which then yielded its SM
  int64_t pending_expect;
  uint64_t pending_launch_ns;
  uint64_t done_ns;  // globaltimer when the last step's completion was seen; 0 after an idle loop (stats gap_ns)
  uint64_t flips_seen[kFlipWords];  // the header's pending_flips as of the last scan
  uint32_t flips_synced;            // 0: the next scan reads every slot (at start, after an overflow)
  int64_t flip_credit;              // flips seen minus doorbell increments seen since the last full scan
  GramEntry *gram;                  // [BLINK_GRAMMAR_ENTRIES] the grammar arena's table (cfg.grammar)
  uint32_t gram_busy;               // entries being loaded (kGramMeta, kGramSized, kGramCopy)
  uint32_t gram_tick;               // admissions with a grammar: the LRU clock
};

// ------------------------------------------------------------------ the ring
__device__ __forceinline__ blink_ring_header *header(SchedState *s) {
  return reinterpret_cast<blink_ring_header *>(s->cfg.ring);
}
__device__ __forceinline__ blink_slot *slot(SchedState *s, uint32_t i) {
  return reinterpret_cast<blink_slot *>(s->cfg.ring + s->cfg.slots_off) + i;
}
// A slot's 64-bit state word: state in the low half, seq in the high half.
__device__ __forceinline__ uint64_t word(uint32_t state, uint32_t seq) {
  return (static_cast<uint64_t>(seq) << 32) | state;
}

// ------------------------------------------------------------------ the state's arrays
__device__ __forceinline__ int32_t *req_tokens(SchedState *s, uint32_t i) {
  return s->tokens + static_cast<size_t>(i) * s->cfg.max_context;
}
__device__ __forceinline__ int32_t *req_blocks(SchedState *s, uint32_t i) {
  return s->blocks + static_cast<size_t>(i) * s->cfg.max_blocks_per_seq;
}
__device__ __forceinline__ size_t bias_at(SchedState *s, uint32_t i) {
  return static_cast<size_t>(i) * s->cfg.max_bias;
}
__device__ __forceinline__ uint64_t *req_block_hashes(SchedState *s, uint32_t i) {
  return s->req_hashes + static_cast<size_t>(i) * s->cfg.max_blocks_per_seq;
}
// SamplingSpec.processed without a grammar: a penalty, a bias table or min_tokens.
__device__ __forceinline__ bool penalized(const ReqInfo *r) {
  return r->rep != 1.f || r->freq != 0.f || r->pres != 0.f;
}
__device__ __forceinline__ bool uses_processors(const ReqInfo *r) {
  return penalized(r) || r->num_bias > 0 || r->min_tokens > 0;
}
__device__ __forceinline__ void sample_into(uint32_t *arr, uint32_t *n, uint64_t v) {
  uint32_t k = *n;
  arr[k % BLINK_SAMPLES] = static_cast<uint32_t>(v > 0xFFFFFFFFull ? 0xFFFFFFFFull : v);
  *n = k + 1;
}

// The row r < n whose range holds j, rows given by their ascending first indices `starts` (starts[0] <= j):
// the last r with starts[r] <= j. A step's packed tokens (stage_tokens) and its scored positions (sched_score).
__device__ uint32_t row_of(const uint32_t *starts, uint32_t n, uint32_t j) {
  uint32_t lo = 0, hi = n;
  while (hi - lo > 1) {
    uint32_t mid = (lo + hi) / 2;
    if (starts[mid] <= j)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// Thread 0: the scheduler's own state was overwritten (by a kernel writing out of bounds): stop
// at once, through the copy of the ring address, rather than dereference what is left.
__device__ bool state_corrupted(SchedState *s) {
  if (s->cfg.ring == s->ring_check) return false;
  s->stats->exit_reason = BLINK_EXIT_STATE_OVERWRITTEN;
  s->stopped = 1;
  st_rel32(&reinterpret_cast<blink_ring_header *>(s->ring_check)->engine_state, BLINK_ENGINE_STATE_FAILED);
  return true;
}

}  // namespace

#endif  // BLINK_SCHED_STATE_CUH_
