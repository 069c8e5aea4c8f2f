"""The ASGI application: lifespan, the body-size guard, the error handlers, the routes."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app import __version__, tracing
from app.child import watch_loading
from app.errors import (
    BadRequest,
    PayloadTooLarge,
    RequestTimeout,
    StokerError,
    Unavailable,
    client_text,
)
from app.frontend import observability
from app.frontend.auth import ApiKeys
from app.frontend.body_sink import BODY_INTO, BodyReader
from app.frontend.browser import BrowserGuard, HostPolicy
from app.frontend.http_limits import Saturation
from app.frontend.plane import DataPlane
from app.frontend.refusal import refuse
from app.frontend.routes import infer_response, json_response, router
from app.metrics import http_refused
from app.settings import Settings
from engines.heap import freeze_heap

if TYPE_CHECKING:
    import grpc

log = logging.getLogger(__name__)


class BodyLimit:
    """What a request body may cost, for every route, before the application reads it:

    - 413 when it is over ``max_bytes``: at once when ``Content-Length`` says so, else as soon
      as the streamed bytes pass it;
    - 503 at once when the bodies being received would pass ``max_inflight_bytes`` in all,
      or ``share`` of it from the client's address (declared lengths reserved up front; a
      chunked body counted as its bytes arrive), so one address never takes the whole;
    - 408 when it has not arrived whole within ``timeout_s`` of the request's start, however
      slowly it trickles (the connection and its reservation are freed then).

    It is full, in ``saturation``, while a body of ``max_bytes`` would not fit.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        max_inflight_bytes: int,
        timeout_s: float,
        share: float = 1.0,
        saturation: Saturation | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.max_per_address = max(1, int(max_inflight_bytes * share))
        self.timeout_s = timeout_s
        self.inflight = 0
        self.by_address: dict[str, int] = {}
        self.saturation = saturation

    def _full(self, more: int, address: str) -> str | None:
        if not more:
            return None
        if self.inflight + more > self.max_inflight_bytes:
            return (
                f"{self.inflight} body bytes are being received already (at most "
                f"{self.max_inflight_bytes}); retry later"
            )
        held = self.by_address.get(address, 0)
        if held + more > self.max_per_address:
            return (
                f"{held} body bytes are being received from this address already (at most "
                f"{self.max_per_address}); retry later"
            )
        return None

    def _reserve(self, address: str, more: int) -> None:
        self.inflight += more
        held = self.by_address.get(address, 0) + more
        if held:
            self.by_address[address] = held
        else:
            self.by_address.pop(address, None)
        if self.saturation is not None:
            room = self.max_inflight_bytes - self.inflight
            self.saturation.note("body-bytes", room < min(self.max_bytes, self.max_inflight_bytes))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                http_refused(400, "content_length")
                await refuse(send, 400, "invalid Content-Length")
                return
            if int(declared) > self.max_bytes:
                message = f"request body of {int(declared)} bytes exceeds {self.max_bytes}"
                http_refused(413, "body_bytes")
                await refuse(send, 413, message)
                return
        size = int(declared) if declared is not None else 0
        client = scope.get("client")
        address = str(client[0]) if client else ""
        full = self._full(size, address)
        if full is not None:
            http_refused(503, "inflight_bytes")
            await refuse(send, 503, full)
            return
        reserved = size
        self._reserve(address, reserved)
        received = 0
        complete = timed_out = False
        deadline = time.monotonic() + self.timeout_s

        def too_slow() -> RequestTimeout:
            nonlocal timed_out
            timed_out = True
            http_refused(408, "body_timeout")
            return RequestTimeout(
                f"{received} of {size or 'the'} body bytes arrived in {self.timeout_s:g} s"
            )

        extensions = scope.get("extensions") or {}
        into: BodyReader | None = extensions.get(BODY_INTO)
        if into is not None:  # a declared body read straight into its buffer: same deadline

            async def limited_into(buffer: memoryview) -> int:
                nonlocal received, complete
                assert into is not None
                if not into.waits:  # the body is here (or its client gone): nothing to time
                    received = await into(buffer)
                    complete = True
                    return received
                try:
                    async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                        received = await into(buffer)
                except TimeoutError:
                    received = into.received
                    raise too_slow() from None
                complete = True
                return received

            extensions[BODY_INTO] = limited_into

        async def limited() -> Message:
            nonlocal received, reserved, complete
            if complete:  # after the body: only the disconnect is left to wait for
                return await receive()
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    message = await receive()
            except TimeoutError:
                raise too_slow() from None
            if message["type"] == "http.request":
                chunk = len(message.get("body", b""))
                received += chunk
                if received > self.max_bytes:
                    http_refused(413, "body_bytes")
                    raise PayloadTooLarge(f"request body exceeds {self.max_bytes} bytes")
                if received > reserved:  # chunked, or longer than declared
                    full = self._full(received - reserved, address)
                    if full is not None:
                        http_refused(503, "inflight_bytes")
                        raise Unavailable(full)
                    self._reserve(address, received - reserved)
                    reserved = received
                complete = not message.get("more_body", False)
            else:
                complete = True
            return message

        async def answer(message: Message) -> None:
            if message["type"] == "http.response.start" and timed_out:
                # The body did not come: the server would wait on the rest of it (an early
                # answer to a body that does come is fine, the server reads past it), and the
                # client on the server. Close the connection after the 408.
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        try:
            await self.app(scope, limited, answer)
        finally:
            self._reserve(address, -reserved)


