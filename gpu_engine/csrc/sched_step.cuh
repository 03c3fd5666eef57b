// One step: plan (thread 0), stage the static buffers (all threads), launch the graph from the
// device (thread 0), wait for its completion counter, score the prompts that asked for their log-probs
// (sched_score.cuh) and publish the results (all threads).
#ifndef BLINK_SCHED_STEP_CUH_
#define BLINK_SCHED_STEP_CUH_

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "blink_ring.h"
#include "sched.h"
#include "sched_grammar.cuh"
#include "sched_launch.cuh"
#include "sched_memory.cuh"
#include "sched_policy.cuh"
#include "sched_score.cuh"
#include "sched_state.cuh"

namespace {

enum Action : uint32_t { kActionIdle = 0, kActionRun = 1, kActionRelaunch = 2, kActionExit = 3 };

// policy.needs_filter: a row samples (temperature > 0) with top-k, top-p or min-p not off, "off"
// read exactly as filter_logits reads it (so a NaN counts as on, like on the Python side).
__device__ bool row_filters(const ReqInfo *q) {
  return q->temperature > 0.f && !(q->top_k <= 0 && q->top_p >= 1.f && q->min_p <= 0.f);
}

// SeqWork.samples: the row's token is used (a decode, or the chunk that ends its prompt).
// shared.ring.step_fill_bucket: which EngineStats.step_fill count a step of `tokens` adds to.
__device__ uint32_t step_fill_bucket(uint32_t tokens, uint32_t budget) {
  if (tokens >= budget) return 6;
  const uint64_t num[5] = {1, 1, 1, 1, 3}, den[5] = {16, 8, 4, 2, 4};
  for (uint32_t k = 0; k < 5; ++k)
    if (static_cast<uint64_t>(tokens) * den[k] <= static_cast<uint64_t>(budget) * num[k]) return k;
  return 5;
}

__device__ bool row_samples(SchedState *s, uint32_t r) {
  return s->plan_cached[r] + s->plan_new[r] == ctx_len(&s->req[s->plan_slot[r]]);
}

// policy.step_filters, then the graph: row 0 of each table samples without the filtering sort
// (no sampled row filters), row 1 with it. Where no unfiltered prefill graph was captured (no
// chunking), row 0 of prefill_table names the filtering graphs.
__device__ uint32_t pick_graph(SchedState *s, bool decode, uint32_t n, uint32_t tokens) {
  const blink_sched_config &c = s->cfg;
  uint32_t filtered = 0, b = n < c.max_batch ? n : c.max_batch;
  for (uint32_t r = 0; r < n && !filtered; ++r) filtered = row_samples(s, r) && row_filters(&s->req[s->plan_slot[r]]);
  if (decode) return static_cast<uint32_t>(c.decode_table[filtered * (c.max_batch + 1) + b]);
  uint32_t col = (tokens + c.token_grain - 1) / c.token_grain;
  if (col >= c.prefill_cols) col = c.prefill_cols - 1;
  return static_cast<uint32_t>(c.prefill_table[(filtered * (c.max_batch + 1) + b) * c.prefill_cols + col]);
}

// Thread 0: queue the next execution of this scheduler graph. It starts once this execution and
// every graph it launched are complete; false (and the engine marked failed) if refused.
__device__ bool relaunch_self(SchedState *s) {
  s->stats->tail_start_ns = now_ns();
  cudaError_t err = cudaGraphLaunch(cudaGetCurrentGraphExec(), cudaStreamGraphTailLaunch);
  if (err == cudaSuccess) return true;
  s->stats->error = static_cast<uint32_t>(err);
  s->stats->exit_reason = BLINK_EXIT_TAIL_LAUNCH_FAILED;
  s->stopped = 1;
  st_rel32(&header(s)->engine_state, BLINK_ENGINE_STATE_FAILED);
  return false;
}

// Thread 0: tail-relaunch when the window is nearly used, else plan the next step.
__device__ uint32_t plan_step(SchedState *s, uint32_t *launches) {
  if (s->stopped) return kActionExit;
  // room for a prefill, its score launches and the resumed decode
  if (*launches + 2 + s->cfg.score_max_pieces > BLINK_WINDOW_LIMIT - 1) {
    s->stats->windows++;
    return relaunch_self(s) ? kActionRelaunch : kActionExit;
  }
  bool decode = false;
  if (s->cfg.chunked) {
    if (!plan_chunked(s)) return kActionIdle;
    decode = s->req[s->plan_slot[s->plan_n - 1]].phase == kRunning;  // chunks come last
    s->plan_kind = decode ? kDecode : kPrefill;
  } else if (plan_prefill(s)) {
    s->plan_kind = kPrefill;
  } else if (plan_decode(s)) {
    s->plan_kind = kDecode;
    decode = true;
  } else {
    return kActionIdle;
  }
  s->plan_graph = pick_graph(s, decode, s->plan_n, s->plan_tokens);
  return kActionRun;
}

// All threads: each token's id, position and KV slot; tokens past T pad (slot_mapping -1).
__device__ void stage_tokens(SchedState *s, const uint32_t *cu, uint32_t n, uint32_t T, uint32_t Tg) {
  const blink_sched_config &c = s->cfg;
  for (uint32_t j = threadIdx.x; j < Tg; j += blockDim.x) {
    if (j >= T) {
      c.input_ids[j] = 0;
      c.positions[j] = 0;
      c.slot_mapping[j] = -1;
      continue;
    }
    uint32_t lo = row_of(cu, n, j);  // row r with cu[r] <= j < cu[r+1]
    uint32_t i = s->plan_slot[lo], pos = s->plan_cached[lo] + (j - cu[lo]);
    int32_t block = req_blocks(s, i)[pos / c.block_size];
    c.input_ids[j] = req_tokens(s, i)[pos];
    c.positions[j] = pos;
    c.slot_mapping[j] = static_cast<int64_t>(block) * c.block_size + pos % c.block_size;
  }
}

// All threads: each row's sequence bounds, context length and sampling parameters; rows past n
// are zero-length and greedy. The leading `nd` one-token rows attend through the decode kernel
// (decode_ctx), the rest through the prefill kernel (cu_chunks), as runner.split_rows says.
__device__ void stage_rows(SchedState *s, const uint32_t *cu, uint32_t n, uint32_t nd, uint32_t T, uint32_t Bg) {
  const blink_sched_config &c = s->cfg;
  for (uint32_t r = threadIdx.x; r <= Bg; r += blockDim.x) {
    uint32_t at = r <= n ? cu[r] : T;
    c.cu_seqlens[r] = at;
    c.cu_chunks[r] = at > nd ? at : nd;
  }
  for (uint32_t r = threadIdx.x; r < Bg; r += blockDim.x) {
    bool real = r < n;
    const ReqInfo *q = real ? &s->req[s->plan_slot[r]] : nullptr;
    c.context_lens[r] = real ? s->plan_cached[r] + s->plan_new[r] : 0;
    c.decode_ctx[r] = real && r < nd ? s->plan_cached[r] + s->plan_new[r] : 0;
    // log-probs only for the rows that asked and whose token is used (runner.StepBuffers.want_logprobs)
    c.want_logprobs[r] = real && (q->flags & BLINK_SAMPLING_FLAGS_WANT_LOGPROBS) && row_samples(s, r) ? 1 : 0;
    c.temperature[r] = real ? q->temperature : 0.f;
    c.top_k[r] = real ? q->top_k : 0;
    c.top_p[r] = real ? q->top_p : 1.f;
    c.min_p[r] = real ? q->min_p : 0.f;
    c.seeds[r] = real ? static_cast<int64_t>(q->seed) : 0;
    c.sample_index[r] = real ? q->out_len : 0;
  }
}

// All threads: each row's logits processors (kernels/processors.py reads them): off (slot -1) for padding, for
// a row whose token is not used and for a request without any; else its slot, the history the penalties count
// (prompt then outputs, none without a penalty), its bias entries, and the stop ids and EOS it may not sample
// below min_tokens (EOS unless ignored), with its penalties.
static_assert(kMaxStopIds + BLINK_MAX_EOS <= BLINK_PROC_MAX_BAN, "a row's banned ids: its stop ids and EOS");
static_assert(BLINK_PROC_BAN_COL + BLINK_PROC_MAX_BAN <= BLINK_PROC_COLS, "proc_rows columns");

__device__ void stage_processors(SchedState *s, uint32_t n, uint32_t Bg) {
  const blink_sched_config &c = s->cfg;
  for (uint32_t r = threadIdx.x; r < Bg; r += blockDim.x) {
    int32_t *row = c.proc_rows + static_cast<size_t>(r) * BLINK_PROC_COLS;
    const ReqInfo *q = r < n && row_samples(s, r) ? &s->req[s->plan_slot[r]] : nullptr;
    uint32_t nban = 0;
    if (q && q->out_len < q->min_tokens) {
      for (uint32_t k = 0; k < q->num_stop; ++k) row[BLINK_PROC_BAN_COL + nban++] = q->stop_ids[k];
      for (uint32_t k = 0; k < c.num_eos && !(q->flags & BLINK_SAMPLING_FLAGS_IGNORE_EOS); ++k)
        row[BLINK_PROC_BAN_COL + nban++] = c.eos_ids[k];
    }
    bool pen = q && penalized(q);
    if (!(pen || nban || (q && q->num_bias))) {
      row[0] = -1;
      continue;
    }
    row[0] = static_cast<int32_t>(s->plan_slot[r]);
    row[1] = static_cast<int32_t>(q->prompt_len);
    row[2] = pen ? static_cast<int32_t>(ctx_len(q)) : 0;
    row[3] = static_cast<int32_t>(q->num_bias);
    row[4] = static_cast<int32_t>(nban);
    c.proc_penalties[3 * r] = q->rep;
    c.proc_penalties[3 * r + 1] = q->freq;
    c.proc_penalties[3 * r + 2] = q->pres;
  }
}

// All threads: each row's grammar mask (kernels/grammar.py): -1 for a row without a grammar or whose token is
// not used; else the byte offset of its state's allowed bits (-2 once it left the grammar: only the end tokens),
// whether its text is complete (the end tokens allowed) and the end tokens: its stop ids, then EOS unless ignored.
static_assert(kMaxStopIds + BLINK_MAX_EOS <= BLINK_GRAM_MAX_END, "a row's end ids: its stop ids and EOS");
static_assert(2 + BLINK_GRAM_MAX_END <= BLINK_GRAM_COLS, "gram_ends columns");

__device__ void stage_grammar(SchedState *s, uint32_t n, uint32_t Bg) {
  const blink_sched_config &c = s->cfg;
  for (uint32_t r = threadIdx.x; r < Bg; r += blockDim.x) {
    const ReqInfo *q = r < n && row_samples(s, r) ? &s->req[s->plan_slot[r]] : nullptr;
    if (!q || q->gentry == kNoGrammar) {
      c.gram_bits[r] = -1;
      continue;
    }
    const GramEntry *g = &s->gram[q->gentry];
    bool in = q->gstate >= 0;
    int32_t *row = c.gram_ends + static_cast<size_t>(r) * BLINK_GRAM_COLS;
    uint32_t ne = 0;
    for (uint32_t k = 0; k < q->num_stop; ++k) row[2 + ne++] = q->stop_ids[k];
    for (uint32_t k = 0; k < c.num_eos && !(q->flags & BLINK_SAMPLING_FLAGS_IGNORE_EOS); ++k)
      row[2 + ne++] = c.eos_ids[k];
    row[0] = !in || arena_word(gram_words(s, g) + g->states + q->gstate) != 0;
    row[1] = static_cast<int32_t>(ne);
    c.gram_bits[r] = in ? static_cast<int64_t>(g->offset + static_cast<uint64_t>(q->gstate) * c.gram_row_bytes) : -2;
  }
}

// All threads: each row's block table, -1 past its blocks.
__device__ void stage_block_tables(SchedState *s, uint32_t n, uint32_t Bg) {
  const blink_sched_config &c = s->cfg;
  for (uint32_t e = threadIdx.x; e < Bg * c.max_graph_blocks; e += blockDim.x) {
    uint32_t r = e / c.max_graph_blocks, k = e % c.max_graph_blocks;
    int32_t v = -1;
    if (r < n && k < s->req[s->plan_slot[r]].num_blocks) v = req_blocks(s, s->plan_slot[r])[k];
    c.block_tables[e] = v;
  }
}

// All threads: write the step into the graphs' static buffers, padding the rest exactly as
// GpuModelRunner.stage does (slot_mapping -1, zero-length sequences, greedy defaults). The state's
// row_cu ([max_batch + 1], global memory) receives the rows' token offsets.
__device__ void stage(SchedState *s) {
  __shared__ uint32_t nd;
  uint32_t *cu = s->row_cu;
  const blink_sched_config &c = s->cfg;
  uint32_t g = s->plan_graph, n = s->plan_n, T = s->plan_tokens;
  uint32_t Bg = static_cast<uint32_t>(c.graph_batch[g]), Tg = static_cast<uint32_t>(c.graph_tokens[g]);
  if (threadIdx.x == 0) {
    cu[0] = 0;
    for (uint32_t r = 0; r < n; ++r) cu[r + 1] = cu[r] + s->plan_new[r];
    nd = 0;
    while (nd < n && cu[nd + 1] == nd + 1) ++nd;
  }
  __syncthreads();  // also makes thread 0's stores to row_cu visible to the block
  stage_tokens(s, cu, n, T, Tg);
  stage_rows(s, cu, n, nd, T, Bg);
  stage_block_tables(s, n, Bg);
  if (c.processors) stage_processors(s, n, Bg);
  if (c.grammar) stage_grammar(s, n, Bg);
  __threadfence();
}

// Thread 0: this step is the one BLINK_FAULT picked for `fault` (debug).
__device__ bool fault_now(SchedState *s, uint32_t fault) {
  return s->cfg.fault == fault && s->stats->steps + 1 == s->cfg.fault_at;
}

// Thread 0: fire-and-forget launch of the step's graph, rotating executable copies (launch_copy);
// BLINK_FAULT_LAUNCH fails it.
__device__ bool launch(SchedState *s, int64_t *expect, uint64_t *t_launch) {
  const blink_sched_config &c = s->cfg;
  uint32_t g = s->plan_graph;
  *expect = ld_volatile64(&c.counters[g]) + 1;
  if (launch_copy(s, c.exec_handles + static_cast<size_t>(g) * c.copies, &s->copy_rr[g],
                  fault_now(s, BLINK_FAULT_LAUNCH), t_launch) != cudaSuccess)
    return false;
  volatile blink_sched_stats *hs = s->host_stats;  // what a host watchdog reads if this step hangs
  hs->current_since_ns = *t_launch;
  hs->current_graph = g + 1;
  return true;
}

// One row's results: the finish check, then tokens (and logprobs) to the ring, `generated` last.
__device__ uint32_t publish_row(SchedState *s, uint32_t r) {
  const blink_sched_config &c = s->cfg;
  uint32_t i = s->plan_slot[r];
  ReqInfo *q = &s->req[i];
  if (!row_samples(s, r)) return BLINK_FINISH_REASON_NONE;  // a chunk before the prompt's end
  int32_t tok = static_cast<int32_t>(c.next_tokens[r]);
  uint32_t reason = finish_reason(s, q, tok);
  if (reason != BLINK_FINISH_REASON_NONE && reason != BLINK_FINISH_REASON_LENGTH) return reason;
  uint32_t pos = q->out_len;
  size_t at = static_cast<size_t>(i) * c.max_output + pos;
  req_tokens(s, i)[q->prompt_len + pos] = tok;
  grammar_step(s, q, tok);
  reinterpret_cast<int32_t *>(c.ring + c.output_off)[at] = tok;
  reinterpret_cast<float *>(c.ring + c.logprob_off)[at] = c.token_logprobs[r];
  if (q->flags & BLINK_SAMPLING_FLAGS_WANT_LOGPROBS) {
    uint32_t kk = c.ring_top_k ? c.ring_top_k : 1;
    uint32_t m = q->num_top < kk ? q->num_top : kk;
    m = m < c.num_top_out ? m : c.num_top_out;
    blink_top_logprob *dst = reinterpret_cast<blink_top_logprob *>(c.ring + c.top_logprob_off) + at * kk;
    for (uint32_t k = 0; k < m; ++k) {
      dst[k].token = static_cast<int32_t>(c.top_ids[r * c.num_top_out + k]);
      dst[k].logprob = c.top_logprobs[r * c.num_top_out + k];
    }
  }
  blink_slot *sl = slot(s, i);
  uint64_t t = now_ns() + c.clock_offset_ns;
  if (pos == 0) {
    sl->first_token_ns = t;
    sl->cached_tokens = q->cached_tokens < 0 ? 0u : static_cast<uint32_t>(q->cached_tokens);
  }
  sl->last_token_ns = t;
  __threadfence_system();
  st_rel32(&sl->generated, pos + 1);
  q->out_len = pos + 1;
  return reason;
}

// Thread 0: wait for the graph's completion counter, at most step_timeout_ns after its launch;
// past that the step is taken for hung: false and the scheduler stopped. The host, seeing the exit
// reason, fails the in-flight requests (ENGINE_FAILURE), then marks the engine failed: marked here,
// the frontend could take the engine for dead before those requests are failed.
// BLINK_FAULT_HANG waits for a count that never comes.
__device__ bool await_step(SchedState *s, int64_t expect, uint64_t t_launch) {
  if (fault_now(s, BLINK_FAULT_HANG)) ++expect;
  return await_counter(s, &s->cfg.counters[s->plan_graph], expect, t_launch);
}

// All threads: wait for the graph, score its prompts, publish every row (the threads loop over them, each
// row's finish reason into the state's row_reason), then thread 0 updates the policy state. `launches`:
// this execution's count (the score graph's launches add to it).
__device__ void wait_and_postprocess(SchedState *s, int64_t expect, uint64_t t_launch, uint32_t *launches) {
  uint32_t *reason = s->row_reason;
  if (threadIdx.x == 0 && await_step(s, expect, t_launch)) {
    __threadfence();
    reinterpret_cast<volatile blink_sched_stats *>(s->host_stats)->current_graph = 0;
    s->done_ns = now_ns();
    sample_into(s->stats->step_ns, &s->stats->n_step_samples, s->done_ns - t_launch);
  }
  __syncthreads();
  if (s->stopped) return;  // the step timed out, or the state was found overwritten: publish nothing
  if (!score_prompts(s, launches)) return;
  for (uint32_t r = threadIdx.x; r < s->plan_n; r += blockDim.x) reason[r] = publish_row(s, r);
  __syncthreads();
  if (threadIdx.x != 0) return;
  bool prefill = s->plan_kind == kPrefill;
  for (uint32_t r = 0; r < s->plan_n; ++r) {
    uint32_t i = s->plan_slot[r];
    ReqInfo *q = &s->req[i];
    q->cached = s->plan_cached[r] + s->plan_new[r];
    register_full(s, i);
    if (q->phase == kPrefilling) {
      s->stats->prompt_tokens += s->plan_new[r];
      if (s->partial == i) continue;  // a chunk before the prompt's end: nothing sampled
      if (reason[r] == BLINK_FINISH_REASON_NONE) {
        join_running(s, i);
        st_rel32(&slot(s, i)->state, BLINK_SLOT_STATE_DECODE_PROCESSING);
      }
    }
    if (reason[r] == BLINK_FINISH_REASON_NONE || reason[r] == BLINK_FINISH_REASON_LENGTH) s->stats->output_tokens++;
    if (reason[r] == BLINK_FINISH_REASON_STOP_ID)  // Slot.stop_token (minor 6): before complete_slot's fence
      slot(s, i)->stop_token = static_cast<int32_t>(s->cfg.next_tokens[r]);
    if (reason[r] != BLINK_FINISH_REASON_NONE) finish_in_place(s, i, reason[r], BLINK_ERROR_CODE_OK);
  }
  compact_running(s);  // the finished ones leave `running` (join_running above kept its arrival order)
  s->stats->steps++;
  if (s->plan_n > s->stats->max_step_rows) s->stats->max_step_rows = s->plan_n;
  s->stats->step_fill[step_fill_bucket(s->plan_tokens, s->cfg.max_prefill_tokens)]++;
  uint32_t graph_tokens = static_cast<uint32_t>(s->cfg.graph_tokens[s->plan_graph]);
  s->stats->step_tokens += s->plan_tokens;  // RingHeader.step_tokens, padded_tokens: the graph's past the step's
  s->stats->padded_tokens += graph_tokens > s->plan_tokens ? graph_tokens - s->plan_tokens : 0;
  if (prefill)
    s->stats->prefills++;
  else
    s->stats->decodes++;
}

}  // namespace

#endif  // BLINK_SCHED_STEP_CUH_
