"""``stoker bench``: measure one or more targets with the same payloads, in one run.

Targets, in the order given, the first being the one the others are compared with: ``--url``
(any V2 server, repeatable), ``--serve`` (a Stoker the bench starts), ``--naive`` (the naive
baseline the bench starts), ``--in-process`` (Stoker's batcher and runner pool with no
HTTP), ``--direct`` (the model's runner called directly, ``bench.direct``). ``--protocol
http,grpc`` measures each ``--url`` and ``--serve`` server over both protocols, one target
each (``stoker-http``, ``stoker-grpc``), against the same server process. Every step of the
concurrency sweep, then every fixed open-loop rate, runs on each target in turn
(``--rounds`` times over, for a median of each ratio on a noisy machine); the
``--find-rate`` search comes last, target by target.

The server's own cost, guarded: ``stoker bench --serve --direct --concurrency 1,8 --rounds
3`` prints Stoker ÷ ONNX Runtime called directly at c=1 and c=8 (binary V2, batch 1, the
embedded default), so a change that adds a millisecond a request shows.

Kept in one module (~560 lines): the options, the targets they plan, the payloads built once
for all of them and the loop that runs every step on each target are one flow that changes
together when a target or an option is added; the clients and the step are
``bench.loadgen``'s, the answers' check ``bench.answers``'s.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import orjson

from bench import answers, launch, payloads, report
from bench.direct import DirectTarget
from bench.grpc_client import GrpcTarget
from bench.loadgen import (
    HttpTarget,
    InProcessTarget,
    Step,
    StepResult,
    Target,
    Workers,
)
from bench.payloads import ModelInputs, Payload, ProtocolName
from engines.preprocess import ImagePreprocess

DEFAULT_MODEL = "efficientnet_lite0"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="stoker bench",
        description="Load-test KServe V2 servers: a closed-loop concurrency sweep, open-loop "
        "Poisson rates, and the rate that keeps p99 under a target. The first target is "
        "compared with the others.",
        epilog="From a source checkout: python -m bench ... (this command) and python -m bench "
        "accuracy ... (stoker accuracy).",
    )
    targets = parser.add_argument_group("targets (in this order; at least one)")
    targets.add_argument(
        "--url",
        action="append",
        default=[],
        help="a V2 server (repeatable); NAME=URL names it in the tables and plots",
    )
    targets.add_argument("--serve", action="store_true", help="start Stoker and measure it")
    targets.add_argument("--naive", action="store_true", help="start the naive baseline server")
    targets.add_argument(
        "--in-process",
        action="store_true",
        help="Stoker's batcher and runner pool in one client process, no HTTP and no codec "
        "(the raw baseline; it always uses one process, and its cpu column includes compute)",
    )
    targets.add_argument(
        "--direct",
        action="store_true",
        help="ONNX Runtime called directly: the model's runner as the server makes it, "
        "batches of c requests' rows back to back, no batcher and no HTTP (what the server "
        "would do if it cost nothing)",
    )
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=DEFAULT_MODEL, help=f"default {DEFAULT_MODEL}")
    model.add_argument("--model-version", help="version (precision) in the path and metrics")
    model.add_argument(
        "--repository",
        type=Path,
        default=Path("models"),
        help="model repository for --serve, --naive, --in-process and preprocessing",
    )
    model.add_argument("--backend", help="backend for the servers the bench starts")
    targets.add_argument(
        "--protocol",
        default="http",
        help="http, grpc, grpc-stream, or several (http,grpc,grpc-stream): how --url and "
        "--serve servers are measured; gRPC sends v2-binary as raw_input_contents and v2-json "
        "as typed contents, as ModelInfer calls or (grpc-stream) as messages of "
        "ModelStreamInfer streams, one a request in flight",
    )
    targets.add_argument(
        "--grpc-port",
        type=int,
        default=8001,
        help="the gRPC port of --url servers, on the URL's host (default 8001)",
    )
    load = parser.add_argument_group("payload")
    load.add_argument("--payload", choices=payloads.KINDS, default="v2-binary")
    load.add_argument("--rows", type=int, default=1, help="rows (images) per request")
    load.add_argument(
        "--uint8",
        action="store_true",
        help="send an image input as UINT8 pixels (resized and cropped, not normalised: a "
        "quarter of the bytes; the server normalises them)",
    )
    load.add_argument("--images", type=Path, help="folder of JPEG/PNG files (default synthetic)")
    load.add_argument("--image-size", default="640x480", help="synthetic images, WxH")
    load.add_argument("--distinct", type=int, default=16, help="distinct payloads to cycle")
    load.add_argument("--jpeg-path", default="/infer", help="upload route for --payload jpeg")
    steps = parser.add_argument_group("steps")
    steps.add_argument(
        "--concurrency",
        default="1,2,4,8,16,32",
        help="closed-loop sweep, comma-separated, or 'none' (default 1,2,4,8,16,32)",
    )
    steps.add_argument("--rate", action="append", type=float, default=[], help="open-loop req/s")
    steps.add_argument(
        "--find-rate", action="store_true", help="search the highest rate meeting --p99-target-ms"
    )
    steps.add_argument("--p99-target-ms", type=float, default=100.0)
    steps.add_argument("--search-steps", type=int, default=6, help="bisection steps")
    steps.add_argument("--duration", type=float, default=5.0, help="measured seconds per step")
    steps.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the sweep this many times over, interleaved across targets; the "
        "comparison gives each ratio's median",
    )
    steps.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds first")
    client = parser.add_argument_group("client")
    client.add_argument(
        "--workers",
        type=int,
        default=1,
        help="client processes sharing each step (one does some thousands of req/s)",
    )
    client.add_argument("--timeout", type=float, default=60.0, help="request timeout, seconds")
    client.add_argument(
        "--http-client",
        choices=("raw", "aiohttp"),
        default="raw",
        help="HTTP requests by the lean client (bench.http_wire: each request's bytes made "
        "once, about 0.2 ms of client CPU a 600 KB request) or by aiohttp (about 0.5 ms)",
    )
    client.add_argument("--max-in-flight", type=int, default=16384, help="open-loop cap")
    client.add_argument(
        "--check-answers",
        action="store_true",
        help="V2 tensors over HTTP and gRPC: send each distinct request alone first, then "
        "compare every answer under load with it row by row; one that differs is a "
        "'wrong-answer' error (bench.answers)",
    )
    client.add_argument(
        "--check-tolerance",
        type=float,
        default=0.02,
        help="--check-answers: a float row's largest relative error (L2) against its answer "
        "alone (default 0.02)",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", type=Path, help="write every result here")
    out.add_argument("--plots", type=Path, help="write throughput.png and latency.png here")
    args = parser.parse_args(argv)
    if not (args.url or args.serve or args.naive or args.in_process or args.direct):
        parser.error("give a target: --url URL, --serve, --naive, --in-process or --direct")
    if args.rows < 1 or args.workers < 1 or args.distinct < 1 or args.rounds < 1:
        parser.error("--rows, --workers, --distinct and --rounds must be at least 1")
    if args.direct and args.payload == "jpeg":
        parser.error("--direct runs tensors: use --payload v2-binary or v2-json")
    if args.duration <= 0 or args.warmup < 0:
        parser.error("--duration must be positive and --warmup not negative")
    args.protocols = protocols(args.protocol)
    if not args.protocols:
        parser.error(f"--protocol takes {', '.join(payloads.PROTOCOLS)}, comma-separated")
    if set(args.protocols) - {"http"} and args.payload == "jpeg":
        parser.error("gRPC has no image upload: use --payload v2-binary or v2-json with grpc")
    if args.check_answers and args.payload == "jpeg":
        parser.error("--check-answers compares V2 tensor answers: v2-binary or v2-json")
    if not args.check_tolerance > 0:
        parser.error("--check-tolerance must be positive")
    try:
        args.levels = levels(args.concurrency)
        width, height = (int(v) for v in args.image_size.lower().split("x"))
    except ValueError as exc:
        parser.error(str(exc))
    args.size = (width, height)
    return args


def levels(text: str) -> list[int]:
    if text.strip().lower() == "none":
        return []
    values = [int(v) for v in text.split(",") if v.strip()]
    if any(v < 1 for v in values):
        raise ValueError("concurrency levels must be positive")
    return values


def protocols(text: str) -> list[ProtocolName]:
    """The protocols named, in order, once each; empty if any is unknown."""
    chosen: list[ProtocolName] = []
    for value in (v.strip().lower() for v in text.split(",") if v.strip()):
        named = [name for name in payloads.PROTOCOLS if name == value]
        if not named:
            return []
        if named[0] not in chosen:
            chosen.append(named[0])
    return chosen


@dataclass(frozen=True)
class TargetPlan:
    name: str
    description: str
    launch: list[str] | None = None
    url: str | None = None
    port: int = 0
    grpc: str | None = None
    """Its gRPC address (host:port), where it serves gRPC."""
    direct: bool = False
    """The model's runner called directly (``bench.direct``), not the in-process pool."""


