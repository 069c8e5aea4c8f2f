"""The spans of ``app.tracing`` to an OTLP collector: buffered as they end, encoded and sent
by one thread of this process, in batches.

Why not the SDK's span objects and ``BatchSpanProcessor``: each of its spans costs the event
loop about 40 us to make and end, and its exporter's thread about 20 us more to encode, while
holding the GIL; nine a request at 100% sampling took a third of a tiny model's batch-1
req/s (BENCHMARKS.md, issue 45). Here a span is a slotted record (about 1 us) and the thread
fills opentelemetry-proto's ``ExportTraceServiceRequest`` from the records directly (about
2 us a span). The OpenTelemetry SDK still makes the resource (``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``, ``telemetry.sdk.*``), and over ``grpc`` its OTLP exporter
sends (its endpoint, headers, credentials, compression, retries from the
``OTEL_EXPORTER_OTLP_*`` variables). Over ``http/protobuf`` the request is posted here, to
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` + ``/v1/traces``
(default ``http://localhost:4318``), with ``OTEL_EXPORTER_OTLP(_TRACES)_HEADERS``,
``_TIMEOUT`` and ``_COMPRESSION`` (gzip), as the SDK's exporter reads them. The batches
follow the SDK's variables: ``OTEL_BSP_SCHEDULE_DELAY`` (ms, 5000), ``OTEL_BSP_MAX_QUEUE_SIZE``
(2048: spans past it are dropped and counted), ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` (512).
"""

from __future__ import annotations

import gzip
import logging
import threading
import time
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue

log = logging.getLogger(__name__)


class Record(Protocol):
    """What a span of ``app.tracing`` holds when it ends."""

    trace_id: int
    span_id: int
    parent_id: int
    name: str
    start_ns: int
    end_ns: int
    server: bool
    attributes: dict[str, Any] | None
    links: list[tuple[int, int, dict[str, Any] | None]] | None
    error: str | None
    trace_state: str


def _number(environ: Mapping[str, str], key: str, default: int) -> int:
    try:
        return max(1, int(environ.get(key, default)))
    except ValueError:
        return default


def set_value(into: AnyValue, value: Any) -> None:
    if isinstance(value, str):
        into.string_value = value
    elif isinstance(value, bool):
        into.bool_value = value
    elif isinstance(value, int):
        into.int_value = value
    elif isinstance(value, float):
        into.double_value = value
    elif isinstance(value, (list, tuple)):
        for item in value:
            set_value(into.array_value.values.add(), item)
    else:
        into.string_value = str(value)


def add_attributes(into: Any, attributes: Mapping[str, Any]) -> None:
    for key, value in attributes.items():
        set_value(into.add(key=key).value, value)


