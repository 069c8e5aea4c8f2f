"""The spans of ``app.tracing`` to an OTLP collector: buffered as they end, encoded and sent
by one thread of this process, in batches.

Why not the SDK's span objects and ``BatchSpanProcessor``: each of its spans costs the event
loop about 40 us to make and end, and its exporter's thread about 20 us more to encode,
while holding the GIL; nine a request at 100% sampling took half a tiny model's batch-1
req/s at eight clients (BENCHMARKS.md, "Tracing at 100%"). Here a span is a slotted record
(about 1 us) and the thread writes opentelemetry-proto's ``ExportTraceServiceRequest`` in
protobuf's wire format from the records directly (about 2 us a span). The OpenTelemetry SDK
still makes the resource (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``telemetry.sdk.*``), and over ``grpc`` its OTLP exporter sends (its endpoint, headers,
credentials, compression, retries from the ``OTEL_EXPORTER_OTLP_*`` variables). Over
``http/protobuf`` the request is posted here, to ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_ENDPOINT`` + ``/v1/traces`` (default ``http://localhost:4318``), with
``OTEL_EXPORTER_OTLP(_TRACES)_HEADERS``, ``_TIMEOUT``, ``_COMPRESSION`` (gzip), and for https
``_CERTIFICATE``, ``_CLIENT_CERTIFICATE`` and ``_CLIENT_KEY``, as the
SDK's exporter reads them. The batches follow the SDK's variables:
``OTEL_BSP_SCHEDULE_DELAY`` (ms, 5000), ``OTEL_BSP_MAX_QUEUE_SIZE`` (2048: spans past it are
dropped and counted), ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` (512).
"""

from __future__ import annotations

import gzip
import http.client
import logging
import ssl
import struct
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

log = logging.getLogger(__name__)

RETRIED = frozenset({429, 502, 503, 504})
"""Answers OTLP/HTTP says to retry."""


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


# opentelemetry-proto's wire format, written here: field tags (number << 3 | wire type) of
# the messages a request holds. Filling the generated classes cost 5 us a span (their
# attribute setters), writing the bytes 1-2 us.
_PACK_TIMES = struct.Struct("<BQBQ").pack  # Span start (7) and end (8), fixed64
_PACK_DOUBLE = struct.Struct("<Bd").pack  # AnyValue.double_value (4)


def _varint(number: int) -> bytes:
    if number < 0x80:
        return bytes((number,))
    out = bytearray()
    while number > 0x7F:
        out.append((number & 0x7F) | 0x80)
        number >>= 7
    out.append(number)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    size = len(payload)
    if size < 0x80:
        return bytes((tag, size)) + payload
    return bytes((tag,)) + _varint(size) + payload


def _any_value(value: Any) -> bytes:
    """An ``AnyValue``'s fields."""
    if isinstance(value, str):
        return _field(0x0A, value.encode())
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + _varint(value & 0xFFFFFFFFFFFFFFFF)
    if isinstance(value, float):
        return _PACK_DOUBLE(0x21, value)
    if isinstance(value, (list, tuple)):  # ArrayValue (5) of AnyValue values (1)
        return _field(0x2A, b"".join(_field(0x0A, _any_value(item)) for item in value))
    return _field(0x0A, str(value).encode())


_ATTRIBUTES: dict[tuple[int, str, type, Any], bytes] = {}
CACHED = (str, bool, int)


def attribute(tag: int, key: str, value: Any) -> bytes:
    """An attribute: a ``KeyValue`` (key 1, value 2) as the field ``tag`` of the message
    holding it; those of strings and integers cached, as most repeat (models, sizes). Keyed
    by type too: True and 1 are equal keys, not equal values."""
    if not isinstance(value, CACHED):
        return _field(tag, _field(0x0A, key.encode()) + _field(0x12, _any_value(value)))
    cached = _ATTRIBUTES.get((tag, key, type(value), value))
    if cached is None:
        cached = _field(tag, _field(0x0A, key.encode()) + _field(0x12, _any_value(value)))
        if len(_ATTRIBUTES) < 4096:
            _ATTRIBUTES[(tag, key, type(value), value)] = cached
    return cached