def plans(args: argparse.Namespace) -> list[TargetPlan]:
    result = []
    for i, given in enumerate(args.url):
        name, _, url = given.partition("=") if "=" in given.split("://")[0] else ("", "", given)
        name = name or ("target" if len(args.url) == 1 else f"target{i + 1}")
        host = urllib.parse.urlsplit(url).hostname or "127.0.0.1"
        address = f"{host}:{args.grpc_port}"
        result.append(TargetPlan(name, f"V2 server at {url}", url=url.rstrip("/"), grpc=address))
    if args.serve:
        port = launch.free_port()
        grpc_port = launch.free_port() if set(args.protocols) - {"http"} else 0
        command = launch.stoker_command(args.repository, args.model, args.backend, port, grpc_port)
        served = f"127.0.0.1:{grpc_port}" if grpc_port else None
        plan = TargetPlan("stoker", "Stoker started by the bench", command, port=port, grpc=served)
        result.append(plan)
    if args.naive:
        port = launch.free_port()
        command = launch.naive_command(args.repository, args.model, args.backend, port)
        result.append(TargetPlan("naive", "naive server: no batching", command, port=port))
    if args.in_process:
        result.append(
            TargetPlan("in-process", "Stoker's batcher + runner pool, no HTTP (raw runner)")
        )
    if args.direct:
        description = "ONNX Runtime called directly: batches of c rows, nothing around them"
        result.append(TargetPlan("direct", description, direct=True))
    return result


