#!/usr/bin/env bash
# Stoker against MLServer 1.7.1 on the CPU, V2 JSON (the format MLServer takes over REST), one
# image per request, the same ONNX file (EfficientNet-Lite0 FP32) on ONNX Runtime in both:
#
#   bash scripts/mlserver_compare.sh                        (from anywhere; needs .venv)
#   DURATION=3 WARMUP=1 bash scripts/mlserver_compare.sh    (a smoke run)
#   STOKER_FLAGS='--front-ends 2' bash scripts/mlserver_compare.sh
#   STOKER_AGAINST=/tmp/before bash scripts/mlserver_compare.sh   (another tree beside, e.g.
#       `git archive COMMIT | tar -x -C /tmp/before`: a third target in the same bench)
#
# What it does: makes (if missing) MLServer's own venv at MLSERVER_VENV (default /tmp/mlsenv;
# never the project's .venv) with mlserver==1.7.1, uvloop<0.22 (MLServer 1.7.1 does not start
# its parallel workers with uvloop 0.22), onnxruntime and numpy; writes a model folder for
# MLServer in a temporary directory (bench/mlserver/: the runtime, model-settings.json with
# adaptive batching max_batch_size 32 / max_batch_time 0.002, settings.json) pointing at
# Stoker's own models/efficientnet_lite0/model.onnx; starts MLServer (HTTP, gRPC and metrics
# each on a free port), then Stoker (`stoker serve`, free port), waits until both are ready,
# checks that both give the same top class for the same images, then runs ONE
# `stoker bench --url STOKER --url MLSERVER`: each concurrency step runs on Stoker, then on
# MLServer, with the same client and the same payloads. Both servers are stopped on exit.
#
# CPU threads: both servers see every core of the machine (nothing is pinned), and the bench
# client (one process) runs beside them.
#   Stoker:   one process by default (HTTP, JSON codec and batcher on one event loop); one
#             runner whose ONNX Runtime session has intra-op threads = os.cpu_count(), one
#             inter-op thread, no spinning (engines/backends/onnxruntime.py). Its INT8 version
#             is loaded too (idle), as `stoker serve` does by default; built on first start.
#   MLServer: the main process (uvicorn HTTP, request parsing, adaptive batcher; its gRPC and
#             metrics servers idle) and MLSERVER_WORKERS (default 1) inference worker
#             processes, each with one ONNX Runtime session of intra-op threads =
#             os.cpu_count() unless ORT_INTRA_OP_THREADS says otherwise; ONNX Runtime's own
#             spinning default unless ORT_ALLOW_SPINNING=0|1. debug (access log per request)
#             and gzip of answers are off: the fastest MLServer, not its defaults.
#
# Environment: DURATION or D (20 s measured per step), WARMUP or W (3 s), CONCURRENCY (8,32), OUT
# (build/mlserver-compare: compare.json, throughput.png, latency.png, logs), STOKER_FLAGS
# (extra `stoker serve` flags), STOKER_VENV (.venv), MLSERVER_VENV (/tmp/mlsenv),
# MLSERVER_PYTHON (python3, to create it), MLSERVER_WORKERS (1), ORT_INTRA_OP_THREADS,
# ORT_ALLOW_SPINNING (MLServer's runtime), STOKER_AGAINST (a second Stoker tree, served
# from its own folder with this venv, this repository's models and no gRPC), READY_TIMEOUT (900 s: Stoker's first start builds
# its INT8 version).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
MODEL=efficientnet_lite0
STOKER_VENV=${STOKER_VENV:-$ROOT/.venv}
MLSERVER_VENV=${MLSERVER_VENV:-/tmp/mlsenv}
MLSERVER_PYTHON=${MLSERVER_PYTHON:-python3}
MLSERVER_WORKERS=${MLSERVER_WORKERS:-1}
DURATION=${DURATION:-${D:-20}}
WARMUP=${WARMUP:-${W:-3}}
CONCURRENCY=${CONCURRENCY:-8,32}
OUT=${OUT:-$ROOT/build/mlserver-compare}
STOKER_FLAGS=${STOKER_FLAGS:-}
STOKER_AGAINST=${STOKER_AGAINST:-}
READY_TIMEOUT=${READY_TIMEOUT:-900}
PY=$STOKER_VENV/bin/python
export PYTHONUNBUFFERED=1

