"""The gRPC server of a front end: grpc.aio in the front end's own event loop, beside HTTP.

``start`` binds ``server.grpc_port`` (with several front-end processes each binds it with
SO_REUSEPORT, so the kernel spreads connections over them as the shared HTTP listener does;
with one process a port that is taken fails the start) and serves ``inference.
GRPCInferenceService`` and ``grpc.health.v1.Health`` over the data plane, every call
counted against the limits of ``app.frontend.grpc.limits`` (connections, calls, probes
and request bytes in flight, per process and per address; message size and arrival time;
idle connections), and every client address held to its share of the connections
(``app.frontend.grpc.connections``). With API keys, every call but the health and liveness
ones needs one (``authorization: Bearer <key>`` or ``x-api-key: <key>`` metadata, as HTTP's
headers) or is UNAUTHENTICATED before its handler runs (and before it is counted). On a
drain, the door stays open while calls have arrived that grpc.aio has not handed over yet
(in grpc core or in the kernel: ``app.frontend.grpc.arrivals``), and each is judged by when
it was handed over; ``stop`` comes after the drain and lets calls in flight finish: the
data plane has already refused new inference with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2

from app import tracing
from app.frontend.auth import KeyRing, RefusalLog, presented_key
from app.frontend.grpc.arrivals import Arrivals, server_ids
from app.frontend.grpc.connections import ConnectionShares
from app.frontend.grpc.ending import Ended
from app.frontend.grpc.generated import grpc_service_pb2 as pb
from app.frontend.grpc.limits import CallLimits, core_options, limited, peer_host
from app.frontend.grpc.service import SERVICE, Health, InferenceService
from app.frontend.plane import DataPlane
from app.settings import Settings

if TYPE_CHECKING:
    from typing import TypeAlias

    Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]
    Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]

log = logging.getLogger(__name__)
_SWEEPS: set[asyncio.Task[None]] = set()
"""Each server's ``ConnectionShares`` task, until the server stops (a reference to each)."""

HEALTH = "grpc.health.v1.Health"
# Open without a key, as /v2/health/live and /v2/health/ready are over HTTP.
OPEN_METHODS = frozenset(
    {
        f"/{SERVICE}/ServerLive",
        f"/{SERVICE}/ServerReady",
        f"/{HEALTH}/Check",
        f"/{HEALTH}/Watch",
    }
)
# Counted against the probes, not the calls in flight, so that probes answer while the
# server is full; their message is due within a second (a Watch is counted against
# watches: it stays open).
PROBES = frozenset({"ServerLive", "ServerReady"})
# Messages held to ``limits.max_control_body_bytes``, refused before they are parsed.
CONTROL_METHODS = frozenset(
    {"RepositoryModelLoad", "RepositoryModelUnload", "SystemSharedMemoryRegister"}
)


class KeyCheck(grpc.aio.ServerInterceptor):
    """Calls without an accepted key end UNAUTHENTICATED before their handler runs; logged
    at most once a second per client address, as HTTP's 401s are."""

    def __init__(self, ring: KeyRing) -> None:
        self.ring = ring
        self.refusals = RefusalLog(label="gRPC UNAUTHENTICATED")

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
        return refusal(handler, problem, method, self.refusals)


def refusal(handler: Handler, problem: str, method: str, refusals: RefusalLog) -> Handler:
    """A handler of the same kind as ``handler`` that ends the call UNAUTHENTICATED, its
    refusal logged through ``refusals``."""
    ended = Ended(
        grpc.StatusCode.UNAUTHENTICATED,
        f"{problem}: send authorization: Bearer <key> or x-api-key: <key>",
    )

    async def refuse(_: Any, context: Context) -> None:
        refusals.refused(peer_host(context), problem, method)
        ended.end(context)

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


