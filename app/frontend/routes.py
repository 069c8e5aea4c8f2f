"""HTTP routes: parse, call one data-plane method, serialise.

KServe V2 / Open Inference Protocol with Triton's binary tensor, classification,
statistics, model repository and system shared-memory extensions; ``POST /infer`` for image
uploads; ``GET /metrics``. (The trace and logging extensions are in ``observability``.)
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import orjson
from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.datastructures import UploadFile

from app import __version__
from app.errors import BadRequest, PayloadTooLarge
from app.frontend.body_sink import BODY_INTO, ReadInto
from app.frontend.control_parameters import (
    LOAD_PARAMETERS,
    UNLOAD_PARAMETERS,
    config_override,
    control_parameters,
)
from app.frontend.disconnect import unless_disconnected
from app.frontend.http_limits import BEGAN, Saturation
from app.frontend.plane import DataPlane
from app.frontend.protocol_schema import INFER_REQUEST_SCHEMA, INFER_RESPONSE_SCHEMA
from app.metrics import http_refused
from app.protocol import HEADER_LENGTH

# Every status other than 200 carries {"error": message}; documented once for every route.
ERROR_RESPONSE: dict[str, Any] = {
    "description": "400 bad input, 401 no or wrong API key, 403 a browser's cross-origin "
    "request or an unknown Host, 404 unknown model, version or route, 413 too large, 429 "
    "queue full, 503 not ready or draining, 504 deadline, 500 engine failure",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "properties": {"error": {"type": "string"}},
                "required": ["error"],
            }
        }
    },
}
router = APIRouter(responses={"default": ERROR_RESPONSE})

EXTENSIONS = [
    "binary_tensor_data",
    "classification",
    "statistics",
    "model_repository",
    "system_shared_memory",
    "trace",
    "logging",
]


def json_response(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def client_of(request: Request) -> str:
    """Whom the batcher is fair to: the client's address (one client behind a proxy)."""
    return request.client.host if request.client else ""


def plane_of(request: Request) -> DataPlane:
    plane: DataPlane = request.app.state.plane
    return plane


CLIENT_GONE = Response(status_code=499)


# A declared body gets a buffer of at most this up front; beyond it the buffer grows with the
# bytes that arrive, so a client that declares 64 MiB and sends one byte costs 4 MiB, not 64.
UPFRONT_BODY_BYTES = 4 * 1024 * 1024


async def read_body(
    request: Request, into: memoryview | None = None
) -> bytes | bytearray | memoryview:
    """The whole body. With a declared length up to ``UPFRONT_BODY_BYTES``, the protocol's
    reads land in a buffer of that length (``app.frontend.body_sink``; the application wakes
    once); a longer one is copied chunk by chunk into a buffer that starts at
    ``UPFRONT_BODY_BYTES`` and at most doubles as bytes arrive, so memory follows what was
    received, never what was declared. ``into``: a buffer at least as long as the declared
    length to read into instead (a shared-memory slot); the body is then a view of it. (How
    long it may take is ``BodyLimit``'s business, for every route.)"""
    declared = request.headers.get("content-length")
    if declared is None or not declared.isdigit():
        return await request.body()
    length = int(declared)
    reader: ReadInto | None = request.scope.get("extensions", {}).get(BODY_INTO)
    if reader is not None and (into is None or len(into) >= length):
        # Copied once, by the protocol (app.frontend.body_sink), and one wake-up for the
        # whole body. Without a slot, into a buffer of the declared length, allocated up
        # front only to UPFRONT_BODY_BYTES (a longer body grows as it arrives, below).
        if into is not None:
            await read_into(reader, into[:length], length)
            return into[:length]
        if length <= UPFRONT_BODY_BYTES:
            # Not zeroed first (a bytearray would be: 40-60 us for 600 KB, BENCHMARKS.md).
            own = np.empty(length, np.uint8).data
            await read_into(reader, own, length)
            return own
    if into is not None and len(into) >= length:
        buffer: bytearray | memoryview = into
    else:
        buffer = bytearray(min(length, UPFRONT_BODY_BYTES))
    filled = 0
    async for chunk in request.stream():
        end = filled + len(chunk)
        if end > length:
            raise BadRequest("request body is longer than its Content-Length")
        if end > len(buffer):
            assert isinstance(buffer, bytearray)
            buffer.extend(bytes(min(length, max(end, 2 * len(buffer))) - len(buffer)))
        buffer[filled:end] = chunk
        filled = end
    if filled != length:
        raise BadRequest("request body is shorter than its Content-Length")
    return buffer[:length] if isinstance(buffer, memoryview) else buffer


