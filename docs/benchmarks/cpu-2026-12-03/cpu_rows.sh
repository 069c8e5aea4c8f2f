#!/usr/bin/env bash
# JPEG uploads to /infer on this CPU (issue 25, item 4): the embedded default in one process,
# two front ends with the engine decoding the files, and two front ends making the rows
# themselves (server.decode_uploads_in_front_ends, the default with front ends), alternated
# ROUNDS times; one photo a request at CONCURRENCY (c=1 and c=32); a table last. FRONT_ENDS
# (2), REPOSITORY (models: the embedded default) and WORKERS (client processes, 1) for a
# larger machine.
set -u
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}
out=${OUT:-/tmp/cpu_rows}; rm -rf "$out"; mkdir -p "$out"
declare -A setting=(
    [one]="--front-ends 1"
    [files]="--front-ends ${FRONT_ENDS:-2}"
    [rows]="--front-ends ${FRONT_ENDS:-2}"
)
declare -A decode=([one]=true [files]=false [rows]=true)
for round in $(seq 1 "${ROUNDS:-2}"); do
    for name in one files rows; do
        STOKER_SERVER__DECODE_UPLOADS_IN_FRONT_ENDS=${decode[$name]} timeout 300 $PY -m app serve \
            --port 8152 --repository "${REPOSITORY:-models}" ${setting[$name]} \
            >"$out/server_${name}_$round.log" 2>&1 &
        server=$!
        for _ in $(seq 300); do curl -sf localhost:8152/v2/health/ready >/dev/null && break; sleep 1; done
        $PY -m bench --url http://127.0.0.1:8152 --repository "${REPOSITORY:-models}" \
            --payload jpeg --images "${JPEG_IMAGES:-.carry/photos}" --distinct 48 --rows 1 \
            --concurrency "${CONCURRENCY:-1,32}" --workers "${WORKERS:-1}" \
            --duration "${DURATION:-6}" --warmup 2 --json "$out/${name}_$round.json" \
            >"$out/${name}_$round.log" 2>&1
        curl -s localhost:8152/metrics | grep '^stoker_image_decode_total' >"$out/${name}_$round.decoded"
        kill -TERM $server; wait $server
        echo "$name round $round done"
    done
done
$PY - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| setting | round | clients | img/s | p50 ms | p99 ms |")
print("| --- | ---: | ---: | ---: | ---: | ---: |")
for path in sorted(out.glob("*.json")):
    name, round_ = path.stem.rsplit("_", 1)
    for target in json.loads(path.read_text())["targets"]:
        for step in target["steps"]:
            lat = step["latency_ms"]
            print(f"| {name} | {round_} | {step['concurrency']} | {step['rows_per_s']:,.1f} | "
                  f"{lat['p50']:.1f} | {lat['p99']:.1f} |")
PY
grep -h "pillow" "$out"/*_1.decoded
