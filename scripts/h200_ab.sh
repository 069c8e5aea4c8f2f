#!/usr/bin/env bash
# One setting A/B on the GPU machine, alternated to see through run-to-run noise: the
# service (ResNet-50 FP16, gpu.compile none, FRONT_ENDS front ends) started ROUNDS times
# with each value of AB_VAR in turn (default STOKER_SERVER__PIN_ARENA: 1 then 0), and each
# time UINT8 32 images/request at c = 8 and 32 and batch-1 UINT8 at c=256, over AB_PROTOCOL
# (http, or http,grpc); a table last. AB_LOADS replaces those loads: words of
# payload:rows:clients, payload u8 (UINT8 binary V2) or jpeg (uploads of JPEG_IMAGES, real
# photos, to POST /infer). DURING_LOAD: a command run (bash -c) beside each load's client,
# with LOAD_NAME set to the load's output path without its extension (h200_sampled.sh).
# The server's /metrics after its loads: metrics_<round>_<value>.txt.
#
# AB_SETS replaces AB_VAR and AB_VALUES: words of settings joined by '+' (VAR=VALUE+VAR=VALUE),
# each word one server, named s1, s2... in the table (the legend first). COMPILE: the served
# model's gpu.compile (none; default compiles its buckets at the first start, the engine
# store keeps them for the next). MPS=1 starts CUDA's MPS daemon first (a word of AB_SETS
# with CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe runs under it; the rest do not), and after each
# server's loads prints the processes the MPS server serves (none: MPS was not in use).
# After each server stops, each decode process's time a batch (decode, resize, handover).
#
#   AB_VAR=STOKER_SERVER__PIN_ARENA AB_VALUES="1 0" ROUNDS=2 bash scripts/h200_ab.sh
#   MPS=1 AB_SETS="STOKER_UPLOADS__JPEG_DECODER=torchvision CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe" \
#       JPEG_IMAGES=$PWD/.carry/photos AB_LOADS="jpeg:1:256" bash scripts/h200_ab.sh
#   AB_VAR=STOKER_UPLOADS__DECODE_PROCESSES AB_VALUES="0 2" JPEG_IMAGES=$PWD/.carry/photos \
#       AB_LOADS="jpeg:1:64,256 jpeg:16:32" bash scripts/h200_ab.sh
set -u
OUT=${OUT:-/tmp/stoker-gpu}
mkdir -p "$OUT"
source "$(dirname "$0")/h200_wheels.sh"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
export STOKER_STORE__PATH=/tmp/stoker-store CUDA_VISIBLE_DEVICES=0
var=${AB_VAR:-STOKER_SERVER__PIN_ARENA}
repo=/tmp/stoker-repo
python3 scripts/gpu_repo.py "$repo" --compile "${COMPILE:-none}" >"$OUT/repo.log" 2>&1
if [ "${MPS:-0}" = 1 ]; then
    mkdir -p /tmp/mps-pipe /tmp/mps-log
    CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log \
        nvidia-cuda-mps-control -d && echo "MPS daemon started" || echo "MPS daemon did not start"
fi
if [ -n "${AB_SETS:-}" ]; then
    var=settings
    values=""
    i=0
    for words in $AB_SETS; do
        i=$((i + 1))
        values="$values s$i"
        echo "s$i: ${words//+/ }" | tee -a "$OUT/legend.txt"
    done
