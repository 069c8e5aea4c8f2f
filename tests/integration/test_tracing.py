"""OpenTelemetry traces and Triton's trace and logging extensions, for real: ``stoker serve``
with two front ends and gRPC, configured by ``OTEL_*`` alone, exporting over OTLP/HTTP to a
receiver in this process that decodes opentelemetry-proto's ``ExportTraceServiceRequest``.

A V2 request and an image upload carrying a ``traceparent`` come back as one trace each, the
client's, with spans from a front end and from the engine process, in order, the batch
linked; each request of a gRPC stream is a span of its own under the stream's context; the
spans go over OTLP/gRPC as well; the trace-setting APIs change the sampling over HTTP and
gRPC (tritonclient), the log settings reach every process, and the extensions Stoker lacks
answer a JSON error over HTTP.
"""

from __future__ import annotations

import itertools
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
import tritonclient.utils.shared_memory as shm
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from bench.launch import free_port
from tests.conftest import configure, tiny_model
from tests.integration.conftest import Server, metric_samples, start_server, stop_server

WAIT_S = 60.0


@dataclass(frozen=True)
class Received:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    links: tuple[str, ...]
    """The span ids it links to."""
    attributes: dict[str, Any]
    resource: dict[str, Any]


def value_of(any_value: Any) -> Any:
    which = any_value.WhichOneof("value")
    return getattr(any_value, which) if which else None


class Receiver:
    """An OTLP/HTTP trace endpoint: every span posted to ``/v1/traces``, decoded."""

    def __init__(self) -> None:
        self.spans: list[Received] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                receiver.add(request)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, request: ExportTraceServiceRequest) -> None:
        found = []
        for resource_spans in request.resource_spans:
            resource = {a.key: value_of(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    found.append(
                        Received(
                            span.name,
                            span.trace_id.hex(),
                            span.span_id.hex(),
                            span.parent_span_id.hex(),
                            span.start_time_unix_nano,
                            span.end_time_unix_nano,
                            tuple(link.span_id.hex() for link in span.links),
                            {a.key: value_of(a.value) for a in span.attributes},
                            resource,
                        )
                    )
        with self.lock:
            self.spans.extend(found)

    def wait_for(self, done: Callable[[list[Received]], bool]) -> list[Received]:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            with self.lock:
                spans = list(self.spans)
            if done(spans):
                return spans
            time.sleep(0.05)
        raise AssertionError(f"not received in {WAIT_S:g} s: {[s.name for s in spans]}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass(frozen=True)
class Traced:
    server: Server
    grpc: str
    """Its gRPC address."""

    def revisions(self) -> dict[str, int]:
        """Per process, the latest revision of the trace and log settings it logged."""
        found: dict[str, int] = {}
        for who, revision in SETTINGS_LINE.findall(self.server.log.read_text()):
            found[who] = max(found.get(who, 0), int(revision))
        return found

    def wait_adopted(self) -> None:
        """Until every process runs with the engine's latest settings."""

        def agree() -> bool:
            got = self.revisions()
            return len(got) == 3 and len(set(got.values())) == 1

        deadline = time.monotonic() + WAIT_S
        while not agree():
            assert time.monotonic() < deadline, self.revisions()
            time.sleep(0.05)


SETTINGS_LINE = re.compile(r" (engine|front-end-\d) app\.observed: settings of revision (\d+)")


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    running = Receiver()
    yield running
    running.close()


@pytest.fixture(scope="module")
def traced(
    tmp_path_factory: pytest.TempPathFactory, receiver: Receiver, efficientnet_dir: Path
) -> Iterator[Traced]:
    repo = tmp_path_factory.mktemp("traced") / "repository"
    for name in ("tiny", "other"):
        tiny_model(repo / name)
    # The image classifier for uploads, FP32 alone (no calibration at the start).
    shutil.copytree(efficientnet_dir, repo / "efficientnet_lite0")
    configure(repo / "efficientnet_lite0", {"precisions": ["fp32"]})
    env = {
        "STOKER_MODELS__DEFAULT_MODEL": "efficientnet_lite0",
        "STOKER_SERVER__FRONT_ENDS": "2",
        "STOKER_SERVER__GRPC_PORT": str(free_port()),
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_SERVICE_NAME": "stoker-under-test",
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }
    server = start_server(repo, repo.parent / "server.log", env)
    yield Traced(server, f"127.0.0.1:{env['STOKER_SERVER__GRPC_PORT']}")
    code = stop_server(server)
    assert code == 0, f"exit {code}:\n{server.log.read_text()[-3000:]}"


def infer(client: httpx.Client, server: Server, model: str, headers: dict[str, str]) -> None:
    """One V2 request of one row to ``model``, answered 200."""
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1] * 4}]}
    answer = client.post(f"{server.url}/v2/models/{model}/infer", json=body, headers=headers)
    assert answer.status_code == 200, answer.text


