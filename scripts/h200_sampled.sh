#!/usr/bin/env bash
# Where the service's processes spend their time at a load: the service as h200_ab.sh starts
# it (ResNet-50 FP16, gpu.compile none, FRONT_ENDS front ends), every Python thread of every
# process sampled (engines/sampler.py, STOKER_SAMPLE_DIR), one server start per load word of
# SAMPLED_LOADS (h200_ab.sh's payload:rows:clients; default jpeg:1:256 u8:1:256), then each
# record's summary by thread (scripts/pyspy_summary.py --by-thread), the throughput table last.
# The samples and the cores each process used (scripts/cpu_shares.py, *.cpu.txt) are taken in a
# window of the measured load alone: from WARMUP + 2 s after the client starts, for
# DURATION - 3 s (defaults 2 and 8), with the GPU's use (nvidia-smi dmon, *.gpu.txt); the
# decode and runner batch sizes from each server's /metrics. SAMPLED_VAR and SAMPLED_VALUES:
# h200_ab.sh's AB_VAR and AB_VALUES (default one server with frames_in_flight 4).
#
#   JPEG_IMAGES=$PWD/.carry/photos bash scripts/h200_sampled.sh
set -u
OUT=${OUT:-/tmp/stoker-gpu}
mkdir -p "$OUT"
export WARMUP=${WARMUP:-2} DURATION=${DURATION:-8}
window="sleep $((WARMUP + 2)); touch \$STOKER_SAMPLE_WHILE; \
    timeout $((DURATION - 3)) nvidia-smi dmon -s u -d 1 >\$LOAD_NAME.gpu.txt 2>&1 & \
    python3 scripts/cpu_shares.py \
    --seconds $((DURATION - 3)) >\$LOAD_NAME.cpu.txt 2>&1; rm -f \$STOKER_SAMPLE_WHILE"
for load in ${SAMPLED_LOADS:-jpeg:1:256 u8:1:256}; do
    name=${load//[:,]/_}
    mkdir -p "$OUT/$name/samples"
    STOKER_SAMPLE_DIR="$OUT/$name/samples" STOKER_SAMPLE_WHILE="$OUT/$name/window" \
        DURING_LOAD="$window" OUT="$OUT/$name" AB_VAR=${SAMPLED_VAR:-STOKER_SERVER__FRAMES_IN_FLIGHT} \
        AB_VALUES=${SAMPLED_VALUES:-4} ROUNDS=1 AB_LOADS="$load" bash "$(dirname "$0")/h200_ab.sh" >"$OUT/$name/ab.txt" 2>&1
done
source "$(dirname "$0")/h200_wheels.sh"
for load in ${SAMPLED_LOADS:-jpeg:1:256 u8:1:256}; do
    name=${load//[:,]/_}
    for record in "$OUT/$name"/samples/*.txt; do
        head -1 "$record"
        python3 scripts/pyspy_summary.py "$record" --by-thread --top "${TOP:-12}" \
            >"${record%.txt}.summary" 2>&1
    done
done
for load in ${SAMPLED_LOADS:-jpeg:1:256 u8:1:256}; do
    name=${load//[:,]/_}
    echo "## $load"
    for cpu in "$OUT/$name"/*.cpu.txt; do
        echo "### ${cpu##*/}"
        head -10 "$cpu"
        awk '!/^#/ { sm += $2; dec += $5; jpg += $6; n++ }
            END { if (n) printf "GPU: sm %.0f%%, nvdec %.0f%%, nvjpg %.0f%% (mean of %d s)\n", sm / n, dec / n, jpg / n, n }' \
            "${cpu%.cpu.txt}.gpu.txt"
    done
    for metrics in "$OUT/$name"/metrics_*.txt; do
        python3 - "$metrics" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
def mean(name):
    total = sum(float(v) for v in re.findall(rf"^{name}_sum{{[^}}]*}} (\S+)", text, re.M))
    count = sum(float(v) for v in re.findall(rf"^{name}_count{{[^}}]*}} (\S+)", text, re.M))
    return total / count if count else float("nan"), count
for name in ("stoker_image_decode_batch_size", "stoker_inference_batch_size"):
    m, n = mean(name)
    print(f"{sys.argv[1].rsplit('/', 1)[-1]}: {name} mean {m:.1f} over {n:.0f}")
PY
    done
    sed -n '/^| /,$p' "$OUT/$name/ab.txt"
done
