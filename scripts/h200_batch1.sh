#!/usr/bin/env bash
# Issue 42, item 4: what bounds batch 1 at c=256 on the served default (ResNet-50 FP16 from
# scripts/gpu_repo.py, gpu.compile default, 4 runners, decode processes). One server start a
# front-end count in FRONT_ENDS_LIST (the first fills the engine store, the others load it);
# against each, batch 1 over HTTP at c=256 with the cores of every process on the machine
# (scripts/cpu_shares.py, over the middle of the run: the front ends, the engine, the
# clients); against the first, also gRPC at the same load and the client with twice the
# processes (is the client the bound?), and py-spy over the server's processes (PYSPY=1). A
# table last.
#
#   FRONT_ENDS_LIST="4 8 2" bash scripts/h200_batch1.sh     (carry .whl)
set -u
OUT=${OUT:-/tmp/stoker-gpu}
mkdir -p "$OUT"
source "$(dirname "$0")/h200_wheels.sh"
root=$PWD
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$root"
python3 -V >"$OUT/env.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >>"$OUT/env.txt"
python3 -c "import torch; print('torch', torch.__version__)" >>"$OUT/env.txt"
git -C "$root" log --oneline -1 >>"$OUT/env.txt" 2>/dev/null
cat "$OUT/env.txt"
port=8126
url=http://127.0.0.1:$port
repo=/tmp/stoker-repo-b1
export STOKER_STORE__PATH=/tmp/stoker-store-b1
python3 scripts/gpu_repo.py "$repo" --compile default >"$OUT/repo.log" 2>&1

run() {  # name, then bench's arguments: batch 1 at c=256, the cores of every process beside
    local name=$1
    shift
    timeout 60 python3 -m bench --url "$url" --backend torch --model resnet50 \
        --repository "$repo" --model-version fp16 --uint8 --payload v2-binary --rows 1 \
        --concurrency 256 --duration "${DURATION:-6}" --warmup 1.5 \
        --json "$OUT/$name.json" "$@" >"$OUT/$name.log" 2>&1 &
    local client=$!
    sleep 3
    pgrep -f -- "-m bench --url" >"$OUT/$name.clients.txt"
    python3 scripts/cpu_shares.py --seconds 3 --min-cores 0.1 >"$OUT/$name.cores.txt" 2>&1
    wait $client
    echo "$name exit $?"
}

first=1
for fe in ${FRONT_ENDS_LIST:-4 8 2}; do
    t0=$(date +%s.%N)
    STOKER_MODELS__BACKEND=torch timeout 400 python3 -m app serve --repository "$repo" \
        --model resnet50 --port $port --front-ends "$fe" >"$OUT/server_fe$fe.log" 2>&1 &
    server=$!
    for _ in $(seq 1 1500); do
        curl -sf "$url/v2/health/ready" >/dev/null && break
        kill -0 $server 2>/dev/null || break
        sleep 0.2
    done
    echo "front ends $fe: ready in $(python3 -c "import time; print(f'{time.time() - $t0:.1f}')") s"
    if [ "${PYSPY:-0}" = 1 ] && [ $first = 1 ] && command -v py-spy >/dev/null; then
        (sleep 2.5 && py-spy record --pid $server --subprocesses --threads --nonblocking \
            --rate 97 --duration 3 --format raw -o "$OUT/pyspy_b1.txt" >"$OUT/pyspy.log" 2>&1) &
        spy=$!
        run "http_fe$fe"
        wait $spy
    else
        run "http_fe$fe"
    fi
    if [ $first = 1 ]; then
        run "grpc_fe$fe" --protocol grpc
        run "http_fe${fe}_clients8" --workers 8
    fi
    curl -s "$url/metrics" | grep -E "^stoker_inference_batch_size_(sum|count)" >"$OUT/metrics_fe$fe.txt"
    kill -TERM $server 2>/dev/null
    wait $server
    first=0
done
[ -f "$OUT/pyspy_b1.txt" ] && python3 scripts/pyspy_summary.py "$OUT/pyspy_b1.txt" --top 50 \
    >"$OUT/pyspy_summary.txt" 2>&1
python3 - "$OUT" <<'PY'
import json, re, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| run | req/s | p50 ms | p99 ms | client processes' cores | server's busiest processes (cores) |")
print("| --- | ---: | ---: | ---: | ---: | --- |")
for path in sorted(out.glob("*.json")):
    steps = [s for t in json.loads(path.read_text())["targets"] if t["name"] == "target" for s in t["steps"]]
    cores = (out / f"{path.stem}.cores.txt").read_text() if (out / f"{path.stem}.cores.txt").exists() else ""
    pids = set((out / f"{path.stem}.clients.txt").read_text().split()) if (out / f"{path.stem}.clients.txt").exists() else set()
    rows = [r.split("|") for r in cores.splitlines() if r.startswith("| ") and "cores" not in r and "---" not in r]
    mine = [r for r in rows if r[2].strip() in pids or r[3].strip() in pids]
    client = sum(float(r[1]) for r in mine)
    server = [r for r in rows if r not in mine]
    busiest = ", ".join(f"{r[1].strip()} {r[5].strip()[-40:]}" for r in server[:6])
    for s in steps:
        lat = s["latency_ms"]
        print(f"| {path.stem} | {s['rows_per_s']:,.0f} | {lat.get('p50', 0):.1f} | {lat['p99']:.1f} | {client:.2f} | {busiest} |")
for m in sorted(out.glob("metrics_fe*.txt")):
    v = dict(line.rsplit(" ", 1) for line in m.read_text().splitlines() if " " in line)
    s = sum(float(x) for k, x in v.items() if "_sum" in k); c = sum(float(x) for k, x in v.items() if "_count" in k)
    print(f"{m.stem}: mean model batch {s / max(c, 1):.1f} rows")
PY
