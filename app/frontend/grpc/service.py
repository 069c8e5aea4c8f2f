"""``inference.GRPCInferenceService`` and ``grpc.health.v1.Health`` over the data plane.

Each method is one more caller of the data plane the HTTP routes call: it turns its message
into what a route would hand over (``app.frontend.grpc.codec``), calls the same method and
turns the answer back. So limits, shared memory, classification, batching, metrics,
statistics and errors are HTTP's, and an inference answer carries the very bytes HTTP's
binary answer does. A ``StokerError`` ends the call with the gRPC code Triton uses for that
failure and the error's message; anything else is logged here and answered INTERNAL, never
with a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from app import __version__, tracing
from app.contract import THREADED_DECODE_BYTES
from app.errors import PayloadTooLarge, StokerError
from app.frontend.control_parameters import (
    LOAD_PARAMETERS,
    UNLOAD_PARAMETERS,
    check_parameters,
    config_override,
)
from app.frontend.grpc import codec
from app.frontend.grpc.arrivals import ARRIVED
from app.frontend.grpc.ending import Ended
from app.frontend.grpc.generated import grpc_service_pb2 as pb
from app.frontend.grpc.limits import CallLimits, peer_host
from app.frontend.plane import DataPlane
from app.frontend.routes import EXTENSIONS
from app.json_bounds import LARGE_DECODES
from app.metrics import http_refused
from app.tensor_data import quote

log = logging.getLogger(__name__)

# Triton's codes for the failures Stoker's HTTP statuses name (a full queue is UNAVAILABLE in
# Triton, which clients retry; RESOURCE_EXHAUSTED is for what is too large).
CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
SERVICE = "inference.GRPCInferenceService"
STREAMED = f"{SERVICE}/ModelStreamInfer"
"""The span name of each request of a stream (``app.tracing``)."""
# How often a health Watch looks at readiness again: readiness is the engines' state (in
# another process, with several front ends), which no event announces.
WATCH_INTERVAL_S = 1.0
# Requests of one stream running or answered and not yet sent: enough to keep a batch full
# for a client that pipelines, few enough that one that never reads holds little.
STREAM_WINDOW = 64

M = TypeVar("M")
if TYPE_CHECKING:
    from typing import TypeAlias

    Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]
    Method: TypeAlias = Callable[[Any, Any, Context], Coroutine[Any, Any, M]]


def code_of(error: StokerError) -> grpc.StatusCode:
    return CODES.get(error.status, grpc.StatusCode.INTERNAL)


async def unimplemented(context: Context, what: str) -> NoReturn:
    raise Ended(grpc.StatusCode.UNIMPLEMENTED, f"not supported: {what}")


def answered(method: Method[M]) -> Method[M]:
    """A unary method whose ``StokerError`` ends the call with its code and message, and any
    other exception with INTERNAL (logged here, with its traceback, for the operator), as an
    ``Ended``: ``limited`` sets it on the call, no traceback kept."""

    @functools.wraps(method)
    async def call(self: Any, request: Any, context: Context) -> M:
        try:
            return await method(self, request, context)
        except StokerError as error:
            raise Ended(code_of(error), error.message) from None
        except (asyncio.CancelledError, Ended):
            raise
        except Exception as error:
            name = method.__name__
            log.error("unhandled %s in gRPC %s", type(error).__name__, name, exc_info=error)
            raise Ended(grpc.StatusCode.INTERNAL, "internal server error") from None

    return call


def deadline_us(context: Context) -> int | None:
    """What is left of the call's deadline, in microseconds (None: the call has none)."""
    left = context.time_remaining()
    return None if left is None else int(left * 1e6)


