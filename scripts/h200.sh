#!/usr/bin/env bash
# The one command the GPU machine runs: install the carried wheels, run the GPU tests, the
# raw-runner benchmarks and the service over HTTP (stoker bench), then print the tables.
#
#   bash scripts/h200.sh            (on the device, from the repository root; logs in $OUT)
#   SECTIONS=tests,raw bash scripts/h200.sh
#
# Wheels for what the machine lacks travel in .whl/ (see BENCHMARKS.md, "GPU (H200)").
set -u
OUT=${OUT:-/tmp/stoker-gpu}
SECTIONS=${SECTIONS:-tests,raw,http}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -V
    python3 -m pip list 2>/dev/null | grep -i -E \
        "^(torch|torchvision|cuda-bindings|cuda-python|nvidia-ml-py|onnx|onnxruntime|numpy|pytest) "
    nproc
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

has() { [[ ",$SECTIONS," == *",$1,"* ]]; }

if has tests; then
    echo "== GPU tests"
    timeout "${TESTS_LIMIT:-150}" python3 -m pytest -p no:cacheprovider -q --timeout 120 \
        tests/gpu tests/unit/test_cuda.py >"$OUT/gpu_tests.log" 2>&1
    echo "pytest exit $?"
    tail -25 "$OUT/gpu_tests.log"
fi

if has raw; then
    echo "== raw runner benchmarks"
    timeout "${RAW_LIMIT:-260}" python3 scripts/gpu_bench.py --out "$OUT" \
        --seconds "${SECONDS_PER_WINDOW:-1.5}" ${RAW_ONLY:+--only "$RAW_ONLY"} \
        >"$OUT/gpu_bench.log" 2>&1
    echo "gpu_bench exit $?"
fi

bench() {
    local limit=$1 name=$2
    shift 2
    timeout "$limit" python3 -m app bench --backend torch --payload v2-binary --workers 4 \
        --duration 4 --warmup 1 --json "$OUT/$name.json" "$@" >"$OUT/$name.log" 2>&1
    echo "$name exit $?"
}

if has http; then
    echo "== service over HTTP (stoker bench)"
    bench 100 http_resnet50_rows32 --serve --model resnet50 --rows 32 --concurrency 8,16,32
    bench 90 http_effnet_rows32 --serve --model efficientnet_lite0 --rows 32 --concurrency 8,16,32
    bench 110 http_effnet_b1_c256 --serve --naive --model efficientnet_lite0 --rows 1 \
        --concurrency 256 --duration 5 --warmup 2
fi

echo
echo "================ results ================"
if [ -f "$OUT/gpu_bench.log" ]; then
    grep -E "^env:|^!!" "$OUT/gpu_bench.log"
    sed -n '/^| model |/,$p' "$OUT/gpu_bench.log"
fi
for log in "$OUT"/http_*.log; do
    [ -f "$log" ] || continue
    echo "-- $(basename "$log")"
    grep -v -E "^\s*$" "$log" | tail -12
done
