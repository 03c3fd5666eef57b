// Claiming new prompts (all threads): scan the ring, claim the pending slots, order the claims by
// submission time, admit them (read, check, queue).
//
// The scan runs only when the doorbell moved. With scan_flips, 64 threads first read the header's
// pending_flips (512 bytes, a few PCIe reads) and only slots whose bit flipped since the last scan
// have their state word read; otherwise, and on the first scan or after one that overflowed
// kMaxClaims, every slot's state word is read. The flips are read before the state words, so a
// slot whose flip is seen shows PENDING (the frontend flips after storing the state word). Each
// publication flips once and rings once, its flip first: fewer flips than rings since the last
// full scan means a writer that does not flip (an older frontend) published, and every slot is
// read.
#ifndef BLINK_SCHED_CLAIM_CUH_
#define BLINK_SCHED_CLAIM_CUH_

#include <stddef.h>
#include <stdint.h>

#include "blink_ring.h"
#include "sched_memory.cuh"
#include "sched_policy.cuh"
#include "sched_state.cuh"

namespace {

// ------------------------------------------------------------------ phase clocks
// Built with -DBLINK_SCHED_PHASE_CLOCKS (build_library(phase_clocks=True)), a scan that claims
// through the flips adds the time of each of its phases to stats.scan_phase_ns; otherwise none of
// these clocks is read and scan_phase_ns stays zero.
struct ScanClocks {
  uint64_t flips;  // the flip words read and fenced
  uint64_t word;   // the first claimed slot's state word read and fenced
  uint64_t claim;  // that slot claimed and its submission time in hand
};

__device__ __forceinline__ uint64_t phase_now() {
#ifdef BLINK_SCHED_PHASE_CLOCKS
  return now_ns();
#else
  return 0;
#endif
}

__device__ __forceinline__ void clock_flips(ScanClocks *c) {
#ifdef BLINK_SCHED_PHASE_CLOCKS
  c->flips = now_ns();
#endif
}

__device__ __forceinline__ void clock_first_claim(ScanClocks *c, uint64_t t_seen, uint64_t key) {
#ifdef BLINK_SCHED_PHASE_CLOCKS
  uint64_t arrived;
  asm volatile("mov.u64 %0, %1;" : "=l"(arrived) : "l"(key));  // the clock is read once the key is here
  c->word = t_seen;
  c->claim = now_ns() + (arrived & 0);
#endif
}

__device__ __forceinline__ void add_phase_clocks(blink_sched_stats *st, const ScanClocks *c, uint64_t t0,
                                                 uint64_t t_end) {
#ifdef BLINK_SCHED_PHASE_CLOCKS
  st->scan_phase_ns[0] += c->flips - t0;
  st->scan_phase_ns[1] += c->word - c->flips;
  st->scan_phase_ns[2] += c->claim - c->word;
  st->scan_phase_ns[3] += t_end - c->claim;
  st->scan_phase_n++;
#endif
}

// ------------------------------------------------------------------ one scan's shared scratch
struct ClaimScratch {
  uint32_t n_claimed, go, full, n_flips;                          // full: every slot's state word is read
  uint32_t ok[kMaxClaims], bad[kMaxClaims], claimed[kMaxClaims];  // claimed: slot, or kNoSlot (CAS lost)
  uint64_t key[kMaxClaims];                                       // submission time (the sort key)
  uint64_t bell, t0;
  uint64_t flips[kFlipWords];  // bits flipped since the last scan
  int64_t credit;
  ScanClocks clocks;
};

// ------------------------------------------------------------------ requests
// Read one claimed slot's request into device state; false when the engine can never run it.
__device__ bool read_request(SchedState *s, uint32_t i) {
  const volatile blink_slot *sl = slot(s, i);
  ReqInfo *r = &s->req[i];
  r->seq = sl->seq;
  r->request_id = sl->request_id;
  r->prompt_len = sl->prompt_len;
  r->max_new_tokens = sl->max_new_tokens;
  r->flags = sl->sampling.flags;
  r->temperature = sl->sampling.temperature;
  r->top_p = sl->sampling.top_p;
  r->top_k = sl->sampling.top_k;
  r->min_p = sl->sampling.min_p;
  r->num_top = sl->sampling.num_top_logprobs;
  r->num_stop = sl->sampling.num_stop_ids > kMaxStopIds ? kMaxStopIds : sl->sampling.num_stop_ids;
  for (uint32_t k = 0; k < kMaxStopIds; ++k) r->stop_ids[k] = sl->sampling.stop_ids[k];
  float rep = sl->sampling.repetition_penalty;
  r->rep = rep == 0.f ? 1.f : rep;
  r->freq = sl->sampling.frequency_penalty;
  r->pres = sl->sampling.presence_penalty;
  r->min_tokens = sl->sampling.min_tokens;
  r->num_bias = sl->sampling.num_logit_bias;
  r->num_prompt_top = sl->num_prompt_logprobs;
  r->grammar_id = sl->sampling.grammar_id;
  r->gentry = kNoGrammar;
  r->gstate = -1;
  uint64_t seed =
      (r->flags & BLINK_SAMPLING_FLAGS_HAS_SEED) ? sl->sampling.seed : r->request_id * 0x9E3779B97F4A7C15ull;
  r->seed = seed & 0x7FFFFFFFFFFFFFFFull;
  r->out_len = 0;
  r->num_blocks = 0;
  r->cached = 0;
  r->salt = sl->cache_salt;
  r->num_hashed = r->num_registered = 0;
  r->cached_tokens = -1;
  const blink_sched_config &c = s->cfg;
  uint32_t total = r->prompt_len + r->max_new_tokens;
  bool ok = r->prompt_len >= 1 && r->prompt_len <= c.max_prompt && r->max_new_tokens >= 1 &&
            r->max_new_tokens <= c.max_output && total <= c.max_context && blocks_for(s, total) <= c.num_blocks &&
            blocks_for(s, total) <= c.max_blocks_per_seq && (c.chunked || total - 1 <= c.max_tokens);
  st_rel64(const_cast<uint64_t *>(&sl->admit_ns), now_ns() + c.clock_offset_ns);
  return ok;
}

// Copy a claimed prompt into device memory once; flags ids outside the vocabulary.
__device__ void copy_prompt(SchedState *s, uint32_t i, uint32_t *bad) {
  const volatile int32_t *src =
      reinterpret_cast<const int32_t *>(s->cfg.ring + s->cfg.prompt_off) + static_cast<size_t>(i) * s->cfg.max_prompt;
  int32_t *dst = req_tokens(s, i);
  uint32_t n = s->req[i].prompt_len;
  for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) {
    int32_t t = src[j];
    dst[j] = t;
    if (t < 0 || static_cast<uint32_t>(t) >= s->cfg.vocab_size) *bad = 1;
  }
}