async def read_into(reader: ReadInto, view: memoryview, length: int) -> None:
    """``length`` bytes of body into ``view`` by the protocol's reader, or ``BadRequest``."""
    filled = await reader(view)
    if filled != length:
        longer = "longer" if filled > length else "shorter"
        raise BadRequest(f"request body is {longer} than its Content-Length")


# -- health and metadata ------------------------------------------------------------------


@router.get("/v2")
async def server_metadata() -> Response:
    return json_response({"name": "stoker", "version": __version__, "extensions": EXTENSIONS})


@router.get("/v2/health/live")
async def live(request: Request) -> Response:
    alive = plane_of(request).alive
    return json_response({"live": alive}, 200 if alive else 503)


@router.get("/v2/health/ready")
async def ready(request: Request) -> Response:
    """Ready: the engine is (every runner warm, no drain) and none of this process's caps
    (connections, body bytes in flight, a front end's shared-memory arena) has been full for
    ``saturated_after_s``; else 503, with the ``reason`` when it is a cap."""
    plane = plane_of(request)
    is_ready = plane.is_ready
    engines = plane.engines()  # one engine process per GPU: which of them are ready
    body: dict[str, object] = {"ready": is_ready} | ({"engines": engines} if engines else {})
    saturation: Saturation = request.app.state.saturation
    saturated = saturation.reason({"shared-memory arena": plane.arena_full_since()})
    if saturated is not None:
        body |= {"ready": False, "reason": saturated}
    return json_response(body, 200 if body["ready"] else 503)


@router.get("/v2/models/stats")
async def all_stats(request: Request) -> Response:
    return json_response({"model_stats": await plane_of(request).control("statistics")})


@router.get("/v2/models/{name}")
@router.get("/v2/models/{name}/versions/{version}")
async def model_metadata(request: Request, name: str, version: str | None = None) -> Response:
    return json_response(await plane_of(request).control("metadata", name, version))


@router.get("/v2/models/{name}/ready")
@router.get("/v2/models/{name}/versions/{version}/ready")
async def model_ready(request: Request, name: str, version: str | None = None) -> Response:
    answer = await plane_of(request).control("version_ready", name, version)
    return json_response(answer, 200 if answer["ready"] else 503)


@router.get("/v2/models/{name}/config")
@router.get("/v2/models/{name}/versions/{version}/config")
async def model_config(request: Request, name: str, version: str | None = None) -> Response:
    return json_response(await plane_of(request).control("model_config", name, version))


@router.get("/v2/models/{name}/stats")
@router.get("/v2/models/{name}/versions/{version}/stats")
async def model_stats(request: Request, name: str, version: str | None = None) -> Response:
    stats = await plane_of(request).control("statistics", name, version)
    return json_response({"model_stats": stats})


@router.post("/v2/repository/index")
async def repository_index(request: Request) -> Response:
    return json_response(await plane_of(request).control("repository_index"))


# -- model control ------------------------------------------------------------------------


