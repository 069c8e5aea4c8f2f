#!/usr/bin/env bash
# The one command the GPU machine runs: install the carried wheels, run the GPU tests, the
# raw-runner benchmarks and the service over HTTP (stoker bench), then print the tables.
#
#   bash scripts/h200.sh                      (on the device, from the repository root)
#   SECTIONS=tests,raw,http bash scripts/h200.sh      (the first session's runs)
#   SECTIONS=service,gpus bash scripts/h200.sh        (UINT8 / JPEG / rate service runs, and
#                                                      runners over two GPUs: nvidia-h200-x2)
#   SECTIONS=restart bash scripts/h200.sh             (start to ready from an empty engine
#                                                      store, then from the filled one)
#
# Logs and JSON go to $OUT. With `service`, the GPU tests (TESTS, default all of them) run
# beside it on the last GPU when there are two (TESTS_BESIDE=1), so one call does both;
# SKIP_U8=1 leaves out the UINT8 and open-loop runs. Time limits in seconds: TESTS_LIMIT,
# RAW_LIMIT, READY_LIMIT, U8_LIMIT, JPEG_LIMIT, GPUS_LIMIT; RAW_ONLY and RAW_ARGS (gpu_bench.py's
# --only and its other arguments); the service runs: BACKEND (torch),
# ROWS (32), DURATION (4 s a step), RATE_DURATION (8 s), U8_CONCURRENCY (8,16,32),
# JPEG_CONCURRENCY (64,256), JPEG16_CONCURRENCY (8,32; none skips), JPEG_IMAGES (a folder of
# photos for the JPEG runs, 48 of them cycled; default synthetic 640x480), FRONT_ENDS (1: one
# process; N: N front ends before an engine process), BATCH1 (1: batch-1 UINT8 at c=256 against
# the naive server; 0 skips), PROFILE (1: cProfile every server process, summary in
# profile_summary.txt), COMPILE (the served model's gpu.compile: default, none, max-autotune),
# RUNNERS (the served model's runners; unset: the GPU default),
# ENGINE_GPUS (server.engine_gpus, e.g. [0,1]: one engine process per GPU; set TESTS_BESIDE=0);
# PROTOCOL (http, or http,grpc: the UINT8 and batch-1 runs over both, against one server);
# RATE_FRACTION (0.5: the open-loop rate as a fraction of the best closed-loop one);
# JPEG_IN_PROCESS (1: the JPEG runs also measure the in-process decode, resize and infer
# pipeline); UNLOAD (1: models.control explicit, and after the runs GPU memory before and
# after unloading the model, then loading it again, in unload.txt);
# PYSPY (1: py-spy samples every thread of every server process for PYSPY_SECONDS, 14, from the
# start of the batch-1 run; pyspy_summary.txt); SECONDS_PER_WINDOW for gpu_bench.py.
# Wheels for what the machine lacks travel in .whl/ (see BENCHMARKS.md, "GPU (H200)").
set -u
OUT=${OUT:-/tmp/stoker-gpu}
SECTIONS=${SECTIONS:-tests,raw,http}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/h200_wheels.sh"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -V
    python3 -m pip list 2>/dev/null | grep -i -E \
        "^(torch|torchvision|cuda-bindings|cuda-python|nvidia-ml-py|onnx|onnxruntime|numpy|pytest) "
    nproc
    df -h /dev/shm | tail -1
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

has() { [[ ",$SECTIONS," == *",$1,"* ]]; }

gpu_tests() {  # $1: the log's name
    # SIGINT at the limit: pytest stops and still prints what failed so far, with tracebacks.
    timeout -s INT -k 30 "${TESTS_LIMIT:-150}" python3 -m pytest -p no:cacheprovider -q -rfE --timeout 120 \
        ${TESTS:-tests/gpu tests/unit/engines/devices/test_cuda.py tests/unit/app/engine/test_images.py tests/unit/app/engine/test_models.py} \
        >"$OUT/$1" 2>&1
    echo "pytest exit $?" >>"$OUT/$1"
}