class Exporter:
    """The buffer of ended spans and the thread that sends them (``OtelSpanExporter``)."""

    def __init__(
        self,
        resource: Mapping[str, Any],
        send: Callable[[ExportTraceServiceRequest], None],
        environ: Mapping[str, str],
    ) -> None:
        self._resource = dict(resource)
        self._send = send
        self._delay_s = _number(environ, "OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000
        self._most = _number(environ, "OTEL_BSP_MAX_QUEUE_SIZE", 2048)
        self._batch = min(_number(environ, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512), self._most)
        self._ended: deque[Record] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="OtelSpanExporter", daemon=True)
        self._thread.start()

    def ended(self, span: Record) -> None:
        """A span ended: kept for the next batch (on any thread; deque appends are atomic)."""
        ended = self._ended
        if len(ended) >= self._most:
            self.dropped += 1
            return
        ended.append(span)
        if len(ended) == self._batch:
            self._wake.set()

    def shutdown(self) -> None:
        """Send what is buffered, then stop the thread."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            self._wake.wait(self._delay_s)
            self._wake.clear()
            while self._ended:
                self._export(self._take())
            if self.dropped:
                log.warning("%d spans dropped: past OTEL_BSP_MAX_QUEUE_SIZE", self.dropped)
                self.dropped = 0
            if self._stopping:
                return

    def _take(self) -> list[Record]:
        taken = []
        for _ in range(min(self._batch, len(self._ended))):
            taken.append(self._ended.popleft())
        return taken

    def _export(self, spans: Sequence[Record]) -> None:
        try:
            self._send(self.request(spans))
        except Exception as error:  # the collector's trouble is never the request path's
            log.warning("spans not exported: %s: %s", type(error).__name__, str(error)[:200])

    def request(self, spans: Sequence[Record]) -> ExportTraceServiceRequest:
        """opentelemetry-proto's request of these spans, under this process's resource."""
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )
        from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

        server, internal = Span.SPAN_KIND_SERVER, Span.SPAN_KIND_INTERNAL
        request = ExportTraceServiceRequest()
        resource_spans = request.resource_spans.add()
        add_attributes(resource_spans.resource.attributes, self._resource)
        scope = resource_spans.scope_spans.add()
        scope.scope.name = "stoker"
        into = scope.spans
        for span in spans:
            made = into.add(
                trace_id=span.trace_id.to_bytes(16, "big"),
                span_id=span.span_id.to_bytes(8, "big"),
                name=span.name,
                kind=server if span.server else internal,
                start_time_unix_nano=span.start_ns,
                end_time_unix_nano=span.end_ns,
            )
            if span.parent_id:
                made.parent_span_id = span.parent_id.to_bytes(8, "big")
            if span.trace_state:
                made.trace_state = span.trace_state
            if span.attributes:
                add_attributes(made.attributes, span.attributes)
            for trace_id, span_id, attributes in span.links or ():
                link = made.links.add(
                    trace_id=trace_id.to_bytes(16, "big"), span_id=span_id.to_bytes(8, "big")
                )
                if attributes:
                    add_attributes(link.attributes, attributes)
            if span.error is not None:
                made.status.code = Status.STATUS_CODE_ERROR
                made.status.message = span.error
        return request


def _variable(environ: Mapping[str, str], name: str) -> str | None:
    """``OTEL_EXPORTER_OTLP_TRACES_<name>``, else ``OTEL_EXPORTER_OTLP_<name>``."""
    return environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or environ.get(
        f"OTEL_EXPORTER_OTLP_{name}"
    )


def http_sender(environ: Mapping[str, str]) -> Callable[[ExportTraceServiceRequest], None]:
    """A POST of each request to the collector's OTLP/HTTP traces endpoint."""
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if not endpoint:
        base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://localhost:4318"
        endpoint = base.rstrip("/") + "/v1/traces"
    headers = {"Content-Type": "application/x-protobuf"}
    for pair in (_variable(environ, "HEADERS") or "").split(","):
        key, _, value = pair.partition("=")
        if key.strip():
            headers[urllib.parse.unquote(key.strip())] = urllib.parse.unquote(value.strip())
    compressed = (_variable(environ, "COMPRESSION") or "").strip().lower() == "gzip"
    if compressed:
        headers["Content-Encoding"] = "gzip"
    try:
        timeout_s = float(_variable(environ, "TIMEOUT") or 10_000) / 1000
    except ValueError:
        timeout_s = 10.0

    def send(request: ExportTraceServiceRequest) -> None:
        body = request.SerializeToString()
        if compressed:
            body = gzip.compress(body)
        for attempt in range(3):
            posted = urllib.request.Request(endpoint, body, headers, method="POST")
            try:
                with urllib.request.urlopen(posted, timeout=timeout_s) as answer:
                    answer.read()
                return
            except OSError:
                if attempt == 2:
                    raise
                time.sleep(0.5 * 2**attempt)

    return send


def grpc_sender(environ: Mapping[str, str]) -> Callable[[ExportTraceServiceRequest], None]:
    """The SDK's OTLP/gRPC exporter, handed the request made here (its ``_translate_data``
    is where it would make one of SDK spans)."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    class RequestExporter(OTLPSpanExporter):
        def _translate_data(self, data: Any) -> Any:
            return data

        def _count_data(self, data: Any) -> int:
            return sum(len(s.spans) for r in data.resource_spans for s in r.scope_spans)

    exporter = RequestExporter()

    def send(request: ExportTraceServiceRequest) -> None:
        exporter.export(request)  # type: ignore[arg-type]

    return send


def console_sender() -> Callable[[ExportTraceServiceRequest], None]:
    """Each request as OTLP's JSON on standard output (``OTEL_TRACES_EXPORTER=console``)."""
    from google.protobuf.json_format import MessageToJson

    def send(request: ExportTraceServiceRequest) -> None:
        print(MessageToJson(request), flush=True)

    return send


def sender(environ: Mapping[str, str]) -> Callable[[ExportTraceServiceRequest], None]:
    """Where ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``, or both) and
    ``OTEL_EXPORTER_OTLP(_TRACES)_PROTOCOL`` send the spans."""
    sends: list[Callable[[ExportTraceServiceRequest], None]] = []
    names = environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    for name in (n.strip() for n in names.split(",")):
        if name == "console":
            sends.append(console_sender())
        elif name == "otlp":
            protocol = (_variable(environ, "PROTOCOL") or "http/protobuf").strip()
            if protocol == "grpc":
                sends.append(grpc_sender(environ))
            else:
                if protocol != "http/protobuf":
                    log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%s: http/protobuf", protocol[:40])
                sends.append(http_sender(environ))
        else:
            log.warning("OTEL_TRACES_EXPORTER=%s is not one Stoker has", name[:40])
    if len(sends) == 1:
        return sends[0]

    def every(request: ExportTraceServiceRequest) -> None:
        for send in sends:
            send(request)

    return every
