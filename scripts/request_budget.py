"""A request's CPU budget on a running server, by stage: closed-loop binary V2 load from
``bench.loadgen``'s client processes, the server's CPU per request read from /proc (per
thread: the event loops, the runner threads, ONNX Runtime's own threads), and each event
loop's and runner thread's time split into the request path's stages by a py-spy record of
the same window taken with ``--gil`` (only samples of a thread holding the GIL: uvloop
waits for the network and ONNX Runtime computes without it, so what is left is the Python
work of the path).

    python3 scripts/request_budget.py --url http://127.0.0.1:8000 --pid PID --model tiny \\
        --rows 1 --concurrency 1,8 --seconds 6 [--grpc 127.0.0.1:8001]

``--grpc``: the load goes over gRPC (ModelInfer) to this address instead of HTTP.
``--protocols``: no profile; the same server's CPU per request over HTTP and over gRPC
(``--grpc``) in alternating rounds, and their ratio.

``--pid``: the server's first process (its front ends and engine process are its children
and are counted with it). A stage's microseconds are its share of a thread's GIL samples
times that thread's CPU per request; the rest of a thread's CPU (outside the GIL: socket
calls, the kernel, ONNX Runtime's kernels) is its ``native`` row. Needs py-spy on the PATH
or beside this Python (``pip install py-spy``) and the right to attach (root, or ptrace).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import payloads
from bench.grpc_client import GrpcTarget
from bench.loadgen import HttpTarget, Step, Workers

TICK = os.sysconf("SC_CLK_TCK")

# The deepest frame that names a stage decides a sample's stage (checked leaf first).
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("V2 decode + validate", ("decode_infer", "decode_request", "validate_inputs", "checked")),
    ("encode", ("encode_response", "Answer.encode", "infer_response_bytes")),
    ("output split + shape", ("shape_output", "classify (protocol")),
    ("batch assembly + run + split (runner)", ("run_batch",)),
    ("queue (batcher)", ("Batcher.",)),
    ("runner hand-off", ("RunnerPool.", "ThreadPoolExecutor", "_worker (thread", "Future.")),
    ("metrics", ("metrics.py", "Metrics.", "request_timed", "exposition")),
    (
        "crossing to the engine (client, wire)",
        (
            "LocalEngine.",
            "RemoteEngine.",
            "remote.py",
            "channel.py",
            "wire.py",
            "arena.py",
            "packing.py",
            "process.py",
            "links.py",
        ),
    ),
    ("gathering", ("Gatherer.", "Callers.", "gathering.py")),
    ("disconnect watch", ("unless_disconnected", "until_disconnected")),
    ("data plane", ("DataPlane.",)),
    ("HTTP write", ("Response.__call__", "RequestResponseCycle.send", "_send (", "answer (server")),
    (
        "HTTP parse + read body",
        (
            "httptools",
            "http_limits.py",
            "read_body",
            "receive",
            "limited (server",
            "Request.",
            "header_length",
        ),
    ),
    (
        "middleware + routing",
        (
            "InferFastPath",
            "BodyLimit",
            "ApiKeys",
            "BrowserGuard",
            "Middleware",
            "Starlette.",
            "FastAPI.",
            "infer_response",
            "plane_of",
            "client_of",
        ),
    ),
    ("gRPC", ("grpc",)),
]


def stage_and_frame(frames: list[str]) -> tuple[str, str]:
    """A sample's stage and the frame that named it (the deepest that names one)."""
    for frame in reversed(frames):
        for stage, marks in STAGES:
            if any(mark in frame for mark in marks):
                return stage, frame
    return "event loop, asyncio", frames[-1] if frames else "?"


def descendants(pid: int) -> list[int]:
    found, todo = [pid], [pid]
    while todo:
        parent = todo.pop()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                if int(stat[stat.rindex(")") + 2 :].split()[1]) == parent:
                    found.append(int(entry.name))
                    todo.append(int(entry.name))
    return found


def thread_times(pids: list[int]) -> dict[tuple[int, int], tuple[str, int]]:
    """(pid, tid) -> (thread name, utime + stime ticks)."""
    times = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                text = (task / "stat").read_text()
            except OSError:
                continue
            name = text[text.index("(") + 1 : text.rindex(")")]
            fields = text[text.rindex(")") + 2 :].split()
            times[(pid, int(task.name))] = (name, int(fields[11]) + int(fields[12]))
    return times


def py_spy() -> str:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else "py-spy"