_NAMES: dict[str, bytes] = {}
SCOPE = _field(0x0A, _field(0x0A, b"stoker"))
"""ScopeSpans' scope (1): the instrumentation scope ``stoker``."""


def encode_span(span: Record) -> bytes:
    """A ``Span`` message's bytes."""
    name = _NAMES.get(span.name)
    if name is None:
        name = _field(0x2A, span.name.encode())
        if len(_NAMES) < 1024:
            _NAMES[span.name] = name
    parts = [
        b"\x0a\x10",
        span.trace_id.to_bytes(16, "big"),
        b"\x12\x08",
        span.span_id.to_bytes(8, "big"),
    ]
    if span.trace_state:
        parts.append(_field(0x1A, span.trace_state.encode()))
    if span.parent_id:
        parts += (b"\x22\x08", span.parent_id.to_bytes(8, "big"))
    parts += (name, b"\x30\x02" if span.server else b"\x30\x01")  # kind SERVER / INTERNAL
    parts.append(_PACK_TIMES(0x39, span.start_ns, 0x41, span.end_ns))
    if span.attributes:
        for key, value in span.attributes.items():
            parts.append(attribute(0x4A, key, value))
    for trace_id, span_id, attributes in span.links or ():
        link = b"\x0a\x10" + trace_id.to_bytes(16, "big") + b"\x12\x08" + span_id.to_bytes(8, "big")
        for key, value in (attributes or {}).items():
            link += attribute(0x22, key, value)
        parts.append(_field(0x6A, link))
    if span.error is not None:  # Status: message (2), code (3) ERROR (2)
        parts.append(_field(0x7A, _field(0x12, span.error.encode()) + b"\x18\x02"))
    return b"".join(parts)


