#!/usr/bin/env bash
# The library as a plug-in user installs it (issue #27): build the wheel and
# the sdist, then for each Flower version a clean venv with only that flwr,
# numpy and pytest (no PyTorch), our wheel installed on top WITHOUT changing
# flwr, and the library tests (flwr + numpy only) run against the installed
# wheel, the two-round plug-in run among them (tests/strategies/test_library_plug_in.py).
#
# usage: scripts/test-flower-versions.sh BUILD_PYTHON VENV_PYTHON "VERSIONS" TESTS...
#   BUILD_PYTHON  a Python with `build` (the dev extra), builds dist/
#   VENV_PYTHON   the Python of the clean venvs (3.11)
#   VERSIONS      Flower versions, e.g. "1.41.0 1.42.0" (Makefile: FLOWER_VERSIONS)
#   TESTS         test files that need only flwr + numpy (Makefile: LIBRARY_TESTS)
# Everything it writes lies in build/ (git-ignored); venvs are made afresh.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -lt 4 ]; then
    echo "usage: $0 BUILD_PYTHON VENV_PYTHON \"VERSIONS\" TESTS..." >&2
    exit 2
fi
BUILD_PYTHON=$1 VENV_PYTHON=$2 VERSIONS=$3
shift 3
unset PYTHONPATH  # the installed wheel, never this checkout, is under test

rm -rf build/dist && mkdir -p build
"$BUILD_PYTHON" -m build --outdir build/dist . >build/build.log 2>&1 \
    || { tail -20 build/build.log >&2; exit 1; }
wheel=$(ls "$PWD"/build/dist/fedadapt-*.whl)
sdist=$(ls "$PWD"/build/dist/fedadapt-*.tar.gz)
"$VENV_PYTHON" - "$wheel" "$sdist" <<'EOF'
import sys, tarfile, zipfile

wheel, sdist = sys.argv[1:]
in_wheel = [n for n in zipfile.ZipFile(wheel).namelist() if n.endswith("/licenses/LICENSE")]
in_sdist = [n for n in tarfile.open(sdist).getnames() if n.endswith("/LICENSE") and n.count("/") == 1]
assert in_wheel and in_sdist, "LICENSE missing from the wheel or the sdist"
EOF
echo "built $(basename "$wheel") and $(basename "$sdist")"

for version in $VERSIONS; do
    start=$(date +%s)
    venv=$PWD/build/flwr-$version
    rm -rf "$venv"
    "$VENV_PYTHON" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet "flwr==$version" numpy pytest
    "$venv/bin/python" -m pip install --quiet "$wheel"
    # from a copy of the tests, so that `fedadapt` is the installed wheel
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    cp -r tests pyproject.toml README.md "$work"/
    cd "$work"
    # the wheel must keep the user's Flower and bring no PyTorch
    "$venv/bin/python" - "$version" <<'EOF'
import importlib.metadata as md
import importlib.util
import sys

import fedadapt.strategies

wanted = sys.argv[1]
assert md.version("flwr") == wanted, f"installing fedadapt changed flwr {wanted} to {md.version('flwr')}"
assert importlib.util.find_spec("torch") is None, "the clean venv has PyTorch"
assert "site-packages" in fedadapt.strategies.__file__, fedadapt.strategies.__file__
EOF
    "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not app and not e2e" "$@"
    cd - >/dev/null
    rm -rf "$work"
    echo "flwr $version: library tests passed on the installed wheel ($(( $(date +%s) - start ))s)"
done
