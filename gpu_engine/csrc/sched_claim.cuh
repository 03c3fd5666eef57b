// Claiming new prompts (all 256 threads), cancellations, heartbeat and shutdown.

// Read one claimed slot's request into device state; false when the engine can never run it.
__device__ bool read_request(SchedState *s, uint32_t i) {
  const volatile blink_slot *sl = slot(s, i);
  ReqInfo *r = &s->req[i];
  r->seq = sl->seq;
  r->request_id = sl->request_id;
  r->prompt_len = sl->prompt_len;
  r->max_new = sl->max_new_tokens;
  r->flags = sl->sampling.flags;
  r->temp = sl->sampling.temperature;
  r->top_p = sl->sampling.top_p;
  r->top_k = sl->sampling.top_k;
  r->min_p = sl->sampling.min_p;
  r->num_top = sl->sampling.num_top_logprobs;
  r->num_stop = sl->sampling.num_stop_ids > 8 ? 8 : sl->sampling.num_stop_ids;
  for (int k = 0; k < 8; ++k) r->stop_ids[k] = sl->sampling.stop_ids[k];
  uint64_t seed =
      (r->flags & BLINK_SAMPLING_FLAGS_HAS_SEED) ? sl->sampling.seed : r->request_id * 0x9E3779B97F4A7C15ull;
  r->seed = seed & 0x7FFFFFFFFFFFFFFFull;
  r->out_len = 0;
  r->num_blocks = 0;
  const blink_sched_config &c = s->cfg;
  uint32_t total = r->prompt_len + r->max_new;
  bool ok = r->prompt_len >= 1 && r->prompt_len <= c.max_prompt && r->max_new >= 1 && r->max_new <= c.max_output &&
            total <= c.max_context && blocks_for(s, total) <= c.num_blocks &&
            blocks_for(s, total) <= c.max_blocks_per_seq && total - 1 <= c.max_tokens;
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

// Thread 0: the scheduler's own state was overwritten (by a kernel writing out of bounds): stop
// at once, through the copy of the ring address, rather than dereference what is left.
__device__ bool state_corrupted(SchedState *s) {
  if (s->cfg.ring == s->ring_check) return false;
  s->stats->exit_reason = 5;  // scheduler state overwritten
  s->stopped = 1;
  st_rel32(&reinterpret_cast<blink_ring_header *>(s->ring_check)->engine_state, BLINK_ENGINE_STATE_FAILED);
  return true;
}

// Scan of the ring, run only when the doorbell moved; claims pending prompts and queues them
// oldest-submitted first. With scan_flips, 64 threads first read the header's pending_flips
// (512 bytes, a few PCIe reads) and only slots whose bit flipped since the last scan have their
// state word read; otherwise, and on the first scan or after one that overflowed kMaxClaims,
// every slot's state word is read. The flips are read before the state words, so a slot whose
// flip is seen shows PENDING (the frontend flips after storing the state word). Each publication
// flips once and rings once, its flip first: fewer flips than rings since the last full scan
// means a writer that does not flip (an older frontend) published, and every slot is read.
__device__ void claim_new(SchedState *s) {
  __shared__ uint32_t n_claimed, go, full, n_flips, ok[kMaxClaims], bad[kMaxClaims], claimed[kMaxClaims];
  __shared__ uint64_t key[kMaxClaims], bell, t0, t_flips, t_word, t_claim, flips[kFlipWords];
  __shared__ int64_t credit;
  if (threadIdx.x == 0 && state_corrupted(s)) go = 0;
  __syncthreads();
  if (s->stopped) return;
  if (threadIdx.x == 0) {
    bell = ld_acq64(&header(s)->doorbell);
    go = !s->draining && bell != s->last_doorbell;
    n_claimed = n_flips = 0;
    full = !s->cfg.scan_flips || !s->flips_synced;
    t0 = now_ns();
  }
  __syncthreads();
  if (!go) return;
  if (s->cfg.scan_flips) {
    if (threadIdx.x < kFlipWords) {
      uint64_t b = ld_relaxed64(&header(s)->pending_flips[threadIdx.x]);
      flips[threadIdx.x] = b ^ s->flips_seen[threadIdx.x];
      s->flips_seen[threadIdx.x] = b;
      atomicAdd(&n_flips, static_cast<uint32_t>(__popcll(flips[threadIdx.x])));
    }
    __threadfence_system();  // the flips before the state words they announce
    __syncthreads();
    if (threadIdx.x == 0) {
      credit = s->flip_credit + static_cast<int64_t>(n_flips) - static_cast<int64_t>(bell - s->last_doorbell);
      full = full || credit < 0;
      t_flips = now_ns();
    }
    __syncthreads();
  }
  // Relaxed loads, all issued before any is used, so the PCIe round trips overlap; an acquire
  // fence orders them before the payload reads of a pending slot. A slot found through its flip
  // has its whole payload visible already (the frontend flips after the state word), so its
  // submission time is loaded beside the state word rather than after the claim.
  uint64_t words[kMaxPerThread], submit[kMaxPerThread];
#pragma unroll
  for (uint32_t k = 0; k < kMaxPerThread; ++k) {
    uint32_t i = threadIdx.x + k * blockDim.x;
    bool look = i < s->cfg.num_slots && (full || ((flips[i >> 6] >> (i & 63)) & 1u));
    words[k] = look ? ld_relaxed64(slot(s, i)) : 0;
    submit[k] = look && !full ? ld_relaxed64(&slot(s, i)->submit_ns) : 0;
  }
  __threadfence_system();
#pragma unroll
  for (uint32_t k = 0; k < kMaxPerThread; ++k) {
    uint32_t i = threadIdx.x + k * blockDim.x;
    uint64_t w = words[k];
    if (i >= s->cfg.num_slots || static_cast<uint32_t>(w) != BLINK_SLOT_STATE_PREFILL_PENDING) continue;
    blink_slot *sl = slot(s, i);
    uint64_t t_seen = now_ns();
    uint32_t c = atomicAdd(&n_claimed, 1u);
    if (c >= kMaxClaims) continue;  // the rest next time (the doorbell is not marked seen)
    uint64_t want = word(BLINK_SLOT_STATE_PREFILL_PROCESSING, static_cast<uint32_t>(w >> 32));
    bool won = true;
    if (s->cfg.claim_with_cas) {
      won = atomicCAS_system(reinterpret_cast<unsigned long long *>(sl), w, want) == w;
    } else {
      st_rel32(&sl->state, BLINK_SLOT_STATE_PREFILL_PROCESSING);  // only the engine writes PENDING slots
    }
    claimed[c] = won ? i : 0xFFFFFFFFu;
    uint64_t kv = !won ? ~0ull : full ? *reinterpret_cast<volatile uint64_t *>(&sl->submit_ns) : submit[k];
    key[c] = kv;
    if (c == 0) {
      uint64_t arrived;
      asm volatile("mov.u64 %0, %1;" : "=l"(arrived) : "l"(kv));  // the clock is read once kv is here
      t_word = t_seen;
      t_claim = now_ns() + (arrived & 0);
    }
  }
  __syncthreads();
  uint32_t n = n_claimed < kMaxClaims ? n_claimed : kMaxClaims;
  if (threadIdx.x == 0) {
    uint64_t t_end = now_ns();
    s->stats->scans++;
    sample_into(s->stats->scan_ns, &s->stats->n_scan_samples, t_end - t0);
    if (n > 0 && !full) {
      s->stats->scan_phase_ns[0] += t_flips - t0;
      s->stats->scan_phase_ns[1] += t_word - t_flips;
      s->stats->scan_phase_ns[2] += t_claim - t_word;
      s->stats->scan_phase_ns[3] += t_end - t_claim;
      s->stats->scan_phase_n++;
    }
    if (n_claimed <= kMaxClaims) {
      s->last_doorbell = bell;
      s->flip_credit = full ? 0 : credit;
    }
    s->flips_synced = n_claimed <= kMaxClaims;  // after an overflow the flips of the rest are spent
    for (uint32_t a = 1; a < n; ++a) {          // insertion sort by submission time
      uint32_t ci = claimed[a];
      uint64_t ck = key[a];
      uint32_t b = a;
      for (; b > 0 && (key[b - 1] > ck || (key[b - 1] == ck && claimed[b - 1] > ci)); --b) {
        claimed[b] = claimed[b - 1];
        key[b] = key[b - 1];
      }
      claimed[b] = ci;
      key[b] = ck;
    }
  }
  __syncthreads();
  for (uint32_t k = threadIdx.x; k < n; k += blockDim.x) {
    ok[k] = claimed[k] != 0xFFFFFFFFu && read_request(s, claimed[k]);
    bad[k] = 0;
  }
  __syncthreads();
  for (uint32_t k = 0; k < n; ++k)
    if (ok[k]) copy_prompt(s, claimed[k], &bad[k]);
  __syncthreads();
  if (threadIdx.x == 0) {
    for (uint32_t k = 0; k < n; ++k) {
      uint32_t i = claimed[k];
      if (i == 0xFFFFFFFFu) continue;
      s->stats->claims++;
      if (!ok[k]) {
        s->stats->refused++;
        complete_slot(s, i, kError, BLINK_ERROR_CODE_NO_CAPACITY);
        continue;
      }
      if (bad[k]) {
        s->stats->refused++;
        complete_slot(s, i, kError, BLINK_ERROR_CODE_BAD_PARAMS);
        continue;
      }
      ReqInfo *r = &s->req[i];
      r->arrival = s->arrivals++;
      r->phase = kWaiting;
      s->waiting[(s->wait_head + s->wait_count++) % s->cfg.num_slots] = i;
    }
  }
  __syncthreads();
}

// Cancel flags of every active request, read in parallel; thread 0 finishes them.
__device__ void apply_cancellations(SchedState *s) {
  __shared__ uint32_t n, list[BLINK_SCHED_THREADS];
  if (s->stopped) return;
  if (threadIdx.x == 0) n = 0;
  __syncthreads();
  for (uint32_t i = threadIdx.x; i < s->cfg.num_slots; i += blockDim.x) {
    if (s->req[i].phase == kFree) continue;
    if (ld_relaxed32(&slot(s, i)->cancel) == 0) continue;
    uint32_t k = atomicAdd(&n, 1u);
    if (k < BLINK_SCHED_THREADS) list[k] = i;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t m = n < BLINK_SCHED_THREADS ? n : BLINK_SCHED_THREADS;
    for (uint32_t k = 0; k < m; ++k) {
      finish_req(s, list[k], kCancelled, BLINK_ERROR_CODE_OK);
      s->stats->cancels++;
      s->stats->last_cancel_slot = list[k];
    }
  }
  __syncthreads();
}

__device__ void publish_stats(SchedState *s) {
  blink_ring_header *h = header(s);
  h->stats.running = s->running_count;
  h->stats.waiting = s->wait_count + s->paused_count;
  h->stats.kv_blocks_total = s->cfg.num_blocks;
  h->stats.kv_blocks_free = s->free_count;
  h->stats.steps = s->stats->steps;
  h->stats.prompt_tokens = s->stats->prompt_tokens;
  h->stats.output_tokens = s->stats->output_tokens;
  h->stats.preemptions = s->stats->preemptions;
  h->stats.window_relaunches = s->stats->windows;
  s->stats->running = s->running_count;
  s->stats->waiting = s->wait_count;
  s->stats->paused = s->paused_count;
  s->stats->kv_free = s->free_count;
  const uint32_t *src = reinterpret_cast<const uint32_t *>(s->stats);
  volatile uint32_t *dst = reinterpret_cast<volatile uint32_t *>(s->host_stats);
  for (uint32_t k = 0; k < offsetof(blink_sched_stats, launch_ns) / 4; ++k) dst[k] = src[k];
}

// Heartbeat, stats and the shutdown flag (thread 0). Draining stops claims; once nothing is
// left (or the drain time is over) the remaining requests are cancelled and the loop exits.
__device__ void maintenance(SchedState *s) {
  if (threadIdx.x != 0 || state_corrupted(s)) return;
  uint64_t t = now_ns();
  blink_ring_header *h = header(s);
  if (t - s->last_beat >= s->cfg.heartbeat_ns) {
    s->last_beat = t;
    publish_stats(s);
    st_rel64(&h->heartbeat_ns, t + s->cfg.clock_offset_ns);
    volatile uint64_t *beat = &h->heartbeat;  // single writer: no PCIe atomic needed
    *beat = *beat + 1;
  }
  if (!s->draining && ld_acq32(&h->shutdown)) {
    s->draining = 1;
    s->stats->exit_reason = 1;  // shutdown flag
    s->drain_deadline = t + s->cfg.drain_ns;
    st_rel32(&h->engine_state, BLINK_ENGINE_STATE_DRAINING);
  }
  bool empty = !s->running_count && !s->wait_count && !s->paused_count;
  if (s->draining && (empty || t > s->drain_deadline)) {
    while (s->running_count) finish_req(s, s->running[0], kCancelled, BLINK_ERROR_CODE_OK);
    while (s->paused_count) finish_req(s, s->paused[0], kCancelled, BLINK_ERROR_CODE_OK);
    while (s->wait_count) finish_req(s, s->waiting[s->wait_head], kCancelled, BLINK_ERROR_CODE_OK);
    publish_stats(s);
    st_rel32(&h->engine_state, BLINK_ENGINE_STATE_STOPPED);
    s->stopped = 1;
  }
}