// A claimed request's logit-bias table (the tail of its prompt row) into the device table, checked as the
// Python engine checks it (at most max_bias entries that fit beside the prompt, tokens in the vocabulary,
// biases in [-100, 100]) and ascending as the ring promises. `bad`: the request is refused (BAD_PARAMS),
// as is one whose processors this scheduler does not apply, one with a grammar without the arena, or one
// asking for prompt log-probs that its slot's rows cannot hold (or without the score graph).
__device__ void copy_bias(SchedState *s, uint32_t i, uint32_t *bad) {
  const blink_sched_config &c = s->cfg;
  const ReqInfo *r = &s->req[i];
  uint32_t n = r->num_bias;
  const volatile blink_slot *sl = slot(s, i);
  bool prompt_top = (r->flags & BLINK_SAMPLING_FLAGS_WANT_PROMPT_LOGPROBS) &&
                    !(c.score_rows && r->prompt_len <= c.prompt_logprob_rows && r->num_prompt_top <= c.score_top &&
                      r->num_prompt_top <= c.ring_top_k);
  bool refuse = (!c.processors && uses_processors(r)) || (r->grammar_id && !c.grammar) || prompt_top ||
                n > c.max_bias || r->prompt_len + 2 * n > c.max_prompt;
  if (refuse) {
    if (threadIdx.x == 0) *bad = 1;
    return;
  }
  const volatile blink_logit_bias *src = reinterpret_cast<const blink_logit_bias *>(
      reinterpret_cast<const int32_t *>(c.ring + c.prompt_off) + (static_cast<size_t>(i) + 1) * c.max_prompt - 2 * n);
  for (uint32_t k = threadIdx.x; k < n; k += blockDim.x) {
    int32_t t = src[k].token;
    float b = src[k].bias;
    c.bias_tokens[bias_at(s, i) + k] = t;
    c.bias_values[bias_at(s, i) + k] = b;
    bool ascending = k == 0 || src[k - 1].token < t;
    if (t < 0 || static_cast<uint32_t>(t) >= c.vocab_size || !(fabsf(b) <= 100.f) || !ascending) *bad = 1;
  }
}

