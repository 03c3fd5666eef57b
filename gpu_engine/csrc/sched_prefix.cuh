// The prefix cache on the device (thread 0 only): gpu_engine/prefix_cache.py and the reference counts of
// gpu_engine/kv_cache.py's BlockAllocator. A block is held (refs > 0), idle-cached (refs 0, registered,
// in the LRU) or unused (on the free-block stack); the allocator takes unused blocks first, then evicts
// the least recently used idle one. The block hash chains SplitMix64 over the block's tokens from the
// request's salt: not the Python side's BLAKE2b, but equal prefixes hit on both sides alike, so the
// decisions are the same. Inert unless cfg.prefix_caching: nothing is registered, the LRU stays empty.
#ifndef BLINK_SCHED_PREFIX_CUH_
#define BLINK_SCHED_PREFIX_CUH_

#include <stdint.h>

#include "sched_state.cuh"

namespace {

__device__ __forceinline__ uint64_t mix64(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Hashes of request i's full blocks up to `upto` (its tokens in req_tokens), computed once each.
__device__ void extend_hashes(SchedState *s, uint32_t i, uint32_t upto) {
  ReqInfo *r = &s->req[i];
  uint32_t bs = s->cfg.block_size;
  uint64_t *h = req_block_hashes(s, i);
  const int32_t *tok = req_tokens(s, i);
  for (uint32_t k = r->num_hashed; k < upto && k < s->cfg.max_blocks_per_seq; ++k) {
    uint64_t v = k ? h[k - 1] : r->salt;
    for (uint32_t t = 0; t < bs; ++t) v = mix64(v ^ static_cast<uint32_t>(tok[k * bs + t]));
    h[k] = v;
    r->num_hashed = k + 1;
  }
}

// ------------------------------------------------------------------ the table hash -> block
__device__ __forceinline__ uint32_t home(SchedState *s, uint64_t h) {
  return static_cast<uint32_t>(mix64(h)) & s->table_mask;
}

__device__ int32_t table_find(SchedState *s, uint64_t h) {
  for (uint32_t p = home(s, h);; p = (p + 1) & s->table_mask) {
    if (s->table_block[p] < 0) return -1;
    if (s->table_key[p] == h) return s->table_block[p];
  }
}

// PrefixCache.register: false (nothing changes) when h is already held by another block.
__device__ bool table_insert(SchedState *s, uint64_t h, uint32_t b) {
  if (s->registered[b]) return false;
  uint32_t p = home(s, h);
  for (; s->table_block[p] >= 0; p = (p + 1) & s->table_mask)
    if (s->table_key[p] == h) return false;
  s->table_key[p] = h;
  s->table_block[p] = static_cast<int32_t>(b);
  s->block_hash[b] = h;
  s->registered[b] = 1;
  return true;
}

// Remove block b's entry, shifting back the entries after it that probed past it (no tombstones).
__device__ void table_erase(SchedState *s, uint32_t b) {
  uint32_t m = s->table_mask, i = home(s, s->block_hash[b]);
  while (s->table_block[i] != static_cast<int32_t>(b)) i = (i + 1) & m;
  for (uint32_t j = i;;) {
    s->table_block[i] = -1;
    for (;;) {
      j = (j + 1) & m;
      if (s->table_block[j] < 0) {
        s->registered[b] = 0;
        return;
      }
      uint32_t k = home(s, s->table_key[j]);
      bool stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
      if (!stays) break;
    }
    s->table_key[i] = s->table_key[j];
    s->table_block[i] = s->table_block[j];
    i = j;
  }
}

// ------------------------------------------------------------------ the LRU of idle cached blocks
__device__ void lru_push(SchedState *s, uint32_t b) {  // PrefixCache.park: the most recently used
  s->lru_prev[b] = s->lru_tail;
  s->lru_next[b] = -1;
  if (s->lru_tail >= 0)
    s->lru_next[s->lru_tail] = static_cast<int32_t>(b);
  else
    s->lru_head = static_cast<int32_t>(b);
  s->lru_tail = static_cast<int32_t>(b);
  s->idle_count++;
}

__device__ void lru_remove(SchedState *s, uint32_t b) {  // PrefixCache.unpark
  int32_t p = s->lru_prev[b], n = s->lru_next[b];
  if (p >= 0)
    s->lru_next[p] = n;
  else
    s->lru_head = n;
  if (n >= 0)
    s->lru_prev[n] = p;
  else
    s->lru_tail = p;
  s->idle_count--;
}

// ------------------------------------------------------------------ the allocator's side
__device__ __forceinline__ uint32_t num_free(SchedState *s) { return s->free_count + s->idle_count; }

// One fresh block (count 1): unused first, else the oldest idle cached block, evicted.
__device__ uint32_t take_block(SchedState *s) {
  uint32_t b;
  if (s->free_count) {
    b = s->free_blocks[--s->free_count];
  } else {
    b = static_cast<uint32_t>(s->lru_head);
    lru_remove(s, b);
    table_erase(s, b);
    s->cache_evictions++;
  }
  s->refs[b] = 1;
  return b;
}

// BlockAllocator.free over a block table: one reference fewer each; unused blocks back on the stack in
// table order, idle cached ones parked tail first.
__device__ void release_blocks(SchedState *s, const int32_t *tab, uint32_t n) {
  for (uint32_t k = 0; k < n; ++k) {
    uint32_t b = static_cast<uint32_t>(tab[k]);
    if (--s->refs[b] == 0 && !s->registered[b]) s->free_blocks[s->free_count++] = b;
  }
  for (uint32_t k = n; k-- > 0;) {
    uint32_t b = static_cast<uint32_t>(tab[k]);
    if (s->refs[b] == 0 && s->registered[b]) lru_push(s, b);
  }
}

// Policy._cached_prefix: write into request i's block table the cached blocks of its leading full
// blocks, up to the block before the one holding its last token; returns how many (none shared yet). None
// for a request asking for prompt log-probs: they need every position computed.
__device__ uint32_t cached_prefix(SchedState *s, uint32_t i, uint32_t ctx) {
  if (!s->cfg.prefix_caching || (s->req[i].flags & BLINK_SAMPLING_FLAGS_WANT_PROMPT_LOGPROBS)) return 0;
  uint32_t limit = (ctx - 1) / s->cfg.block_size, hit = 0;
  extend_hashes(s, i, limit);
  const uint64_t *h = req_block_hashes(s, i);
  int32_t *tab = req_blocks(s, i);
  for (; hit < limit; ++hit) {
    int32_t b = table_find(s, h[hit]);
    if (b < 0) break;
    tab[hit] = b;
  }
  return hit;
}

// Policy._take_blocks for an admission: share the `hit` blocks at the head of request i's table (it
// holds none) and grow it to n blocks, all or nothing; an idle hit counts as taken.
__device__ bool take_with_hit(SchedState *s, uint32_t i, uint32_t hit, uint32_t n) {
  int32_t *tab = req_blocks(s, i);
  uint32_t idle = 0;
  for (uint32_t k = 0; k < hit; ++k) idle += s->refs[tab[k]] == 0;
  if (n > s->cfg.max_blocks_per_seq || n - hit > num_free(s) - idle) return false;
  for (uint32_t k = 0; k < hit; ++k) {
    uint32_t b = static_cast<uint32_t>(tab[k]);
    if (s->refs[b]++ == 0) lru_remove(s, b);
  }
  for (uint32_t k = hit; k < n; ++k) tab[k] = static_cast<int32_t>(take_block(s));
  s->req[i].num_blocks = n;
  return true;
}

// Policy._count_lookup: the counters, and the request's cached prompt tokens at its first admission.
__device__ void count_lookup(SchedState *s, ReqInfo *r, uint32_t ctx, uint32_t cached) {
  if (!s->cfg.prefix_caching) return;
  s->cache_queries += ctx;
  s->cache_hits += cached;
  if (r->cached_tokens < 0) r->cached_tokens = static_cast<int32_t>(cached);
}

// Policy._register_full: register the blocks that request i's computed tokens filled.
__device__ void register_full(SchedState *s, uint32_t i) {
  ReqInfo *r = &s->req[i];
  uint32_t full = r->cached / s->cfg.block_size;
  if (!s->cfg.prefix_caching || full <= r->num_registered) return;
  extend_hashes(s, i, full);
  const uint64_t *h = req_block_hashes(s, i);
  const int32_t *tab = req_blocks(s, i);
  for (uint32_t k = r->num_registered; k < full; ++k) table_insert(s, h[k], static_cast<uint32_t>(tab[k]));
  r->num_registered = full;
}

}  // namespace

#endif  // BLINK_SCHED_PREFIX_CUH_