def fetch_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return orjson.loads(response.read())


def configured_preprocess(repository: Path, model: str, datatype: str) -> ImagePreprocess | None:
    """The model's own preprocessing when its config is in the local repository."""
    from app.engine.folders import ConfigError
    from app.engine.repository import load_config

    folder = repository / model
    if not (folder / "config.yaml").is_file():
        return None
    try:
        config = load_config(folder).config
    except ConfigError:
        return None
    return config.preprocess.with_datatype(datatype) if config.preprocess else None


def in_process_inputs(repository: Path, model: str) -> ModelInputs:
    from app.engine import models
    from app.engine.repository import discover

    spec = models.source(discover(repository, [model])[0]).spec
    return ModelInputs(spec.name, spec.inputs, spec.batched)


class PayloadCache:
    """Payloads are built once per kind and model contract, before anything is timed."""

    def __init__(self, args: argparse.Namespace) -> None:
        self._args = args
        self._built: dict[Any, list[Payload]] = {}
        if args.images is not None:
            self.images = payloads.folder_images(args.images, args.distinct * args.rows)
        else:
            # Requests of several rows get more images (each with 24 views, ``variant``), so
            # their rows differ; a few: each takes ~30 ms to make.
            self.images = payloads.synthetic_images(args.distinct * min(args.rows, 4), *args.size)

    def get(
        self, kind: Any, model: ModelInputs | None, protocol: ProtocolName = "http"
    ) -> list[Payload]:
        key = (kind, model, protocol)
        if key not in self._built:
            configured = None
            if model is not None and len(model.inputs) == 1:
                tensor = model.inputs[0]
                datatype = "UINT8" if self._args.uint8 else tensor.datatype
                configured = configured_preprocess(self._args.repository, model.name, datatype)
                if configured is None and self._args.uint8:
                    configured = replace(payloads.image_preprocess(tensor, None), datatype="UINT8")
            self._built[key] = payloads.build(
                kind,
                self.images,
                self._args.rows,
                self._args.distinct,
                model,
                configured,
                protocol,
                self._args.model_version,
            )
        return self._built[key]


def http_path(args: argparse.Namespace) -> str:
    if args.payload == "jpeg":
        return str(args.jpeg_path)
    version = f"/versions/{args.model_version}" if args.model_version else ""
    return f"/v2/models/{args.model}{version}/infer"


