#!/usr/bin/env bash
# Issue 42's A/B in one call on the GPU machine: the served default (ResNet-50 FP16 from
# scripts/gpu_repo.py, gpu.compile default, 4 runners, decode processes, front_ends auto)
# started from the last verified tree (carried in .gpu/$BASE: `git archive $BASE | tar -x -C
# .gpu/$BASE`; a tree other than this one is started with --front-ends 4, since a833e8c has no
# auto and serves one front end by default: name a later tree NAME=DIR#f8 to give it the 8 its
# own auto picks on 16 cores) and then from this tree, each with an engine store of its own, and the same client (this
# tree's bench) against each: UINT8 32 rows a request at c = U8_CONCURRENCY, batch 1 at
# c=256, and on this tree gRPC at both loads and the in-process pool (Stoker's batcher and
# runner pool, no HTTP, loaded from the store this tree's server filled) at the 32-row
# loads, and the naive server at batch 1. PYSPY=1: py-spy samples every process of this
# tree's server for 8 s of a 32-row c=32 load (pyspy_summary.txt). A table last.
#
#   BASE=a833e8c bash scripts/h200_hotpath.sh     (carry .whl and .gpu)
#
# TREES names every tree and its folder, the last verified one first and this tree (".")
# last, e.g. TREES="base=.gpu/a833e8c before=.gpu/before this=." (default: base, this); the
# trees named in SHARED_STORE share one engine store (trees of the same engine code: the
# second loads what the first built). The table has a column of each and this tree's
# ratio to each (without "this" in TREES, the last tree's). JPEG_IMAGES (a folder of real
# photos, >= 48): each tree's server also takes one photo a request at c =
# JPEG_CONCURRENCY (256), and CHAIN=1 runs the in-process chain probe
# (scripts/jpeg_decode_bench.py --chain, batches of 256) over this tree's store last;
# JPEG_ONLY=1 runs only the photos (the trees in TREES's order, "this" first or not); a
# tree named NAME=DIR@jpeg runs only the photos whatever JPEG_ONLY says (for "this" too: then
# no pool, gRPC or metrics either); NAME=DIR#fN starts that tree's server with N front ends
# (e.g. "f8=.#f8": this tree with 8); NAME=DIR:NAME=VALUE,... gives that server settings
# (e.g. "dt=.:STOKER_UPLOADS__DECODE_PROCESSES=0,STOKER_UPLOADS__DECODE_WORKERS=2"; after
# any @jpeg or #fN); REPO_ARGS_NAME (NAME a tree's) gives its model repository arguments of
# scripts/gpu_repo.py, e.g. TREES="... r2=.#f8 this=." REPO_ARGS_r2="--runners 2" with
# SHARED_STORE="r2 this" (runners and preferred sizes that are powers of two are not in the
# store's keys). WORKERS: the client's processes (4).
# Files: $OUT/h200_hotpath.tgz (scripts/h200_pack.sh; a 2026-12-07 call that wrote them into
# $OUT itself lost 30 of 38 to the device tool's 8-file limit).
set -u
OUT=${OUT:-/tmp/stoker-gpu}
source "$(dirname "$0")/h200_pack.sh"
source "$(dirname "$0")/h200_wheels.sh"
root=$PWD
base=${BASE:-a833e8c}
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
site=${PYTHONPATH:-}
python3 -V >"$OUT/env.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >>"$OUT/env.txt"
python3 -c "import torch; print('torch', torch.__version__)" >>"$OUT/env.txt"
git -C "$root" log --oneline -1 >>"$OUT/env.txt" 2>/dev/null
cat "$OUT/env.txt"
port=8125
url=http://127.0.0.1:$port

# Every HTTP and gRPC load's answers compared row by row with each request's answer alone (a
# 'wrong-answer' is an error in the table's statuses; bench.answers); CHECK=0: not compared.
check=()
[ "${CHECK:-1}" = 1 ] && check=(--check-answers)
bench() {  # name, limit, arguments: this tree's bench, against the server at $url
    local name=$1 limit=$2
    shift 2
    (cd "$root" && PYTHONPATH="$site${site:+:}$root" timeout "$limit" python3 -m bench \
        --url "$url" --backend torch --model resnet50 --repository "$repo" --model-version fp16 --uint8 \
        --payload v2-binary --workers "${WORKERS:-4}" --duration "${DURATION:-5}" --warmup "${WARMUP:-1.5}" \
        --json "$OUT/$name.json" "$@" >"$OUT/$name.log" 2>&1)
    echo "$name exit $?"
    pack
}

