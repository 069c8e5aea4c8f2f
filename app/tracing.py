"""OpenTelemetry traces of inference requests, across the front ends and the engine.

Configured by OpenTelemetry's own variables, nothing else: tracing is on where
``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``, ``console``) or an OTLP endpoint is set
(``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), and
``OTEL_SDK_DISABLED`` is not true; ``OTEL_EXPORTER_OTLP_PROTOCOL`` picks ``http/protobuf``
(the default) or ``grpc``; ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` name the
resource, to which each process adds its ``process.pid``, ``service.instance.id`` and
``stoker.process`` (``front-end``, ``engine``, ``server`` in one process);
``OTEL_TRACES_SAMPLER`` / ``_ARG`` set the starting sampling (``always_on``,
``always_off``, ``traceidratio``, and their ``parentbased_`` forms, the default
``parentbased_always_on``): a ratio r traces one request in round(1/r), a parent-based
sampler also traces every request whose ``traceparent`` says sampled. Triton's trace
extension changes the sampling at run time (``app.observed``).

Off (the default), ``tracer`` is None: no SDK is imported, no exporter thread runs, and each
hook on the request path is one None check. On, per traced request:

- front end: the request's span (continuing the client's W3C ``traceparent`` and
  ``tracestate`` from HTTP headers or gRPC metadata, a new root where none came), and under
  it ``receive`` (the body read), ``decode`` (parse and validate against the contract),
  ``engine call`` (gathered and across to the engine and back), ``encode and write``;
- engine: ``engine`` (the request's stay in the engine, a child of ``engine call``: its
  context crosses on the wire as ``RunItem.traceparent``), under it ``queue`` (its wait in
  the batcher), and the batch it ran in: ``batch`` (rows, requests; linked from every
  request's ``engine`` span and linking to each) with ``run`` (the runner's run, its compute
  input / infer / output times as attributes).

Each span costs the request tens of microseconds in Python's SDK (made, then encoded by the
exporter's thread): nine per traced request, so sample accordingly under load.
"""

from __future__ import annotations

import contextvars
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from app import observed

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

    from app.metrics import BatchTimes

log = logging.getLogger(__name__)
T = TypeVar("T")


class Queued(Protocol):
    """What a batch's trace reads of each request in it (the batcher's ``Pending``): the
    floor names no room's types."""

    @property
    def traced(self) -> tuple[Any, ...]: ...
    @property
    def enqueued(self) -> float: ...
    @property
    def requests(self) -> int: ...


tracer: Tracing | None = None
"""This process's tracing; None while off (the hooks' one check)."""

INCOMING: contextvars.ContextVar[Incoming | None] = contextvars.ContextVar(
    "stoker_incoming", default=None
)
"""The inference request this task serves, as its transport received it."""
FRAME: contextvars.ContextVar[tuple[Span, ...]] = contextvars.ContextVar("stoker_frame", default=())
"""In the engine: the ``engine`` spans of the traced requests of the frame being queued."""

PARENT_BASED = "parentbased_"