def handlers(service: InferenceService, limits: CallLimits) -> dict[str, Handler]:
    """A handler for every method the proto declares, by its name, each calling the method of
    ``service`` of that name under ``limits`` (``PROBES`` counted as probes, ``CONTROL_METHODS``'
    messages held to their own size); the messages of all but ``RAW_METHODS``
    (de)serialized by the generated classes."""
    found: dict[str, Handler] = {}
    for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        behaviour = getattr(service, method.name)
        if method.name in RAW_METHODS:
            decode, encode = None, None
        else:
            decode = getattr(pb, method.input_type.name).FromString
            encode = getattr(pb, method.output_type.name).SerializeToString
        if method.client_streaming and method.server_streaming:
            handler = grpc.stream_stream_rpc_method_handler(behaviour, decode, encode)
        else:
            handler = grpc.unary_unary_rpc_method_handler(behaviour, decode, encode)
        most = limits.max_control_bytes if method.name in CONTROL_METHODS else None
        # A unary inference call is one the drain waits for, from before its message is
        # read (a stream's requests are, each, from the data plane's ``infer``).
        drain = service.plane.drain_state if method.name == "ModelInfer" else None
        if method.name in PROBES:
            found[method.name] = limited(
                handler, limits, limits.probes, most, limits.probe_timeout_s
            )
        else:
            found[method.name] = limited(handler, limits, limits.calls, most, drain=drain)
    return found


def health_handlers(health: Health, limits: CallLimits) -> dict[str, Handler]:
    """``grpc.health.v1.Health``'s two methods under ``limits``: a Check counted against
    the probes, a Watch against the watches, both apart from the calls."""
    decode = health_pb2.HealthCheckRequest.FromString
    encode = health_pb2.HealthCheckResponse.SerializeToString
    check = grpc.unary_unary_rpc_method_handler(health.Check, decode, encode)
    watch = grpc.unary_stream_rpc_method_handler(health.Watch, decode, encode)
    return {
        "Check": limited(check, limits, limits.probes, None, limits.probe_timeout_s),
        "Watch": limited(watch, limits, limits.watches),
    }


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def start(plane: DataPlane, settings: Settings) -> grpc.aio.Server:
    """The gRPC server on ``server.grpc_port``, started; raises if the port cannot be bound."""
    keys = KeyRing(settings.auth.keys())
    options = core_options(settings)
    arrivals = Arrivals()
    interceptors: list[grpc.aio.ServerInterceptor] = [arrivals]
    if keys:
        interceptors.append(KeyCheck(keys))
    if tracing.tracer is not None:
        from app.frontend.grpc.tracing import TraceCalls

        interceptors.append(TraceCalls())
    before = server_ids()
    server = grpc.aio.server(interceptors=interceptors, options=options)
    if len(created := server_ids() - before) == 1:
        arrivals.server_id = created.pop()
    limits = CallLimits(settings.limits)
    service = InferenceService(plane, settings.limits.max_body_bytes, limits)
    for name, served in [
        (SERVICE, handlers(service, limits)),
        (HEALTH, health_handlers(Health(plane), limits)),
    ]:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, served),))
        server.add_registered_method_handlers(name, served)
    where = address(settings.server.host, settings.server.grpc_port)
    try:
        bound = server.add_insecure_port(where)
    except RuntimeError:
        bound = 0
    if not bound:
        raise OSError(f"gRPC cannot listen on {where} (in use, or not an address of this host)")
    await server.start()
    arrivals.port = bound
    plane.hold_door(arrivals.unread)
    shares = ConnectionShares(settings.limits, bound)
    sweeping = asyncio.create_task(shares.run(server), name="grpc-connection-shares")
    _SWEEPS.add(sweeping)
    sweeping.add_done_callback(_SWEEPS.discard)
    log.info("serving gRPC on %s%s", where, " (API keys required)" if keys else "")
    return server


async def stop(server: grpc.aio.Server, grace_s: float) -> None:
    """Stop taking calls; those in flight get ``grace_s`` to finish, then are cancelled."""
    await server.stop(grace_s)
