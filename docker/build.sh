#!/bin/sh
# Build Blink's images from one commit of this repository:
#   docker/build.sh [--commit REV] [--tag TAG] [IMAGE...]      IMAGE: frontend engine-cpu engine-cuda
# (default: frontend engine-cpu, tag "latest", commit HEAD). The context is `git archive REV` plus this
# folder's files under _deploy/, so the same recipe builds an older commit (the previous schema minor's
# services for a rolling upgrade). Images: blink-frontend:TAG, blink-engine-cpu:TAG, blink-engine-cuda:TAG.
# The CPU torch wheel comes from BLINK_WHEELS (default: PIP_FIND_LINKS, else /opt/wheels, pip's find-links on the machines of this repository's CI); builds reach PyPI through the host network,
# trusting the host's CA bundle (BLINK_PIP_CERT, else PIP_CERT, else the system bundle).
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
REV=HEAD TAG=latest IMAGES=""
while [ $# -gt 0 ]; do
  case "$1" in
    --commit) REV=$2; shift 2 ;;
    --tag) TAG=$2; shift 2 ;;
    frontend|engine-cpu|engine-cuda) IMAGES="$IMAGES $1"; shift ;;
    *) echo "build.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
IMAGES=${IMAGES:-frontend engine-cpu}
WHEELS=${BLINK_WHEELS:-${PIP_FIND_LINKS:-/opt/wheels}}

CTX=$(mktemp -d /var/tmp/blink-ctx.XXXXXX)
trap 'rm -rf "$CTX"' EXIT
git -C "$REPO" archive "$REV" | tar -x -C "$CTX"
mkdir -p "$CTX/_deploy/wheels"
cp "$HERE"/Dockerfile.* "$HERE"/entrypoint.sh "$HERE"/healthcheck.py "$HERE"/requirements-*.txt "$CTX/_deploy/"
commit=$(git -C "$REPO" rev-parse "$REV")
minor=$(sed -n 's/^SCHEMA_MINOR = //p' "$CTX/shared/ring_layout.py")
echo "commit $commit schema 1.$minor" > "$CTX/_deploy/BUILD"
# The build host's CA bundle for pip inside the build (a TLS-inspecting proxy on the way to PyPI), if any.
CA=${BLINK_PIP_CERT:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}
if [ -n "$CA" ] && [ -f "$CA" ]; then cp "$CA" "$CTX/_deploy/pip-ca.crt"; else : > "$CTX/_deploy/pip-ca.crt"; fi

for image in $IMAGES; do
  if [ "$image" = engine-cpu ]; then
    wheel=$(ls "$WHEELS"/torch-2.13.0+cpu-*.whl 2>/dev/null | head -n1)
    [ -n "$wheel" ] || { echo "build.sh: no torch-2.13.0+cpu wheel in $WHEELS (set BLINK_WHEELS)" >&2; exit 1; }
    ln "$wheel" "$CTX/_deploy/wheels/" 2>/dev/null || cp "$wheel" "$CTX/_deploy/wheels/"
  fi
  echo "== blink-$image:$TAG from $commit (schema 1.$minor)"
  docker build --network host -f "$CTX/_deploy/Dockerfile.$image" -t "blink-$image:$TAG" \
    --label "org.blink.commit=$commit" --label "org.blink.schema=1.$minor" "$CTX"
  rm -f "$CTX"/_deploy/wheels/*.whl
done
