#!/usr/bin/env bash
# Before and after a change in one call on the GPU machine: the service section of h200.sh
# (ResNet-50 FP16, FRONT_ENDS front ends: UINT8 32 images/request at c = 8/16/32 beside the
# in-process pool, JPEG 1/request, batch-1 UINT8 at c=256 against the naive server) from the
# tree in .before/ (carried: copy an older commit's app, engines, bench, scripts, zoo, models
# and pyproject.toml there), then from this tree, one after the other, with one engine store.
#
#   bash scripts/h200_compare.sh     (carry .whl and .before; COMPILE defaults to none here)
set -u
OUT=${OUT:-/tmp/stoker-gpu}
mkdir -p "$OUT"
source "$(dirname "$0")/h200_wheels.sh"
root=$PWD
for tree in before after; do
    dir=$root
    [ "$tree" = before ] && dir=$root/.before
    # A clean copy of the commit under test, where one is carried (git archive HEAD).
    [ "$tree" = after ] && [ -d "$root/.after" ] && dir=$root/.after
    echo "== $tree ($dir)"
    (cd "$dir" && OUT=$OUT/$tree SECTIONS=service FRONT_ENDS=${FRONT_ENDS:-4} \
        COMPILE=${COMPILE:-none} JPEG16_CONCURRENCY=none JPEG_CONCURRENCY=${JPEG_CONCURRENCY:-256} \
        U8_CONCURRENCY=${U8_CONCURRENCY:-8,16,32} READY_LIMIT=200 bash scripts/h200.sh) \
        >"$OUT/$tree.txt" 2>&1
    grep -E "exit|server ready" "$OUT/$tree.txt" | head -12
done
echo
echo "================ before / after ================"
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| run | target | load | before rows/s | after rows/s | after/before | p99 ms before / after |")
print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
for name in ("service_u8_rows32", "service_jpeg_rows1", "service_u8_rows1"):
    docs = {}
    for tree in ("before", "after"):
        path = out / tree / f"{name}.json"
        if path.exists():
            docs[tree] = json.loads(path.read_text())
    if len(docs) < 2:
        print(f"| {name} | missing: {sorted(docs)} | | | | | |")
        continue
    for target_b, target_a in zip(docs["before"]["targets"], docs["after"]["targets"]):
        for step_b, step_a in zip(target_b["steps"], target_a["steps"]):
            b, a = step_b["rows_per_s"], step_a["rows_per_s"]
            p99 = f"{step_b['latency_ms']['p99']:.0f} / {step_a['latency_ms']['p99']:.0f}"
            load = step_b["concurrency"] or f"rate {step_b['offered_rate']}"
            print(f"| {name} | {target_b['name']} | {load} | {b:,.0f} | {a:,.0f} | {a / b:.2f} | {p99} |")
PY
