#!/usr/bin/env bash
# Issue 42, items 1 and 4: where a request's time goes on the served default (ResNet-50 FP16
# from scripts/gpu_repo.py, gpu.compile default, 4 runners, decode processes), batch 1 at
# c=256 and 32 rows at c=32. One server start a front-end count in FRONT_ENDS_LIST (the first
# fills the engine store, the others load it; 1: one process), each tracing TRACE_RATIO of
# its requests to its output (OTEL_TRACES_EXPORTER=console), and scripts/span_budget.py
# splitting each run's traced requests by stage. Against each: batch 1 over HTTP at c=256,
# with the cores of every process beside (scripts/cpu_shares.py: the front ends, the
# engine, the clients), and 32 rows at c=32; against the first also gRPC at batch 1 and
# the client with 8 and 16 processes (is the client the bound?); py-spy over the server's
# processes with PYSPY=1. Tables last; the logs, JSON and spans in $OUT/batch1.tar.gz. POOL=1:
# the in-process pool at 32 rows (c = POOL_CONCURRENCY, 32) over the filled store, last;
# NAIVE=1: the naive server (bench --naive) at batch 1, c=256, over the filled store, last;
# BUDGET_S (400): no server starts after this many seconds, so what ran comes back whole.
#
#   FRONT_ENDS_LIST="4 1" bash scripts/h200_batch1.sh     (carry .whl)
#
# An entry of FRONT_ENDS_LIST may name server.frames_in_flight too: "4f0" is 4 front ends, no
# limit on frames in flight; and settings for its server after a colon, NAME=VALUE joined by
# commas: "4:STOKER_UPLOADS__DECODE_PROCESSES=0" (its runs are named by a short form of them).
# QUEUE_DELAY_US=N there serves a copy of the model repository whose max_queue_delay_us is N,
# PREFERRED=32.64.128 one whose preferred batch sizes are those (dots between them: every power
# of two to 256 cuts a batch to the largest CUDA graph it fills instead of padding it), RUNNERS=N
# one with N runners (the engine store is shared: none of these is in its keys); TREE=DIR serves the tree
# carried in DIR (e.g. .gpu/base: `git archive BASE | tar -x -C .gpu/base`), sharing the store,
# against this tree's client. JPEG_ALL=1: every server
# takes the photos, not only the first. WORKERS: the client's processes (bench --workers, default 1);
# EXTRAS=0 leaves out the first server's gRPC and 8- and 16-process runs. JPEG_IMAGES (a folder
# of real photos): the first server also takes one photo a request at c=256 (4 client
# processes), its spans budgeted like the others.
set -u
OUT=${OUT:-/tmp/stoker-gpu}
work=/tmp/stoker-batch1
mkdir -p "$OUT" "$work"
source "$(dirname "$0")/h200_wheels.sh"
root=$PWD
site=${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0 PYTHONPATH="${site:+$site:}$root"
{
    date -u
    python3 -V
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    python3 -c "import torch; print('torch', torch.__version__)"
    git -C "$root" log --oneline -1 2>/dev/null
} >"$work/env.txt"
cat "$work/env.txt"
port=8126
url=http://127.0.0.1:$port
repo=/tmp/stoker-repo-b1
warmup=1.5
duration=${DURATION:-6}
export STOKER_STORE__PATH=${STORE:-/tmp/stoker-store-b1}
python3 scripts/gpu_repo.py "$repo" --compile default >"$work/repo.log" 2>&1

descendants() { local p; for p in $(pgrep -P "$1"); do echo "$p"; descendants "$p"; done; }

served() { curl -s "$url/metrics" | awk '/^stoker_inference_count_total/ {s += $2} END {print s + 0}'; }

busy() {  # returns once the server answers more than 100 rows in half a second (30 s at most):
    # the client's processes take seconds to start, so a fixed sleep sampled their start-up
    local before now
    for _ in $(seq 1 60); do
        before=$(served)
        sleep 0.5
        now=$(served)
        awk -v a="$before" -v b="$now" 'BEGIN {exit !(b - a > 100)}' && return 0
    done
    return 1
}

run() {  # name, then bench's arguments (batch 1 at c=256 unless they say otherwise)
    local name=$1
    shift
    timeout 60 python3 -m bench --url "$url" --backend torch --model resnet50 \
        --repository "$repo" --model-version fp16 --uint8 --payload v2-binary --rows 1 \
        --concurrency 256 --duration "$duration" --warmup "$warmup" --workers "${WORKERS:-1}" \
        --json "$work/$name.json" "$@" >"$work/$name.log" 2>&1 &
    local client=$!
    busy
    sleep "$warmup"  # inside the measured seconds
    { echo $client; descendants $client; } >"$work/$name.clients.txt"
    python3 scripts/cpu_shares.py --seconds 3 --min-cores 0.02 >"$work/$name.cores.txt" 2>&1
    wait $client
    echo "$name exit $?"
    curl -s "$url/metrics" >"$work/metrics_after_$name.prom"  # a run's share: after - before
    # The traced requests of the measured seconds: those before the client's report.
    python3 -c "import time; t = time.time() - 0.5; print(f'$name={t - $duration:.3f},{t:.3f}')" \
        >>"$work/windows_$server_name.txt"
}

spied() {  # run, with py-spy over the first server's processes (PYSPY=1) for 3 s of it
    if [ "${PYSPY:-0}" = 1 ] && [ $first = 1 ] && command -v py-spy >/dev/null; then
        (busy && sleep "$warmup" && py-spy record --pid $server --subprocesses --threads --nonblocking \
            --rate 97 --duration 3 --format raw -o "$work/pyspy_$1.txt" >"$work/pyspy_$1.log" 2>&1) &
        local spy=$!
        run "$@"
        wait $spy
    else
        run "$@"
    fi
}

first=1
began=$(date +%s)
for entry in ${FRONT_ENDS_LIST:-4 1}; do
    if (($(date +%s) - began > ${BUDGET_S:-400})); then  # what is done still comes back whole
        echo "skipped $entry: past ${BUDGET_S:-400} s"
        continue
    fi
    extra=()
    if [[ $entry == *:* ]]; then
        IFS=, read -r -a extra <<<"${entry#*:}"
        entry=${entry%%:*}
    fi
    fe=${entry%%f*}
    frames=$([[ $entry == *f* ]] && echo "${entry#*f}" || echo 4)
    server_name=fe$entry
    served_repo=$repo
    repo_args=()
    tree=$root
    for setting in "${extra[@]}"; do  # STOKER_UPLOADS__DECODE_PROCESSES=0 -> _decode_processes0
        short=${setting#STOKER_*__}
        server_name+=_$(echo "${short/=/}" | tr 'A-Z' 'a-z' | tr -c 'a-z0-9_.\n' '_')
        case $setting in  # the model's config: a repo of its own (the store is shared)
            QUEUE_DELAY_US=*) repo_args+=(--queue-delay-us "${setting#*=}") ;;
            PREFERRED=*) repo_args+=(--preferred "$(echo "${setting#*=}" | tr . ,)") ;;
            RUNNERS=*) repo_args+=(--runners "${setting#*=}") ;;
        esac
        [[ $setting == TREE=* ]] && tree=$root/${setting#*=}
    done
    if ((${#repo_args[@]})); then
        served_repo=$repo-$server_name
        python3 scripts/gpu_repo.py "$served_repo" --compile default "${repo_args[@]}" >>"$work/repo.log" 2>&1
    fi
    t0=$(date +%s.%N)
    settings=()
    for setting in "${extra[@]}"; do  # what went into the repo copy, or chose the tree, is no setting
        [[ $setting == QUEUE_DELAY_US=* || $setting == PREFERRED=* || $setting == RUNNERS=* || $setting == TREE=* ]] ||
            settings+=("$setting")
    done
    env -C "$tree" PYTHONPATH="${site:+$site:}$tree" "${settings[@]}" STOKER_SERVER__FRAMES_IN_FLIGHT=$frames STOKER_SERVER__GATHERING_LOG_S=4 OTEL_TRACES_EXPORTER=console OTEL_TRACES_SAMPLER=traceidratio \
        OTEL_TRACES_SAMPLER_ARG=${TRACE_RATIO:-0.02} OTEL_BSP_SCHEDULE_DELAY=1000 \
        STOKER_MODELS__BACKEND=torch timeout 400 python3 -m app serve --repository "$served_repo" \
        --model resnet50 --port $port --front-ends "$fe" \
        >"$work/spans_$server_name.log" 2>"$work/server_$server_name.log" &
    server=$!
    for _ in $(seq 1 1500); do
        curl -sf "$url/v2/health/ready" >/dev/null && break
        kill -0 $server 2>/dev/null || break
        sleep 0.2
    done
    echo "front ends $fe: ready in $(python3 -c "import time; print(f'{time.time() - $t0:.1f}')") s"
    spied "http_$server_name"
    run "rows32_$server_name" --rows 32 --concurrency 32
    if { [ $first = 1 ] || [ "${JPEG_ALL:-0}" = 1 ]; } && [ -n "${JPEG_IMAGES:-}" ]; then  # one photo a request, c=256
        spied "jpeg_$server_name" --payload jpeg --images "$JPEG_IMAGES" --distinct 48 --workers 4
    fi
    if [ $first = 1 ] && [ "${EXTRAS:-1}" = 1 ]; then
        run "grpc_$server_name" --protocol grpc
        run "http_${server_name}_clients8" --workers 8
        run "http_${server_name}_clients16" --workers 16
    fi
    curl -s "$url/metrics" | grep -E "^stoker_inference_(batch_size_(sum|count)|padded_rows_total|count_total|exec_count_total)" \
        >"$work/metrics_$server_name.txt"
    sleep 1.5  # the last spans exported (OTEL_BSP_SCHEDULE_DELAY)
    kill -TERM $server 2>/dev/null
    wait $server
    first=0
done
if [ "${NAIVE:-0}" = 1 ]; then  # the naive server over the filled store, batch 1 at c=256
    STOKER_MODELS__BACKEND=torch timeout 120 python3 -m bench --naive --backend torch \
        --model resnet50 --repository "$repo" --model-version fp16 --uint8 --payload v2-binary \
        --rows 1 --concurrency 256 --duration "$duration" --warmup "$warmup" \
        --json "$work/naive_rows1.json" >"$work/naive.log" 2>&1
    echo "naive exit $?"
fi
if [ "${POOL:-0}" = 1 ]; then  # the in-process pool over the store the servers filled, 32 rows
    STOKER_MODELS__BACKEND=torch timeout 150 python3 -m bench --in-process --backend torch \
        --model resnet50 --repository "$repo" --model-version fp16 --uint8 --payload v2-binary \
        --workers 4 --rows 32 --concurrency "${POOL_CONCURRENCY:-32}" --duration "$duration" \
        --warmup "$warmup" --json "$work/pool_rows32.json" >"$work/pool.log" 2>&1
    echo "pool exit $?"
fi
for spy in "$work"/pyspy_*.txt; do
    [ -f "$spy" ] && python3 scripts/pyspy_summary.py "$spy" --top 50 >"${spy%.txt}.summary" 2>&1
done
for windows in "$work"/windows_*.txt; do
    name=$(basename "$windows" .txt)
    name=${name#windows_}
    args=()
    while read -r line; do args+=(--window "$line"); done <"$windows"
    python3 scripts/span_budget.py "$work/spans_$name.log" "${args[@]}" >"$work/budget_$name.txt" 2>&1
done
python3 - "$work" >"$work/table.txt" <<'PY'
import json, re, sys
from pathlib import Path
out = Path(sys.argv[1])
role = {}  # pid: what it is, from the servers' logs
for log in out.glob("server_*.log"):
    for what, pid in re.findall(r"app\.processes: (.+?) started \(pid (\d+)\)", log.read_text()):
        role[pid] = what.replace(" process", "")
print("| run | req/s | img/s | p50 ms | p99 ms | client processes' cores | server's busiest processes (cores) | server: mean batch, queue ms, infer ms, request ms |")
print("| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |")
for path in sorted(out.glob("*.json")):
    steps = [s for t in json.loads(path.read_text())["targets"] if t["name"].startswith(("target", "naive")) for s in t["steps"]]
    cores = (out / f"{path.stem}.cores.txt").read_text() if (out / f"{path.stem}.cores.txt").exists() else ""
    pids = set((out / f"{path.stem}.clients.txt").read_text().split()) if (out / f"{path.stem}.clients.txt").exists() else set()
    rows = [r.split("|") for r in cores.splitlines() if r.startswith("| ") and "cores" not in r and "---" not in r]
    mine = [r for r in rows if r[2].strip() in pids or r[3].strip() in pids]
    client = sum(float(r[1]) for r in mine)
    server = [r for r in rows if r not in mine]
    busiest = ", ".join(f"{r[1].strip()} {role.get(r[2].strip(), 'server' if '--port' in r[5] else r[5].strip()[-30:])}" for r in server[:7])
    for s in steps:
        lat, srv = s["latency_ms"], s.get("server") or {}
        numbers = ", ".join(f"{srv[k]:.1f}" if isinstance(srv.get(k), (int, float)) else "-"
                            for k in ("mean_batch_size", "queue_ms", "compute_infer_ms", "request_ms"))
        print(f"| {path.stem} | {s['throughput']:,.0f} | {s['rows_per_s']:,.0f} | {lat.get('p50', 0):.1f} | {lat['p99']:.1f} | {client:.2f} | {busiest} | {numbers} |")
for m in sorted(out.glob("metrics_*.txt")):
    v = dict(line.rsplit(" ", 1) for line in m.read_text().splitlines() if " " in line)
    s = sum(float(x) for k, x in v.items() if "_sum" in k); c = sum(float(x) for k, x in v.items() if "_count" in k)
    rows = sum(float(x) for k, x in v.items() if k.startswith("stoker_inference_count_total"))
    padded = sum(float(x) for k, x in v.items() if k.startswith("stoker_inference_padded_rows_total"))
    print(f"{m.stem}: mean model batch {s / max(c, 1):.1f} rows; padded rows {padded:,.0f} "
          f"= {padded / max(rows, 1):.3f} of the {rows:,.0f} rows inferred")
PY
grep -h -E "front-end.*(frame|a frame)|sent .* frame" "$work"/server_*.log | tail -8
tar -czf "$OUT/batch1.tar.gz" -C "$work" .
cp "$work/table.txt" "$OUT/"
cat "$work"/budget_*.txt
[ -f "$work/pool.log" ] && grep -E "in-process|target" "$work/pool.log" | tail -3
cat "$work/table.txt"
