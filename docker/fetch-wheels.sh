#!/usr/bin/env bash
# Download the image's Python packages on the host, for builds that cannot
# reach PyPI from inside the build (no registry, no index), into a cache
# outside the repository, then link them into the build context
# (docker/wheels/, ignored by git).
#
#   docker/fetch-wheels.sh "torch==2.13.0"      # TORCH_SPEC of the build
#
# The cache is ${FEDADAPT_WHEEL_CACHE:-${XDG_CACHE_HOME:-~/.cache}/fedadapt/wheels};
# a warm cache makes this a no-op apart from the links.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_SPEC=${1:?usage: $0 TORCH_SPEC (e.g. "torch==2.13.0")}
CACHE=${FEDADAPT_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fedadapt/wheels}
PYTHON=${PYTHON:-python3}
mkdir -p "$CACHE"

reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
"$PYTHON" docker/requirements.py >"$reqs"
# shellcheck disable=SC2086  # TORCH_SPEC may hold several requirements
"$PYTHON" -m pip download --quiet --dest "$CACHE" --only-binary=:all: \
    -r "$reqs" $TORCH_SPEC hatchling

find docker/wheels -type f ! -name .gitkeep -delete 2>/dev/null || mkdir -p docker/wheels
cp -l "$CACHE"/* docker/wheels/ 2>/dev/null || cp "$CACHE"/* docker/wheels/
echo "fetch-wheels.sh: $(ls docker/wheels | wc -l) files in docker/wheels" >&2
