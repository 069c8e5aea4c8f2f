"""What tracing every request costs: batch-1 req/s of a server with tracing off against the
same server tracing 100% of its requests (``OTEL_EXPORTER_OTLP_ENDPOINT`` at a receiver in
this process that reads each export and answers 200), both up side by side and measured in
alternating closed-loop rounds of binary V2 requests (``bench.loadgen``'s client process).

    python3 scripts/trace_cost.py --repository REPO --model tiny --concurrency 1,8 \\
        --seconds 3 --rounds 7 [--front-ends 2]

Prints, per concurrency, the median req/s of each, the median of their per-round ratio
(traced / off: the issue's bound is 0.95), and each one's server CPU per request (every
thread of every process, from /proc). A benchmark, not a test: the machine is shared.
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


def measured(workers: Workers, pid: int, concurrency: int, seconds: float) -> tuple[float, float]:
    """One closed-loop step: req/s and the server's CPU per request (us)."""
    pids = descendants(pid)
    before = thread_times(pids)
    result = workers.run(Step("closed", concurrency, 0.5, seconds))
    after = thread_times(pids)
    used = sum(t - before.get(k, ("", 0))[1] for k, (_, t) in after.items())
    return result.throughput, used * 1e6 / TICK / max(result.requests, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", required=True)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--front-ends", type=int, default=1)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    sink = Sink()
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
            for c in (int(v) for v in args.concurrency.split(",")):
                rates: dict[str, list[float]] = {"off": [], "on": []}
                cpu: dict[str, list[float]] = {"off": [], "on": []}
                for _ in range(args.rounds):
                    for key, workers, process in (("off", a, off), ("on", b, on)):
                        rate, used = measured(workers, process.pid, c, args.seconds)
                        rates[key].append(rate)
                        cpu[key].append(used)
                ratios = [t / o for t, o in zip(rates["on"], rates["off"], strict=True)]
                print(
                    f"c={c}: off {statistics.median(rates['off']):,.0f} req/s "
                    f"({statistics.median(cpu['off']):,.0f} us CPU/request), 100% traced "
                    f"{statistics.median(rates['on']):,.0f} req/s "
                    f"({statistics.median(cpu['on']):,.0f} us); median ratio "
                    f"{statistics.median(ratios):.3f} ({', '.join(f'{r:.2f}' for r in ratios)})",
                    flush=True,
                )
        print(f"the receiver took {sink.received:,} bytes of spans")
    finally:
        stop(on)
        stop(off)


if __name__ == "__main__":
    main()
