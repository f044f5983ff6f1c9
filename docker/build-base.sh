#!/usr/bin/env bash
# Build a Debian bookworm + Python 3.11 base image WITHOUT a registry:
# debootstrap from the Debian mirror the host's apt sources name, then
# `docker import`. Users with registry access don't need this: the
# Dockerfile's default BASE_IMAGE is python:3.11-slim-bookworm.
#
# usage: docker/build-base.sh [IMAGE]     # default fedadapt-base:bookworm
#
# Skips the work when IMAGE exists (delete it to rebuild). Needs root
# (debootstrap; installed from Debian's packages when missing) and a running
# engine (docker/engine.sh up). About 1 minute and 190 MB.
set -euo pipefail

if [ $# -gt 1 ] || [[ "${1:-}" == -* ]]; then
    echo "usage: $0 [IMAGE]   (default fedadapt-base:bookworm)" >&2
    exit 2
fi
IMAGE=${1:-fedadapt-base:bookworm}
if docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "build-base.sh: $IMAGE exists" >&2
    exit 0
fi

mirror() {
    local uri
    uri=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | awk '{print $2}' | grep -v security | head -1 || true)
    if [ -z "$uri" ]; then
        uri=$(grep -hs '^deb ' /etc/apt/sources.list 2>/dev/null \
            | awk '{print $2}' | grep -v security | head -1 || true)
    fi
    echo "${uri:-http://deb.debian.org/debian}"
}

if [ "$(id -u)" != 0 ]; then
    echo "build-base.sh: debootstrap needs root" >&2
    exit 1
fi
if ! command -v debootstrap >/dev/null 2>&1; then
    apt-get -o DPkg::Lock::Timeout=300 update -qq
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq \
        debootstrap >/dev/null
fi

ROOTFS=$(mktemp -d "${TMPDIR:-/tmp}/fedadapt-rootfs.XXXXXX")
trap 'rm -rf "$ROOTFS" "$ROOTFS.log"' EXIT
MIRROR=$(mirror)
echo "build-base.sh: debootstrap bookworm from $MIRROR" >&2
debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1 \
    || { tail -20 "$ROOTFS.log" >&2; exit 1; }
# smaller image: no apt lists or caches
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin \
    "$ROOTFS"/var/cache/apt/archives/*.deb
tar -C "$ROOTFS" -c . | docker import \
    --change 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' - "$IMAGE" >/dev/null
echo "build-base.sh: built $IMAGE" >&2
