"""What tracing every request costs: batch-1 req/s of a server with tracing off against the
same server tracing 100% of its requests (``OTEL_EXPORTER_OTLP_ENDPOINT`` at a receiver in
this process that reads each export and answers 200), both up side by side and measured in
alternating closed-loop rounds of binary V2 requests (``bench.loadgen``'s client process).

    python3 scripts/trace_cost.py --repository REPO --model tiny --concurrency 1,8 \\
        --seconds 3 --rounds 7 [--front-ends 2]

Prints first what the spans of one traced request cost in this process (the hooks alone, CPU
us on the request path and on the exporter's thread); then per step (closed loops of
``--concurrency`` clients, open loops at ``--rate`` req/s) the median req/s of each server,
the median of their per-round ratio (traced / off: the issue's bound is 0.95), and each
one's server CPU per request (every thread of every process, from /proc) and the median
ratio of those (off / traced: what req/s would be where the CPU is the limit). A benchmark,
not a test: the machine is shared, so compare within one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson

from bench import payloads
from bench.launch import free_port, is_ready, stoker_command, stop
from bench.loadgen import HttpTarget, Step, Workers
from scripts.request_budget import descendants, thread_times

TICK = os.sysconf("SC_CLK_TCK")


class Sink:
    """An OTLP/HTTP endpoint that takes every export and counts its bytes."""

    def __init__(self) -> None:
        self.received = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # kept alive, as collectors do

            def do_POST(self) -> None:
                sink.received += len(self.rfile.read(int(self.headers["Content-Length"])))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def launch(args: argparse.Namespace, env: dict[str, str]) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    command = stoker_command(Path(args.repository), args.model, None, port)
    if args.front_ends > 1:
        command += ["--front-ends", str(args.front_ends)]
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    log = tempfile.TemporaryFile()  # noqa: SIM115 (read where the server fails to start)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**base, **env})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while not is_ready(url):
        if process.poll() is not None or time.monotonic() > deadline:
            log.seek(0)
            raise RuntimeError(log.read()[-3000:].decode(errors="replace"))
        time.sleep(0.2)
    return url, process


def measured(workers: Workers, pid: int, step: Step) -> tuple[float, float]:
    """One step: req/s and the server's CPU per request (us)."""
    pids = descendants(pid)
    before = thread_times(pids)
    result = workers.run(step)
    after = thread_times(pids)
    used = sum(t - before.get(k, ("", 0))[1] for k, (_, t) in after.items())
    return result.throughput, used * 1e6 / TICK / max(result.requests, 1)