def find_rate(
    workers: Workers,
    capacity: float,
    args: argparse.Namespace,
    record: Callable[[StepResult], None],
) -> StepResult | None:
    """Bisect the open-loop rate between 0 and a little above the closed-loop capacity for
    the highest one whose p99 meets the target with no errors. Latency runs from each
    request's scheduled arrival, so a backlog (server or client) shows in the p99."""
    low, high = 0.0, max(capacity, 1.0) * 1.1
    best: StepResult | None = None
    for _ in range(args.search_steps):
        rate = (low + high) / 2
        result = workers.run(Step("open", 0, rate, args.warmup, args.duration))
        record(result)
        p99 = result.latency_ms["p99"]
        if p99 is not None and p99 <= args.p99_target_ms and not result.errors:
            low, best = rate, result
        else:
            high = rate
    return best


def start(
    plan: TargetPlan, args: argparse.Namespace, cache: PayloadCache, stack: ExitStack
) -> list[tuple[str, str, Workers]]:
    """Start a target (its server if the bench owns it, then client workers for each protocol
    it is measured over); the stack stops them. Each: its name, description and workers."""
    url = stack.enter_context(serving(plan))

    def workers(target: Target, chosen: list[Payload], count: int) -> Workers:
        made = Workers(target, chosen, count, args.max_in_flight, args.model, args.model_version)
        return stack.enter_context(made)

    if url is None:
        if args.check_answers:
            print(f"--check-answers: the answers of {plan.name} are not checked (no server)")
        inputs = in_process_inputs(args.repository, args.model)
        # Uploads are decoded in process by the model's handler; anything else goes in as
        # the tensors the engine takes.
        tensors = cache.get("jpeg" if args.payload == "jpeg" else "tensors", inputs)
        raw: Target
        if plan.direct:
            raw = DirectTarget(args.repository, args.model, args.backend, args.model_version)
        else:
            raw = InProcessTarget(args.repository, args.model, args.backend, args.model_version)
        return [(plan.name, plan.description, workers(raw, tensors, 1))]
    model: ModelInputs | None = None
    if args.payload != "jpeg":
        version = f"/versions/{args.model_version}" if args.model_version else ""
        model = ModelInputs.from_metadata(fetch_json(f"{url}/v2/models/{args.model}{version}"))
    started: list[tuple[str, str, Workers]] = []
    measured: list[ProtocolName] = args.protocols if plan.grpc is not None else ["http"]
    for protocol in measured:
        target: Target
        if protocol != "http" and plan.grpc is not None:
            stream = protocol == "grpc-stream"
            name = f"{plan.name}-{protocol}"
            way = "ModelStreamInfer streams" if stream else "gRPC"
            description = f"{plan.description}, {way} at {plan.grpc}"
            target = GrpcTarget(plan.grpc, url, args.timeout, stream)
        else:
            name = plan.name if len(measured) == 1 else f"{plan.name}-http"
            description, target = (
                plan.description,
                HttpTarget(url, http_path(args), args.timeout, args.http_client),
            )
        # A stream's messages are the ModelInferRequests of unary calls: built once.
        payload = cache.get(args.payload, model, "http" if protocol == "http" else "grpc")
        if args.check_answers and protocol == "http":
            payload = checked(f"{url}{http_path(args)}", payload, args, answers.reference)
        elif args.check_answers and plan.grpc is not None:
            payload = checked(plan.grpc, payload, args, answers.reference_grpc)
        started.append((name, description, workers(target, payload, args.workers)))
    return started


def checked(
    url: str,
    chosen: list[Payload],
    args: argparse.Namespace,
    reference: answers.Reference,
) -> list[Payload]:
    """``--check-answers``: the payloads with ``url``'s answers to each alone
    (``answers.reference`` over HTTP, ``answers.reference_grpc``), and a line on how far apart
    those answers are (a tolerance above it could not tell one request's row from
    another's)."""
    with_answers, apart = reference(url, chosen, args.check_tolerance, args.timeout)
    if apart is None:
        note = "no two requests' float rows to compare"
    else:
        closest, equal = apart
        verdict = "" if closest > 2 * args.check_tolerance else " (too close: lower the tolerance)"
        note = f"the closest two rows of different requests differ by {closest:.3g}{verdict}"
        if equal:
            note += f"; {equal} pairs of rows are the same input, not told apart"
    print(
        f"answers checked at {url}: {len(with_answers)} distinct requests answered alone; "
        f"tolerance {args.check_tolerance:g}, {note}",
        flush=True,
    )
    return with_answers


