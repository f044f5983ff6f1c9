#!/usr/bin/env bash
# Download the image's Python packages on the host, for builds that cannot
# reach an index (no registry, no PyPI inside the build), into a cache OUTSIDE
# the repository, then hard-link exactly the files this build needs into the
# build context, docker/wheels/ (ignored by git, never committed).
#
# usage: docker/fetch-wheels.sh TORCH_SPEC
#   e.g. docker/fetch-wheels.sh "torch==2.13.0"                        # CPU, here
#        docker/fetch-wheels.sh "torch==2.14.1 torchvision==0.29.1"    # GPU (CUDA)
#
# Environment: FEDADAPT_WHEEL_CACHE (default ${XDG_CACHE_HOME:-~/.cache}/fedadapt/wheels),
# PYTHON (any Python with pip; default python3). The wheels are for the
# image's Python (3.11, glibc 2.36 of Debian bookworm, this machine's
# architecture) whatever Python runs pip. A warm cache skips pip entirely.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -ne 1 ] || [ -z "$1" ]; then
    echo "usage: $0 TORCH_SPEC   (e.g. \"torch==2.13.0\")" >&2
    exit 2
fi
TORCH_SPEC=$1
CACHE=${FEDADAPT_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fedadapt/wheels}
PYTHON=${PYTHON:-python3}
ARCH=$(uname -m)
mkdir -p "$CACHE/sets" docker/wheels

# the image's interpreter: CPython 3.11 on glibc 2.36 (manylinux_2_5 … 2_36)
target=(--only-binary=:all: --python-version 3.11 --implementation cp --abi cp311)
for minor in $(seq 36 -1 5); do target+=(--platform "manylinux_2_${minor}_${ARCH}"); done
target+=(--platform "manylinux2014_${ARCH}" --platform "manylinux2010_${ARCH}"
         --platform "manylinux1_${ARCH}")

reqs=$(mktemp)
log=$(mktemp)
trap 'rm -f "$reqs" "$log"' EXIT
"$PYTHON" docker/requirements.py >"$reqs"
# shellcheck disable=SC2086  # TORCH_SPEC may hold several requirements
printf '%s\n' $TORCH_SPEC hatchling >>"$reqs"

# one list of file names per requirement set: a warm cache needs no pip
key=$( (cat "$reqs"; echo "${target[*]}") | sha256sum | cut -c1-16)
list=$CACHE/sets/$key.txt
complete() {
    [ -s "$list" ] || return 1
    while read -r name; do [ -f "$CACHE/$name" ] || return 1; done <"$list"
}

if complete; then
    echo "fetch-wheels.sh: wheel cache is warm ($CACHE)" >&2
else
    echo "fetch-wheels.sh: downloading into $CACHE" >&2
    if ! "$PYTHON" -m pip download --dest "$CACHE" "${target[@]}" -r "$reqs" >"$log" 2>&1; then
        tail -20 "$log" >&2
        exit 1
    fi
    # pip names each file it saved or found already in --dest
    sed -nE 's/^ *(Saved|File was already downloaded) (.*)$/\2/p' "$log" \
        | xargs -r -n1 basename | sort -u >"$list.tmp"
    mv "$list.tmp" "$list"
    complete || { echo "fetch-wheels.sh: pip's file list is incomplete" >&2; exit 1; }
fi

# make docker/wheels/ exactly the list, touching only what differs (a build
# of the same set running meanwhile keeps its files)
for path in docker/wheels/*; do
    name=${path##*/}
    [ -e "$path" ] || continue
    grep -qxF "$name" "$list" || rm -f "$path"
done
while read -r name; do
    [ -f "docker/wheels/$name" ] && continue
    ln "$CACHE/$name" "docker/wheels/$name" 2>/dev/null \
        || cp "$CACHE/$name" "docker/wheels/$name"
done <"$list"
echo "fetch-wheels.sh: $(wc -l <"$list") files ($(du -sh docker/wheels | cut -f1)) in docker/wheels" >&2