def measure(args: argparse.Namespace, workers: Workers, concurrency: int) -> None:
    pids = descendants(args.pid)
    record = Path(tempfile.mkdtemp()) / "record.txt"
    spy = subprocess.Popen(
        [
            py_spy(),
            "record",
            "-p",
            str(args.pid),
            "--subprocesses",
            "--threads",
            "--gil",
            "--nonblocking",
            "-r",
            "250",
            "--format",
            "raw",
            "-o",
            str(record),
            "-d",
            str(int(args.seconds + 2)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.0)
    before = thread_times(pids)
    result = workers.run(Step("closed", concurrency, 0.0, 0.0, args.seconds))
    after = thread_times(pids)
    spy.wait()
    requests = max(result.requests, 1)
    samples: dict[str, Counter[str]] = defaultdict(Counter)
    lines: Counter[tuple[str, str]] = Counter()  # (frame naming the stage, leaf) of --lines
    kinds: dict[int, str] = {}
    for line in record.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        thread = next((f for f in frames if f.startswith("thread ")), "thread (0): ?")
        tid = int(thread[thread.index("(") + 1 : thread.index(")")], 0)
        kind = kinds.setdefault(tid, thread_kind(thread))
        frames = [f for f in frames if not f.startswith(("process ", "thread "))]
        stage, named = stage_and_frame(frames)
        samples[kind][stage] += int(count)
        if kind == "event loop" and stage in args.lines:
            lines[(named, frames[-1] if frames else "?")] += int(count)
    cpu: defaultdict[str, float] = defaultdict(float)
    for (pid, tid), (_, ticks) in after.items():
        used = ticks - before.get((pid, tid), ("", 0))[1]
        cpu[kinds.get(tid, "native (ONNX Runtime, ...)")] += used * 1e6 / TICK / requests
    print(
        f"\n## c={concurrency}, {args.rows} row(s): {result.throughput:,.1f} req/s, "
        f"p50 {result.latency_ms['p50']:.2f} ms; server CPU per request (us): "
        + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(cpu.items()))
        + f"; total {sum(cpu.values()):,.0f}"
    )
    for kind in ("event loop", "runner thread"):
        total = sum(samples[kind].values())
        if not total:
            continue
        print(f"| {kind}: stage | us/request | share of its GIL samples ({total}) |")
        print("| --- | ---: | ---: |")
        for stage, n in samples[kind].most_common():
            print(f"| {stage} | {cpu[kind] * n / total:,.1f} | {100 * n / total:.1f}% |")
    loop = sum(samples["event loop"].values())
    if lines and loop:
        print("| event loop: frame naming the stage / leaf frame | us/request |")
        print("| --- | ---: |")
        for (named, leaf), n in lines.most_common(20):
            print(f"| {named} / {leaf} | {cpu['event loop'] * n / loop:,.1f} |")


def thread_kind(thread: str) -> str:
    """``thread (TID): NAME`` of a py-spy record: an event loop (a process's main thread),
    a runner thread (the pool's executor names them after the model version) or another."""
    if thread.endswith("MainThread"):
        return "event loop"
    if "-fp" in thread or "-int8" in thread or "-bf16" in thread:
        return "runner thread"
    return "other Python thread"


def cpu_per_request(workers: Workers, pid: int, concurrency: int, seconds: float) -> float:
    """The server's CPU (every process and thread) per request over one closed-loop step."""
    pids = descendants(pid)
    before = thread_times(pids)
    result = workers.run(Step("closed", concurrency, 0.0, 0.0, seconds))
    after = thread_times(pids)
    used = sum(t - before.get(k, ("", 0))[1] for k, (_, t) in after.items())
    return used * 1e6 / TICK / max(result.requests, 1)


def compare(args: argparse.Namespace, built: list[payloads.Payload]) -> None:
    """``--against URL PID``: the two servers' CPU per request in alternating rounds (no
    profiler attached), and the median of each and of their ratio."""
    import statistics

    url_b, pid_b = args.against[0].rstrip("/"), int(args.against[1])
    path = f"/v2/models/{args.model}/infer"
    url = args.url.rstrip("/")
    with (
        Workers(HttpTarget(url, path), built, args.workers) as a,
        Workers(HttpTarget(url_b, path), built, args.workers) as b,
    ):
        for workers in (a, b):
            workers.run(Step("closed", 1, 0.0, 0.0, 1.0))
        for c in (int(v) for v in args.concurrency.split(",")):
            mine, theirs = [], []
            for _ in range(args.rounds):
                mine.append(cpu_per_request(a, args.pid, c, args.seconds))
                theirs.append(cpu_per_request(b, pid_b, c, args.seconds))
            ratios = [m / t for m, t in zip(mine, theirs, strict=True)]
            print(
                f"c={c}: {url} {statistics.median(mine):,.0f} us/request, {url_b} "
                f"{statistics.median(theirs):,.0f}; median ratio {statistics.median(ratios):.3f} "
                f"({', '.join(f'{r:.2f}' for r in ratios)})"
            )


def protocols(args: argparse.Namespace, model: payloads.ModelInputs) -> None:
    """``--protocols``: one server's CPU per request over HTTP, over gRPC's ModelInfer and
    over ModelStreamInfer streams (one a request in flight), in alternating rounds (no
    profiler attached), and the median of each and of each gRPC form's ratio to HTTP."""
    import statistics

    url = args.url.rstrip("/")
    images = payloads.synthetic_images(4, 320, 240)
    bodies = {
        name: payloads.build("v2-binary", images, args.rows, 4, model, None, name, None)
        for name in ("http", "grpc")
    }
    targets: dict[str, tuple[HttpTarget | GrpcTarget, str]] = {
        "HTTP": (HttpTarget(url, f"/v2/models/{args.model}/infer"), "http"),
        "gRPC": (GrpcTarget(args.grpc, url), "grpc"),
        "gRPC stream": (GrpcTarget(args.grpc, url, stream=True), "grpc"),
    }
    with contextlib.ExitStack() as stack:
        loads = {
            name: stack.enter_context(Workers(target, bodies[body], 1))
            for name, (target, body) in targets.items()
        }
        for workers in loads.values():
            workers.run(Step("closed", 1, 0.0, 0.0, 1.0))
        for c in (int(v) for v in args.concurrency.split(",")):
            used: dict[str, list[float]] = {name: [] for name in loads}
            for _ in range(args.rounds):
                for name, workers in loads.items():
                    used[name].append(cpu_per_request(workers, args.pid, c, args.seconds))
            medians = {name: statistics.median(values) for name, values in used.items()}
            ratios = {
                name: statistics.median([v / h for v, h in zip(values, used["HTTP"], strict=True)])
                for name, values in used.items()
                if name != "HTTP"
            }
            print(
                f"c={c}, {args.rows} row(s), us of server CPU a request (median of "
                f"{args.rounds}): "
                + ", ".join(f"{name} {value:,.0f}" for name, value in medians.items())
                + "; ÷ HTTP: "
                + ", ".join(f"{name} {value:.2f}" for name, value in ratios.items())
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument(
        "--against",
        nargs=2,
        metavar=("URL", "PID"),
        help="compare CPU per request with this server instead of profiling",
    )
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (--against)")
    parser.add_argument("--grpc", metavar="HOST:PORT", help="load over gRPC to this address")
    parser.add_argument(
        "--lines",
        action="append",
        default=[],
        metavar="STAGE",
        help="also list the event loop's samples of this stage by frame and leaf (repeatable)",
    )
    parser.add_argument(
        "--protocols", action="store_true", help="HTTP against gRPC (--grpc), no profile"
    )
    args = parser.parse_args()
    known = {stage for stage, _ in STAGES} | {"event loop, asyncio"}
    if set(args.lines) - known:
        parser.error(f"--lines takes a stage of: {', '.join(sorted(known))}")
    if args.protocols and not args.grpc:
        parser.error("--protocols needs --grpc")
    url = args.url.rstrip("/")
    with urllib.request.urlopen(f"{url}/v2/models/{args.model}", timeout=10) as response:
        model = payloads.ModelInputs.from_metadata(orjson.loads(response.read()))
    if args.protocols:
        protocols(args, model)
        return
    images = payloads.synthetic_images(4, 320, 240)
    protocol: payloads.ProtocolName = "grpc" if args.grpc else "http"
    built = payloads.build("v2-binary", images, args.rows, 4, model, None, protocol, None)
    if args.against:
        compare(args, built)
        return
    target: HttpTarget | GrpcTarget = (
        GrpcTarget(args.grpc, url)
        if args.grpc
        else HttpTarget(url, f"/v2/models/{args.model}/infer")
    )
    with Workers(target, built, args.workers) as workers:
        workers.run(Step("closed", 1, 0.0, 0.0, 1.0))  # connections and the model warm
        for c in (int(v) for v in args.concurrency.split(",")):
            measure(args, workers, c)


if __name__ == "__main__":
    main()