async def control_body(request: Request) -> bytes:
    """The body of a model-control or shared-memory registration request, refused with 413
    past ``limits.max_control_body_bytes`` before any of it is parsed: at once when its
    ``Content-Length`` says so, else as soon as the streamed bytes pass it."""
    limit = plane_of(request).settings.limits.max_control_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        http_refused(413, "control_body_bytes")
        raise PayloadTooLarge(f"a control request's body of {int(declared)} bytes exceeds {limit}")
    parts: list[bytes] = []
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > limit:
            http_refused(413, "control_body_bytes")
            raise PayloadTooLarge(f"a control request's body exceeds {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


@router.post("/v2/repository/models/{name}/load")
async def load_model(request: Request, name: str) -> Response:
    plane = plane_of(request)
    # mode, drain, unknown model: before the body is read
    await plane.check_control(name, partial(plane.control, "repository_index"))
    parameters = control_parameters(await control_body(request), LOAD_PARAMETERS)
    await plane.control("load", name, config_override(parameters))
    return json_response({})


@router.post("/v2/repository/models/{name}/unload")
async def unload_model(request: Request, name: str) -> Response:
    plane = plane_of(request)
    await plane.check_control(name, partial(plane.control, "repository_index"))
    # unload_dependents is accepted as Triton's clients send it; no model depends on another.
    control_parameters(await control_body(request), UNLOAD_PARAMETERS)
    await plane.control("unload", name)
    return json_response({})


# -- system shared memory -----------------------------------------------------------------


class RegionRegistration(BaseModel):
    """Triton's register body: the POSIX shared-memory key and the part of it to use."""

    model_config = ConfigDict(extra="forbid")

    key: str
    offset: int = 0
    byte_size: int


@router.post(
    "/v2/systemsharedmemory/region/{name}/register",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": RegionRegistration.model_json_schema()}},
        }
    },
)
async def shm_register(request: Request, name: str) -> Response:
    # tritonclient sends the JSON without a Content-Type: parsed here, not by FastAPI.
    try:
        region = RegionRegistration.model_validate_json(await control_body(request))
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in error.errors()
        )
        raise BadRequest(f"shared memory registration: {problems}") from None
    await plane_of(request).control(
        "shm_register", name, region.key, region.offset, region.byte_size
    )
    return json_response({})


@router.post("/v2/systemsharedmemory/region/{name}/unregister")
@router.post("/v2/systemsharedmemory/unregister")
async def shm_unregister(request: Request, name: str | None = None) -> Response:
    await plane_of(request).control("shm_unregister", name)
    return json_response({})


@router.get("/v2/systemsharedmemory/region/{name}/status")
@router.get("/v2/systemsharedmemory/status")
async def shm_status(request: Request, name: str | None = None) -> Response:
    return json_response(await plane_of(request).control("shm_status", name))


# -- inference ----------------------------------------------------------------------------


def header_length(request: Request) -> int | None:
    raw = request.headers.get(HEADER_LENGTH)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"{HEADER_LENGTH} must be an integer") from None
    if value < 0:
        raise BadRequest(f"{HEADER_LENGTH} must not be negative")
    return value


INFER_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "A V2 request; with Inference-Header-Content-Length, that many bytes "
        "of JSON followed by binary tensor data (0: the raw bytes of the model's one input).",
        "content": {
            "application/json": {"schema": INFER_REQUEST_SCHEMA},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
    },
    "parameters": [
        {
            "name": HEADER_LENGTH,
            "in": "header",
            "required": False,
            "schema": {"type": "integer", "minimum": 0},
        }
    ],
}
INFER_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The outputs: JSON, or JSON followed by binary outputs when any "
        "output is asked for as binary (Inference-Header-Content-Length says where).",
        "content": {
            "application/json": {"schema": INFER_RESPONSE_SCHEMA},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
    }
}