if has tests; then
    echo "== GPU tests"
    gpu_tests gpu_tests.log
    tail -25 "$OUT/gpu_tests.log"
fi

if has raw; then
    echo "== raw runner benchmarks"
    timeout "${RAW_LIMIT:-260}" python3 scripts/gpu_bench.py --out "$OUT" \
        --seconds "${SECONDS_PER_WINDOW:-1.5}" ${RAW_ONLY:+--only "$RAW_ONLY"} ${RAW_ARGS:-} \
        >"$OUT/gpu_bench.log" 2>&1
    echo "gpu_bench exit $?"
fi

if has restart; then
    # Time to ready of `stoker serve` (ResNet-50 FP16, gpu.compile COMPILE, default: default)
    # from an empty engine store, then again from the store it filled; each start with an
    # empty Inductor cache of its own, so only the engine store carries compiled kernels.
    echo "== restart: start to ready, empty store then filled (gpu.compile ${COMPILE:-default})"
    repo=/tmp/stoker-repo-restart
    store=/tmp/stoker-store-restart
    rm -rf "$store"
    python3 scripts/gpu_repo.py "$repo" --compile "${COMPILE:-default}" >"$OUT/restart_repo.log" 2>&1
    for start in cold warm; do
        t0=$(date +%s.%N)
        TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-$start STOKER_STORE__PATH=$store \
            STOKER_MODELS__BACKEND=torch timeout "${RESTART_LIMIT:-240}" python3 -m app serve \
            --repository "$repo" --model resnet50 --port 8124 >"$OUT/restart_$start.log" 2>&1 &
        pid=$!
        until curl -sf http://127.0.0.1:8124/v2/health/ready >/dev/null; do
            kill -0 $pid 2>/dev/null || break
            sleep 0.2
        done
        t1=$(date +%s.%N)
        echo "$start: ready in $(python3 -c "print(f'{$t1 - $t0:.1f}')") s"
        grep -E "engine store|loaded and warmed|Traceback|Error" "$OUT/restart_$start.log" | cut -c1-220 | head -6
        kill -TERM $pid 2>/dev/null
        wait $pid
    done
fi

bench() {
    local limit=$1 name=$2
    shift 2
    timeout "$limit" python3 -m bench --backend "${BACKEND:-torch}" --workers 4 \
        --duration "${DURATION:-4}" --warmup 1 --json "$OUT/$name.json" "$@" >"$OUT/$name.log" 2>&1
    echo "$name exit $?"
}

if has http; then
    echo "== service over HTTP (stoker bench)"
    # Each --serve starts a server that compiles its buckets (gpu.compile default): minutes.
    bench 240 http_resnet50_rows32 --serve --model resnet50 --rows 32 --concurrency 8,16,32
    bench 240 http_effnet_rows32 --serve --model efficientnet_lite0 --rows 32 --concurrency 8,16,32
    bench 240 http_effnet_b1_c256 --serve --naive --model efficientnet_lite0 --rows 1 \
        --concurrency 256 --duration 5 --warmup 2
fi

