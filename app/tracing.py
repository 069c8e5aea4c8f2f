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
  ``tracestate`` from HTTP headers or gRPC metadata, a new root where none came; each
  request of a gRPC stream its own, under the stream's context), and under it ``receive``
  (the body read), ``decode`` (parse and validate against the contract; an upload's header
  screened), ``make rows`` (an upload decoded, resized and cropped here, where the front end
  makes its rows), ``engine call`` (gathered and across to the engine and back),
  ``encode and write``;
- engine: ``engine`` (the request's stay in the engine, a child of ``engine call``: its
  context crosses on the wire as ``RunItem.traceparent``, ``Infer.traceparent`` or
  ``Classify.traceparents``), under it an upload's ``decode`` (its images decoded, or the
  rows a front end made stacked), ``queue`` (its wait in the batcher), and the batch it ran
  in: ``batch`` (rows, requests; linked from every request's ``engine`` span and linking to
  each) with ``run`` (the runner's run, its compute input / infer / output times as
  attributes).

A span is a slotted record made and ended on the request path in about a microsecond, not
the SDK's span object (tens of microseconds each): ``app.otlp`` encodes and sends them from
its own thread.
"""

from __future__ import annotations

import contextvars
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from random import getrandbits
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from app import observed

if TYPE_CHECKING:
    from app.metrics import BatchTimes
    from app.otlp import Exporter

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
REQUESTS: contextvars.ContextVar[tuple[Span | None, ...]] = contextvars.ContextVar(
    "stoker_requests", default=()
)
"""In the engine: each request's ``engine`` span, by its place in the frame (None: untraced)."""
CROSSED: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "stoker_crossed", default=None
)
"""In the engine: when the front end wrote the call this task answers and when the engine's
link read it (wall clock ns; ``wire.Run.sent_ns``), which its ``engine`` spans note."""

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
        tracer.shutdown()
        tracer = None


def carried(metadata: Iterable[tuple[str, str | bytes]] | None) -> dict[str, str]:
    """A gRPC call's ``traceparent`` and ``tracestate``, from its invocation metadata."""
    return {
        key: value if isinstance(value, str) else value.decode("latin-1")
        for key, value in metadata or ()
        if key in CARRIED
    }


