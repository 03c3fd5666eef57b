#!/usr/bin/env bash
# The one GPU script: on a CUDA host, build what needs building, run the GPU tests and the
# benchmarks, and write logs and JSON to OUTDIR.
#
#   bash scripts/gpu_run.sh OUTDIR [STEP ...]
#
# Steps (default: all, in this order): build kernels persistent micro fig3 roofline serving
# Run from the repository root; the project need not be installed. Wheels of packages missing
# on the host may be put in .whl/ (they are installed into a private folder first).
set -u
OUT="${1:?usage: scripts/gpu_run.sh OUTDIR [STEP ...]}"
shift
STEPS="${*:-build kernels persistent micro fig3 roofline serving}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/blink-site .whl/*.whl
  export PYTHONPATH="/tmp/blink-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_MODULE_LOADING=EAGER PYTHONUNBUFFERED=1 BLINK_GPU_OUT="$OUT"
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
step() {  # step NAME TIMEOUT CMD...
  local name=$1 limit=$2
  shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  summary "== $name rc=$rc ($((SECONDS - t0)) s)"
  grep -v '^{"' "$OUT/$name.log" | tail -n 25 | tee -a "$OUT/summary.txt"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/nvidia_smi.log" 2>&1
step build "${T_BUILD:-180}" bash -c "$PY setup.py -q build_ext --inplace && $PY -c 'from gpu_engine.gpu.persistent import build_library; print(build_library())'"
step kernels "${T_KERNELS:-240}" "$PY" -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_kernels.py tests/test_kernels_runner.py tests/gpu
step persistent "${T_PERSISTENT:-300}" "$PY" -m pytest -q -rf -p no:cacheprovider tests/persistent
step micro "${T_MICRO:-150}" "$PY" -m bench.scheduler_micro --out "$OUT/scheduler_micro.json"
step fig3 "${T_FIG3:-300}" "$PY" -m bench.fig3 --out "$OUT/fig3.json" --reps 2
step roofline "${T_ROOFLINE:-200}" "$PY" bench/roofline.py --out "$OUT/decode_roofline.json"
step serving "${T_SERVING:-540}" "$PY" -m bench.serving_study --out "$OUT/serving.json"
# Few files come back from a lent machine: every log goes into one archive.
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)
exit 0
