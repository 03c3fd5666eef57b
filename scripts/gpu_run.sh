#!/usr/bin/env bash
# On a GPU host: run the GPU tests and the roofline bench; logs and JSON go to OUTDIR.
# Usage: bash scripts/gpu_run.sh OUTDIR   (from the repository root; the project need not be installed)
set -u
OUT="${1:?usage: scripts/gpu_run.sh OUTDIR}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_MODULE_LOADING=EAGER
PY="${PYTHON:-python3}"

nvidia-smi >"$OUT/nvidia_smi.txt" 2>&1
"$PY" -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
  >"$OUT/versions.txt" 2>&1

# Preflight: the model package must import here (it needs no pip-only packages on this path).
"$PY" -c "import gpu_engine.gpu.runner" >"$OUT/preflight.txt" 2>&1 || { echo "IMPORT FAILED:"; tail -n 3 "$OUT/preflight.txt"; } \
  | tee -a "$OUT/summary.txt"

echo "== roofline bench" | tee -a "$OUT/summary.txt"
timeout "${BENCH_TIMEOUT:-170}" "$PY" bench/roofline.py --out "$OUT/decode_roofline.json" >"$OUT/roofline.log" 2>&1
echo "bench rc=$?" | tee -a "$OUT/summary.txt"
tail -n 20 "$OUT/roofline.log" | tee -a "$OUT/summary.txt"

echo "== GPU tests" | tee -a "$OUT/summary.txt"
timeout "${TEST_TIMEOUT:-215}" "$PY" -m pytest -m gpu -q -rf --noconftest -p no:cacheprovider \
  tests/test_kernels.py tests/test_kernels_runner.py tests/gpu >"$OUT/pytest_gpu.log" 2>&1
echo "pytest rc=$?" | tee -a "$OUT/summary.txt"
tail -n 30 "$OUT/pytest_gpu.log" | tee -a "$OUT/summary.txt"