def span_path(sink: Sink, requests: int = 5000) -> tuple[float, float]:
    """CPU (us) the spans of one traced V2 request cost in one process: on the request path
    (the hooks of ``app.tracing`` as the front end, engine and batcher call them) and on the
    exporter's thread (written and sent), over ``requests`` of them, the best of 5 rounds."""
    import asyncio
    from types import SimpleNamespace

    from app import tracing
    from app.metrics import BatchTimes

    environ = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": sink.url,
        "OTEL_TRACES_SAMPLER": "always_on",
        "OTEL_BSP_SCHEDULE_DELAY": "600000",
        "OTEL_BSP_MAX_QUEUE_SIZE": str(requests * 10),  # none dropped in this tight loop
    }
    header = {"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01"}
    times = BatchTimes(1, 1, 1e-5, 1e-4, 1e-5)

    async def one(tracer: tracing.Tracing) -> None:
        incoming = tracing.Incoming(f"POST /v2/models/{sink.url[-4:]}/infer", dict(header))
        token = tracing.INCOMING.set(incoming)
        trace = tracer.request("tiny")
        assert trace is not None
        trace.stage("engine call")

        async def batch() -> None:
            pending = SimpleNamespace(traced=tracing.FRAME.get(), enqueued=time.monotonic())
            pending.requests = 1
            traced = tracer.batch([pending], 1)  # type: ignore[list-item]
            assert traced is not None
            traced.ran(times)

        await tracer.engine([trace.traceparent], batch())
        trace.stage("encode and write")
        tracing.INCOMING.reset(token)
        incoming.finish()

    async def many(tracer: tracing.Tracing) -> None:
        for _ in range(requests):
            await one(tracer)

    best_path, best_export = float("inf"), float("inf")
    for _ in range(5):
        tracing.configure("server", "warning", environ)
        tracer = tracing.tracer
        assert tracer is not None
        exporter_clock = time.pthread_getcpuclockid(tracer.exporter.thread.ident or 0)
        began, exported = time.thread_time(), time.clock_gettime(exporter_clock)
        asyncio.run(many(tracer))
        path = time.thread_time() - began
        assert tracer.exporter.flush()  # everything written and sent
        export = time.clock_gettime(exporter_clock) - exported
        tracing.shutdown()
        best_path, best_export = min(best_path, path), min(best_export, export)
    return best_path * 1e6 / requests, best_export * 1e6 / requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", required=True)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--front-ends", type=int, default=1)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--rate",
        default="",
        help="also open-loop (Poisson) steps at these req/s: the same requests to both, so "
        "their CPU per request compares what tracing adds with the machine's noise in both",
    )
    args = parser.parse_args()
    sink = Sink()
    path, export = span_path(sink)
    print(
        f"the spans of one traced request: {path:.1f} us of CPU on the request path, "
        f"{export:.1f} us on the exporter's thread",
        flush=True,
    )
    traced_env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": sink.url,
        "OTEL_TRACES_SAMPLER": "always_on",
    }
    off_url, off = launch(args, {})
    on_url, on = launch(args, traced_env)
    try:
        with urllib.request.urlopen(f"{off_url}/v2/models/{args.model}", timeout=10) as got:
            model = payloads.ModelInputs.from_metadata(orjson.loads(got.read()))
        images = payloads.synthetic_images(4, 320, 240)
        built = payloads.build("v2-binary", images, 1, 4, model, None, "http", None)
        path = f"/v2/models/{args.model}/infer"
        with (
            Workers(HttpTarget(off_url, path), built, 1) as a,
            Workers(HttpTarget(on_url, path), built, 1) as b,
        ):
            for workers in (a, b):
                workers.run(Step("closed", 1, 0.0, 1.0))
            steps = [
                (f"c={c}", Step("closed", c, 0.0, 0.5, args.seconds))
                for c in (int(v) for v in args.concurrency.split(",") if v)
            ]
            steps += [
                (f"{r:g} req/s offered", Step("open", 0, r, 0.5, args.seconds))
                for r in (float(v) for v in args.rate.split(",") if v)
            ]
            for label, step in steps:
                rates: dict[str, list[float]] = {"off": [], "on": []}
                cpu: dict[str, list[float]] = {"off": [], "on": []}
                for _ in range(args.rounds):
                    for key, workers, process in (("off", a, off), ("on", b, on)):
                        rate, used = measured(workers, process.pid, step)
                        rates[key].append(rate)
                        cpu[key].append(used)
                ratios = [t / o for t, o in zip(rates["on"], rates["off"], strict=True)]
                cpu_ratios = [o / t for t, o in zip(cpu["on"], cpu["off"], strict=True)]
                print(
                    f"{label}: off {statistics.median(rates['off']):,.0f} req/s "
                    f"({statistics.median(cpu['off']):,.0f} us CPU/request), 100% traced "
                    f"{statistics.median(rates['on']):,.0f} req/s "
                    f"({statistics.median(cpu['on']):,.0f} us); median ratio of req/s "
                    f"{statistics.median(ratios):.3f} ({', '.join(f'{r:.2f}' for r in ratios)}), "
                    f"of CPU/request off/traced {statistics.median(cpu_ratios):.3f}",
                    flush=True,
                )
        print(f"the receiver took {sink.received:,} bytes of spans")
    finally:
        stop(on)
        stop(off)


if __name__ == "__main__":
    main()
