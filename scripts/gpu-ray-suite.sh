#!/usr/bin/env bash
# Issue #39 item 5 on a GPU machine without network: a suite's cells sharing
# one GPU through Ray (fractional client-resources-num-gpus), one cell at a
# time against several at once, same machine, same call (docs/benchmarks.md).
#   SUITE (default conf/demo.yaml), PARALLEL (default "1 3"), GPU_SHARE (0.1
#   of a GPU per simulated client), CELL_TIMEOUT (s per suite run, 200).
# Without flwr/Ray in the interpreter it installs .gpu-wheels/ (flwr 1.42 and
# what the image lacks) and .gpu-ray/ (ray 2.55.1's cp312 wheel contents as a
# tar.xz without its Java jars, RLlib, Tune, Serve, Train, Data and the
# dashboard's source map: the wheel, 74 MB, is over what a call carries; plus
# jsonschema and its dependencies). Output: $OUT (suite folders, timings.json).
set -uo pipefail
cd "$(dirname "$0")/.."
GPU_OUT_DEFAULT=/tmp/gpu-ray
source scripts/gpu-env.sh
if ! "$PY" -c "import ray" 2>/dev/null; then
    site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    tar xJf .gpu-ray/ray-stripped.tar.xz -C "$site" || exit 2
    "$PY" -m pip install -q --no-index --no-deps .gpu-ray/*.whl || exit 2
    bin=$(dirname "$(command -v "$PY")")
    printf '#!%s\nimport sys\nfrom ray.scripts.scripts import main\nsys.exit(main())\n' \
        "$(command -v "$PY")" > "$bin/ray" && chmod +x "$bin/ray"
fi
gpu_versions torch flwr ray
SUITE=${SUITE:-conf/demo.yaml}
status=0
echo "{" > "$OUT/timings.json"
first=1
for p in ${PARALLEL:-1 3}; do
    start=$(date +%s.%N)
    timeout "${CELL_TIMEOUT:-200}" "$PY" -m fedadapt.tools.experiments run "$SUITE" \
        --output "$OUT/parallel-$p" --parallel "$p" --set device=cuda \
        --federation-config "client-resources-num-gpus=${GPU_SHARE:-0.1} client-resources-num-cpus=1" \
        > "$OUT/parallel-$p.log" 2>&1
    rc=$?
    end=$(date +%s.%N)
    [ $rc -eq 0 ] || status=1
    tail -6 "$OUT/parallel-$p.log"
    wall=$("$PY" -c "print(round($end - $start, 1))")
    echo "parallel $p: rc $rc, wall $wall s"
    [ $first -eq 1 ] || echo "," >> "$OUT/timings.json"
    first=0
    echo "\"$p\": {\"rc\": $rc, \"wall_s\": $wall}" >> "$OUT/timings.json"
done
echo "}" >> "$OUT/timings.json"
# failed cells' Flower logs, one level down so that they come back
for log in "$OUT"/parallel-*/*/*/flower.log; do
    [ -f "$log" ] || continue
    cell=$(basename "$(dirname "$log")"); p=$(basename "$(dirname "$(dirname "$(dirname "$log")")")")
    grep -q '"status": "completed"' "$(dirname "$log")/results.json" 2>/dev/null \
        || tail -300 "$log" > "$OUT/flower-$p-$cell.log"
done
# per cell: status, wall time, final central accuracy, the clients' devices
"$PY" - "$OUT" <<'PYEOF' | tee "$OUT/summary.json"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
cells = {}
for results in sorted(out.glob("parallel-*/**/results.json")):
    r = json.loads(results.read_text())
    rounds = r.get("rounds") or []
    last = (rounds[-1].get("eval") or {}) if rounds else {}
    devices = set()
    clients = results.parent / "clients.jsonl"
    if clients.exists():
        for line in clients.read_text().splitlines():
            devices.add(str(json.loads(line).get("device")))
    key = str(results.relative_to(out).parent)
    cells[key] = {"status": r.get("status"), "wall_time_s": r.get("wall_time_s"),
                  "rounds": len(rounds), "accuracy": last.get("accuracy"),
                  "devices": sorted(devices), "error": r.get("error")}
print(json.dumps(cells, indent=1))
PYEOF
exit $status