def rendered(spans: list[Received]) -> str:
    """One trace as a tree, each span with its process, start and duration (README's
    "Tracing" shows one so)."""
    by_parent: dict[str, list[Received]] = {}
    for span in sorted(spans, key=lambda s: s.start_ns):
        by_parent.setdefault(span.parent_id, []).append(span)
    ids = {s.span_id for s in spans}
    start = min(s.start_ns for s in spans)
    lines: list[str] = []

    def add(span: Received, depth: int) -> None:
        process = f"{span.resource['stoker.process']} pid {span.resource['process.pid']}"
        shown = {k: v for k, v in span.attributes.items() if k != "model"}
        extra = " ".join(f"{k}={v}" for k, v in shown.items())
        if span.links:
            extra += " (linked)"
        at = f"+{(span.start_ns - start) // 1000} us"
        took = f"{(span.end_ns - span.start_ns) // 1000} us"
        lines.append(
            f"{'  ' * depth + span.name:<22} {process:<20} {at:<10} {took:>8}  {extra}".rstrip()
        )
        for child in by_parent.get(span.span_id, []):
            add(child, depth + 1)

    for span in sorted(spans, key=lambda s: s.start_ns):
        if span.parent_id not in ids:
            add(span, 0)
    return "\n".join(lines)


def a_traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def test_a_request_is_one_trace_across_the_front_end_and_the_engine(
    traced: Traced, receiver: Receiver
) -> None:
    header, trace_id, client_span = a_traceparent()
    with httpx.Client(timeout=30) as client:
        infer(client, traced.server, "tiny", {"traceparent": header, "tracestate": "vendor=1"})
    wanted = {"receive", "decode", "engine call", "encode and write"}
    wanted |= {"engine", "queue", "batch", "run"}

    def complete(spans: list[Received]) -> bool:
        names = {s.name for s in spans if s.trace_id == trace_id}
        return wanted | {"POST /v2/models/tiny/infer"} <= names

    spans = {s.name: s for s in receiver.wait_for(complete) if s.trace_id == trace_id}
    root = spans["POST /v2/models/tiny/infer"]
    assert root.parent_id == client_span  # the client's trace, continued
    assert root.attributes["http.response.status_code"] == 200
    order = ("receive", "decode", "engine call", "encode and write")
    for stage in order:
        assert spans[stage].parent_id == root.span_id
    # In order, each inside the request's span.
    stages = [spans[s] for s in order]
    for before, after in itertools.pairwise(stages):
        assert before.end_ns <= after.start_ns
    assert root.start_ns <= stages[0].start_ns and stages[-1].end_ns <= root.end_ns
    # The engine's side continues the front end's crossing, in another process.
    engine, queue, batch, run = (spans[s] for s in ("engine", "queue", "batch", "run"))
    assert engine.parent_id == spans["engine call"].span_id
    assert queue.parent_id == engine.span_id and batch.parent_id == engine.span_id
    assert run.parent_id == batch.span_id
    assert spans["engine call"].start_ns <= engine.start_ns <= queue.start_ns
    assert queue.end_ns <= batch.start_ns <= run.start_ns and run.end_ns <= engine.end_ns
    assert engine.end_ns <= spans["engine call"].end_ns
    for phase in ("compute_input_us", "compute_infer_us", "compute_output_us"):
        assert 0 <= run.attributes[phase] <= (run.end_ns - run.start_ns) / 1e3
    # The batch, linked both ways, says its size.
    assert engine.span_id in batch.links and batch.span_id in engine.links
    assert batch.attributes["batch.size"] == 1 and batch.attributes["batch.requests"] == 1
    # Each process reports its own resource, named by the OTEL_* variables.
    front, back = root.resource, engine.resource
    assert front["stoker.process"] == "front-end" and back["stoker.process"] == "engine"
    assert front["process.pid"] != back["process.pid"]
    assert front["service.instance.id"] != back["service.instance.id"]
    for resource in (front, back):
        assert resource["service.name"] == "stoker-under-test"
        assert resource["deployment.environment"] == "test"