// ------------------------------------------------------------------ scan
// All threads: whether this scan runs (the same answer for every thread). Thread 0 checks the
// state, reads the doorbell and starts the clock.
__device__ bool scan_begin(SchedState *s, ClaimScratch *sh) {
  if (threadIdx.x == 0 && state_corrupted(s)) sh->go = 0;
  __syncthreads();
  if (s->stopped) return false;
  if (threadIdx.x == 0) {
    sh->bell = ld_acq64(&header(s)->doorbell);
    sh->go = !s->draining && sh->bell != s->last_doorbell;
    sh->n_claimed = sh->n_flips = 0;
    sh->full = !s->cfg.scan_flips || !s->flips_synced;
    sh->t0 = now_ns();
  }
  __syncthreads();
  return sh->go;
}

// All threads (with scan_flips): the bits flipped since the last scan, read by 64 threads; the
// scan reads every slot when the flips do not account for every ring of the doorbell.
__device__ void scan_flip_words(SchedState *s, ClaimScratch *sh) {
  if (threadIdx.x < kFlipWords) {
    uint64_t b = ld_relaxed64(&header(s)->pending_flips[threadIdx.x]);
    sh->flips[threadIdx.x] = b ^ s->flips_seen[threadIdx.x];
    s->flips_seen[threadIdx.x] = b;
    atomicAdd(&sh->n_flips, static_cast<uint32_t>(__popcll(sh->flips[threadIdx.x])));
  }
  __threadfence_system();  // the flips before the state words they announce
  __syncthreads();
  if (threadIdx.x == 0) {
    sh->credit = s->flip_credit + static_cast<int64_t>(sh->n_flips) - static_cast<int64_t>(sh->bell - s->last_doorbell);
    sh->full = sh->full || sh->credit < 0;
    clock_flips(&sh->clocks);
  }
  __syncthreads();
}

// Each thread's slots (threadIdx.x + k * blockDim.x) that the scan looks at: relaxed loads of the
// state words, all issued before any is used, so the PCIe round trips overlap. A slot found
// through its flip has its whole payload visible already (the frontend flips after the state
// word), so its submission time is loaded beside the state word rather than after the claim.
__device__ __forceinline__ void scan_state_words(SchedState *s, const ClaimScratch *sh,
                                                 uint64_t (&words)[kMaxPerThread], uint64_t (&submit)[kMaxPerThread]) {
#pragma unroll
  for (uint32_t k = 0; k < kMaxPerThread; ++k) {
    uint32_t i = threadIdx.x + k * blockDim.x;
    bool look = i < s->cfg.num_slots && (sh->full || ((sh->flips[i >> 6] >> (i & 63)) & 1u));
    words[k] = look ? ld_relaxed64(slot(s, i)) : 0;
    submit[k] = look && !sh->full ? ld_relaxed64(&slot(s, i)->submit_ns) : 0;
  }
}

// ------------------------------------------------------------------ claim
// All threads: load the state words, then an acquire fence orders them before the payload reads
// of a pending slot, then claim every pending one: by a CAS of its state word, or by a release
// store without claim_with_cas (only the engine writes PENDING slots), recorded with its
// submission time (the sort key). A lost CAS leaves a kNoSlot entry; past kMaxClaims a slot waits
// for the next scan (the doorbell is not marked seen).
__device__ void claim_pending(SchedState *s, ClaimScratch *sh) {
  uint64_t words[kMaxPerThread], submit[kMaxPerThread];
  scan_state_words(s, sh, words, submit);
  __threadfence_system();
#pragma unroll
  for (uint32_t k = 0; k < kMaxPerThread; ++k) {
    uint32_t i = threadIdx.x + k * blockDim.x;
    uint64_t w = words[k];
    if (i >= s->cfg.num_slots || static_cast<uint32_t>(w) != BLINK_SLOT_STATE_PREFILL_PENDING) continue;
    blink_slot *sl = slot(s, i);
    uint64_t t_seen = phase_now();
    uint32_t c = atomicAdd(&sh->n_claimed, 1u);
    if (c >= kMaxClaims) continue;
    uint64_t want = word(BLINK_SLOT_STATE_PREFILL_PROCESSING, static_cast<uint32_t>(w >> 32));
    bool won = true;
    if (s->cfg.claim_with_cas) {
      won = atomicCAS_system(reinterpret_cast<unsigned long long *>(sl), w, want) == w;
    } else {
      st_rel32(&sl->state, BLINK_SLOT_STATE_PREFILL_PROCESSING);
    }
    sh->claimed[c] = won ? i : kNoSlot;
    uint64_t kv = !won ? ~0ull : sh->full ? *reinterpret_cast<volatile uint64_t *>(&sl->submit_ns) : submit[k];
    sh->key[c] = kv;
    if (c == 0) clock_first_claim(&sh->clocks, t_seen, kv);
  }
}