INFER_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")


class InferFastPath:
    """``POST /v2/models/{name}[/versions/{version}]/infer`` answered straight from ASGI.

    The busiest route does the same work as its FastAPI route (``routes.infer_response``),
    after the same middleware (API keys, body limits), but without FastAPI's stack: its
    route matching and dependency solving, which a profile of a front end put above the V2
    codec itself (every request tried some 20 routes), and its own layers (error, telemetry
    and body-limit middleware, ``StokerApp``). Errors are answered as the exception handlers
    answer them (``ERROR_HANDLERS``). Every other path goes on to ``routed``: the
    application's own stack."""

    def __init__(self, app: FastAPI, routed: ASGIApp) -> None:
        self.app = app
        self.routed = routed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = INFER_PATH.fullmatch(scope["path"]) if scope["type"] == "http" else None
        if match is None or scope["method"] != "POST":
            await self.routed(scope, receive, send)
            return
        scope["app"] = self.app  # as Starlette sets it: the route's request.app
        request = Request(scope, receive, send)
        response: Response
        try:
            response = await infer_response(request, match[1], match[2])
        except Exception as error:
            response = await handler_of(error)(request, error)
        await response(scope, receive, send)


class StokerApp(FastAPI):
    """FastAPI behind a door of Stoker's own: every request passes the door's layers first
    (the browser guard, API keys, body limits, tracing where on), whose innermost
    (``InferFastPath``) answers the infer path and hands the rest to FastAPI's own stack
    (``routed``). The layers are those ``add_middleware`` would put inside FastAPI's, in the
    same order, outside it instead, so the busiest path pays for no layer it does not use.

    What FastAPI's ``ServerErrorMiddleware`` did for the layers when they were inside it,
    ``__call__`` does: an exception out of the door before a response began is answered as
    the exception handlers answer it (``handler_of``: a JSON 500 for the unexpected, logged),
    not left to the server's plain-text one. The infer path does not pass ``FastAPI.__call__``,
    so FastAPI's own telemetry (spans and metrics it records where a global OpenTelemetry
    provider is set from outside) does not see it; Stoker's tracing (``app.tracing``) does."""

    door: ASGIApp | None = None
    layers: tuple[str, ...] = ()
    """The door's layers, outermost first, by class name (what a request passes)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        door = self.door
        if door is None or scope["type"] != "http":  # the lifespan: FastAPI's
            await super().__call__(scope, receive, send)
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await door(scope, receive, sending)
        except Exception as error:
            if started:  # half an answer is out: the server closes the connection
                raise
            request = Request(scope, receive)
            response = await handler_of(error)(request, error)
            await response(scope, receive, send)

    async def routed(self, scope: Scope, receive: Receive, send: Send) -> None:
        """FastAPI's own stack: its middleware, exception handlers and router."""
        await super().__call__(scope, receive, send)

    def open_door(self, *layers: Callable[[ASGIApp], ASGIApp]) -> None:
        """Build the door from its layers, innermost first, around ``InferFastPath``. A layer
        that says it would pass every request on as it is (``passes_all``: API keys with no
        keys) is left out."""
        door: ASGIApp = InferFastPath(self, self.routed)
        names = [type(door).__name__]
        for layer in layers:
            made = layer(door)
            if getattr(made, "passes_all", False):
                continue
            door = made
            names.append(type(door).__name__)
        self.door = door
        self.layers = tuple(reversed(names))


async def stoker_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, StokerError)
    return json_response({"error": exc.message}, exc.status)


async def http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return json_response({"error": str(exc.detail)}, exc.status_code)


async def validation_error(_: Request, exc: Exception) -> Response:
    # FastAPI's default 422 echoes the input back; say what is wrong and where, nothing more.
    assert isinstance(exc, RequestValidationError)
    problems = "; ".join(
        f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg', 'invalid')}"
        for err in exc.errors()[:5]
    )
    return json_response({"error": BadRequest(problems).message}, 400)


async def client_gone(request: Request, _: Exception) -> Response:
    # The client closed the connection mid-body: nothing can be answered, nothing is wrong
    # with the server. One line, not a traceback (a flood of them would fill the disk).
    client = request.client
    log.info(
        "client %s went away mid-request (%s %s)",
        client.host if client else "?",
        request.method,
        client_text(request.url.path),
    )
    return Response(status_code=499)