def test_a_caller_that_did_not_sample_its_trace_gets_no_spans(
    traced: Traced, receiver: Receiver
) -> None:
    """The default sampler is parent-based: a ``traceparent`` whose sampled flag is off
    (``-00``) is that caller's decision, and neither process records its request. Counted
    once a later sampled request over the same connection (so the same front end) has
    arrived, as ``traced_count`` does."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    header, sentinel, _ = a_traceparent()
    with httpx.Client(timeout=30) as client:
        infer(client, traced.server, "tiny", {"traceparent": f"00-{trace_id}-{span_id}-00"})
        infer(client, traced.server, "other", {"traceparent": header})
    wanted = {"POST /v2/models/other/infer", "engine", "run"}
    spans = receiver.wait_for(lambda got: wanted <= {s.name for s in got if s.trace_id == sentinel})
    assert [s.name for s in spans if s.trace_id == trace_id] == []


def test_an_upload_is_one_trace_across_the_front_end_and_the_engine(
    traced: Traced, receiver: Receiver, coffee_jpeg: bytes
) -> None:
    """``POST /infer`` with a photo: the front end makes its row (``make rows``, as a CPU
    engine would decode it), the engine stacks (``decode``), queues and runs it."""
    header, trace_id, client_span = a_traceparent()
    files = {"image": ("coffee.jpg", coffee_jpeg, "image/jpeg")}
    answer = httpx.post(
        f"{traced.server.url}/infer", files=files, headers={"traceparent": header}, timeout=60
    )
    assert answer.status_code == 200, answer.text
    order = ("receive", "decode", "make rows", "engine call", "encode and write")
    wanted = {"POST /infer", *order, "engine", "queue", "batch", "run"}

    def complete(spans: list[Received]) -> bool:
        names = [s.name for s in spans if s.trace_id == trace_id]
        return wanted <= set(names) and names.count("decode") == 2

    found = [s for s in receiver.wait_for(complete) if s.trace_id == trace_id]
    print(rendered(found))  # what README's "Tracing" shows (pytest -s)
    root = next(s for s in found if s.name == "POST /infer")
    assert root.parent_id == client_span and root.attributes["http.response.status_code"] == 200
    front = {s.name: s for s in found if s.resource["stoker.process"] == "front-end"}
    back = {s.name: s for s in found if s.resource["stoker.process"] == "engine"}
    assert (
        set(front) == {"POST /infer", *order}
        and root.resource["process.pid"] != (back["engine"].resource["process.pid"])
    )
    # The front end's stages, in order, each inside the request's span.
    stages = [front[s] for s in order]
    for stage in stages:
        assert stage.parent_id == root.span_id
    for before, after in itertools.pairwise(stages):
        assert before.end_ns <= after.start_ns
    assert root.start_ns <= stages[0].start_ns and stages[-1].end_ns <= root.end_ns
    # The engine continues the crossing: its decode, then the queue, the batch and its run.
    engine, decode, queue = back["engine"], back["decode"], back["queue"]
    batch, run = back["batch"], back["run"]
    assert engine.parent_id == front["engine call"].span_id
    assert {decode.parent_id, queue.parent_id, batch.parent_id} == {engine.span_id}
    assert run.parent_id == batch.span_id
    assert front["engine call"].start_ns <= engine.start_ns <= decode.start_ns
    assert decode.end_ns <= queue.start_ns <= queue.end_ns <= batch.start_ns
    assert run.end_ns <= engine.end_ns <= front["engine call"].end_ns
    assert engine.span_id in batch.links and batch.span_id in engine.links
    assert batch.attributes["batch.size"] == 1 and batch.attributes["batch.requests"] == 1


def test_an_upload_to_a_models_classify_joins_the_trace_too(
    traced: Traced, receiver: Receiver, coffee_jpeg: bytes
) -> None:
    header, trace_id, client_span = a_traceparent()
    answer = httpx.post(
        f"{traced.server.url}/v2/models/efficientnet_lite0/classify?k=2",
        content=coffee_jpeg,
        headers={"traceparent": header, "Content-Type": "image/jpeg"},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    name = "POST /v2/models/efficientnet_lite0/classify"

    def complete(spans: list[Received]) -> bool:
        return {name, "engine call", "engine", "batch"} <= {
            s.name for s in spans if s.trace_id == trace_id
        }

    spans = {s.name: s for s in receiver.wait_for(complete) if s.trace_id == trace_id}
    assert spans[name].parent_id == client_span
    assert spans[name].attributes["model"] == "efficientnet_lite0"
    assert spans["engine"].parent_id == spans["engine call"].span_id


def roots(spans: list[Received], model: str) -> list[Received]:
    return [s for s in spans if s.name == f"POST /v2/models/{model}/infer"]


def traced_count(
    traced: Traced, receiver: Receiver, model: str, requests: int, sentinel_model: str
) -> int:
    """How many of ``requests`` untraced requests to ``model`` (over one connection, so one
    front end) were traced: counted once a later request to ``sentinel_model`` that carries
    a sampled traceparent has arrived (each front end exports its spans in the order they
    end)."""
    with receiver.lock:
        seen = {s.span_id for s in roots(receiver.spans, model)}
    header, trace_id, _ = a_traceparent()
    with httpx.Client(timeout=30) as client:
        for _ in range(requests):
            infer(client, traced.server, model, {})
        infer(client, traced.server, sentinel_model, {"traceparent": header})
    spans = receiver.wait_for(lambda got: any(s.trace_id == trace_id for s in roots(got, "other")))
    return len([s for s in roots(spans, model) if s.span_id not in seen])


def wait_until(read: Callable[[], Any], expected: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while (got := read()) != expected:
        assert time.monotonic() < deadline, f"{got} is not {expected}"
        time.sleep(0.05)


def test_the_trace_settings_change_the_sampling_over_http_and_grpc(
    traced: Traced, receiver: Receiver
) -> None:
    http = triton_http.InferenceServerClient(traced.server.address)
    grpc = triton_grpc.InferenceServerClient(traced.grpc)
    started = http.get_trace_settings()
    assert started["trace_level"] == ["TIMESTAMPS"] and started["trace_rate"] == "1"
    assert started["trace_mode"] == "opentelemetry" and started["trace_count"] == "-1"
    assert traced_count(traced, receiver, "tiny", 4, "other") == 4

    # One in three, set over HTTP: every front end takes it (the other within a poll).
    changed = http.update_trace_settings(settings={"trace_rate": "3"})
    assert changed["trace_rate"] == "3"
    traced.wait_adopted()
    assert grpc.get_trace_settings(as_json=True)["settings"]["trace_rate"] == {"value": ["3"]}
    assert traced_count(traced, receiver, "tiny", 6, "other") == 2

    # Off for one model, over gRPC: its requests are not traced, the other model's are.
    grpc.update_trace_settings(model_name="tiny", settings={"trace_level": ["OFF"]})
    traced.wait_adopted()
    assert http.get_trace_settings(model_name="tiny")["trace_level"] == ["OFF"]
    assert http.get_trace_settings()["trace_level"] == ["TIMESTAMPS"]
    assert traced_count(traced, receiver, "tiny", 3, "other") == 0
    # A null setting drops the model's own: the global one holds again.
    grpc.update_trace_settings(model_name="tiny", settings={"trace_level": None})
    traced.wait_adopted()
    assert http.get_trace_settings(model_name="tiny")["trace_level"] == ["TIMESTAMPS"]
    http.update_trace_settings(settings={"trace_rate": "1"})
    traced.wait_adopted()
    assert traced_count(traced, receiver, "tiny", 2, "other") == 2


def test_bad_trace_settings_are_refused_with_a_json_error(traced: Traced) -> None:
    for body in ({"trace_rate": "often"}, {"trace_level": ["LOUD"]}, {"colour": "1"}):
        answer = httpx.post(f"{traced.server.url}/v2/trace/setting", json=body)
        assert answer.status_code == 400 and "error" in answer.json()
    answer = httpx.get(f"{traced.server.url}/v2/models/absent/trace/setting")
    assert answer.status_code == 404 and "absent" in answer.json()["error"]
    # A settings body is a control body: past its 64 KiB it is 413 before it is parsed.
    for path in ("/v2/trace/setting", "/v2/logging"):
        answer = httpx.post(
            f"{traced.server.url}{path}", json={"log_info": True, "x": "y" * 70_000}
        )
        assert answer.status_code == 413 and "exceeds" in answer.json()["error"]


def test_the_log_settings_reach_every_process(traced: Traced) -> None:
    http = triton_http.InferenceServerClient(traced.server.address)
    grpc = triton_grpc.InferenceServerClient(traced.grpc)
    started = http.get_log_settings()
    assert started == {
        "log_file": "",
        "log_info": True,
        "log_warning": True,
        "log_error": True,
        "log_verbose_level": 0,
        "log_format": "default",
    }
    grpc.update_log_settings({"log_verbose_level": 1})
    # Each of the three processes says it took the change, at the new level.
    line = "app.observed: log level now DEBUG"

    def processes() -> set[str]:
        lines = [row for row in traced.server.log.read_text().splitlines() if line in row]
        return {row.split(" DEBUG ")[1].split(" ")[0] for row in lines}

    wait_until(processes, {"engine", "front-end-0", "front-end-1"})
    assert http.get_log_settings()["log_verbose_level"] == 1
    answer = http.update_log_settings({"log_verbose_level": 0, "log_format": "ISO8601"})
    assert answer["log_verbose_level"] == 0 and answer["log_format"] == "ISO8601"
    traced.wait_adopted()
    assert grpc.get_log_settings(as_json=True)["settings"]["log_format"] == {
        "string_param": "ISO8601"
    }
    refused = httpx.post(f"{traced.server.url}/v2/logging", json={"log_info": "yes"})
    assert refused.status_code == 400 and "log_info" in refused.json()["error"]


def test_the_extensions_are_listed_and_cuda_shared_memory_is_a_json_refusal(
    traced: Traced,
) -> None:
    extensions = httpx.get(f"{traced.server.url}/v2").json()["extensions"]
    assert {"trace", "logging"} <= set(extensions)
    assert "cuda_shared_memory" not in extensions
    for method, path in (
        ("GET", "/v2/cudasharedmemory/status"),
        ("POST", "/v2/cudasharedmemory/region/r/register"),
        ("POST", "/v2/cudasharedmemory/unregister"),
    ):
        answer = httpx.request(method, f"{traced.server.url}{path}", json={})
        assert answer.status_code == 501
        assert "CUDA shared memory" in answer.json()["error"]


def test_a_grpc_call_joins_the_trace_its_metadata_names(traced: Traced, receiver: Receiver) -> None:
    grpc = triton_grpc.InferenceServerClient(traced.grpc)
    tensor = triton_grpc.InferInput("x", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
    header, trace_id, client_span = a_traceparent()
    result = grpc.infer("tiny", [tensor], headers={"traceparent": header})
    assert result.as_numpy("y").shape == (1, 3)
    name = "inference.GRPCInferenceService/ModelInfer"

    def complete(spans: list[Received]) -> bool:
        return {name, "engine", "batch"} <= {s.name for s in spans if s.trace_id == trace_id}

    spans = {s.name: s for s in receiver.wait_for(complete) if s.trace_id == trace_id}
    assert spans[name].parent_id == client_span


def test_each_request_of_a_grpc_stream_is_its_own_span_of_the_streams_trace(
    traced: Traced, receiver: Receiver
) -> None:
    """``ModelStreamInfer``: the stream's metadata names the trace; each request streamed
    on it gets its own span under it, with its own stages and its own engine span."""
    import queue

    grpc = triton_grpc.InferenceServerClient(traced.grpc)
    answers: queue.Queue[Any] = queue.Queue()
    header, trace_id, client_span = a_traceparent()
    grpc.start_stream(
        lambda result, error: answers.put(error or result), headers={"traceparent": header}
    )
    try:
        for i in range(3):
            tensor = triton_grpc.InferInput("x", [1, 4], "FP32")
            tensor.set_data_from_numpy(np.full((1, 4), i, np.float32))
            grpc.async_stream_infer("tiny", [tensor], request_id=str(i))
        got = [answers.get(timeout=WAIT_S) for _ in range(3)]
    finally:
        grpc.stop_stream()
    assert all(isinstance(r, triton_grpc.InferResult) for r in got), got
    name = "inference.GRPCInferenceService/ModelStreamInfer"

    def complete(spans: list[Received]) -> bool:
        names = [s.name for s in spans if s.trace_id == trace_id]
        return names.count(name) == 3 and names.count("engine") == 3 and names.count("run") >= 1

    spans = [s for s in receiver.wait_for(complete) if s.trace_id == trace_id]
    roots = [s for s in spans if s.name == name]
    assert {r.parent_id for r in roots} == {client_span}
    assert len({r.span_id for r in roots}) == 3
    for root in roots:  # each request's own stages, its engine span under its crossing
        stages = {s.name: s for s in spans if s.parent_id == root.span_id}
        assert set(stages) == {"receive", "decode", "engine call", "encode and write"}
        engines = [s for s in spans if s.parent_id == stages["engine call"].span_id]
        assert [e.name for e in engines] == ["engine"]
        assert engines[0].resource["stoker.process"] == "engine"


def test_spans_go_over_otlp_grpc_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """``OTEL_EXPORTER_OTLP_PROTOCOL=grpc``: the SDK's gRPC exporter sends the request
    ``app.otlp`` wrote, to a real OTLP/gRPC receiver in this process."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    from app import otlp
    from app.tracing import Span

    got: list[ExportTraceServiceRequest] = []
    arrived = threading.Event()

    class Traces(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> ExportTraceServiceResponse:
            got.append(request)
            arrived.set()
            return ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        variables = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_BSP_SCHEDULE_DELAY": "60000"}
        exporter = otlp.Exporter({"service.name": "grpc-test"}, otlp.sender(variables), variables)
        Span(exporter, "POST /infer", 7, 0, 1_000).end(2_000)
        exporter.shutdown()
        assert arrived.wait(WAIT_S)
    finally:
        server.stop(None)
    (span,) = got[0].resource_spans[0].scope_spans[0].spans
    assert span.name == "POST /infer" and int(span.trace_id.hex(), 16) == 7
    assert span.end_time_unix_nano - span.start_time_unix_nano == 1_000


def test_off_without_otel_variables(tmp_path: Path) -> None:
    """No ``OTEL_*``: no SDK imported, no exporter thread, no middleware on the path."""
    import subprocess
    import sys

    script = (
        "import sys, threading\n"
        "from app.settings import Settings\n"
        "from app.frontend.server import create_app\n"
        "from app import tracing\n"
        "app = create_app(Settings())\n"
        "print(tracing.tracer is None, 'opentelemetry.sdk' in sys.modules,\n"
        "      [t.name for t in threading.enumerate() if 'Otel' in t.name],\n"
        "      'TraceRequests' in app.layers, app.user_middleware == [])\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.stdout.split() == ["True", "False", "[]", "False", "True"], out.stderr


def test_a_request_the_engine_decodes_carries_its_trace_too(
    traced: Traced, receiver: Receiver
) -> None:
    """A request naming shared-memory regions crosses as its body (``wire.Infer``): the
    engine's spans still continue the front end's."""
    tag = secrets.token_hex(4)
    region = shm.create_shared_memory_region(f"out-{tag}", f"/stoker_trace_{tag}", 4096)
    client = triton_http.InferenceServerClient(traced.server.address)
    header, trace_id, _ = a_traceparent()
    try:
        client.register_system_shared_memory(f"out-{tag}", f"/stoker_trace_{tag}", 4096)
        tensor = triton_http.InferInput("x", [1, 4], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
        y_out = triton_http.InferRequestedOutput("y")
        y_out.set_shared_memory(f"out-{tag}", 3 * 4)
        client.infer("tiny", [tensor], outputs=[y_out], headers={"traceparent": header})
    finally:
        client.unregister_system_shared_memory()
        client.close()
        shm.destroy_shared_memory_region(region)

    def complete(spans: list[Received]) -> bool:
        return {"engine call", "engine", "batch"} <= {
            s.name for s in spans if s.trace_id == trace_id
        }

    spans = {s.name: s for s in receiver.wait_for(complete) if s.trace_id == trace_id}
    assert spans["engine"].parent_id == spans["engine call"].span_id
    assert spans["engine"].resource["stoker.process"] == "engine"


def test_tritons_metric_names_move_with_stokers_through_the_front_ends(traced: Traced) -> None:
    """With front ends, ``/metrics`` is the engine's one set of totals, in both vocabularies."""

    def both() -> tuple[float, float, float, float]:
        found = metric_samples(traced.server)
        labels = (("model", "tiny"), ("version", "fp32"))
        return (
            found[("nv_inference_request_success", labels)],
            found[("stoker_inference_request_success_total", labels)],
            found[("nv_inference_count", labels)],
            found[("stoker_inference_count_total", labels)],
        )

    before = both()
    with httpx.Client(timeout=30) as client:
        for _ in range(3):
            infer(client, traced.server, "tiny", {})
    # Successes reach the engine's totals with the front ends' next poll.
    wait_until(lambda: both()[1] - before[1], 3.0)
    after = both()
    assert after[0] == after[1] and after[2] == after[3] and after[2] - before[2] == 3
    text = httpx.get(f"{traced.server.url}/metrics").text
    assert "_created" not in text


def test_console_spans_are_one_export_a_line_and_give_each_requests_stages(
    tmp_path: Path,
) -> None:
    """``OTEL_TRACES_EXPORTER=console`` with two front ends and the engine writing to one
    output: every line of spans parses whole, and ``scripts/span_budget.py`` finds each
    request's stages across the processes (the engine's spans joined to the front end's, the
    run through the batch it linked), each within its request's span."""
    from scripts.span_budget import STAGES, budgets, spans_of

    repo = tmp_path / "repository"
    tiny_model(repo / "tiny")
    env = {
        "STOKER_SERVER__FRONT_ENDS": "2",
        "STOKER_SERVER__GRPC_PORT": "0",
        "OTEL_TRACES_EXPORTER": "console",
        "OTEL_TRACES_SAMPLER": "always_on",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }
    server = start_server(repo, tmp_path / "server.log", env)
    try:
        with httpx.Client(timeout=30) as client:
            for _ in range(12):
                infer(client, server, "tiny", {})
    finally:
        assert stop_server(server) == 0  # the exporters flush as each process stops
    lines = [
        line for line in server.log.read_text().splitlines() if line.startswith('{"resourceSpans"')
    ]
    spans = list(spans_of(lines))  # a line cut by another process's would not parse
    assert len(spans) >= 12 * 9 and {s.process for s in spans} == {"front-end", "engine"}
    found, facts = budgets(spans, name="infer")
    assert facts["requests"] == 12 and facts["batches"] >= 1
    for stage in STAGES:
        # The ONNX Runtime runner times no compute parts; these requests are no uploads.
        if "compute" not in stage and "uploads" not in stage:
            assert len(found[stage]) == 12, stage
    request = found["request (front end, first byte to answer)"]
    for stage in ("engine call", "  queue (batcher)", "  run (runner)"):
        assert all(0 <= part <= whole for part, whole in zip(found[stage], request, strict=True))
    # The crossing's stamps (the front end's write, the engine's read, the front end's read
    # of the answer) split each way into parts that tile it, none negative.
    for whole, parts in (
        ("  to the engine (gather, cross, pick up)", ("held", "the link (", "pick-up")),
        ("  back to the front end", ("the link back", "the request's turn")),
    ):
        pieces = [next(v for k, v in found.items() if "of it" in k and p in k) for p in parts]
        for at, total in enumerate(found[whole]):
            each = [piece[at] for piece in pieces]
            assert min(each) >= 0 and abs(sum(each) - total) < 2, (whole, each, total)