// ------------------------------------------------------------------ order
// Thread 0: the scan's counters and samples. The doorbell (and the flips' credit) count as seen
// unless the claims overflowed, so that the next scan reads every slot again.
__device__ void scan_end(SchedState *s, const ClaimScratch *sh, uint32_t n) {
  uint64_t t_end = now_ns();
  s->stats->scans++;
  sample_into(s->stats->scan_ns, &s->stats->n_scan_samples, t_end - sh->t0);
  if (n > 0 && !sh->full) add_phase_clocks(s->stats, &sh->clocks, sh->t0, t_end);
  if (sh->n_claimed <= kMaxClaims) {
    s->last_doorbell = sh->bell;
    s->flip_credit = sh->full ? 0 : sh->credit;
  }
  s->flips_synced = sh->n_claimed <= kMaxClaims;  // after an overflow the flips of the rest are spent
}

// Thread 0: the n claims by submission time, then slot index (insertion sort).
__device__ void order_claims(ClaimScratch *sh, uint32_t n) {
  for (uint32_t a = 1; a < n; ++a) {
    uint32_t ci = sh->claimed[a];
    uint64_t ck = sh->key[a];
    uint32_t b = a;
    for (; b > 0 && (sh->key[b - 1] > ck || (sh->key[b - 1] == ck && sh->claimed[b - 1] > ci)); --b) {
      sh->claimed[b] = sh->claimed[b - 1];
      sh->key[b] = sh->key[b - 1];
    }
    sh->claimed[b] = ci;
    sh->key[b] = ck;
  }
}

// ------------------------------------------------------------------ admit
// Thread 0: every won claim counts; a request the engine cannot serve (ok 0) or whose prompt
// holds ids outside the vocabulary (bad) completes with an error, the rest join `waiting` in
// submission order.
__device__ void queue_admitted(SchedState *s, const ClaimScratch *sh, uint32_t n) {
  for (uint32_t k = 0; k < n; ++k) {
    uint32_t i = sh->claimed[k];
    if (i == kNoSlot) continue;
    s->stats->claims++;
    if (!sh->ok[k]) {
      s->stats->refused++;
      complete_slot(s, i, BLINK_FINISH_REASON_ERROR, BLINK_ERROR_CODE_NO_CAPACITY);
      continue;
    }
    if (sh->bad[k]) {
      s->stats->refused++;
      complete_slot(s, i, BLINK_FINISH_REASON_ERROR, BLINK_ERROR_CODE_BAD_PARAMS);
      continue;
    }
    ReqInfo *r = &s->req[i];
    r->arrival = s->arrivals++;
    r->phase = kWaiting;
    s->waiting[(s->wait_head + s->wait_count++) % s->cfg.num_slots] = i;
  }
}

// All threads: the claimed requests read (one per thread), their prompts copied (every thread
// on each), then queued by thread 0.
__device__ void admit_claims(SchedState *s, ClaimScratch *sh, uint32_t n) {
  for (uint32_t k = threadIdx.x; k < n; k += blockDim.x) {
    sh->ok[k] = sh->claimed[k] != kNoSlot && read_request(s, sh->claimed[k]);
    sh->bad[k] = 0;
  }
  __syncthreads();
  for (uint32_t k = 0; k < n; ++k) {
    if (!sh->ok[k]) continue;
    copy_prompt(s, sh->claimed[k], &sh->bad[k]);
    copy_bias(s, sh->claimed[k], &sh->bad[k]);
  }
  __syncthreads();
  if (threadIdx.x == 0) queue_admitted(s, sh, n);
  __syncthreads();
}

// All threads: scan, claim, order, admit. Returns at once (every thread) when the scheduler has
// stopped or the doorbell has not moved.
__device__ void claim_new(SchedState *s) {
  __shared__ ClaimScratch sh;
  if (!scan_begin(s, &sh)) return;
  if (s->cfg.scan_flips) scan_flip_words(s, &sh);
  claim_pending(s, &sh);
  __syncthreads();
  uint32_t n = sh.n_claimed < kMaxClaims ? sh.n_claimed : kMaxClaims;
  if (threadIdx.x == 0) {
    scan_end(s, &sh, n);
    order_claims(&sh, n);
  }
  __syncthreads();
  admit_claims(s, &sh, n);
}

}  // namespace

#endif  // BLINK_SCHED_CLAIM_CUH_