if has service; then
    # One server (ResNet-50 FP16 on GPU 0) measured three ways over HTTP, against the raw
    # runner pool in the bench's own process: binary UINT8 at 32 images per request, JPEG
    # uploads decoded on the GPU, and an open-loop rate at half the best closed-loop one.
    echo "== service: ResNet-50 FP16, UINT8 / JPEG / open loop"
    beside=""
    if [ "$GPUS" -ge 2 ] && [ "${TESTS_BESIDE:-1}" = 1 ]; then
        CUDA_VISIBLE_DEVICES=$((GPUS - 1)) gpu_tests gpu_tests_beside.log &
        beside=$!
    fi
    export STOKER_STORE__PATH=/tmp/stoker-store
    if [ -n "${ENGINE_GPUS:-}" ]; then  # one engine process per listed GPU, e.g. [0,1]
        export STOKER_SERVER__ENGINE_GPUS=$ENGINE_GPUS
    else
        export CUDA_VISIBLE_DEVICES=0
    fi
    repo=/tmp/stoker-repo
    python3 scripts/gpu_repo.py "$repo" --compile "${COMPILE:-default}" \
        ${RUNNERS:+--runners "$RUNNERS"} >"$OUT/service_repo.log" 2>&1
    port=8123
    url=http://127.0.0.1:$port
    if [ "${PROFILE:-0}" = 1 ]; then  # cProfile of the engine and every front end
        mkdir -p "$OUT/profile"
        export STOKER_PROFILE_DIR=$OUT/profile
    fi
    if [ "${UNLOAD:-0}" = 1 ]; then
        # Model control needs keys or this setting: this box is private.
        export STOKER_MODELS__CONTROL=explicit STOKER_MODELS__STARTUP='["resnet50"]' \
            STOKER_MODELS__CONTROL_WITHOUT_KEYS=true
    fi
    STOKER_MODELS__BACKEND=${BACKEND:-torch} timeout 580 python3 -m app serve \
        --repository "$repo" --model resnet50 --port $port --front-ends "${FRONT_ENDS:-1}" \
        >"$OUT/service_server.log" 2>&1 &
    server=$!
    for _ in $(seq 1 "${READY_LIMIT:-150}"); do
        curl -sf "$url/v2/health/ready" >/dev/null && break
        kill -0 $server 2>/dev/null || break
        sleep 1
    done
    echo "server ready: $(curl -s "$url/v2/health/ready")"
    [ "${SKIP_U8:-0}" = 1 ] || bench "${U8_LIMIT:-120}" service_u8_rows32 --url "$url" --in-process --model resnet50 \
        --repository "$repo" --model-version fp16 --uint8 --payload v2-binary \
        --rows "${ROWS:-32}" --concurrency "${U8_CONCURRENCY:-8,16,32}" --image-size 640x480 \
        --protocol "${PROTOCOL:-http}"
    inproc=""
    [ "${JPEG_IN_PROCESS:-0}" = 1 ] && inproc=--in-process
    bench "${JPEG_LIMIT:-45}" service_jpeg_rows1 --url "$url" $inproc --model resnet50 \
        --repository "$repo" --payload jpeg --rows 1 --concurrency "${JPEG_CONCURRENCY:-64,256}" \
        ${JPEG_IMAGES:+--images "$JPEG_IMAGES" --distinct 48}
    [ "${JPEG16_CONCURRENCY:-}" = none ] || bench "${JPEG_LIMIT:-45}" service_jpeg_rows16 \
        --url "$url" $inproc --model resnet50 --repository "$repo" --payload jpeg --rows 16 \
        --concurrency "${JPEG16_CONCURRENCY:-8,32}" \
        ${JPEG_IMAGES:+--images "$JPEG_IMAGES" --distinct 16}
    rate=$(python3 - "$OUT/service_u8_rows32.json" "${RATE_FRACTION:-0.5}" 2>/dev/null <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
steps = doc["targets"][0]["steps"]
print(f"{float(sys.argv[2]) * max(s['throughput'] for s in steps):.1f}")
PY
)
    echo "open-loop rate (${RATE_FRACTION:-0.5} of the best closed-loop req/s): $rate"
    if [ -n "$rate" ]; then
        bench 30 service_u8_rate50 --url "$url" --model resnet50 --repository "$repo" \
            --model-version fp16 --uint8 --payload v2-binary --rows "${ROWS:-32}" \
            --concurrency none --rate "$rate" --duration "${RATE_DURATION:-8}"
    fi
    # Batch-1 UINT8 at c=256 against the naive per-request server (the bench starts it).
    if [ "${PYSPY:-0}" = 1 ] && command -v py-spy >/dev/null; then  # every thread of every process
        py-spy record --pid $server --subprocesses --threads --nonblocking --rate 97 \
            --duration "${PYSPY_SECONDS:-14}" --format raw -o "$OUT/pyspy_b1.txt" \
            >"$OUT/pyspy.log" 2>&1 &
        pyspy=$!
    fi
    [ "${BATCH1:-1}" = 1 ] && bench "${BATCH1_LIMIT:-60}" service_u8_rows1 --url "$url" --naive \
        --model resnet50 --repository "$repo" --model-version fp16 --uint8 --payload v2-binary \
        --rows 1 --concurrency 256 --duration 5 --warmup 2 --protocol "${PROTOCOL:-http}"
    curl -s "$url/metrics" | grep -E "^stoker_gpu_|^stoker_inference_batch_size_(sum|count)|^stoker_image_decode" \
        >"$OUT/service_metrics.txt"
    if [ "${UNLOAD:-0}" = 1 ]; then
        python3 scripts/gpu_unload.py "$url" --pid "$server" >"$OUT/unload.txt" 2>&1
        echo "unload exit $?"
    fi
    [ -n "${pyspy:-}" ] && wait "$pyspy"  # its record is whole before it is summarised
    kill -TERM $server 2>/dev/null
    wait $server
    echo "server exit $?"
    if [ "${PROFILE:-0}" = 1 ]; then
        unset STOKER_PROFILE_DIR
        python3 scripts/profile_summary.py "$OUT/profile" --top 25 >"$OUT/profile_summary.txt" 2>&1
    fi
    unset CUDA_VISIBLE_DEVICES STOKER_SERVER__ENGINE_GPUS
    if [ -n "$beside" ]; then
        wait "$beside"
        echo "== GPU tests (on GPU $((GPUS - 1)), beside the service)"
        tail -25 "$OUT/gpu_tests_beside.log"
    fi
