// Persistent scheduler: configuration and device state shared by scheduler.cu and its host API.
//
// The Python side (gpu_engine/gpu/persistent.py) fills blink_sched_config with ctypes; the layout
// of that struct is mirrored there field by field and checked by a size query.
#ifndef BLINK_SCHED_H_
#define BLINK_SCHED_H_

#include <stdint.h>

#define BLINK_SCHED_THREADS 256
#define BLINK_WINDOW_LIMIT 120  // device graph launches per parent execution (CUDA limit)
#define BLINK_MAX_EOS 8
#define BLINK_SAMPLES 4096  // instrumentation samples kept per metric

#ifdef __cplusplus
extern "C" {
#endif

typedef struct blink_sched_config {
  // ---- ring (device-visible addresses; host-mapped shared memory or GPU memory)
  uint8_t *ring;
  uint32_t num_slots, max_prompt, max_output, ring_top_k;
  uint64_t slots_off, prompt_off, output_off, logprob_off, top_logprob_off;
  // ---- policy
  uint32_t max_batch, block_size, num_blocks, max_blocks_per_seq;
  uint32_t max_context, max_prefill_tokens, num_eos, claim_with_cas;
  uint32_t scan_flips;  // find new prompts through the header's pending_flips (num_slots <= 4096)
  int32_t eos_ids[BLINK_MAX_EOS];
  // ---- graphs (device arrays)
  uint32_t num_graphs, copies, token_grain, prefill_cols;
  const uint64_t *exec_handles;  // [num_graphs * copies] cudaGraphExec_t
  const int32_t *graph_batch;    // [num_graphs]
  const int32_t *graph_tokens;   // [num_graphs]
  const int32_t *decode_table;   // [2][max_batch + 1]: without, with the filtering sort
  const int32_t *prefill_table;  // [(max_batch + 1) * prefill_cols]
  int64_t *counters;             // [num_graphs] completion counters bumped by each graph
  const uint32_t *graph_yield;   // [num_graphs] 1: the scheduler leaves its SM while this graph runs
  // ---- static step buffers shared by every graph (device)
  int64_t *input_ids, *positions, *slot_mapping;
  int32_t *cu_seqlens, *context_lens, *block_tables;
  float *temperature, *top_p, *min_p;
  int32_t *top_k;
  int64_t *seeds, *sample_index;
  int64_t *next_tokens;
  float *token_logprobs;
  int64_t *top_ids;
  float *top_logprobs;
  uint32_t num_top_out, max_tokens, max_graph_blocks, vocab_size;
  // ---- options
  uint64_t heartbeat_ns;    // beat period
  uint64_t drain_ns;        // after shutdown, cancel what is still running after this long
  int64_t clock_offset_ns;  // CLOCK_REALTIME - globaltimer, so ring timestamps share the host clock
} blink_sched_config;

// Counters and instrumentation the host may read after the scheduler stopped (or by peeking).
typedef struct blink_sched_stats {
  uint64_t steps, prefills, decodes, prompt_tokens, output_tokens, preemptions;
  uint64_t launches, launch_retries, launch_failures, windows, claims, completions, cancels;
  uint64_t refused, scans, idle_loops, yield_steps;
  uint32_t running, waiting, paused, kv_free;
  uint32_t exited, error, n_launch_samples, n_scan_samples;
  uint32_t n_tail_samples, n_step_samples, exit_reason, last_cancel_slot;
  uint32_t current_graph, pad0;       // host copy only: 1 + index of the graph in flight, 0 when none
  uint64_t current_since_ns;          // host copy only: globaltimer when that graph was launched
  uint64_t tail_start_ns;             // globaltimer when the last tail launch was issued
  uint32_t launch_ns[BLINK_SAMPLES];  // device cudaGraphLaunch call durations
  uint32_t scan_ns[BLINK_SAMPLES];    // full ring scans
  uint32_t tail_ns[BLINK_SAMPLES];    // tail launch issued -> next execution running
  uint32_t step_ns[BLINK_SAMPLES];    // graph launch -> completion seen
  // Scans that claimed through the flips, phase by phase (sums): flip words read and fenced, the
  // first claimed slot's state word read and fenced, its claim and submission time, the rest.
  uint64_t scan_phase_ns[4], scan_phase_n;
} blink_sched_stats;

#ifdef __cplusplus
}
#endif

#endif  // BLINK_SCHED_H_
