// Constrained decoding on the device: the grammar arena's table, its loads through the engine's host thread,
// admission, and each step's part (the rows' masks staged for the sampling graph, the states advanced by the
// sampled tokens).
//
// The frontend compiled each grammar into a token DFA and stored it (shared/token_dfa.py); a slot names it by
// id. The tables live in a device arena of cfg.gram_arena_bytes, one contiguous range per grammar in
// token_dfa.device_layout's order. A grammar reaches the arena once: thread 0 posts a request in a host-mapped
// mailbox (one entry per table entry, BLINK_MAIL_WORDS words), the engine's host thread answers (first the
// sizes, then the copy to the offset the scheduler chose), and the request waits at the head of `waiting`
// meanwhile. So the host is on a new grammar's first admission only, never on the token path: every step the
// scheduler stages each constrained row's allowed bits and end tokens (kernels/grammar.py masks the logits
// in the graph) and, once the step is done, walks the row's state by its token with the tables in the arena.
#ifndef BLINK_SCHED_GRAMMAR_CUH_
#define BLINK_SCHED_GRAMMAR_CUH_

#include <stdint.h>

#include "blink_ring.h"
#include "sched.h"
#include "sched_memory.cuh"
#include "sched_policy.cuh"
#include "sched_state.cuh"

namespace {

// ------------------------------------------------------------------ tables in the arena
__device__ uint64_t gram_bytes(SchedState *s, uint64_t states, uint64_t exceptions) {
  uint64_t raw = states * s->cfg.gram_row_bytes + 4 * (3 * states + 1 + 2 * exceptions);
  return (raw + 255) / 256 * 256;
}
// default [S], accept [S], exc_offsets [S + 1], exc_tokens [X], exc_next [X], after the bits
__device__ const int32_t *gram_words(SchedState *s, const GramEntry *g) {
  return reinterpret_cast<const int32_t *>(s->cfg.gram_arena + g->offset +
                                           static_cast<uint64_t>(g->states) * s->cfg.gram_row_bytes);
}

// An arena word or byte, read through L2 (ld.global.cg): the host thread's copies land there, and a range this
// execution of the scheduler read before an eviction may hold another grammar now, so no stale L1 line of its
// SM may answer.
__device__ __forceinline__ int32_t arena_word(const int32_t *p) { return __ldcg(p); }
__device__ __forceinline__ uint32_t arena_byte(const uint8_t *p) { return __ldcg(p); }

// TokenDFA.advance: the state after `tok`, -1 where the token is not allowed (or the row left the grammar).
__device__ int32_t gram_advance(SchedState *s, const GramEntry *g, int32_t state, int32_t tok) {
  if (state < 0 || static_cast<uint32_t>(state) >= g->states || tok < 0 ||
      static_cast<uint32_t>(tok) >= s->cfg.vocab_size)
    return -1;
  const uint8_t *bits = s->cfg.gram_arena + g->offset + static_cast<uint64_t>(state) * s->cfg.gram_row_bytes;
  if (!(arena_byte(bits + (tok >> 3)) & (0x80u >> (tok & 7)))) return -1;
  const int32_t *w = gram_words(s, g);
  const int32_t *off = w + 2 * g->states, *etok = off + g->states + 1, *enext = etok + g->exceptions;
  int32_t lo = arena_word(off + state), hi = arena_word(off + state + 1), end = hi;
  while (lo < hi) {
    int32_t mid = lo + (hi - lo) / 2;
    if (arena_word(etok + mid) < tok)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo < end && arena_word(etok + lo) == tok ? arena_word(enext + lo) : arena_word(w + state);
}

// ------------------------------------------------------------------ the mailbox (thread 0)
__device__ volatile uint64_t *mail(SchedState *s, uint32_t e) {
  return s->cfg.gram_mail + static_cast<size_t>(e) * BLINK_MAIL_WORDS;
}

// The request first, then its sequence number, each published to the host in that order.
__device__ void post(SchedState *s, uint32_t e, uint64_t op) {
  GramEntry *g = &s->gram[e];
  volatile uint64_t *m = mail(s, e);
  m[0] = g->id;
  m[1] = g->offset;
  m[2] = op;
  __threadfence_system();
  m[3] = ++g->seq;
  __threadfence_system();
}

// The host answered the entry's last request: its `done` word (written after the others) equals `seq`.
__device__ bool answered(SchedState *s, uint32_t e) {
  bool done = mail(s, e)[4] == s->gram[e].seq;
  __threadfence_system();
  return done;
}

__device__ bool holds_space(const GramEntry *g) { return g->status == kGramCopy || g->status == kGramReady; }

// The lowest offset where `bytes` fit between the ranges of the entries that hold space.
__device__ bool gram_place(SchedState *s, uint64_t bytes, uint64_t *at) {
  bool found = false;
  for (uint32_t k = 0; k <= BLINK_GRAMMAR_ENTRIES; ++k) {
    if (k < BLINK_GRAMMAR_ENTRIES && !holds_space(&s->gram[k])) continue;
    uint64_t c = k < BLINK_GRAMMAR_ENTRIES ? s->gram[k].offset + s->gram[k].bytes : 0;
    if (c + bytes > s->cfg.gram_arena_bytes || (found && c >= *at)) continue;
    bool clash = false;
    for (uint32_t m = 0; m < BLINK_GRAMMAR_ENTRIES && !clash; ++m) {
      const GramEntry *g = &s->gram[m];
      clash = holds_space(g) && c < g->offset + g->bytes && g->offset < c + bytes;
    }
    if (!clash) {
      *at = c;
      found = true;
    }
  }
  return found;
}

// Free the least recently admitted entry no request holds (ready or failed); false when there is none.
__device__ bool gram_evict(SchedState *s) {
  uint32_t best = kNoGrammar;
  for (uint32_t k = 0; k < BLINK_GRAMMAR_ENTRIES; ++k) {
    const GramEntry *g = &s->gram[k];
    bool idle = (g->status == kGramReady || g->status == kGramFailed) && g->refs == 0;
    if (idle && (best == kNoGrammar || g->last_use < s->gram[best].last_use)) best = k;
  }
  if (best == kNoGrammar) return false;
  if (s->gram[best].status == kGramReady) s->stats->grammar_evictions++;
  s->gram[best].status = kGramFree;
  return true;
}

__device__ void gram_fail(SchedState *s, GramEntry *g, uint32_t error) {
  g->status = kGramFailed;
  g->error = error;
  s->gram_busy--;
  s->stats->grammar_failures++;
}

// Thread 0, every loop while a load is under way: read the host's answers, place sized grammars (evicting
// idle ones for room) and ask for their copies.
__device__ void grammar_service(SchedState *s) {
  if (!s->cfg.grammar || !s->gram_busy) return;
  for (uint32_t e = 0; e < BLINK_GRAMMAR_ENTRIES; ++e) {
    GramEntry *g = &s->gram[e];
    if ((g->status == kGramMeta || g->status == kGramCopy) && answered(s, e)) {
      volatile uint64_t *m = mail(s, e);
      if (m[5] != BLINK_MAIL_OK) {
        gram_fail(s, g, BLINK_ERROR_CODE_BAD_PARAMS);
        continue;
      }
      if (g->status == kGramCopy) {
        g->status = kGramReady;
        s->gram_busy--;
        s->stats->grammar_loads++;
        continue;
      }
      uint64_t sizes = m[7];
      g->states = static_cast<uint32_t>(m[6]);
      g->exceptions = static_cast<uint32_t>(sizes);
      g->start = static_cast<uint32_t>(sizes >> 32);
      g->bytes = gram_bytes(s, g->states, g->exceptions);
      if (g->states == 0 || g->start >= g->states) {
        gram_fail(s, g, BLINK_ERROR_CODE_BAD_PARAMS);
        continue;
      }
      if (g->bytes > s->cfg.gram_arena_bytes) {  // the gateway refuses these first (RingHeader.grammar_arena_bytes)
        gram_fail(s, g, BLINK_ERROR_CODE_NO_CAPACITY);
        continue;
      }
      g->status = kGramSized;
    }
    if (g->status == kGramSized) {
      uint64_t at = 0;
      bool placed = gram_place(s, g->bytes, &at);
      while (!placed && gram_evict(s)) placed = gram_place(s, g->bytes, &at);
      if (!placed) continue;  // every byte is held by grammars in use: again once one is released
      g->offset = at;
      g->status = kGramCopy;
      post(s, e, BLINK_MAIL_OP_COPY);
    }
  }
}

__device__ uint32_t gram_find(SchedState *s, uint64_t id) {
  for (uint32_t k = 0; k < BLINK_GRAMMAR_ENTRIES; ++k)
    if (s->gram[k].status != kGramFree && s->gram[k].id == id) return k;
  return kNoGrammar;
}

// Start loading grammar `id` into a free entry (an idle one evicted if none is); false when every entry is
// held or loading.
__device__ bool gram_request(SchedState *s, uint64_t id) {
  uint32_t e = kNoGrammar;
  for (uint32_t k = 0; k < BLINK_GRAMMAR_ENTRIES && e == kNoGrammar; ++k)
    if (s->gram[k].status == kGramFree) e = k;
  if (e == kNoGrammar) {
    if (!gram_evict(s)) return false;
    for (uint32_t k = 0; k < BLINK_GRAMMAR_ENTRIES && e == kNoGrammar; ++k)
      if (s->gram[k].status == kGramFree) e = k;
  }
  GramEntry *g = &s->gram[e];
  g->id = id;
  g->offset = g->bytes = 0;
  g->refs = 0;
  g->status = kGramMeta;
  g->last_use = ++s->gram_tick;
  s->gram_busy++;
  post(s, e, BLINK_MAIL_OP_META);
  return true;
}

// ------------------------------------------------------------------ admission (thread 0)
// Thread 0, before each plan: the requests at the head of `waiting` (as many as a step may admit) take a
// reference to their grammars where those are in the arena (the state starts at the DFA's start), in queue
// order up to the first whose grammar is not: that one is asked for, and the queue waits behind it. A grammar
// that failed to load completes its request with an error.
__device__ void grammar_gate(SchedState *s) {
  if (!s->cfg.grammar) return;
  uint32_t k = 0;
  while (k < s->wait_count && k < s->cfg.max_batch) {
    uint32_t i = s->waiting[(s->wait_head + k) % s->cfg.num_slots];
    ReqInfo *r = &s->req[i];
    if (!r->grammar_id || r->gentry != kNoGrammar) {
      ++k;
      continue;
    }
    uint32_t e = gram_find(s, r->grammar_id);
    if (e == kNoGrammar) {
      gram_request(s, r->grammar_id);
      return;
    }
    GramEntry *g = &s->gram[e];
    if (g->status == kGramFailed) {
      finish_req(s, i, BLINK_FINISH_REASON_ERROR, g->error);  // leaves `waiting`: k names the next one
      continue;
    }
    if (g->status != kGramReady) return;
    g->refs++;
    g->last_use = ++s->gram_tick;
    r->gentry = e;
    r->gstate = static_cast<int32_t>(g->start);
    ++k;
  }
}

// ------------------------------------------------------------------ each step
// Thread of row r, after the row's token was appended: the state after it.
__device__ void grammar_step(SchedState *s, ReqInfo *q, int32_t tok) {
  if (q->gentry != kNoGrammar) q->gstate = gram_advance(s, &s->gram[q->gentry], q->gstate, tok);
}

}  // namespace

#endif  // BLINK_SCHED_GRAMMAR_CUH_
