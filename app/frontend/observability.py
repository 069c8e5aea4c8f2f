"""Triton's trace and logging extensions over HTTP, and the trace of each HTTP inference.

- ``GET/POST /v2/trace/setting`` and ``/v2/models/{m}/trace/setting``: the trace settings
  (``app.observed``), global or per model, as ``tritonclient``'s ``get_trace_settings`` and
  ``update_trace_settings`` read and write them;
- ``GET/POST /v2/logging``: the log settings (``get_log_settings`` / ``update_log_settings``);
- Triton's CUDA shared-memory extension, which Stoker does not implement, answers 501 with a
  JSON error naming it (gRPC's UNIMPLEMENTED), not a bare 404.

A change goes through the data plane to the engine client, so it reaches every process.
``TraceRequests`` is the middleware that receives an inference request for ``app.tracing``,
its span from the request's first bytes read (``http_limits.BEGAN``): installed only where
tracing is on.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app import tracing
from app.errors import NotImplementedHere
from app.frontend.control_parameters import json_object
from app.frontend.http_limits import BEGAN
from app.frontend.routes import ERROR_RESPONSE, control_body, json_response, plane_of

router = APIRouter(responses={"default": ERROR_RESPONSE})


async def settings_update(request: Request) -> dict[str, Any]:
    """The body of a settings POST: a JSON object (empty: nothing changes), held to a control
    body's limit (``limits.max_control_body_bytes``) before it is parsed."""
    body = await control_body(request)
    if not body.strip():
        return {}
    return json_object(body, "the settings body", "settings must be a JSON object")


@router.get("/v2/trace/setting")
async def trace_setting(request: Request) -> Response:
    return json_response(await plane_of(request).control("trace_settings"))


@router.post("/v2/trace/setting")
async def update_trace_setting(request: Request) -> Response:
    update = await settings_update(request)
    return json_response(await plane_of(request).control("trace_settings", None, update))


@router.get("/v2/models/{name}/trace/setting")
async def model_trace_setting(request: Request, name: str) -> Response:
    return json_response(await plane_of(request).control("trace_settings", name))


@router.post("/v2/models/{name}/trace/setting")
async def update_model_trace_setting(request: Request, name: str) -> Response:
    update = await settings_update(request)
    return json_response(await plane_of(request).control("trace_settings", name, update))


@router.get("/v2/logging")
async def log_settings(request: Request) -> Response:
    return json_response(await plane_of(request).control("log_settings"))


@router.post("/v2/logging")
async def update_log_settings(request: Request) -> Response:
    update = await settings_update(request)
    return json_response(await plane_of(request).control("log_settings", update))


# Not an operation of this server: an answer for Triton's clients, left out of the OpenAPI.
@router.api_route(
    "/v2/cudasharedmemory{rest:path}", methods=["GET", "POST"], include_in_schema=False
)
async def cuda_shared_memory(rest: str) -> Response:
    raise NotImplementedHere(
        "not supported: CUDA shared memory (Triton's cuda_shared_memory extension); use "
        "system shared memory (/v2/systemsharedmemory)"
    )


def is_inference(scope: Scope) -> bool:
    """An inference request: V2's ``/infer``, the uploads' ``/infer`` and ``/classify``."""
    path = scope["path"]
    return bool(scope["method"] == "POST" and path.endswith(("/infer", "/classify")))


class TraceRequests:
    """Each HTTP inference request, for ``app.tracing``: when it arrived and its
    ``traceparent``/``tracestate``; where the data plane traced it, its status and its end
    (an error status for a 5xx answer)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_inference(scope):
            await self.app(scope, receive, send)
            return
        carrier = {
            key.decode("latin-1"): value.decode("latin-1")
            for key, value in scope["headers"]
            if key in (b"traceparent", b"tracestate")
        }
        # From its first bytes read (the protocol's stamp), not from this call: the parse
        # and the wait for the request's task's first turn are the request's time too.
        began = scope.get(BEGAN)
        arrived = None if began is None else tracing.wall_ns(began)
        incoming = tracing.Incoming(f"POST {scope['path']}", carrier, arrived)
        status = 500

        async def sent(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if incoming.trace is not None:
                    incoming.trace.root.set_attribute("http.response.status_code", status)
            await send(message)

        token = tracing.INCOMING.set(incoming)
        try:
            await self.app(scope, receive, sent)
        finally:
            tracing.INCOMING.reset(token)
            incoming.finish(f"HTTP {status}" if status >= 500 else None)