@router.post("/v2/models/{name}/infer", openapi_extra=INFER_OPENAPI, responses=INFER_RESPONSES)
@router.post(
    "/v2/models/{name}/versions/{version}/infer",
    openapi_extra=INFER_OPENAPI,
    responses=INFER_RESPONSES,
)
async def infer(request: Request, name: str, version: str | None = None) -> Response:
    """Declared for the OpenAPI document and for a stack without ``InferFastPath``; in the
    served app ``InferFastPath`` answers these paths before FastAPI's routing is reached."""
    return await infer_response(request, name, version)


async def infer_response(request: Request, name: str, version: str | None) -> Response:
    """A V2 inference request's response (raises ``StokerError`` for the error answers):
    the route's work, which ``app.frontend.server.InferFastPath`` calls without FastAPI's
    routing."""
    plane = plane_of(request)
    # Counted from its start: a drain waits for a request whose body is still arriving.
    with plane.drain_state.in_flight():
        await plane.check(name, version)  # 404 or 503 before the body is read
        length = header_length(request)
        declared = request.headers.get("content-length")
        async with plane.body_buffer(
            int(declared) if declared and declared.isdigit() else None, client_of(request)
        ) as slot:
            body = await read_body(request, slot.view if slot is not None else None)
            began = request.scope.get(BEGAN)
            work = plane.infer(name, version, body, length, slot, client_of(request), began)
            answer = await unless_disconnected(request, work)
    if answer is None:
        return CLIENT_GONE
    content, headers = answer.encode()
    return Response(content, headers=headers)


async def uploaded_images(request: Request, max_images: int) -> tuple[list[bytes], str | None]:
    """Images from a multipart form (every file part, in order) or a raw image body; and the
    form's ``k`` field if any."""
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        async with request.form(max_files=max_images, max_fields=16) as form:
            uploads = [
                await value.read()
                for _, value in form.multi_items()
                if isinstance(value, UploadFile)
            ]
            k = form.get("k")
            return uploads, k if isinstance(k, str) else None
    if content_type.startswith(("image/", "application/octet-stream")):
        return [await request.body()], None
    raise BadRequest(
        "send the image as multipart/form-data (curl -F image=@photo.jpg) "
        "or as a raw body with Content-Type: image/jpeg or image/png"
    )


UPLOAD_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "image": {
                            "type": "array",
                            "items": {"type": "string", "format": "binary"},
                        },
                        "k": {"type": "integer", "minimum": 1},
                    },
                    "required": ["image"],
                }
            },
            "image/jpeg": {"schema": {"type": "string", "format": "binary"}},
            "image/png": {"schema": {"type": "string", "format": "binary"}},
        },
    }
}


@router.post("/infer", openapi_extra=UPLOAD_OPENAPI)
@router.post("/v2/models/{name}/classify", openapi_extra=UPLOAD_OPENAPI)
@router.post("/v2/models/{name}/versions/{version}/classify", openapi_extra=UPLOAD_OPENAPI)
async def classify_upload(
    request: Request, name: str | None = None, version: str | None = None, k: int | None = None
) -> Response:
    plane = plane_of(request)
    with plane.drain_state.in_flight():  # from its start, as ``infer_response``
        if name is not None:
            await plane.check(name, version)  # 404 or 503 before the uploads are read
        uploads, form_k = await uploaded_images(request, plane.max_images)
        if form_k is not None:
            try:
                k = int(form_k)
            except ValueError:
                raise BadRequest("k must be an integer") from None
        began = request.scope.get(BEGAN)
        work = plane.classify_images(name, version, uploads, k, client_of(request), began)
        answer = await unless_disconnected(request, work)
    if answer is None:
        return CLIENT_GONE
    model, answered_version, predictions = answer
    return json_response(
        {"model_name": model, "model_version": answered_version, "predictions": predictions}
    )


@router.get(
    "/metrics",
    responses={200: {"description": "Prometheus text", "content": {"text/plain": {}}}},
)
async def metrics(request: Request) -> Response:
    text = await plane_of(request).control("metrics_text")
    return Response(text, media_type=CONTENT_TYPE_LATEST)