async def unexpected_error(_: Request, exc: Exception) -> Response:
    log.error("unhandled %s: %s", type(exc).__name__, exc, exc_info=exc)
    return json_response({"error": "internal server error"}, 500)


ErrorHandler = Callable[[Request, Exception], Awaitable[Response]]
ERROR_HANDLERS: dict[type[Exception], ErrorHandler] = {
    StokerError: stoker_error,
    HTTPException: http_error,
    RequestValidationError: validation_error,
    ClientDisconnect: client_gone,
    Exception: unexpected_error,
}
"""What answers an exception a route raises, by its type (the nearest in its MRO, as
Starlette looks them up): the application's handlers and ``InferFastPath``'s."""


def handler_of(error: Exception) -> ErrorHandler:
    return next(ERROR_HANDLERS[kind] for kind in type(error).__mro__ if kind in ERROR_HANDLERS)


def embedded(settings: Settings) -> DataPlane:
    """The data plane over the engine in this process: one process serves everything (the
    embedded default). The one place the front end's room opens the engine's."""
    from app.engine.local import LocalEngine

    return DataPlane(settings, LocalEngine(settings))


async def start_grpc(
    plane: DataPlane, settings: Settings, on_fatal: Callable[[], None] | None
) -> grpc.aio.Server | None:
    """The gRPC API beside HTTP on ``server.grpc_port`` (None when that is 0). A port that
    cannot be bound stops the server, as a taken HTTP port does."""
    if not settings.server.grpc_port:
        return None
    # Imported only when served: grpc and its threads cost nothing where gRPC is off.
    from app.frontend.grpc import server

    try:
        return await server.start(plane, settings)
    except OSError as error:
        log.error("%s", error)
        if on_fatal is not None:
            on_fatal()
        raise


def create_app(
    settings: Settings,
    on_fatal: Callable[[], None] | None = None,
    make_plane: Callable[[], DataPlane] | None = None,
) -> StokerApp:
    """The application. Models load in the background after startup so liveness answers at
    once while readiness stays false until every runner is warm; ``on_fatal`` is called if
    loading fails (the CLI stops the server, so the process exits non-zero). ``make_plane``:
    what serves the routes (default: the data plane over the engine in this process,
    ``embedded``; a front-end process passes one over its ``RemoteEngine``)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        plane = make_plane() if make_plane is not None else embedded(settings)
        app.state.plane = plane
        grpc_server = await start_grpc(plane, settings, on_fatal)
        loading = asyncio.create_task(plane.start(), name="load-models")
        watch_loading(loading, plane, on_fatal)
        freeze_heap()  # the app and its imports; an engine freezes its models once loaded
        try:
            yield
        finally:
            if grpc_server is not None:
                # The drain has answered what the plane accepted; replies still being sent
                # get what is left of the drain timeout.
                await grpc_server.stop(max(1.0, plane.drain_time_left()))
            if not loading.done():
                loading.cancel()
            await asyncio.gather(loading, return_exceptions=True)
            await plane.stop()
            await asyncio.to_thread(tracing.shutdown)

    app = StokerApp(
        title="Stoker",
        version=__version__,
        description="KServe V2 inference server with dynamic batching.",
        lifespan=lifespan,
        docs_url="/docs",
        redoc_url=None,
    )
    app.include_router(router)
    app.include_router(observability.router)
    # The caps' fullness, for readiness: the server's connection cap and BodyLimit note here.
    saturation = Saturation(settings.limits.saturated_after_s)
    app.state.saturation = saturation
    for kind, handler in ERROR_HANDLERS.items():
        app.add_exception_handler(kind, handler)
    keys = settings.auth.keys()
    server = settings.server
    hosts = HostPolicy.of(server.allowed_hosts, server.host, bool(keys))
    tracing.configure("front-end" if make_plane else "server", server.log_level)
    layers: list[Callable[[ASGIApp], ASGIApp]] = [
        partial(
            BodyLimit,
            max_bytes=settings.limits.max_body_bytes,
            max_inflight_bytes=settings.limits.max_inflight_body_bytes,
            timeout_s=settings.limits.body_timeout_s,
            share=settings.limits.max_share_per_address,
            saturation=saturation,
        ),
        # Outside the limits: an unauthenticated request is refused before its body.
        partial(ApiKeys, keys=keys, protect_metrics=settings.auth.protect_metrics),
        # Outside the keys: a browser's cross-site request never reaches the rest.
        partial(BrowserGuard, hosts=hosts, origins=None if keys else server.allowed_origins),
    ]
    if tracing.tracer is not None:  # outermost: a request's span begins at its arrival
        layers.append(observability.TraceRequests)
    app.open_door(*layers)
    if keys:
        log.info(
            "API keys required (%d configured); open: health%s",
            len(keys),
            "" if settings.auth.protect_metrics else ", /metrics",
        )
    return app
