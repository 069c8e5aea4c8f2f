"""The gRPC server of a front end: grpc.aio in the front end's own event loop, beside HTTP.

``start`` binds ``server.grpc_port`` (with several front-end processes each binds it with
SO_REUSEPORT, so the kernel spreads connections over them as the shared HTTP listener does;
with one process a port that is taken fails the start), serves ``inference.
GRPCInferenceService`` and ``grpc.health.v1.Health`` over the data plane, and applies HTTP's
limits where gRPC has them: a message over ``limits.max_body_bytes`` is RESOURCE_EXHAUSTED
before it is read whole, metadata is bounded by ``limits.max_header_bytes``, a connection
must open within ``limits.header_timeout_s`` and idle ones close after ``server.keep_alive_s``.
(``max_connections`` and ``max_inflight_body_bytes`` have no gRPC counterpart here: grpc.aio
reads a message whole before a handler sees it.) With API keys, every call but the health and
liveness ones needs one (``authorization: Bearer <key>`` or ``x-api-key: <key>`` metadata,
as HTTP's headers) or is UNAUTHENTICATED before its handler runs. ``stop`` lets calls in
flight finish: the data plane's drain has already refused new inference with UNAVAILABLE.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from app.errors import client_text
from app.frontend.auth import KeyRing, presented_key
from app.frontend.grpc.generated import grpc_service_pb2 as pb
from app.frontend.grpc.service import SERVICE, Health, InferenceService
from app.frontend.plane import DataPlane
from app.settings import Settings

if TYPE_CHECKING:
    from typing import TypeAlias

    Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]
    Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]

log = logging.getLogger(__name__)

# Open without a key, as /v2/health/live and /v2/health/ready are over HTTP.
OPEN_METHODS = frozenset(
    {
        f"/{SERVICE}/ServerLive",
        f"/{SERVICE}/ServerReady",
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
    }
)


class KeyCheck(grpc.aio.ServerInterceptor):
    """Calls without an accepted key end UNAUTHENTICATED before their handler runs."""

    def __init__(self, ring: KeyRing) -> None:
        self.ring = ring

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(details)
        method = details.method
        if handler is None or method in OPEN_METHODS:
            return handler
        metadata = [
            (key.encode(), value if isinstance(value, bytes) else value.encode())
            for key, value in details.invocation_metadata or ()
        ]
        key = presented_key(metadata)
        if key is not None and self.ring.accepts(key):
            return handler
        problem = "invalid API key" if key is not None else "missing API key"
        log.warning("UNAUTHENTICATED %s for %s", problem, client_text(method))
        return refusal(handler, f"{problem}: send authorization: Bearer <key> or x-api-key: <key>")


def refusal(handler: Handler, message: str) -> Handler:
    """A handler of the same kind as ``handler`` that ends the call UNAUTHENTICATED."""

    async def refuse(_: Any, context: Context) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    decode, encode = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, decode, encode)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, decode, encode)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, decode, encode)
    return grpc.unary_unary_rpc_method_handler(refuse, decode, encode)


# Taken and answered as wire bytes (``codec.read_request``): their tensors are not copied by
# protobuf on the way in or out.
RAW_METHODS = frozenset({"ModelInfer", "ModelStreamInfer"})


def handlers(service: InferenceService) -> dict[str, Handler]:
    """A handler for every method the proto declares, by its name, each calling the method of
    ``service`` of that name; the messages of all but ``RAW_METHODS`` (de)serialized by the
    generated classes."""
    found: dict[str, Handler] = {}
    for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        behaviour = getattr(service, method.name)
        if method.name in RAW_METHODS:
            decode, encode = None, None
        else:
            decode = getattr(pb, method.input_type.name).FromString
            encode = getattr(pb, method.output_type.name).SerializeToString
        if method.client_streaming and method.server_streaming:
            found[method.name] = grpc.stream_stream_rpc_method_handler(behaviour, decode, encode)
        else:
            found[method.name] = grpc.unary_unary_rpc_method_handler(behaviour, decode, encode)
    return found


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def start(plane: DataPlane, settings: Settings) -> grpc.aio.Server:
    """The gRPC server on ``server.grpc_port``, started; raises if the port cannot be bound."""
    limits = settings.limits
    shared_port = settings.server.front_ends > 1 or bool(settings.server.engine_gpus)
    options = [
        ("grpc.max_receive_message_length", limits.max_body_bytes),
        ("grpc.max_metadata_size", limits.max_header_bytes),
        ("grpc.max_connection_idle_ms", settings.server.keep_alive_s * 1000),
        # A connection that has not opened HTTP/2 in this long is closed, as a request head
        # that does not arrive in header_timeout_s is over HTTP (slow-loris).
        ("grpc.server_handshake_timeout_ms", int(limits.header_timeout_s * 1000)),
        ("grpc.so_reuseport", 1 if shared_port else 0),
    ]
    keys = KeyRing(settings.auth.keys())
    server = grpc.aio.server(interceptors=[KeyCheck(keys)] if keys else [], options=options)
    served = handlers(InferenceService(plane, limits.max_body_bytes))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, served),))
    server.add_registered_method_handlers(SERVICE, served)
    health_pb2_grpc.add_HealthServicer_to_server(Health(plane), server)
    where = address(settings.server.host, settings.server.grpc_port)
    try:
        bound = server.add_insecure_port(where)
    except RuntimeError:
        bound = 0
    if not bound:
        raise OSError(f"gRPC cannot listen on {where} (in use, or not an address of this host)")
    await server.start()
    log.info("serving gRPC on %s%s", where, " (API keys required)" if keys else "")
    return server


async def stop(server: grpc.aio.Server, grace_s: float) -> None:
    """Stop taking calls; those in flight get ``grace_s`` to finish, then are cancelled."""
    await server.stop(grace_s)