def wall_ns(monotonic_s: float) -> int:
    """The wall clock (ns, as spans are stamped) of a ``time.monotonic()`` reading."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def traceparent_of(span: Span) -> str:
    return f"00-{span.trace_id:032x}-{span.span_id:016x}-01"


def parent_of(carrier: Mapping[str, str]) -> tuple[int, int, bool, str] | None:
    """W3C ``traceparent`` (and ``tracestate``): its trace id, parent span id, whether it
    says sampled, and the trace state; None where it is absent or not valid."""
    header = carrier.get("traceparent")
    if header is None:
        return None
    header = header.strip()
    version = header[:2]
    # version-trace-parent-flags; a later version may add fields after a dash, 00 none.
    if len(header) < 55 or version == "ff" or (len(header) > 55 and version == "00"):
        return None
    if header[2] != "-" or header[35] != "-" or header[52] != "-" or header[55:56] not in "-":
        return None
    if not HEX.issuperset(header[:2] + header[3:35] + header[36:52] + header[53:55]):
        return None
    trace_id, span_id = int(header[3:35], 16), int(header[36:52], 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, bool(int(header[53:55], 16) & 1), carrier.get("tracestate", "")


def ours(traceparent: str) -> tuple[int, int, bool, str] | None:
    """A ``traceparent`` of ``traceparent_of`` (the front end's, to the engine): read by
    slicing, as it is well formed; anything else through ``parent_of``."""
    if len(traceparent) == 55 and traceparent.startswith("00-") and traceparent[-3:] == "-01":
        try:
            trace_id, span_id = int(traceparent[3:35], 16), int(traceparent[36:52], 16)
        except ValueError:
            return None
        return (trace_id, span_id, True, "") if trace_id and span_id else None
    return parent_of({"traceparent": traceparent})


class Span:
    """One span: what ``app.otlp`` sends of it once it ends (``end``)."""

    __slots__ = (
        "_owner",
        "attributes",
        "end_ns",
        "error",
        "links",
        "name",
        "parent_id",
        "server",
        "span_id",
        "start_ns",
        "trace_id",
        "trace_state",
    )

    def __init__(
        self,
        owner: Exporter,
        name: str,
        trace_id: int,
        parent_id: int,
        start_ns: int,
        trace_state: str = "",
        attributes: dict[str, Any] | None = None,
    ) -> None:
        self._owner = owner
        self.name = name
        self.trace_id = trace_id
        self.span_id = getrandbits(64) or 1
        self.parent_id = parent_id
        self.start_ns = start_ns
        self.end_ns = 0
        self.server = False
        self.trace_state = trace_state
        self.attributes = attributes
        self.links: list[tuple[int, int, dict[str, Any] | None]] | None = None
        self.error: str | None = None

    def child(self, name: str, start_ns: int) -> Span:
        return Span(self._owner, name, self.trace_id, self.span_id, start_ns, self.trace_state)

    def set_attribute(self, key: str, value: Any) -> None:
        if self.attributes is None:
            self.attributes = {}
        self.attributes[key] = value

    def link(self, other: Span, attributes: dict[str, Any] | None = None) -> None:
        if self.links is None:
            self.links = []
        self.links.append((other.trace_id, other.span_id, attributes))

    def end(self, end_ns: int | None = None) -> None:
        self.end_ns = time.time_ns() if end_ns is None else end_ns
        self._owner.ended(self)


class Incoming:
    """An inference request as its transport received it: what the data plane's trace of
    it starts from, and what the transport ends it with. ``carrier``: its ``traceparent``
    and ``tracestate``, where it came with them; ``started_ns``: when it arrived, by default
    now (its ``receive`` lasts until the data plane takes it, its body read)."""

    __slots__ = ("carrier", "name", "started_ns", "trace")

    def __init__(self, name: str, carrier: dict[str, str], started_ns: int | None = None) -> None:
        self.name = name
        self.carrier = carrier
        self.started_ns = time.time_ns() if started_ns is None else started_ns
        self.trace: RequestTrace | None = None

    def finish(self, error: str | None = None) -> None:
        if self.trace is not None:
            self.trace.finish(error)
            self.trace = None


class RequestTrace:
    """One traced request in a front end: its span and the stage running now."""

    __slots__ = ("_stage", "root")

    def __init__(self, root: Span) -> None:
        self.root = root
        self._stage: Span | None = None

    def note(self, key: str, value: Any) -> None:
        """An attribute of the running stage (of the request's span before any)."""
        (self._stage if self._stage is not None else self.root).set_attribute(key, value)

    def stage(self, name: str) -> None:
        """The stage ``name`` starts now (the one before it ends)."""
        now = time.time_ns()
        if self._stage is not None:
            self._stage.end(now)
        self._stage = self.root.child(name, now)

    @property
    def traceparent(self) -> str:
        """The running stage's context, for the engine to continue."""
        return traceparent_of(self._stage if self._stage is not None else self.root)

    def finish(self, error: str | None) -> None:
        now = time.time_ns()
        if self._stage is not None:
            self._stage.end(now)
            self._stage = None
        if error is not None:
            self.root.error = error
        self.root.end(now)


class BatchTrace:
    """The spans of one batch in the engine: ``batch`` and its ``run``."""

    __slots__ = ("batch", "run")

    def __init__(self, batch: Span, run: Span) -> None:
        self.batch = batch
        self.run = run

    def ran(self, times: BatchTimes) -> None:
        """The batch ran: ``run`` says how long its compute phases took, as the runner timed
        them (attributes, not spans of their own: a span a request is what tracing costs)."""
        end = time.time_ns()
        self.run.attributes = {
            "compute_input_us": round(times.compute_input * 1e6, 1),
            "compute_infer_us": round(times.compute_infer * 1e6, 1),
            "compute_output_us": round(times.compute_output * 1e6, 1),
        }
        self.run.end(end)
        self.batch.end(end)

    def failed(self, error: BaseException) -> None:
        for span in (self.run, self.batch):
            span.error = f"{type(error).__name__}: {error}"
            span.end()


class Tracing:
    """This process's exporter (``app.otlp``) and the spans Stoker makes."""

    def __init__(self, process: str, parent_based: bool, environ: Mapping[str, str]) -> None:
        from opentelemetry.sdk.resources import Resource

        from app import otlp

        self.parent_based = parent_based
        attributes: dict[str, Any] = {
            "process.pid": os.getpid(),
            "service.instance.id": str(uuid.uuid4()),
            "stoker.process": process,
        }
        if not environ.get("OTEL_SERVICE_NAME"):
            attributes["service.name"] = "stoker"
        self.resource: Mapping[str, Any] = Resource.create(attributes).attributes
        self.exporter = otlp.Exporter(self.resource, otlp.sender(environ), environ)

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def span(self, name: str, parent: tuple[int, int, bool, str] | None, start_ns: int) -> Span:
        """A span of its own trace (a new root where ``parent`` is None)."""
        if parent is None:
            return Span(self.exporter, name, getrandbits(128) or 1, 0, start_ns)
        trace_id, parent_id, _, state = parent
        return Span(self.exporter, name, trace_id, parent_id, start_ns, state)

    # -- the front end

    def request(self, model: str) -> RequestTrace | None:
        """The trace of the request this task serves, where it is sampled: its span (from
        when it arrived) and ``receive`` begun and ended, ``decode`` begun."""
        incoming = INCOMING.get()
        if incoming is None:
            return None
        parent = parent_of(incoming.carrier) if incoming.carrier else None
        if self.parent_based and parent is not None:
            # A parent's decision holds either way (W3C's sampled flag): a caller that did
            # not sample its trace does not get one from us.
            if not parent[2] or observed.STATE.trace_settings(model)["trace_level"] == ["OFF"]:
                return None
        elif not observed.STATE.sampled(model):
            return None
        root = self.span(incoming.name, parent, incoming.started_ns)
        root.server = True
        if model:
            root.attributes = {"model": model}
        root.child("receive", incoming.started_ns).end()
        traced = RequestTrace(root)
        traced.stage("decode")
        incoming.trace = traced
        return traced

    # -- the engine

    async def engine(self, traceparents: Sequence[str | None], work: Awaitable[T]) -> T:
        """Run ``work`` (requests through the engine, of these trace contexts) with an
        ``engine`` span for each one traced: in ``FRAME`` for the batcher to queue, and in
        ``REQUESTS`` by request (None where one is not traced)."""
        now = time.time_ns()
        each = tuple(
            None
            if (parent := ours(traceparent) if traceparent else None) is None
            else self.span("engine", parent, now)
            for traceparent in traceparents
        )
        spans = tuple(span for span in each if span is not None)
        if not spans:
            return await work
        crossed = CROSSED.get()
        if crossed is not None:
            for span in spans:
                span.set_attribute("stoker.sent_ns", crossed[0])
                span.set_attribute("stoker.read_ns", crossed[1])
        token, by_request = FRAME.set(spans), REQUESTS.set(each)
        failed = None
        try:
            return await work
        except BaseException as error:
            failed = type(error).__name__
            raise
        finally:
            FRAME.reset(token)
            REQUESTS.reset(by_request)
            end = time.time_ns()
            for span in spans:
                span.error = failed
                span.end(end)

    def batch(self, requests: Sequence[Queued], rows: int) -> BatchTrace | None:
        """A batch starts: the ``queue`` span of each traced request in it (ending now),
        and its ``batch`` and ``run`` spans; None where none of its requests is traced."""
        traced = [span for pending in requests for span in pending.traced]
        if not traced:
            return None
        now = time.time_ns()
        for pending in requests:
            start = wall_ns(pending.enqueued)
            for span in pending.traced:
                span.child("queue", start).end(now)
        attributes = {"batch.size": rows, "batch.requests": sum(p.requests for p in requests)}
        batch = traced[0].child("batch", now)
        batch.attributes = attributes
        batch.links = [(span.trace_id, span.span_id, None) for span in traced]
        for span in traced:
            span.link(batch, BATCH_LINK)
        return BatchTrace(batch, batch.child("run", now))


BATCH_LINK = {"stoker.link": "batch"}
CARRIED = frozenset({"traceparent", "tracestate"})
HEX = frozenset("0123456789abcdef")


async def spanned(request: int, name: str, work: Awaitable[T]) -> T:
    """``work`` as the span ``name`` under the ``engine`` span of request ``request`` of
    the frame (``REQUESTS``), where that one is traced."""
    spans = REQUESTS.get()
    span = spans[request] if request < len(spans) else None
    if span is None:
        return await work
    stage = span.child(name, time.time_ns())
    try:
        return await work
    except BaseException as error:
        stage.error = type(error).__name__
        raise
    finally:
        stage.end()


async def framed(requests: Iterable[int], work: Awaitable[T]) -> T:
    """``work`` (a batcher entry of these requests of the frame, ``REQUESTS``) queued with
    their ``engine`` spans alone in ``FRAME``."""
    spans = REQUESTS.get()
    token = FRAME.set(tuple(s for i in requests if i < len(spans) and (s := spans[i])))
    try:
        return await work
    finally:
        FRAME.reset(token)
