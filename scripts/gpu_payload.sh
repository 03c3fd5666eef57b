#!/usr/bin/env bash
# What a GPU host without network needs beside this checkout, made on a machine that reaches PyPI:
#
#   bash scripts/gpu_payload.sh [VLLM_KIT_BUILD_SH]
#
# .whl/              the wheels the GPU host's Python 3.12 lacks (scripts/gpu_run.sh installs them into a private
#                    folder) and, in .whl/tokenizer-assets, the tokenizer files of the serving and peer steps
#                    (about 25 MB)
# .vllmkit0/, 1/, 2/ with the vLLM kit's build.sh given: the kit's parts, one folder a part (at most 55 MiB each),
#                    its install.sh, check_deps.py and SHA256SUMS in the first. A machine lent for a limited
#                    transfer (64 MiB a call with the tree) takes one folder a call; scripts/gpu_run.sh gathers what
#                    each call brings in $VLLMKIT_PARTS, and the peers_vllm step installs the kit once all are there.
# All are ignored by git.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .whl \
  msgspec==0.22.0 structlog==26.1.0 pytest-asyncio==1.5.0 pytest-timeout==2.4.0 pytest-xdist==3.8.0 execnet==2.1.2 \
  gguf==0.19.0 safetensors==0.8.0 openai==3.57.0 pydantic==2.14.4 pydantic-core==2.50.5 jiter==0.19.0 distro==1.9.0 \
  annotated-types==0.8.0 typing-inspection==0.4.5 httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5 anyio==4.16.0 \
  sniffio==1.3.1
"$PY" -m dpu_tokenizer.fetch_assets .whl/tokenizer-assets >/dev/null
if [ -n "${1:-}" ]; then
  kit=$(mktemp -d)
  trap 'rm -rf "$kit"' EXIT
  bash "$1" "$kit" >/dev/null
  rm -rf .vllmkit[0-9]
  i=0
  for part in "$kit"/vllmkit.tar.xz.part*; do
    mkdir -p ".vllmkit$i" && mv "$part" ".vllmkit$i/"
    i=$((i + 1))
  done
  cp "$kit"/SHA256SUMS "$kit"/install.sh "$kit"/check_deps.py .vllmkit0/
fi
du -sh .whl .vllmkit* 2>/dev/null
