#!/usr/bin/env bash
# Where the service's processes spend their time at a load: the service as h200_ab.sh starts
# it (ResNet-50 FP16, gpu.compile none, FRONT_ENDS front ends), every Python thread of every
# process sampled (engines/sampler.py, STOKER_SAMPLE_DIR), one server start per load word of
# SAMPLED_LOADS (h200_ab.sh's payload:rows:clients; default jpeg:1:256 u8:1:256), then each
# record's summary by thread (scripts/pyspy_summary.py --by-thread), the throughput table last.
# The samples and the cores each process used (scripts/cpu_shares.py, *.cpu.txt) are taken in a
# window of the measured load alone: from WARMUP + 2 s after the client starts, for
# DURATION - 3 s (defaults 2 and 8).
#
#   JPEG_IMAGES=$PWD/.carry/photos bash scripts/h200_sampled.sh
set -u
OUT=${OUT:-/tmp/stoker-gpu}
mkdir -p "$OUT"
export WARMUP=${WARMUP:-2} DURATION=${DURATION:-8}
window="sleep $((WARMUP + 2)); touch \$STOKER_SAMPLE_WHILE; python3 scripts/cpu_shares.py \
    --seconds $((DURATION - 3)) >\$LOAD_NAME.cpu.txt 2>&1; rm -f \$STOKER_SAMPLE_WHILE"
for load in ${SAMPLED_LOADS:-jpeg:1:256 u8:1:256}; do
    name=${load//[:,]/_}
    mkdir -p "$OUT/$name/samples"
    STOKER_SAMPLE_DIR="$OUT/$name/samples" STOKER_SAMPLE_WHILE="$OUT/$name/window" \
        DURING_LOAD="$window" OUT="$OUT/$name" AB_VAR=STOKER_SERVER__FRAMES_IN_FLIGHT \
        AB_VALUES=4 ROUNDS=1 AB_LOADS="$load" bash "$(dirname "$0")/h200_ab.sh" >"$OUT/$name/ab.txt" 2>&1
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
    head -12 "$OUT/$name"/*.cpu.txt
    tail -3 "$OUT/$name/ab.txt"
done
