"""The load generator's gRPC client: ModelInfer over grpc.aio with serialized requests
(``bench.payloads.grpc_request``), sent as they are and answered without parsing, as the
HTTP client sends bodies and reads them whole (with ``--check-answers``, parsed and compared:
``bench.answers``); or the same requests as messages of
ModelStreamInfer streams (``stream``), one stream a request in flight, as Triton's
``perf_analyzer --streaming`` sends them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from functools import partial
from typing import Any

from app.frontend.grpc.contents import varint
from bench.answers import check, decode_grpc
from bench.payloads import Payload


@dataclass(frozen=True)
class GrpcTarget:
    """A V2 server's gRPC API at ``address`` (host:port), ``inference.GRPCInferenceService/
    ModelInfer``; ``/metrics`` is read over HTTP at ``url``."""

    address: str
    url: str
    timeout_s: float = 60.0
    stream: bool = False
    """ModelStreamInfer: each request in flight a message on a stream of its own (a stream
    holds one request at a time, so its answer is that request's), not a ModelInfer call."""


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
GRPC_STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
_ERROR_MESSAGE = 0x0A  # ModelStreamInferResponse.error_message's key (field 1, bytes)


def stream_failed(answer: bytes) -> bool:
    """Whether a ModelStreamInferResponse carries an error_message (a request that failed:
    the stream goes on)."""
    at = 0
    while at < len(answer):
        key, at = varint(answer, at)
        if key & 7 == 0:
            _, at = varint(answer, at)
            continue
        if key & 7 == 1 or key & 7 == 5:
            at += 8 if key & 7 == 1 else 4
            continue
        length, at = varint(answer, at)
        if key == _ERROR_MESSAGE and length:
            return True
        at += length
    return False


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

    async def send(self, payload: Payload) -> int | str:
        if self._target.stream:
            return await self._send_on_stream(payload)
        return await self._send_call(payload)

    async def _send_on_stream(self, payload: Payload) -> int | str:
        """The request as the next message of an idle stream (a new one, on a channel of its
        own up to ``MAX_GRPC_CHANNELS``, when none is idle); a stream that fails is dropped.
        A request the server failed is 500 whatever its reason (a stream's failure is a
        message, not a status)."""
        import grpc

        if self._idle:
            stream = self._idle.pop()
        else:
            if len(self._channels) < MAX_GRPC_CHANNELS:
                self._open()
                channel = self._channels[-1]
            else:
                self._turn += 1
                channel = self._channels[self._turn % len(self._channels)]
            stream = channel.stream_stream(GRPC_STREAM_INFER)()
        try:
            answer = await asyncio.wait_for(
                self._exchange(stream, payload.body), self._target.timeout_s
            )
        except grpc.aio.AioRpcError as error:
            status = GRPC_STATUSES.get(error.code().name)
            if status is None:
                raise
            return status
        except TimeoutError:
            stream.cancel()
            return 504  # as a unary call's DEADLINE_EXCEEDED
        except BaseException:
            stream.cancel()
            raise
        self._idle.append(stream)
        if stream_failed(answer):
            return 500
        if payload.expected is not None:
            return check(payload, 200, partial(decode_grpc, answer, stream=True))
        return 200

    @staticmethod
    async def _exchange(stream: Any, body: bytes) -> bytes:
        import grpc

        await stream.write(body)
        answer = await stream.read()
        if answer is grpc.aio.EOF:
            raise ConnectionError("the server ended the stream")
        assert isinstance(answer, bytes)
        return answer

    async def _send_call(self, payload: Payload) -> int | str:
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
            answer = await call(payload.body, timeout=self._target.timeout_s)
        except grpc.aio.AioRpcError as error:
            status = GRPC_STATUSES.get(error.code().name)
            if status is None:
                raise
            return status
        finally:
            if own:
                self._idle.append(call)
        if payload.expected is not None:
            return check(payload, 200, partial(decode_grpc, answer))
        return 200

    async def metrics(self) -> str | None:
        import aiohttp

        try:
            async with self._session.get(self._metrics_url) as response:
                return await response.text() if response.status == 200 else None
        except aiohttp.ClientError:
            return None

    async def close(self) -> None:
        if self._target.stream:
            for stream in self._idle:
                await stream.done_writing()
        for channel in self._channels:
            await channel.close()
        await self._session.close()
