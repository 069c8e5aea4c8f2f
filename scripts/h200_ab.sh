#!/usr/bin/env bash
# One setting A/B on the GPU machine, alternated to see through run-to-run noise: the
# service (ResNet-50 FP16, gpu.compile none, FRONT_ENDS front ends) started ROUNDS times
# with each value of AB_VAR in turn (default STOKER_SERVER__PIN_ARENA: 1 then 0), and each
# time UINT8 32 images/request at c = 8 and 32 and batch-1 UINT8 at c=256, over AB_PROTOCOL
# (http, or http,grpc); a table last.
#
#   AB_VAR=STOKER_SERVER__PIN_ARENA AB_VALUES="1 0" ROUNDS=2 bash scripts/h200_ab.sh
set -u
OUT=${OUT:-/tmp/stoker-gpu}
mkdir -p "$OUT"
source "$(dirname "$0")/h200_wheels.sh"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
export STOKER_STORE__PATH=/tmp/stoker-store CUDA_VISIBLE_DEVICES=0
var=${AB_VAR:-STOKER_SERVER__PIN_ARENA}
repo=/tmp/stoker-repo
python3 scripts/gpu_repo.py "$repo" --compile none >"$OUT/repo.log" 2>&1
port=8125
url=http://127.0.0.1:$port
for round in $(seq 1 "${ROUNDS:-2}"); do
    for value in ${AB_VALUES:-1 0}; do
        name="r${round}_${value}"
        env "$var=$value" STOKER_MODELS__BACKEND=torch timeout 300 python3 -m app serve \
            --repository "$repo" --model resnet50 --port $port --front-ends "${FRONT_ENDS:-4}" \
            >"$OUT/server_$name.log" 2>&1 &
        server=$!
        for _ in $(seq 1 200); do
            curl -sf "$url/v2/health/ready" >/dev/null && break
            kill -0 $server 2>/dev/null || break
            sleep 1
        done
        for load in "32 8,32" "1 256"; do
            set -- $load
            timeout 90 python3 -m bench --url "$url" --model resnet50 --repository "$repo" \
                --model-version fp16 --uint8 --payload v2-binary --rows "$1" --concurrency "$2" \
                --workers 4 --duration "${DURATION:-4}" --warmup 1 --protocol "${AB_PROTOCOL:-http}" \
                --json "$OUT/${name}_rows$1.json" >"$OUT/${name}_rows$1.log" 2>&1
        done
        kill -TERM $server 2>/dev/null
        wait $server
        echo "$var=$value round $round done"
    done
done
python3 - "$OUT" "$var" <<'PY'
import json, sys
from pathlib import Path
out, var = Path(sys.argv[1]), sys.argv[2]
print(f"| {var} | round | target | rows/request | clients | img/s | p99 ms |")
print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
for path in sorted(out.glob("r*_rows*.json")):
    round_, value = path.stem.split("_")[0][1:], path.stem.split("_")[1]
    for target in json.loads(path.read_text())["targets"]:
        for step in target["steps"]:
            rows = path.stem.split("rows")[1]
            print(f"| {value} | {round_} | {target['name']} | {rows} | {step['concurrency']} | "
                  f"{step['rows_per_s']:,.0f} | {step['latency_ms']['p99']:.0f} |")
PY