fi
port=8125
url=http://127.0.0.1:$port
for round in $(seq 1 "${ROUNDS:-2}"); do
    for value in ${values:-${AB_VALUES:-1 0}}; do
        name="r${round}_${value}"
        if [ -n "${AB_SETS:-}" ]; then
            set_words=$(echo $AB_SETS | tr ' ' '\n' | sed -n "${value#s}p")
            assignments=(${set_words//+/ })
        else
            assignments=("$var=$value")
        fi
        env "${assignments[@]}" STOKER_MODELS__BACKEND=torch timeout "${SERVE_LIMIT:-300}" python3 -m app serve \
            --repository "$repo" --model resnet50 --port $port --front-ends "${FRONT_ENDS:-4}" \
            >"$OUT/server_$name.log" 2>&1 &
        server=$!
        for _ in $(seq 1 200); do
            curl -sf "$url/v2/health/ready" >/dev/null && break
            kill -0 $server 2>/dev/null || break
            sleep 1
        done
        for load in ${AB_LOADS:-u8:32:8,32 u8:1:256}; do
            IFS=: read -r payload rows clients <<<"$load"
            protocol=${AB_PROTOCOL:-http}
            if [ "$payload" = jpeg ]; then  # uploads are HTTP's alone
                what=(--payload jpeg --images "$JPEG_IMAGES" --distinct 48)
                protocol=http
            else
                what=(--model-version fp16 --uint8 --payload v2-binary)
            fi
            if [ -n "${DURING_LOAD:-}" ]; then
                LOAD_NAME="$OUT/${name}_${payload}${rows}" bash -c "$DURING_LOAD" &
                during=$!
            fi
            timeout 90 python3 -m bench --url "$url" --model resnet50 --repository "$repo" \
                "${what[@]}" --rows "$rows" --concurrency "$clients" \
                --workers 4 --duration "${DURATION:-4}" --warmup "${WARMUP:-1}" --protocol "$protocol" \
                --json "$OUT/${name}_${payload}${rows}.json" >"$OUT/${name}_${payload}${rows}.log" 2>&1
            [ -n "${DURING_LOAD:-}" ] && wait "$during"
        done
        curl -s "$url/metrics" >"$OUT/metrics_$name.txt"
        grep -h "decode process\|decoded on the" "$OUT/server_$name.log" | head -3
        if [ "${MPS:-0}" = 1 ]; then  # which processes MPS serves: none means it was not used
            mps=$(echo get_server_list | CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe \
                nvidia-cuda-mps-control 2>/dev/null | grep -E '^[0-9]+$')
            for pid in $mps; do
                clients=$(echo "get_client_list $pid" | CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe \
                    nvidia-cuda-mps-control | tr '\n' ' ')
                echo "MPS server $pid serves: ${clients:-none}"
            done
            [ -z "$mps" ] && echo "MPS: no server running"
        fi
        kill -TERM $server 2>/dev/null
        wait $server
        grep -h "decode process .*: .*batch" "$OUT/server_$name.log" | cut -c1-240
        echo "$var=$value round $round done"
    done
done
if [ "${MPS:-0}" = 1 ]; then
    echo quit | CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe nvidia-cuda-mps-control
fi
python3 - "$OUT" "$var" <<'PY'
import json, sys
from pathlib import Path
out, var = Path(sys.argv[1]), sys.argv[2]
print(f"| {var} | round | target | payload, rows/request | clients | img/s | p99 ms |")
print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
for path in sorted(out.glob("r*_*.json")):
    round_, value, load = path.stem.split("_", 2)
    for target in json.loads(path.read_text())["targets"]:
        for step in target["steps"]:
            print(f"| {value} | {round_[1:]} | {target['name']} | {load} | {step['concurrency']} | "
                  f"{step['rows_per_s']:,.0f} | {step['latency_ms']['p99']:.0f} |")
print()
print("| server | requests | ms a request | decode queue | decode | batcher queue | infer |"
      " mean decode batch |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for path in sorted(out.glob("metrics_*.txt")):
    sums: dict[str, float] = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            name = key.split("{")[0]
            sums[name] = sums.get(name, 0.0) + float(value)
    def mean(name: str) -> float:
        count = sums.get(f"stoker_{name}_count", 0.0)
        return sums.get(f"stoker_{name}_sum", 0.0) / count * (1000 if "seconds" in name else 1) if count else 0.0
    requests = sums.get("stoker_inference_request_duration_seconds_count", 0.0)
    print(f"| {path.stem[8:]} | {requests:,.0f} | {mean('inference_request_duration_seconds'):.1f} | "
          f"{mean('image_decode_queue_duration_seconds'):.1f} | {mean('image_decode_duration_seconds'):.1f} | "
          f"{mean('inference_queue_duration_seconds'):.1f} | {mean('inference_compute_infer_duration_seconds'):.1f} | "
          f"{mean('image_decode_batch_size'):.1f} |")
PY
