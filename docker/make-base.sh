#!/bin/sh
# The base image of every Blink image, made from Debian's packages (no image registry needed):
#   docker/make-base.sh [NAME] [SUITE] [MIRROR]
# debootstrap a minimal Debian, add Python 3.11 and the C compiler the extensions need, import it.
set -eu
NAME=${1:-blink-base:bookworm}
SUITE=${2:-bookworm}
MIRROR=${3:-http://deb.debian.org/debian}
ROOTFS=$(mktemp -d /var/tmp/blink-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT

debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-dev,gcc,libc6-dev,ca-certificates \
    "$SUITE" "$ROOTFS" "$MIRROR"
# Keep the image small: no package lists, no docs, no caches.
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/usr/share/doc/* \
       "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/locale/*
tar -C "$ROOTFS" -c . | docker import - "$NAME"
echo "imported $NAME"
