"""The load generator's gRPC client: ModelInfer over grpc.aio with serialized requests
(``bench.payloads.grpc_request``), sent as they are and answered without parsing, as the
HTTP client sends bodies and reads them whole."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.payloads import Payload


@dataclass(frozen=True)
class GrpcTarget:
    """A V2 server's gRPC API at ``address`` (host:port), ``inference.GRPCInferenceService/
    ModelInfer``; ``/metrics`` is read over HTTP at ``url``."""

    address: str
    url: str
    timeout_s: float = 60.0


# A gRPC answer's code as the HTTP status Stoker gives the same failure (status columns
# read alike for both protocols); other codes count as errors by name.
GRPC_STATUSES = {
    "OK": 200,
    "INVALID_ARGUMENT": 400,
    "UNAUTHENTICATED": 401,
    "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 413,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
    "INTERNAL": 500,
}
# Channels a gRPC client opens at most (one per request in flight up to here); past it,
# requests share them. A closed loop of c clients uses c.
MAX_GRPC_CHANNELS = 256
GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"


class GrpcClient:
    """ModelInfer over grpc.aio. Each request in flight has a channel (and so a connection:
    channels do not share a subchannel pool) to itself, as each HTTP client has its
    connection; the payload is a serialized request, sent as it is."""

    def __init__(self, target: GrpcTarget) -> None:
        import aiohttp

        self._target = target
        self._idle: list[Any] = []
        self._channels: list[Any] = []
        self._calls: list[Any] = []
        self._turn = 0
        self._metrics_url = target.url.rstrip("/") + "/metrics"
        self._session = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar())

    def _open(self) -> Any:
        import grpc

        options = [
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.max_receive_message_length", -1),
            ("grpc.max_send_message_length", -1),
        ]
        channel = grpc.aio.insecure_channel(self._target.address, options=options)
        self._channels.append(channel)
        call: Any = channel.unary_unary(GRPC_INFER)  # bytes in, bytes out: none serialized
        self._calls.append(call)
        return call

    async def send(self, payload: Payload) -> int:
        import grpc

        own = bool(self._idle) or len(self._calls) < MAX_GRPC_CHANNELS
        if self._idle:
            call = self._idle.pop()
        elif own:
            call = self._open()
        else:
            self._turn += 1
            call = self._calls[self._turn % len(self._calls)]
        try:
            await call(payload.body, timeout=self._target.timeout_s)
        except grpc.aio.AioRpcError as error:
            status = GRPC_STATUSES.get(error.code().name)
            if status is None:
                raise
            return status
        finally:
            if own:
                self._idle.append(call)
        return 200

    async def metrics(self) -> str | None:
        import aiohttp

        try:
            async with self._session.get(self._metrics_url) as response:
                return await response.text() if response.status == 200 else None
        except aiohttp.ClientError:
            return None

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
        await self._session.close()
