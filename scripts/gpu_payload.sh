#!/usr/bin/env bash
# What a GPU host without network needs beside this checkout, made on a machine that reaches PyPI:
#
#   bash scripts/gpu_payload.sh [VLLM_KIT_BUILD_SH]
#   bash scripts/gpu_payload.sh --pack      (.wx and the kit's folders again from .whl and .vllmkit*, offline: after
#                                            the tracked tree grew, or with other PAYLOAD_ASSETS)
#
# .whl/              the wheels the GPU host's Python 3.12 lacks (scripts/gpu_run.sh installs them into a private
#                    folder) and, in .whl/tokenizer-assets, the tokenizer files of the serving and peer steps
#                    (about 25 MB)
# .vllmkit0/, 1/, 2/ with the vLLM kit's build.sh given: the kit's parts, one folder a part (at most 55 MiB each),
#                    its install.sh, check_deps.py and SHA256SUMS in the first. A machine lent for a limited
#                    transfer (64 MiB a call with the tree) takes one folder a call; scripts/gpu_run.sh gathers what
#                    each call brings in $VLLMKIT_PARTS, and the peers_vllm step installs the kit once all are there.
# .wx/whl.tar.xz     .whl/'s wheels and the tokenizer assets of PAYLOAD_ASSETS (space-separated folders of
#                    .whl/tokenizer-assets, default "llama3": the dense peer study's; "llama3 qwen" for the MoE one) in
#                    one archive (about 9 MB for llama3), which scripts/gpu_run.sh unpacks into .whl/ where that has
#                    no wheels: a call can carry it beside a kit part.
# .vllmkit0/, 1/, .. the kit's bytes cut again so that each call carries one folder and, with the first, .wx: every
#                    call under the 64 MiB a lent machine takes (the tracked tree's disk blocks, measured now, and
#                    512 KiB of slack for its growth counted: with the llama3 assets the kit takes four calls);
#                    the parts' checksums, install.sh and check_deps.py in the last.
# All are ignored by git.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PACK_ONLY=""
[ "${1:-}" = --pack ] && PACK_ONLY=1 && shift
if [ -z "$PACK_ONLY" ]; then
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
fi
rm -rf .wx && mkdir -p .wx
assets=""
for a in ${PAYLOAD_ASSETS:-llama3}; do assets="$assets tokenizer-assets/$a"; done
(cd .whl && tar -cJf ../.wx/whl.tar.xz ./*.whl $assets)
if ls .vllmkit[0-9]/vllmkit.tar.xz.part* >/dev/null 2>&1; then
  # the transfer counts the disk blocks the files take (a file rounds up to 4 KiB), not their bytes: the tracked
  # files and, whole, the folder shared/ (its ignored build outputs too; its tracked files counted twice, as slack)
  tree=$(( $(git ls-files -z | du -c -B1 --files0-from=- | tail -n 1 | cut -f1) + $(du -s -B1 shared | cut -f1) ))
  "$PY" - "$tree" "$(stat -c %s .wx/whl.tar.xz)" <<'PYEOF'
import hashlib, shutil, sys
from pathlib import Path

tree, wx = int(sys.argv[1]), int(sys.argv[2])
room = (64 << 20) - tree - (512 << 10)  # a call's transfer: the tree, one folder, slack for the tree's growth
parts = sorted(Path(".").glob(".vllmkit[0-9]/vllmkit.tar.xz.part*"), key=lambda p: p.name)
scripts = [next(Path(".").glob(f".vllmkit[0-9]/{n}")) for n in ("install.sh", "check_deps.py")]
data = b"".join(p.read_bytes() for p in parts)
kept = {s.name: s.read_bytes() for s in scripts}
for d in Path(".").glob(".vllmkit[0-9]"):
    shutil.rmtree(d)
cuts, start, i = [], 0, 0
while start < len(data):
    size = room - (wx if i == 0 else 0)
    cuts.append(data[start:start + size])
    start, i = start + size, i + 1
sums = []
for i, chunk in enumerate(cuts):
    folder = Path(f".vllmkit{i}")
    folder.mkdir()
    name = f"vllmkit.tar.xz.part{i:02d}"
    (folder / name).write_bytes(chunk)
    sums.append(f"{hashlib.sha256(chunk).hexdigest()}  {name}\n")
last = Path(f".vllmkit{len(cuts) - 1}")
(last / "SHA256SUMS").write_text("".join(sums))
for name, body in kept.items():
    (last / name).write_bytes(body)
    (last / name).chmod(0o755)
print(f"the kit in {len(cuts)} calls (the first with .wx): {[len(c) for c in cuts]} bytes")
PYEOF
fi
du -sh .whl .wx .vllmkit* 2>/dev/null