say() { printf '== %s\n' "$*"; }
die() { printf 'mlserver_compare: %s\n' "$*" >&2; exit 1; }

[[ -x $STOKER_VENV/bin/stoker ]] || die "no Stoker venv at $STOKER_VENV (run make serve first)"
[[ $(realpath -m "$MLSERVER_VENV") != $(realpath -m "$STOKER_VENV") ]] ||
    die "MLSERVER_VENV must not be Stoker's venv: MLServer stays out of the project's"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

# -- MLServer's own venv -----------------------------------------------------------------
mlserver_ready() {
    [[ -x $MLSERVER_VENV/bin/mlserver ]] || return 1
    "$MLSERVER_VENV/bin/python" - <<'EOF' 2>/dev/null
import importlib.metadata as md
import numpy, onnxruntime  # noqa: F401
assert md.version("mlserver") == "1.7.1"
assert tuple(int(p) for p in md.version("uvloop").split(".")[:2]) < (0, 22)
EOF
}
if ! mlserver_ready; then
    say "installing MLServer 1.7.1 into $MLSERVER_VENV"
    [[ -x $MLSERVER_VENV/bin/python ]] || "$MLSERVER_PYTHON" -m venv "$MLSERVER_VENV"
    "$MLSERVER_VENV/bin/python" -m pip install --quiet --upgrade pip
    "$MLSERVER_VENV/bin/python" -m pip install --quiet \
        'mlserver==1.7.1' 'uvloop<0.22' onnxruntime numpy
    mlserver_ready || die "MLServer's venv at $MLSERVER_VENV is not usable"
fi
# The bench's own extra (aiohttp, matplotlib) in Stoker's venv, as `stoker bench` asks.
"$PY" -c 'import aiohttp, matplotlib' 2>/dev/null ||
    "$STOKER_VENV/bin/pip" install --quiet -e "$ROOT[bench]"

# -- the model: Stoker's ONNX file, for both -----------------------------------------------
"$STOKER_VENV/bin/stoker" prepare --model "$MODEL" >/dev/null
ONNX=$ROOT/models/$MODEL/model.onnx
[[ -f $ONNX ]] || die "no $ONNX after stoker prepare"

# -- servers, stopped on every way out ---------------------------------------------------
WORK=$(mktemp -d -t mlserver-compare.XXXXXX)
MLS_PID=
STOKER_PID=
AGAINST_PID=

stop_server() {  # $1: pid (its own session: setsid), $2: name
    local pid=$1 name=$2 i
    [[ -n $pid ]] || return 0
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < 300; i++)); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            echo "mlserver_compare: $name did not stop in 30 s: killed" >&2
            kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    wait "$pid" 2>/dev/null || true
    # Its worker processes, should any outlive it (they share its process group).
    sleep 0.5
    kill -KILL -- "-$pid" 2>/dev/null || true
}
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    stop_server "$STOKER_PID" Stoker
    stop_server "$AGAINST_PID" "Stoker ($STOKER_AGAINST)"
    stop_server "$MLS_PID" MLServer
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

