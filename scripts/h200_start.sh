#!/usr/bin/env bash
# Start to ready of the served default on the GPU machine (ResNet-50 FP16 of scripts/gpu_repo.py,
# gpu.compile default, the GPU default of runners, front_ends auto, the decode processes),
# for one or more trees: per tree, from an empty engine store, then restarted with the store it
# filled (STARTS, default empty,filled,filled). Every start has an empty Inductor cache of its
# own, so only the engine store carries compiled code. After each start one batch of 8 UINT8
# images is inferred over HTTP; its logits are kept and every start's compared with the first's.
# The servers' logs are joined in $OUT/starts.log. Then, in the first tree, the compiled
# package's CUDA-graph replay rate against the uncompiled graph's at batch 32 and 256
# (scripts/gpu_start_check.py).
#
#   TREES="start=.gpu/start base=.gpu/base" bash .gpu/start/scripts/h200_start.sh   (from the
#   checkout's root on the GPU machine, wheels installed; logs to $OUT)
#
# START_LIMIT: seconds a start may take (240); BUDGET: seconds after which no further tree
# starts (330); CHECK (1: the replay check).
set -u
OUT=${OUT:-/tmp/stoker-start}
mkdir -p "$OUT"
work=/tmp/stoker-start-work
rm -rf "$work" && mkdir -p "$work"
export PYTHONUNBUFFERED=1
root=$PWD
began=$(date +%s)
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -V
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    nproc
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

first=""
for pair in ${TREES:-start=.}; do
    label=${pair%%=*}
    tree=$root/${pair#*=}
    first=${first:-$label}
    if (( $(date +%s) - began > ${BUDGET:-330} )) && [[ $label != "$first" ]]; then
        echo "== $label: skipped (past the budget of ${BUDGET:-330} s)"
        continue
    fi
    echo "== $label ($tree): $(git -C "$tree" log -1 --format=%h 2>/dev/null || cat "$tree/COMMIT" 2>/dev/null)"
    repo=/tmp/stoker-repo-$label
    store=/tmp/stoker-store-$label
    rm -rf "$store" "$repo"
    (cd "$tree" && PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$tree" python3 scripts/gpu_repo.py "$repo" \
        >"$work/repo_$label.log" 2>&1)
    i=0
    for start in ${STARTS:-empty filled filled}; do
        i=$((i + 1))
        log=$work/${label}_$i.log
        t0=$(date +%s.%N)
        (cd "$tree" && TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-$label-$i STOKER_STORE__PATH=$store \
            PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$tree" STOKER_MODELS__BACKEND=torch \
            exec timeout "${START_LIMIT:-240}" python3 -m app serve --repository "$repo" \
            --model resnet50 --port 8124) >"$log" 2>&1 &
        pid=$!
        until curl -sf http://127.0.0.1:8124/v2/health/ready >/dev/null; do
            kill -0 $pid 2>/dev/null || break
            sleep 0.1
        done
        t1=$(date +%s.%N)
        echo "$label $i ($start store): ready in $(python3 -c "print(f'{$t1 - $t0:.1f}')") s"
        grep -E "engine store|compil|loaded and warmed|ready:|Traceback|Error" "$log" | cut -c1-400 | tail -8
        python3 "$(dirname "$0")/gpu_start_check.py" answer 8124 \
            "$work/answers_${label}_$i.json" 2>&1 | tail -2
        kill -TERM $pid 2>/dev/null
        wait $pid
        { echo "==== $label $i ($start store)"; cat "$log"; } >>"$OUT/starts.log"
    done
    du -sh "$store" | sed "s/^/store: /"
done
python3 "$(dirname "$0")/gpu_start_check.py" compare "$work" 2>&1 | tail -12
if [[ ${CHECK:-1} == 1 ]]; then
    echo "== replay: the compiled package against the uncompiled graph ($first's store)"
    (cd "$(dirname "$0")/.." && PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" timeout 150 \
        python3 scripts/gpu_start_check.py replay "/tmp/stoker-store-$first") 2>&1 | tail -12
fi
echo "total $(( $(date +%s) - began )) s"