def _on(environ: Mapping[str, str]) -> bool:
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def sampling(environ: Mapping[str, str]) -> tuple[bool, int, bool]:
    """From ``OTEL_TRACES_SAMPLER`` / ``_ARG``: whether requests are traced, one in how
    many, and whether a client's sampled ``traceparent`` is followed."""
    name = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
    parent = name.startswith(PARENT_BASED)
    name = name.removeprefix(PARENT_BASED)
    if name == "always_off":
        return False, 1, parent
    if name == "traceidratio":
        try:
            ratio = float(environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0"))
        except ValueError:
            ratio = 1.0
        if ratio <= 0:
            return False, 1, parent
        return True, max(1, round(1 / min(ratio, 1.0))), parent
    if name != "always_on":
        log.warning("OTEL_TRACES_SAMPLER=%s is not one Stoker knows: always_on", name[:40])
    return True, 1, parent


def configure(process: str, log_level: str, environ: Mapping[str, str] = os.environ) -> None:
    """Set this process's tracing up from the ``OTEL_*`` variables (``process``: what it is,
    for the resource), and its trace and log settings (``app.observed``)."""
    global tracer
    shutdown()  # an application made again in this process (tests) starts afresh
    on = _on(environ)
    traced, rate, parent = sampling(environ)
    if on:
        try:
            tracer = Tracing(process, parent, environ)
        except ImportError as missing:
            log.error(
                "OTEL_* asks for traces, but OpenTelemetry's SDK is not installed (%s): "
                "pip install 'stoker[tracing]'",
                missing.name,
            )
            on = False
    if on and process != "engine":  # said once, by the process that decides the sampling
        log.info(
            "tracing with OpenTelemetry: %s, one request in %d%s%s",
            environ.get("OTEL_TRACES_EXPORTER") or "otlp",
            rate,
            ", and every one a client's traceparent samples" if parent else "",
            "" if traced else " (off: OTEL_TRACES_SAMPLER)",
        )
    observed.configure(log_level, rate, on, traced)


def shutdown() -> None:
    """Send what is buffered and stop the exporter (at the process's end)."""
    global tracer
    if tracer is not None:
        tracer.provider.shutdown()
        tracer = None


def traceparent_of(span: Span) -> str:
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


@dataclass(eq=False)
class Incoming:
    """An inference request as its transport received it: what the data plane's trace of
    it starts from, and what the transport ends it with."""

    name: str
    carrier: dict[str, str]
    """Its ``traceparent`` and ``tracestate``, where it came with them."""
    started_ns: int = field(default_factory=time.time_ns)
    received_ns: int | None = None
    """When its body was read whole."""
    trace: RequestTrace | None = None

    def finish(self, error: str | None = None) -> None:
        if self.trace is not None:
            self.trace.finish(error)
            self.trace = None


class RequestTrace:
    """One traced request in a front end: its span and the stage running now."""

    def __init__(self, owner: Tracing, root: Span) -> None:
        self._owner = owner
        self.root = root
        self._stage: Span | None = None

    def stage(self, name: str) -> None:
        """The stage ``name`` starts now (the one before it ends)."""
        from opentelemetry import trace

        now = time.time_ns()
        if self._stage is not None:
            self._stage.end(now)
        context = trace.set_span_in_context(self.root)
        self._stage = self._owner.tracer.start_span(name, context, start_time=now)

    @property
    def traceparent(self) -> str:
        """The running stage's context, for the engine to continue."""
        return traceparent_of(self._stage if self._stage is not None else self.root)

    def finish(self, error: str | None) -> None:
        from opentelemetry.trace import Status, StatusCode

        now = time.time_ns()
        if self._stage is not None:
            self._stage.end(now)
            self._stage = None
        if error is not None:
            self.root.set_status(Status(StatusCode.ERROR, error))
        self.root.end(now)


class BatchTrace:
    """The spans of one batch in the engine: ``batch`` and its ``run``."""

    def __init__(self, owner: Tracing, batch: Span, run: Span) -> None:
        self._owner = owner
        self.batch = batch
        self.run = run

    def ran(self, times: BatchTimes) -> None:
        """The batch ran: ``run`` says how long its compute phases took, as the runner timed
        them (attributes, not spans of their own: each span costs the request path tens of
        microseconds)."""
        end = time.time_ns()
        for name, seconds in (
            ("compute_input_us", times.compute_input),
            ("compute_infer_us", times.compute_infer),
            ("compute_output_us", times.compute_output),
        ):
            self.run.set_attribute(name, round(seconds * 1e6, 1))
        self.run.end(end)
        self.batch.end(end)

    def failed(self, error: BaseException) -> None:
        from opentelemetry.trace import Status, StatusCode

        for span in (self.run, self.batch):
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
            span.end()


class Tracing:
    """The tracer provider of this process, its exporter, and the spans Stoker makes."""

    def __init__(self, process: str, parent_based: bool, environ: Mapping[str, str]) -> None:
        from opentelemetry.propagate import extract
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON

        self._extract = extract
        self.parent_based = parent_based
        attributes: dict[str, Any] = {
            "process.pid": os.getpid(),
            "service.instance.id": str(uuid.uuid4()),
            "stoker.process": process,
        }
        if not environ.get("OTEL_SERVICE_NAME"):
            attributes["service.name"] = "stoker"
        # Sampling is decided here (``app.observed``), before any span: the SDK keeps all.
        self.provider: TracerProvider = TracerProvider(
            sampler=ALWAYS_ON, resource=Resource.create(attributes)
        )
        exporter = environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
        for name in (n.strip() for n in exporter.split(",")):
            if name == "console":
                from opentelemetry.sdk.trace.export import ConsoleSpanExporter

                self.provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
            elif name == "otlp":
                self.provider.add_span_processor(BatchSpanProcessor(otlp_exporter(environ)))
            else:
                log.warning("OTEL_TRACES_EXPORTER=%s is not one Stoker has", name[:40])
        self.tracer: Tracer = self.provider.get_tracer("stoker")

    # -- the front end

    def request(self, model: str) -> RequestTrace | None:
        """The trace of the request this task serves, where it is sampled: its span (from
        when it arrived) and ``receive`` begun and ended, ``decode`` begun."""
        from opentelemetry import trace

        incoming = INCOMING.get()
        if incoming is None:
            return None
        parent = self._extract(incoming.carrier) if incoming.carrier else None
        followed = (
            self.parent_based
            and parent is not None
            and trace.get_current_span(parent).get_span_context().trace_flags.sampled
            and observed.STATE.trace_settings(model)["trace_level"] != ["OFF"]
        )
        if not followed and not observed.STATE.sampled(model):
            return None
        root = self.tracer.start_span(
            incoming.name,
            parent,
            kind=trace.SpanKind.SERVER,
            attributes={"model": model},
            start_time=incoming.started_ns,
        )
        context = trace.set_span_in_context(root)
        received = incoming.received_ns or time.time_ns()
        receive = self.tracer.start_span("receive", context, start_time=incoming.started_ns)
        receive.end(received)
        traced = RequestTrace(self, root)
        traced.stage("decode")
        incoming.trace = traced
        return traced

    # -- the engine

    async def engine(self, traceparents: Sequence[str | None], work: Awaitable[T]) -> T:
        """Run ``work`` (requests through the engine, of these trace contexts) with an
        ``engine`` span for each one traced, in ``FRAME`` for the batcher to queue."""
        from opentelemetry import trace

        spans = tuple(
            self.tracer.start_span("engine", self._extract({"traceparent": traceparent}))
            for traceparent in traceparents
            if traceparent
        )
        if not spans:
            return await work
        token = FRAME.set(spans)
        try:
            return await work
        except BaseException as error:
            for span in spans:
                span.set_status(trace.Status(trace.StatusCode.ERROR, type(error).__name__))
            raise
        finally:
            FRAME.reset(token)
            for span in spans:
                span.end()

    def batch(self, requests: Sequence[Queued], rows: int) -> BatchTrace | None:
        """A batch starts: the ``queue`` span of each traced request in it (ending now),
        and its ``batch`` and ``run`` spans; None where none of its requests is traced."""
        from opentelemetry import trace

        traced = [span for pending in requests for span in pending.traced]
        if not traced:
            return None
        now, clock = time.time_ns(), time.monotonic()
        for pending in requests:
            start = now - int((clock - pending.enqueued) * 1e9)
            for span in pending.traced:
                context = trace.set_span_in_context(span)
                self.tracer.start_span("queue", context, start_time=start).end(now)
        links = [trace.Link(span.get_span_context()) for span in traced]
        attributes = {"batch.size": rows, "batch.requests": sum(p.requests for p in requests)}
        batch = self.tracer.start_span(
            "batch",
            trace.set_span_in_context(traced[0]),
            attributes=attributes,
            links=links,
            start_time=now,
        )
        for span in traced:
            span.add_link(batch.get_span_context(), {"stoker.link": "batch"})
        run = self.tracer.start_span("run", trace.set_span_in_context(batch), start_time=now)
        return BatchTrace(self, batch, run)


def otlp_exporter(environ: Mapping[str, str]) -> Any:
    """The OTLP span exporter ``OTEL_EXPORTER_OTLP(_TRACES)_PROTOCOL`` names; it reads its
    endpoint, headers and timeout from the ``OTEL_EXPORTER_OTLP_*`` variables itself."""
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol != "http/protobuf":
        log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%s: http/protobuf instead", protocol[:40])
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter()