for entry in ${TREES:-base=.gpu/$base this=.}; do
    tree=${entry%%=*}
    spec=${entry#*=}
    settings=()
    if [[ $spec == *:* ]]; then  # DIR:NAME=VALUE,...: its server's settings
        IFS=, read -r -a settings <<<"${spec#*:}"
        spec=${spec%%:*}
    fi
    only=${JPEG_ONLY:-0}
    if [[ $spec == *@jpeg ]]; then  # this tree's server takes only the photos
        only=1
        spec=${spec%@jpeg}
    fi
    fronts=""
    if [[ $spec == *#f* ]]; then  # DIR#fN: this server with N front ends
        fronts=${spec##*#f}
        spec=${spec%#f*}
    fi
    dir=$root/$spec
    extra=()
    if [ -n "$fronts" ]; then
        extra=(--front-ends "$fronts")
    elif [ "$tree" != this ]; then
        extra=(--front-ends 4)
    fi
    repo=/tmp/stoker-repo-$tree
    export STOKER_STORE__PATH=/tmp/stoker-store-$tree
    [[ " ${SHARED_STORE:-} " == *" $tree "* ]] && export STOKER_STORE__PATH=/tmp/stoker-store-shared
    repo_args_var=REPO_ARGS_$tree
    read -r -a repo_args <<<"${!repo_args_var:-}"
    (cd "$dir" && PYTHONPATH="$site${site:+:}$dir" python3 scripts/gpu_repo.py "$repo" \
        --compile default "${repo_args[@]}" >"$OUT/repo_$tree.log" 2>&1)
    t0=$(date +%s.%N)
    (cd "$dir" && PYTHONPATH="$site${site:+:}$dir" STOKER_MODELS__BACKEND=torch \
        exec env "${settings[@]}" timeout 500 python3 -m app serve --repository "$repo" --model resnet50 \
        --port $port "${extra[@]}") >"$OUT/server_$tree.log" 2>&1 &
    server=$!
    for _ in $(seq 1 1200); do
        curl -sf "$url/v2/health/ready" >/dev/null && break
        kill -0 $server 2>/dev/null || break
        sleep 0.2
    done
    echo "$tree ($dir): ready in $(python3 -c "import time; print(f'{time.time() - $t0:.1f}')") s"
    grep -h -E "front end|Traceback|Error" "$OUT/server_$tree.log" | head -3 | cut -c1-200
    if [ -n "${JPEG_IMAGES:-}" ]; then  # one photo a request, multipart POST /infer
        bench "${tree}_jpeg" 60 --payload jpeg --images "$JPEG_IMAGES" --distinct 48 --rows 1 \
            --concurrency "${JPEG_CONCURRENCY:-256}"
    fi
    if [ "$only" = 1 ]; then
        kill -TERM $server 2>/dev/null
        wait $server
        continue
    fi
    bench "${tree}_u8_rows32" 150 --rows 32 --concurrency "${U8_CONCURRENCY:-8,16,32,64,128}" "${check[@]}"
    if [ "$tree" = this ]; then
        bench "${tree}_u8_rows1" 60 --rows 1 --concurrency 256 --naive "${check[@]}"
        bench "${tree}_grpc" 60 --protocol grpc --rows 32 --concurrency 32 "${check[@]}"
        bench "${tree}_grpc_rows1" 60 --protocol grpc --rows 1 --concurrency 256 "${check[@]}"
        bench "${tree}_grpc_stream_rows1" 60 --protocol grpc-stream --rows 1 --concurrency 256 "${check[@]}"
        if [ "${PYSPY:-0}" = 1 ] && command -v py-spy >/dev/null; then
            py-spy record --pid $server --subprocesses --threads --nonblocking --rate 97 \
                --duration 8 --format raw -o "$OUT/pyspy_rows32.txt" >"$OUT/pyspy.log" 2>&1 &
            spy=$!
            DURATION=9 WARMUP=0.5 bench "${tree}_spied" 40 --rows 32 --concurrency 32
            wait $spy
        fi
        curl -s "$url/metrics" >"$OUT/metrics_$tree.txt"
        kill -TERM $server 2>/dev/null
        wait $server
        # The in-process pool over the store this server filled, no server beside it.
        (cd "$root" && PYTHONPATH="$site${site:+:}$root" STOKER_MODELS__BACKEND=torch \
            timeout 200 python3 -m bench --in-process --backend torch --model resnet50 --repository "$repo" \
            --model-version fp16 --uint8 --payload v2-binary --workers 4 --rows 32 \
            --concurrency "${U8_CONCURRENCY:-8,16,32,64,128}" --duration "${DURATION:-5}" \
            --warmup "${WARMUP:-1.5}" --json "$OUT/pool_u8_rows32.json" >"$OUT/pool.log" 2>&1)
        echo "pool exit $?"
        pack
    else
        bench "${tree}_u8_rows1" 60 --rows 1 --concurrency 256 "${check[@]}"
        kill -TERM $server 2>/dev/null
        wait $server
    fi
done
if [ -n "${JPEG_IMAGES:-}" ] && [ "${CHAIN:-0}" = 1 ]; then
    export STOKER_STORE__PATH=/tmp/stoker-store-this
    [[ " ${SHARED_STORE:-} " == *" this "* ]] && export STOKER_STORE__PATH=/tmp/stoker-store-shared
    (cd "$root" && PYTHONPATH="$site${site:+:}$root" timeout 150 python3 scripts/jpeg_decode_bench.py \
        "$JPEG_IMAGES" --batches 256 --processes "" --threads "" --no-profile \
        --chain "$STOKER_STORE__PATH" --json "$OUT/chain.json" >"$OUT/chain.log" 2>&1)
    echo "chain exit $?"
    pack
    tail -4 "$OUT/chain.log"
fi
[ -f "$OUT/pyspy_rows32.txt" ] && python3 scripts/pyspy_summary.py "$OUT/pyspy_rows32.txt" \
    --top 40 >"$OUT/pyspy_summary.txt" 2>&1
python3 - "$OUT" ${TREES:-base=.gpu/$base this=.} <<'PY' | tee "$OUT/table.md"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
names = [entry.split("=")[0] for entry in sys.argv[2:]]
# The ratios are of "this" tree to each other; without "this" in TREES, of the last tree.
ref = "this" if "this" in names or not names else names[-1]
others = [name for name in names if name != ref]
rates: dict[tuple[str, str, int], tuple[float, float]] = {}
for path in sorted(out.glob("*.json")):
    document = json.loads(path.read_text())
    if not isinstance(document, dict) or "targets" not in document:
        continue  # chain.json: the chain probe's own figures
    for target in document["targets"]:
        for step in target["steps"]:
            key = (path.stem, target["name"], step["concurrency"])
            rates[key] = (step["rows_per_s"], step["latency_ms"]["p99"])
heads = [f"{o} img/s" for o in others] + [f"{ref} img/s"] + [f"{ref} / {o}" for o in others]
heads += ["pool img/s", f"{ref} / pool", "p99 ms " + " / ".join(others + [ref])]
print("| load | c | " + " | ".join(heads) + " |")
print("| --- | ---: |" + " ---: |" * len(heads))
def one(stem: str, c: int, name: str = "stoker") -> tuple[float, float] | None:
    for (s, t, cc), v in rates.items():
        if s == stem and cc == c and (t == name or name == "*"):
            return v
    return None
for stem, label in (
    ("u8_rows32", "UINT8 32 rows"), ("u8_rows1", "UINT8 1 row"), ("jpeg", "JPEG 1 photo")
):
    cs = sorted({c for (s, _, c) in rates if s in {f"{n}_{stem}" for n in names}})
    for c in cs:
        got = {o: one(f"{o}_{stem}", c, "target") for o in others}
        t = one(f"{ref}_{stem}", c, "target")
        p = one(f"pool_{stem}", c, "in-process")
        cells = [f"{got[o][0]:,.0f}" if got[o] else "-" for o in others]
        cells.append(f"{t[0]:,.0f}" if t else "-")
        cells += [f"{t[0] / got[o][0]:.2f}" if got[o] and t else "-" for o in others]
        cells += [f"{p[0]:,.0f}" if p else "-", f"{t[0] / p[0]:.2f}" if p and t else "-"]
        cells.append(" / ".join(f"{v[1]:.0f}" if v else "-" for v in [*got.values(), t]))
        print(f"| {label} | {c} | " + " | ".join(cells) + " |")
for (s, t, c), (r, p99) in sorted(rates.items()):
    if "grpc" in s or t == "naive" or s.endswith("spied"):
        print(f"| {s} {t} | {c} | | {r:,.0f} | | | | p99 {p99:.0f} |")
PY