fi

if has gpus; then
    echo "== runners over GPUs"
    timeout "${GPUS_LIMIT:-90}" python3 scripts/gpu_bench.py --out "$OUT" \
        --seconds "${SECONDS_PER_WINDOW:-1.5}" --only gpus >"$OUT/gpu_bench_gpus.log" 2>&1
    echo "gpu_bench gpus exit $?"
    timeout 60 python3 -m pytest -p no:cacheprovider -q tests/gpu/test_gpu_images.py \
        -k two_gpus >"$OUT/gpu_tests_two.log" 2>&1
    echo "two-GPU test exit $?"; tail -3 "$OUT/gpu_tests_two.log"
fi

echo
echo "================ results ================"
for log in "$OUT/gpu_bench.log" "$OUT/gpu_bench_gpus.log"; do
    [ -f "$log" ] || continue
    grep -E "^env:|^!!" "$log"
    sed -n '/^| model |/,$p' "$log"
done
for log in "$OUT"/http_*.log "$OUT"/service_*.log; do
    [ -f "$log" ] || continue
    case "$log" in *service_server.log|*service_repo.log) continue ;; esac
    echo "-- $(basename "$log")"
    grep -v -E "^\s*$" "$log"
done
[ -f "$OUT/service_metrics.txt" ] && cat "$OUT/service_metrics.txt"
[ -f "$OUT/unload.txt" ] && tail -12 "$OUT/unload.txt"
[ -f "$OUT/profile_summary.txt" ] && head -8 "$OUT/profile_summary.txt"
[ -f "$OUT/pyspy_b1.txt" ] && python3 scripts/pyspy_summary.py "$OUT/pyspy_b1.txt" --top 30 \
    >"$OUT/pyspy_summary.txt" 2>&1 && head -60 "$OUT/pyspy_summary.txt"
[ -f "$OUT/pyspy.log" ] && tail -3 "$OUT/pyspy.log"
[ -f "$OUT/service_server.log" ] && grep -E "loaded and warmed|ERROR|Traceback" "$OUT/service_server.log" | head -5
