#!/usr/bin/env bash
# The GPU checks of issue #40, as one command on a machine with CUDA and no
# network (docs/benchmarks.md, "#40 on a GPU"):
#   1. pytest -m gpu: a deployment (SuperLink + SuperNodes as processes) with
#      device='cuda'; every ClientApp trained on CUDA (clients.jsonl's device)
#   2. benchmarks/clientapp_startup.py: one train message's phases in a fresh
#      process (CUDA initialisation included), against $OLD (another fedadapt
#      checkout) when given, same run
#   3. benchmarks/deployment.py --modes processes --device cuda: the round of
#      fedadapt and of the minimal Flower app, same run
# Without flwr in the interpreter it installs the wheels in .gpu-wheels/
# (flwr 1.42, flwr-datasets and what the image lacks: flower-notes §13;
# digits' Dirichlet split needs flwr-datasets). Output: $OUT.
# CHECKS="pytest startup deployment" (the default) picks which of 1-3 run;
# ROUNDS (default 4) is the deployment benchmark's rounds; DEPLOY_MODES and
# DEPLOY_APPS its --modes and --apps (e.g. "processes-flower-supernode
# processes" and "fedadapt minimal": Flower's SuperNode against
# fedadapt-supernode, same run).
set -uo pipefail
cd "$(dirname "$0")/.."
GPU_OUT_DEFAULT=/tmp/gpu-check
source scripts/gpu-env.sh
gpu_versions torch flwr
CHECKS=${CHECKS:-pytest startup deployment}
status=0
if [[ " $CHECKS " == *" pytest "* ]]; then
timeout 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider -rs \
    tests/tools/deploy/test_deploy_gpu.py > "$OUT/pytest-gpu.txt" 2>&1 || status=1
tail -15 "$OUT/pytest-gpu.txt"
fi
if [[ " $CHECKS " == *" startup "* ]]; then
timeout 150 "$PY" benchmarks/clientapp_startup.py --repo . ${OLD:+--repo "$OLD"} \
    --repeats 2 --json "$OUT/clientapp-startup-gpu.json" > "$OUT/clientapp-startup.txt" 2>&1 || status=1
tail -25 "$OUT/clientapp-startup.txt"
fi
if [[ " $CHECKS " == *" deployment "* ]]; then
timeout "${DEPLOY_TIMEOUT:-220}" "$PY" benchmarks/deployment.py \
    --modes ${DEPLOY_MODES:-processes} --apps ${DEPLOY_APPS:-fedadapt fedadapt-no-worker minimal} \
    --rounds "${ROUNDS:-4}" --device cuda \
    --output "$OUT/deployment-gpu.json" > "$OUT/deployment.txt" 2>&1 || status=1
tail -25 "$OUT/deployment.txt"
fi
exit $status