read -r MLS_HTTP MLS_GRPC MLS_METRICS STOKER_PORT AGAINST_PORT < <("$PY" - <<'EOF'
import socket
socks = [socket.socket() for _ in range(5)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
EOF
)
MLS_URL=http://127.0.0.1:$MLS_HTTP
STOKER_URL=http://127.0.0.1:$STOKER_PORT
AGAINST_URL=http://127.0.0.1:$AGAINST_PORT

# MLServer's model repository: settings.json, and the model folder with the runtime beside
# its model-settings.json (MLServer imports `runtime.OnnxRuntime` from there).
mkdir -p "$WORK/models/$MODEL"
cp bench/mlserver/runtime.py "$WORK/models/$MODEL/runtime.py"
"$PY" - "$WORK/models" "$MODEL" "$ONNX" "$MLS_HTTP" "$MLS_GRPC" "$MLS_METRICS" \
    "$MLSERVER_WORKERS" <<'EOF'
import json, sys
from pathlib import Path

root, model, onnx, http, grpc, metrics, workers = sys.argv[1:]
settings = json.loads(Path("bench/mlserver/settings.json").read_text())
settings.update(
    http_port=int(http), grpc_port=int(grpc), metrics_port=int(metrics),
    parallel_workers=int(workers),
    metrics_dir=f"{root}/.metrics", environments_dir=f"{root}/.envs",
)
model_settings = json.loads(Path("bench/mlserver/model-settings.json").read_text())
model_settings["name"] = model
model_settings.setdefault("parameters", {})["uri"] = onnx
Path(root, "settings.json").write_text(json.dumps(settings, indent=2) + "\n")
Path(root, model, "model-settings.json").write_text(json.dumps(model_settings, indent=2) + "\n")
EOF
cp "$WORK/models/settings.json" "$OUT/mlserver-settings.json"
cp "$WORK/models/$MODEL/model-settings.json" "$OUT/mlserver-model-settings.json"

wait_ready() {  # $1: url, $2: pid, $3: name, $4: log
    local deadline=$((SECONDS + READY_TIMEOUT))
    until curl -sf -o /dev/null "$1/v2/health/ready" &&
        curl -sf -o /dev/null "$1/v2/models/$MODEL/ready"; do
        if ! kill -0 "$2" 2>/dev/null || ((SECONDS > deadline)); then
            tail -40 "$4" >&2
            die "$3 did not become ready at $1 (log: $4)"
        fi
        sleep 0.5
    done
}

say "MLServer 1.7.1 at $MLS_URL (parallel_workers $MLSERVER_WORKERS; gRPC :$MLS_GRPC, metrics :$MLS_METRICS)"
(cd "$WORK" && exec setsid "$MLSERVER_VENV/bin/mlserver" start "$WORK/models") \
    >"$OUT/mlserver.log" 2>&1 &
MLS_PID=$!
wait_ready "$MLS_URL" "$MLS_PID" MLServer "$OUT/mlserver.log"

say "Stoker at $STOKER_URL (stoker serve ${STOKER_FLAGS:-with no extra flags})"
# shellcheck disable=SC2086  # STOKER_FLAGS is a list of flags
setsid "$STOKER_VENV/bin/stoker" serve --model "$MODEL" --port "$STOKER_PORT" \
    --log-level warning $STOKER_FLAGS >"$OUT/stoker.log" 2>&1 &
STOKER_PID=$!
wait_ready "$STOKER_URL" "$STOKER_PID" Stoker "$OUT/stoker.log"
URLS=(--url "stoker=$STOKER_URL" --url "mlserver=$MLS_URL")
if [[ -n $STOKER_AGAINST ]]; then
    AGAINST=$(cd "$STOKER_AGAINST" && pwd)
    say "Stoker from $AGAINST at $AGAINST_URL"
    # shellcheck disable=SC2086
    (cd "$AGAINST" && PYTHONPATH=$AGAINST exec setsid "$PY" -m app serve --model "$MODEL" \
        --repository "$ROOT/models" --port "$AGAINST_PORT" --grpc-port 0 \
        --log-level warning $STOKER_FLAGS) >"$OUT/stoker-against.log" 2>&1 &
    AGAINST_PID=$!
    wait_ready "$AGAINST_URL" "$AGAINST_PID" "Stoker ($AGAINST)" "$OUT/stoker-against.log"
    URLS+=(--url "against=$AGAINST_URL")
fi

# -- sanity: the same images give the same top class from both ----------------------------
say "sanity check: same input, same top class"
"$PY" - "$STOKER_URL" "$MLS_URL" "$MODEL" <<'EOF'
import io
import sys
import urllib.request
from pathlib import Path

import numpy as np
import orjson
from PIL import Image

from bench import payloads
from bench.cli import configured_preprocess
from engines.preprocess import preprocess

stoker, mlserver, model = sys.argv[1:]
prep = configured_preprocess(Path("models"), model, "FP32")
assert prep is not None, "no preprocessing in the model's config"
images = [("synthetic", data) for data in payloads.synthetic_images(3, 640, 480)]
try:
    from skimage import data as photos

    images.insert(0, ("coffee", photos.coffee()))
except ImportError:
    pass


def top(url: str, x: np.ndarray) -> np.ndarray:
    body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                        "data": x.ravel()}]}
    request = urllib.request.Request(
        f"{url}/v2/models/{model}/infer",
        data=orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = orjson.loads(response.read())
    (output,) = answer["outputs"]
    values = np.asarray(output["data"], dtype=np.float64).reshape(output["shape"])
    # Stoker's config applies softmax; MLServer's runtime returns the graph's logits.
    if not np.allclose(values.sum(axis=1), 1.0, atol=1e-3) or values.min() < 0:
        values = np.exp(values - values.max(axis=1, keepdims=True))
        values /= values.sum(axis=1, keepdims=True)
    return values


labels = (Path("models") / model / "labels.txt").read_text().splitlines()
failed = False
for name, image in images:
    pil = Image.fromarray(image) if isinstance(image, np.ndarray) else Image.open(io.BytesIO(image))
    x = preprocess(pil.convert("RGB"), prep)[None].astype(np.float32)
    a, b = top(stoker, x), top(mlserver, x)
    same = int(a.argmax()) == int(b.argmax())
    failed |= not same
    print(f"  {name:10} Stoker {labels[a.argmax()]!r} ({a.max():.4f})  MLServer "
          f"{labels[b.argmax()]!r} ({b.max():.4f})  max |dp| {np.abs(a - b).max():.1e}"
          f"  {'same' if same else 'DIFFERENT'}")
sys.exit(1 if failed else 0)
EOF

{
    date -u
    echo "nproc $(nproc); load average $(cut -d' ' -f1-3 /proc/loadavg)"
    grep -m1 'model name' /proc/cpuinfo || true
    echo "stoker serve --model $MODEL $STOKER_FLAGS"
    echo "mlserver $("$MLSERVER_VENV/bin/python" -c 'import mlserver; print(mlserver.__version__)')," \
        "parallel_workers $MLSERVER_WORKERS, ORT_INTRA_OP_THREADS=${ORT_INTRA_OP_THREADS:-all cores}," \
        "ORT_ALLOW_SPINNING=${ORT_ALLOW_SPINNING:-ORT default}"
    "$MLSERVER_VENV/bin/python" -m pip list 2>/dev/null |
        grep -i -E '^(mlserver|onnxruntime|numpy|uvloop|fastapi|uvicorn|pydantic|orjson) '
    echo "stoker = Stoker $STOKER_URL, mlserver = MLServer $MLS_URL"
    [[ -z $STOKER_AGAINST ]] || echo "against = Stoker from $AGAINST $AGAINST_URL"
} >"$OUT/servers.txt"

# -- one bench, the targets interleaved step by step ----------------------------------------
say "stoker bench: stoker, mlserver (1.7.1)${STOKER_AGAINST:+, against ($AGAINST)}"
"$STOKER_VENV/bin/stoker" bench "${URLS[@]}" --model "$MODEL" \
    --payload v2-json --rows 1 --concurrency "$CONCURRENCY" --duration "$DURATION" \
    --warmup "$WARMUP" --json "$OUT/compare.json" --plots "$OUT" | tee "$OUT/bench.txt"

"$PY" - "$OUT/compare.json" <<'EOF'
import json
import sys

document = json.load(open(sys.argv[1]))
stoker, mlserver, *against = (
    {s["concurrency"]: s for s in t["steps"] if s["mode"] == "closed"}
    for t in document["targets"]
)
print("\nStoker vs MLServer 1.7.1 (adaptive batching 32 / 2 ms), V2 JSON, 1 image/request")
print(f"{'clients':>7} {'Stoker req/s':>13} {'p99 ms':>8} {'MLServer req/s':>15} {'p99 ms':>8}"
      f" {'ratio':>7} {'errors':>7}" + ("  other tree req/s  p99 ms  this / other" if against else ""))


def p99(step):
    value = step["latency_ms"]["p99"]
    return "-" if value is None else f"{value:.1f}"


for c in sorted(set(stoker) & set(mlserver)):
    a, b = stoker[c], mlserver[c]
    ratio = a["throughput"] / b["throughput"] if b["throughput"] else float("inf")
    errors = f"{a['errors']}/{b['errors']}"
    line = (f"{c:>7} {a['throughput']:>13.1f} {p99(a):>8} {b['throughput']:>15.1f} {p99(b):>8}"
            f" {ratio:>6.2f}x {errors:>7}")
    if against and c in against[0]:
        o = against[0][c]
        line += (f"  {o['throughput']:>16.1f} {p99(o):>7} {a['throughput'] / o['throughput']:>12.2f}"
                 f" ({o['errors']} errors)")
    print(line)
print(f"load average at the end {document['machine']['load_average']}")
EOF