class InferenceService:
    """Every method of ``inference.GRPCInferenceService`` (``server.handlers`` registers
    them by the proto's names)."""

    def __init__(self, plane: DataPlane, max_body_bytes: int, limits: CallLimits) -> None:
        self.plane = plane
        self.max_body_bytes = max_body_bytes
        self.limits = limits
        """What the calls in flight hold: a stream's requests count their bytes here."""

    # -- health and metadata ------------------------------------------------------------

    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: Context
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self.plane.alive)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: Context
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.plane.is_ready)

    @answered
    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: Context
    ) -> pb.ModelReadyResponse:
        try:
            answer = await self.plane.control(
                "version_ready", request.name, request.version or None
            )
        except StokerError as error:
            # Unknown, loading or refused: not ready, as Triton answers (HTTP says 404 or 503).
            if error.status not in (404, 503):
                raise
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=bool(answer["ready"]))

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: Context
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="stoker", version=__version__, extensions=EXTENSIONS)

    @answered
    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: Context
    ) -> pb.ModelMetadataResponse:
        document = await self.plane.control("metadata", request.name, request.version or None)
        return codec.message(pb.ModelMetadataResponse, document)

    @answered
    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: Context
    ) -> pb.ModelConfigResponse:
        document = await self.plane.control("model_config", request.name, request.version or None)
        return codec.model_config(document)

    @answered
    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: Context
    ) -> pb.ModelStatisticsResponse:
        entries = await self.plane.control(
            "statistics", request.name or None, request.version or None
        )
        return codec.message(pb.ModelStatisticsResponse, {"model_stats": entries})

    @answered
    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: Context
    ) -> pb.RepositoryIndexResponse:
        entries = await self.plane.control("repository_index")
        if request.ready:
            entries = [e for e in entries if e.get("state") == "READY"]
        return codec.message(pb.RepositoryIndexResponse, {"models": entries})

    # -- model control ------------------------------------------------------------------

    @answered
    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Context
    ) -> pb.RepositoryModelLoadResponse:
        parameters = codec.repository_parameters(request.parameters)
        check_parameters(parameters, LOAD_PARAMETERS)
        await self.plane.control("load", request.model_name, config_override(parameters))
        return pb.RepositoryModelLoadResponse()

    @answered
    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Context
    ) -> pb.RepositoryModelUnloadResponse:
        check_parameters(codec.repository_parameters(request.parameters), UNLOAD_PARAMETERS)
        await self.plane.control("unload", request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # -- system shared memory -----------------------------------------------------------

    @answered
    async def SystemSharedMemoryRegister(
        self, request: pb.SystemSharedMemoryRegisterRequest, context: Context
    ) -> pb.SystemSharedMemoryRegisterResponse:
        await self.plane.control(
            "shm_register", request.name, request.key, request.offset, request.byte_size
        )
        return pb.SystemSharedMemoryRegisterResponse()

    @answered
    async def SystemSharedMemoryUnregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest, context: Context
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        await self.plane.control("shm_unregister", request.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    @answered
    async def SystemSharedMemoryStatus(
        self, request: pb.SystemSharedMemoryStatusRequest, context: Context
    ) -> pb.SystemSharedMemoryStatusResponse:
        entries = await self.plane.control("shm_status", request.name or None)
        regions = {entry["name"]: entry for entry in entries}
        return codec.message(pb.SystemSharedMemoryStatusResponse, {"regions": regions})

    # -- what Stoker does not serve ------------------------------------------------------

    async def CudaSharedMemoryRegister(
        self, request: pb.CudaSharedMemoryRegisterRequest, context: Context
    ) -> NoReturn:
        await unimplemented(context, "CUDA shared memory: use system shared memory")

    async def CudaSharedMemoryUnregister(
        self, request: pb.CudaSharedMemoryUnregisterRequest, context: Context
    ) -> NoReturn:
        await unimplemented(context, "CUDA shared memory: use system shared memory")

    async def CudaSharedMemoryStatus(
        self, request: pb.CudaSharedMemoryStatusRequest, context: Context
    ) -> NoReturn:
        await unimplemented(context, "CUDA shared memory: use system shared memory")

    @answered
    async def TraceSetting(
        self, request: pb.TraceSettingRequest, context: Context
    ) -> pb.TraceSettingResponse:
        """Triton's trace settings (``app.observed``): a setting sent without values drops
        a model's override of it."""
        update = {key: list(value.value) or None for key, value in request.settings.items()}
        settings = await self.plane.control(
            "trace_settings", request.model_name or None, update or None
        )
        answer = pb.TraceSettingResponse()
        for key, value in settings.items():
            answer.settings[key].value.extend(value if isinstance(value, list) else [value])
        return answer

    @answered
    async def LogSettings(
        self, request: pb.LogSettingsRequest, context: Context
    ) -> pb.LogSettingsResponse:
        update = {}
        for key, value in request.settings.items():
            which = value.WhichOneof("parameter_choice")
            update[key] = None if which is None else getattr(value, which)
        settings = await self.plane.control("log_settings", update or None)
        answer = pb.LogSettingsResponse()
        for key, setting in settings.items():
            into = answer.settings[key]
            if isinstance(setting, bool):
                into.bool_param = setting
            elif isinstance(setting, int):
                into.uint32_param = setting
            else:
                into.string_param = str(setting)
        return answer

    # -- inference ----------------------------------------------------------------------
    # Requests and answers are protobuf's wire bytes here (``codec.read_request``): tensors
    # are read where they arrived and written into the answer once.

    @answered
    async def ModelInfer(self, request: bytes, context: Context) -> bytes:
        return await self._infer(codec.read_request(request), context, ARRIVED.get())

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[bytes], context: Context
    ) -> AsyncGenerator[bytes, None]:
        """Every request of the stream runs as it arrives, many at once, and each is answered
        as it completes (a failure as its ``error_message``, one past the request bytes in
        flight among them); the stream ends once the client has sent its last request and
        every one is answered. At most ``STREAM_WINDOW`` requests are running or waiting for
        their answer to be sent: past that the stream is not read until one is sent, so a
        client that does not read its answers is not read either (HTTP/2's flow control then
        stops its sending), and a request's bytes count as in flight until its answer is
        sent."""
        answers: asyncio.Queue[tuple[bytes, int] | None] = asyncio.Queue()
        window = asyncio.Semaphore(STREAM_WINDOW)
        running: set[asyncio.Task[None]] = set()
        held = self.limits.message_bytes
        address = peer_host(context)
        # Each request its own trace, of the context the stream's metadata names.
        carrier = None if tracing.tracer is None else tracing.carried(context.invocation_metadata())

        async def one(data: bytes, began: float) -> None:
            refusal = held.take(address, len(data))
            kept = 0 if refusal is not None else len(data)
            incoming = None
            if carrier is not None:  # this task's own: each request its own span
                incoming = tracing.Incoming(STREAMED, carrier)
                tracing.INCOMING.set(incoming)
            try:
                answer = await self._stream_answer(data, refusal, context, began)
            except BaseException:
                if kept:
                    held.give(address, kept)
                raise
            finally:
                if incoming is not None:
                    incoming.finish()
            answers.put_nowait((answer, kept))

        async def read() -> None:
            try:
                requests = aiter(request_iterator)
                while True:
                    await window.acquire()
                    try:
                        data = await anext(requests)
                    except StopAsyncIteration:
                        break
                    task = asyncio.create_task(one(data, time.monotonic()))
                    running.add(task)
                    task.add_done_callback(running.discard)
                if running:
                    await asyncio.wait(set(running))
            finally:
                answers.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (sent := await answers.get()) is not None:
                answer, kept = sent
                try:
                    yield answer
                finally:
                    if kept:
                        held.give(address, kept)
                    window.release()
            await reader  # a failure to read the stream ends the call with it
        finally:
            reader.cancel()
            for task in running:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(reader, *running, return_exceptions=True)
            while not answers.empty():  # answered, never sent: their bytes are free
                if (unsent := answers.get_nowait()) is not None and unsent[1]:
                    held.give(address, unsent[1])

    async def _stream_answer(
        self, data: bytes, refusal: str | None, context: Context, began: float
    ) -> bytes:
        """A stream's answer to one request: its response, or its error (``refusal``: why
        its bytes were not admitted; ``began``: when it was read)."""
        request = pb.ModelInferRequest()
        try:
            call = codec.read_request(data)
            request = call.request
            if refusal is not None:
                http_refused(503, "grpc_inflight_bytes")
                raise PayloadTooLarge(refusal)
            return codec.stream_answer(await self._infer(call, context, began))
        except StokerError as error:
            return codec.stream_error(request, error.message)
        except Exception as error:
            log.error("unhandled %s in a gRPC stream", type(error).__name__, exc_info=error)
            return codec.stream_error(request, "internal server error")

    async def _infer(self, call: codec.InferCall, context: Context, began: float | None) -> bytes:
        """What HTTP's infer route does with a binary body: into an arena slot when the
        engine client lends one (the tensors' one copy), through ``plane.infer``, which a
        drain judges by ``began`` (when the call or the stream's request was handed over).
        Typed contents are counted against the model's contract first
        (``contents.typed_bytes``)."""
        request = call.request
        name, version = request.model_name, request.model_version or None
        limit, left_us = self.max_body_bytes, deadline_us(context)
        typed = sum(len(c) for c in call.contents if c is not None)
        if not typed:
            header, chunks = codec.request_body(call, None, limit, left_us)
        else:
            spec = (await self.plane.client.contract(name, version)).spec

            def expand() -> tuple[bytes, list[bytes | memoryview]]:
                return codec.request_body(call, spec, limit, left_us)

            if typed <= THREADED_DECODE_BYTES:
                header, chunks = expand()
            else:  # a value costs Python work each: off the loop, as large JSON is decoded
                most = self.plane.settings.limits.max_json_decodes
                header, chunks = await LARGE_DECODES.run(expand, most)
        total = len(header) + sum(map(len, chunks))
        if total > limit:  # typed contents take more bytes as tensors than in the message
            raise PayloadTooLarge(f"request of {total} bytes as tensors exceeds {limit}")
        async with self.plane.body_buffer(total, peer_host(context)) as slot:
            body: bytes | memoryview
            if slot is not None and len(slot.view) >= total:
                view = slot.view
                view[: len(header)] = header
                at = len(header)
                for chunk in chunks:
                    view[at : at + len(chunk)] = chunk
                    at += len(chunk)
                body = view[:total]
            else:
                slot = None
                body = b"".join([header, *chunks])
            answer = await self.plane.infer(
                name,
                version,
                body,
                len(header),
                slot,
                peer_host(context),
                began,
            )
        return codec.infer_response(answer)


class Health(health_pb2_grpc.HealthServicer):
    """``grpc.health.v1``: SERVING while the server is ready (every model warm, no drain),
    NOT_SERVING otherwise, for the server ("") and for the inference service by name."""

    SERVICES = frozenset({"", SERVICE})

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane

    def _status(self, service: str) -> Any:
        Status = health_pb2.HealthCheckResponse
        if service not in self.SERVICES:
            return Status.SERVICE_UNKNOWN
        return Status.SERVING if self.plane.is_ready else Status.NOT_SERVING

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: Context
    ) -> health_pb2.HealthCheckResponse:
        if request.service not in self.SERVICES:
            raise Ended(grpc.StatusCode.NOT_FOUND, f"unknown service {quote(request.service)}")
        return health_pb2.HealthCheckResponse(status=self._status(request.service))

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: Context
    ) -> AsyncGenerator[health_pb2.HealthCheckResponse, None]:
        last = None
        while True:
            status = self._status(request.service)
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(WATCH_INTERVAL_S)