def measure(
    args: argparse.Namespace,
    cache: PayloadCache,
    results: list[report.TargetResult],
    show: Callable[[str, StepResult], None],
) -> None:
    """Every target is started first and stays up; each step then runs on every target in
    turn, so the targets compared at a step are measured minutes apart at most, under the
    same conditions, and a machine that drifts (other work, heat) skews them alike."""
    with ExitStack() as stack:
        live = []
        for plan in plans(args):
            for name, description, workers in start(plan, args, cache, stack):
                results.append(report.TargetResult(name, description))
                live.append((results[-1], workers))

        def record(result: report.TargetResult, step: StepResult) -> None:
            result.steps.append(step)
            show(result.name, step)

        steps = [Step("closed", c, 0.0, args.warmup, args.duration) for c in args.levels]
        steps += [Step("open", 0, rate, args.warmup, args.duration) for rate in args.rate]
        steps *= args.rounds
        for step in steps:
            for result, workers in live:
                record(result, workers.run(step))
        if not args.find_rate:
            return
        for result, workers in live:
            result.p99_target_ms = args.p99_target_ms
            capacity = max((s.throughput for s in result.steps), default=0.0)
            if not result.steps:
                probe = workers.run(Step("closed", 32, 0.0, args.warmup, args.duration))
                record(result, probe)
                capacity = probe.throughput
            result.found_rate = find_rate(workers, capacity, args, partial(record, result))
            found = result.found_rate
            rate = f"{found.step.rate:,.0f} req/s" if found else "none found"
            report.say(f"{result.name}: highest rate with p99 <= {args.p99_target_ms:g} ms: {rate}")


@contextlib.contextmanager
def serving(plan: TargetPlan) -> Iterator[str | None]:
    """The URL to measure (None for in-process), starting the server when the bench owns it."""
    if plan.launch is None:
        yield plan.url
        return
    with launch.running(plan.launch, plan.port) as url:
        yield url


def missing_extra() -> str | None:
    """What to install when the ``bench`` extra is not (``make serve`` installs only the
    service); None when it is."""
    import importlib.util

    missing = [name for name in ("aiohttp", "matplotlib") if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (
        f"stoker bench needs {' and '.join(missing)} (the bench extra): "
        f"{Path(sys.executable).parent / 'pip'} install -e '.[bench]' from the project folder"
    )


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    if arguments[:1] == ["accuracy"]:
        # ``python -m bench accuracy``: the accuracy report from a source checkout, where no
        # entry point names it for ``stoker accuracy``.
        from bench import accuracy_report

        return accuracy_report.main(arguments[1:])
    args = parse_args(argv)
    problem = missing_extra()
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    command = ["stoker", "bench", *(sys.argv[2:] if argv is None else argv)]
    try:
        cache = PayloadCache(args)
    except (OSError, ValueError) as exc:
        print(f"stoker bench: {exc}", file=sys.stderr)
        return 2
    report.say(
        f"stoker bench: model {args.model}, payload {args.payload}, {args.rows} row(s) per "
        f"request, {args.workers} client worker(s), {args.warmup:g} s warmup + "
        f"{args.duration:g} s per step"
    )
    report.say(report.header())

    def show(name: str, step: StepResult) -> None:
        report.say(report.row(name, step))
        for line in report.error_lines(name, step):
            report.say(line)

    results: list[report.TargetResult] = []
    # A plain SIGTERM would leave the servers the bench started running; exit through the
    # context managers instead, so they are stopped and finished targets are still written.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        measure(args, cache, results, show)
    except (OSError, ValueError, RuntimeError, urllib.error.URLError) as exc:
        print(f"stoker bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        if results:
            for line in report.comparison(results):
                report.say(line)
            settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
            if args.json:
                report.write_json(args.json, results, settings, command)
                report.say(f"wrote {args.json}")
            if args.plots:
                title = f"{args.model}, {args.payload}, {args.rows} row(s)/request"
                for path in report.write_plots(args.plots, results, title):
                    report.say(f"wrote {path}")
        signal.signal(signal.SIGTERM, previous)
    return 0
