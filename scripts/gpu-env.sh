# Sourced by the GPU scripts (gpu-check.sh, gpu-ray-suite.sh) on a machine
# without network: from the repository root, with OUT's default in
# GPU_OUT_DEFAULT. Installs .gpu-wheels/ (flwr 1.42, flwr-datasets and what
# the image lacks: flower-notes §13) unless flwr is there, sets Flower's
# environment, puts this checkout on PYTHONPATH (fedadapt-supernode and the
# suites run from here) and writes the card and versions to $OUT/gpu.txt.
OUT=${OUT:-$GPU_OUT_DEFAULT}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if ! "$PY" -c "import flwr, flwr_datasets" 2>/dev/null; then
    ls .gpu-wheels/*.whl >/dev/null 2>&1 || { echo "no flwr and no .gpu-wheels/"; exit 2; }
    "$PY" -m pip install -q --no-index --no-deps .gpu-wheels/*.whl || exit 2
fi
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
gpu_versions() {  # the card, then the versions of the modules named
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
    "$PY" -c "import importlib, sys; print(*(m + ' ' + importlib.import_module(m).__version__ for m in sys.argv[1:]))" \
        "$@" | tee -a "$OUT/gpu.txt"
}
