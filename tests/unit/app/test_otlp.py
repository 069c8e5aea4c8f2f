"""The spans ``app.otlp`` writes are opentelemetry-proto's ``ExportTraceServiceRequest``, as
that package's own parser reads them; the batches follow the ``OTEL_BSP_*`` variables."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from app import otlp
from app.otlp import tls_context
from app.tracing import Span, ours, parent_of, traceparent_of


def value_of(any_value: Any) -> Any:
    which = any_value.WhichOneof("value")
    if which == "array_value":
        return [value_of(v) for v in any_value.array_value.values]
    return getattr(any_value, which)


class Kept:
    """An exporter's sender that keeps each request it is handed."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.arrived = threading.Event()

    def __call__(self, request: bytes) -> None:
        self.requests.append(ExportTraceServiceRequest.FromString(request))
        self.arrived.set()


RESOURCE = {"service.name": "stoker", "process.pid": 42, "weights": [1.5, 2.0], "on": True}


def test_a_request_of_spans_reads_back_field_for_field() -> None:
    kept = Kept()
    exporter = otlp.Exporter(RESOURCE, kept, {"OTEL_BSP_SCHEDULE_DELAY": "60000"})
    try:
        parent = parent_of({"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01", "tracestate": "v=1"})
        root = Span(exporter, "POST /infer", 0xAB << 120, 0, 1_000, "v=1", {"model": "m"})
        root.trace_id, root.parent_id = parent[0], parent[1]  # type: ignore[index]
        root.server = True
        child = root.child("queue", 2_000)
        child.set_attribute("batch.size", 3)
        child.set_attribute("compute_infer_us", 140.7)
        child.set_attribute("negative", -5)
        child.link(root, {"stoker.link": "batch"})
        child.error = "EngineError"
        child.end(3_500)
        root.end(9_000)
    finally:
        exporter.shutdown()  # sends what is buffered
    (request,) = kept.requests
    (resource_spans,) = request.resource_spans
    attributes = {a.key: value_of(a.value) for a in resource_spans.resource.attributes}
    assert attributes == {
        "service.name": "stoker",
        "process.pid": 42,
        "weights": [1.5, 2.0],
        "on": True,
    }
    (scope,) = resource_spans.scope_spans
    assert scope.scope.name == "stoker"
    queue, made_root = scope.spans
    assert made_root.name == "POST /infer" and made_root.kind == ProtoSpan.SPAN_KIND_SERVER
    assert made_root.trace_id.hex() == "ab" * 16 and made_root.parent_span_id.hex() == "cd" * 8
    assert made_root.trace_state == "v=1" and made_root.start_time_unix_nano == 1_000
    assert made_root.end_time_unix_nano == 9_000
    assert {a.key: value_of(a.value) for a in made_root.attributes} == {"model": "m"}
    assert made_root.status.code == Status.STATUS_CODE_UNSET
    assert queue.kind == ProtoSpan.SPAN_KIND_INTERNAL and queue.parent_span_id == made_root.span_id
    assert queue.trace_id == made_root.trace_id and len(queue.span_id) == 8
    assert {a.key: value_of(a.value) for a in queue.attributes} == {
        "batch.size": 3,
        "compute_infer_us": 140.7,
        "negative": -5,
    }
    (link,) = queue.links
    assert link.span_id == made_root.span_id and link.trace_id == made_root.trace_id
    assert [(a.key, value_of(a.value)) for a in link.attributes] == [("stoker.link", "batch")]
    assert queue.status.code == Status.STATUS_CODE_ERROR and queue.status.message == "EngineError"
    # The context a span hands on reads back as itself.
    assert parent_of({"traceparent": traceparent_of(child)})[:2] == (  # type: ignore[index]
        int(queue.trace_id.hex(), 16),
        int(queue.span_id.hex(), 16),
    )


def test_a_full_batch_of_the_bsp_size_goes_at_once() -> None:
    kept = Kept()
    variables = {
        "OTEL_BSP_SCHEDULE_DELAY": "60000",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4",
        "OTEL_BSP_MAX_QUEUE_SIZE": "6",
    }
    exporter = otlp.Exporter(RESOURCE, kept, variables)
    try:
        spans = [Span(exporter, f"s{i}", 1, 0, i) for i in range(4)]
        for span in spans:
            span.end(10)
        assert kept.arrived.wait(30)  # a full batch goes at once, not after the delay
        assert [len(r.resource_spans[0].scope_spans[0].spans) for r in kept.requests] == [4]
    finally:
        exporter.shutdown()


def test_a_traceparent_is_read_as_w3c_says() -> None:
    trace, span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    assert parent_of({"traceparent": f"00-{trace}-{span}-01"}) == (
        int(trace, 16),
        int(span, 16),
        True,
        "",
    )
    assert parent_of({"traceparent": f"00-{trace}-{span}-00", "tracestate": "a=1"}) == (
        int(trace, 16),
        int(span, 16),
        False,
        "a=1",
    )
    # A later version may carry more fields; version 00 may not, nor ff be used.
    assert parent_of({"traceparent": f"01-{trace}-{span}-01-extra"}) is not None
    for refused in (
        f"00-{trace}-{span}-01-extra",
        f"ff-{trace}-{span}-01",
        f"00-{'0' * 32}-{span}-01",
        f"00-{trace}-{'0' * 16}-01",
        f"00-{trace.upper()}-{span}-01",
        f"00-{trace}-{span}",
        "garbage",
    ):
        assert parent_of({"traceparent": refused}) is None, refused


def test_the_engine_reads_its_front_ends_traceparent_as_parent_of_does() -> None:
    trace, span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    for carried in (f"00-{trace}-{span}-01", f"00-{trace}-{span}-00", f"01-{trace}-{span}-01-x"):
        assert ours(carried) == parent_of({"traceparent": carried}), carried
    for refused in (f"00-{'0' * 32}-{span}-01", f"00-{trace}-{'0' * 16}-01", "garbage"):
        assert ours(refused) is None, refused


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_an_https_collector_is_trusted_by_the_named_certificates(tmp_path: Path) -> None:
    """``OTEL_EXPORTER_OTLP_CERTIFICATE`` is the CA bundle and the client certificate and
    key make mutual TLS, as the SDK's exporters read them."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=collector", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    plain = tls_context({})
    named = tls_context(
        {
            "OTEL_EXPORTER_OTLP_CERTIFICATE": str(cert),
            "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE": str(cert),
            "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY": str(key),
        }
    )

    def subjects(context: ssl.SSLContext) -> list[str]:
        return [str(ca["subject"]) for ca in context.get_ca_certs()]

    assert subjects(named) == [str(((("commonName", "collector"),),))]
    assert str(((("commonName", "collector"),),)) not in subjects(plain)
    with pytest.raises(ssl.SSLError):  # a key that is not the certificate's is refused
        other = tmp_path / "other.pem"
        subprocess.run(
            ["openssl", "genrsa", "-out", str(other), "2048"], check=True, capture_output=True
        )
        tls_context(
            {
                "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": str(cert),
                "OTEL_EXPORTER_OTLP_CLIENT_KEY": str(other),
            }
        )