class Exporter:
    """The buffer of ended spans and the thread that sends them (``OtelSpanExporter``)."""

    def __init__(
        self,
        resource: Mapping[str, Any],
        send: Callable[[bytes], None],
        environ: Mapping[str, str],
    ) -> None:
        # Resource (1) of its attributes (1), written once.
        self._resource = _field(0x0A, b"".join(attribute(0x0A, k, v) for k, v in resource.items()))
        self._send = send
        self._delay_s = _number(environ, "OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000
        self._most = _number(environ, "OTEL_BSP_MAX_QUEUE_SIZE", 2048)
        self._batch = min(_number(environ, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512), self._most)
        self._ended: deque[Record] = deque()
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._stopping = False
        self.dropped = 0
        self.thread = threading.Thread(target=self._run, name="OtelSpanExporter", daemon=True)
        self.thread.start()

    def ended(self, span: Record) -> None:
        """A span ended: kept for the next batch (on any thread; deque appends are atomic)."""
        ended = self._ended
        if len(ended) >= self._most:
            self.dropped += 1
            return
        ended.append(span)
        if len(ended) == self._batch:
            self._wake.set()

    def flush(self, timeout_s: float = 30) -> bool:
        """Send what is buffered now; whether it was sent within ``timeout_s``."""
        self._idle.clear()
        self._wake.set()
        return self._idle.wait(timeout_s)

    def shutdown(self) -> None:
        """Send what is buffered, then stop the thread."""
        self._stopping = True
        self._wake.set()
        self.thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            self._wake.wait(self._delay_s)
            self._wake.clear()
            while self._ended:
                self._export(self._take())
            self._idle.set()
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

    def request(self, spans: Sequence[Record]) -> bytes:
        """The ``ExportTraceServiceRequest`` of these spans, under this process's resource,
        in opentelemetry-proto's wire format."""
        scope = SCOPE + b"".join([_field(0x12, encode_span(span)) for span in spans])
        return _field(0x0A, self._resource + _field(0x12, scope))


def _variable(environ: Mapping[str, str], name: str) -> str | None:
    """``OTEL_EXPORTER_OTLP_TRACES_<name>``, else ``OTEL_EXPORTER_OTLP_<name>``."""
    return environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or environ.get(
        f"OTEL_EXPORTER_OTLP_{name}"
    )


def tls_context(environ: Mapping[str, str]) -> ssl.SSLContext:
    """The TLS of an ``https`` collector as the SDK's exporters read it: the CA bundle of
    ``OTEL_EXPORTER_OTLP(_TRACES)_CERTIFICATE`` (else the system's), and the client's own
    certificate and key of ``_CLIENT_CERTIFICATE`` and ``_CLIENT_KEY`` (mutual TLS)."""
    context = ssl.create_default_context(cafile=_variable(environ, "CERTIFICATE") or None)
    certificate = _variable(environ, "CLIENT_CERTIFICATE")
    if certificate:
        context.load_cert_chain(certificate, _variable(environ, "CLIENT_KEY") or None)
    return context


def http_sender(environ: Mapping[str, str]) -> Callable[[bytes], None]:
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

    where = urllib.parse.urlsplit(endpoint)
    path = (where.path or "/") + (f"?{where.query}" if where.query else "")
    tls = tls_context(environ) if where.scheme == "https" else None
    kept: list[http.client.HTTPConnection] = []  # one, kept alive between exports

    def connect() -> http.client.HTTPConnection:
        if tls is None:
            return http.client.HTTPConnection(where.netloc, timeout=timeout_s)
        return http.client.HTTPSConnection(where.netloc, timeout=timeout_s, context=tls)

    def send(request: bytes) -> None:
        body = request
        if compressed:
            body = gzip.compress(body)
        for attempt in range(3):
            if not kept:
                kept.append(connect())
            try:
                kept[0].request("POST", path, body, headers)
                answer = kept[0].getresponse()
                answer.read()
            except (OSError, http.client.HTTPException):
                kept.pop().close()
                if attempt == 2:
                    raise
                time.sleep(0.5 * 2**attempt)
                continue
            if answer.status < 300:
                return
            if answer.status not in RETRIED or attempt == 2:
                raise OSError(f"the collector answered HTTP {answer.status}")
            time.sleep(0.5 * 2**attempt)

    return send


def grpc_sender(environ: Mapping[str, str]) -> Callable[[bytes], None]:
    """The SDK's OTLP/gRPC exporter, handed the request made here (its ``_translate_data``
    is where it would make one of SDK spans)."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    class RequestExporter(OTLPSpanExporter):
        def _translate_data(self, data: Any) -> Any:
            return data

        def _count_data(self, data: Any) -> int:
            return sum(len(s.spans) for r in data.resource_spans for s in r.scope_spans)

    exporter = RequestExporter()

    def send(request: bytes) -> None:
        exporter.export(ExportTraceServiceRequest.FromString(request))  # type: ignore[arg-type]

    return send


def console_sender() -> Callable[[bytes], None]:
    """Each request as OTLP's JSON on standard output, one line an export
    (``OTEL_TRACES_EXPORTER=console``): the front ends and the engine share the server's
    output, so a line is one process's export whole, and ``scripts/span_budget.py`` (or
    ``jq``) reads a log of them."""
    import sys

    from google.protobuf.json_format import MessageToJson
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    def send(request: bytes) -> None:
        line = MessageToJson(ExportTraceServiceRequest.FromString(request), indent=None)
        sys.stdout.write(line + "\n")  # one write: whole beside the other processes' lines
        sys.stdout.flush()

    return send


def sender(environ: Mapping[str, str]) -> Callable[[bytes], None]:
    """Where ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``, or both) and
    ``OTEL_EXPORTER_OTLP(_TRACES)_PROTOCOL`` send the spans."""
    sends: list[Callable[[bytes], None]] = []
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

    def every(request: bytes) -> None:
        for send in sends:
            send(request)

    return every
