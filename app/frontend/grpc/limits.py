"""What a gRPC client may hold of a front end: HTTP's limits where gRPC can have them.

grpc.aio gives Python no hook per connection and hands a message over only once it has
arrived whole, so the limits sit at these levels (``limits`` in the settings):

- **gRPC core, per process**: at most ``max_connections`` connections (one past it is
  closed as it opens, a health probe's too: HTTP's probes stay open), counted apart from
  HTTP's, and ``max_share_per_address`` of them from one address (an address at its share
  has its new connections dropped in the kernel, those past it shut down: ``app.frontend.
  grpc.connections``); at most ``MAX_STREAMS`` calls at once on one connection (a client
  queues the rest); a connection must open HTTP/2 within
  ``header_timeout_s``; one with no call for ``server.keep_alive_s`` is told GOAWAY; a
  peer that stops answering keepalive pings (sent every ``keep_alive_s``) is dropped 20 s
  later; a message over ``max_body_bytes`` is RESOURCE_EXHAUSTED; a client that pings more
  often than every 5 minutes without calls is disconnected (core's defaults).
- **Calls, here, per process and per address**: at most ``max_grpc_calls`` calls in flight
  and ``max_share_per_address`` of them from one client address (RESOURCE_EXHAUSTED, naming
  the limit and its value). A gRPC connection carries many calls, so this is what bounds an
  address's use of the server, as HTTP/1.1's connections (one request each) do over HTTP;
  the connections it holds beyond its calls are idle and closed after ``keep_alive_s``.
  Liveness, readiness and ``grpc.health.v1`` Check are counted apart, against
  ``max_grpc_probes`` and its share per address, so probes answer while the server is full,
  and their message must arrive within ``PROBE_MESSAGE_TIMEOUT_S`` (it is empty: a probe that
  does not send it is no probe); a health Watch (it stays open, and needs no key) counts against
  ``max_grpc_watches`` and its share per address instead, so watches never take the
  inference calls' room.
- **Control messages, here**: a load, unload or shared-memory registration message over
  ``max_control_body_bytes`` is RESOURCE_EXHAUSTED before it is parsed.
- **Request bytes, here, per process and per address**: the requests of the calls in flight
  (from their arrival to their answer) hold at most ``max_inflight_body_bytes`` bytes and
  ``max_share_per_address`` of them from one address; a request past either is
  RESOURCE_EXHAUSTED (in a stream: that request's ``error_message``). HTTP's bodies have a
  budget of the same size of their own.

A slow sender: a unary call's message must arrive whole within ``body_timeout_s`` of the
call's start (DEADLINE_EXCEEDED), so a client that trickles one holds its call, and at most
``max_body_bytes`` of buffer (HTTP/2's flow control opens a stream's window as far as the
message it reads), that long, as HTTP's 408 bounds a trickled body. What messages still
arriving hold in all is bounded only by the calls: ``max_grpc_calls`` x ``max_body_bytes``.
A stream's later messages have no deadline: a stream may stay open as long as its client
wants, counted as a call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from app.drain import Drain
from app.frontend.grpc.ending import Ended
from app.metrics import http_refused
from app.settings import LimitSettings, Settings

MAX_STREAMS = 100
"""Calls at once on one connection (``grpc.max_concurrent_streams``): core's default is
unbounded, and a call that has not sent its message yet costs the server some 4 KB."""
PROBE_MESSAGE_TIMEOUT_S = 1.0
"""How long a probe's (empty) message may take to arrive, ``body_timeout_s`` at most."""

if TYPE_CHECKING:
    from typing import TypeAlias

    Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]
    Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]


def peer_host(context: Context) -> str:
    """The client's address, as HTTP takes it ("ipv4:1.2.3.4:5" and "ipv6:[::1]:5" are
    gRPC's spellings of a peer): what the limits and the batcher's fairness go by."""
    peer = context.peer() or ""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]")
    return rest


class Budget:
    """An amount the calls in flight hold, at most ``limit`` in all and ``share`` of it from
    one client address, so one address never takes the whole. ``reason``: how its refusals
    are counted (``stoker_http_refusals_total``)."""

    def __init__(self, limit: int, share: float, what: str, setting: str, reason: str = "") -> None:
        self.limit = limit
        self.reason = reason
        self.per_address = max(1, int(limit * share))
        self.what = what
        self.setting = setting
        self.held = 0
        self.by_address: dict[str, int] = {}

    def take(self, address: str, amount: int) -> str | None:
        """Holds ``amount`` for ``address``; or, where that would pass a limit, holds nothing
        and says which limit and its value. Nothing (an empty message) is always taken."""
        if not amount:
            return None  # an address holding nothing has no entry: none is made for it
        mine = self.by_address.get(address, 0)
        if self.held + amount > self.limit:
            return (
                f"{self.held} {self.what} in flight, {amount} more would pass "
                f"limits.{self.setting} ({self.limit}); retry later"
            )
        if mine + amount > self.per_address:
            return (
                f"{mine} {self.what} in flight from this address, {amount} more would pass its "
                f"share of limits.{self.setting} ({self.per_address} of {self.limit}); "
                "retry later"
            )
        self.held += amount
        self.by_address[address] = mine + amount
        return None

    def give(self, address: str, amount: int) -> None:
        if not amount:
            return
        self.held -= amount
        left = self.by_address[address] - amount
        if left:
            self.by_address[address] = left
        else:
            del self.by_address[address]


class CallLimits:
    """The calls, health watches and request bytes in flight of one gRPC server, and how
    long a unary call's message may take to arrive."""

    def __init__(self, limits: LimitSettings) -> None:
        share = limits.max_share_per_address
        self.calls = Budget(
            limits.max_grpc_calls, share, "gRPC calls", "max_grpc_calls", "grpc_calls"
        )
        self.watches = Budget(
            limits.max_grpc_watches, share, "health watches", "max_grpc_watches", "grpc_watches"
        )
        self.probes = Budget(
            limits.max_grpc_probes, share, "probe calls", "max_grpc_probes", "grpc_probes"
        )
        self.message_bytes = Budget(
            limits.max_inflight_body_bytes,
            share,
            "request bytes",
            "max_inflight_body_bytes",
            "grpc_inflight_bytes",
        )
        self.max_control_bytes = limits.max_control_body_bytes
        self.message_timeout_s = limits.body_timeout_s
        self.probe_timeout_s = min(PROBE_MESSAGE_TIMEOUT_S, limits.body_timeout_s)
        self._endings: set[asyncio.Future[Any]] = set()
        """Calls being ended for a message that came too late (a reference to each)."""

    @staticmethod
    def refuse(budget: Budget, refusal: str) -> NoReturn:
        http_refused(503, budget.reason)
        raise Ended(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)

    async def message(self, context: Context, timeout_s: float | None = None) -> bytes:
        """A unary call's request, once it has arrived whole; DEADLINE_EXCEEDED if it has not
        within ``timeout_s`` (None: ``message_timeout_s``)."""
        timeout_s = self.message_timeout_s if timeout_s is None else timeout_s
        # Past the deadline the call is ended from a timer, which makes the read fail with
        # that ending; cancelling the read instead would abandon grpc's pending operation.
        ended: list[asyncio.Future[Any]] = []
        timer = asyncio.get_running_loop().call_later(
            timeout_s, self._too_late, context, ended, timeout_s
        )
        try:
            data = await context.read()
        finally:
            timer.cancel()
        if ended:  # it came as the call was being ended: it ends all the same
            await asyncio.wait(ended)
            raise Ended(grpc.StatusCode.DEADLINE_EXCEEDED, "the request came too late")
        if data is grpc.aio.EOF:
            raise Ended(grpc.StatusCode.INVALID_ARGUMENT, "the call sent no request")
        assert isinstance(data, bytes)
        return data

    def _too_late(
        self, context: Context, ended: list[asyncio.Future[Any]], timeout_s: float
    ) -> None:
        http_refused(408, "grpc_message_timeout")
        within = (
            f"limits.body_timeout_s ({timeout_s:g} s)"
            if timeout_s == self.message_timeout_s
            else f"a probe's {timeout_s:g} s"
        )
        message = f"the request message did not arrive whole within {within}"
        # Only abort ends a read still waiting; its exception holds this timer's frames,
        # no request (none arrived).
        ending = asyncio.ensure_future(context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, message))
        self._endings.add(ending)
        ending.add_done_callback(self._ended)
        ended.append(ending)

    def _ended(self, ending: asyncio.Future[Any]) -> None:
        self._endings.discard(ending)
        if not ending.cancelled():
            ending.exception()  # the AbortError that ending a call raises: expected


def limited(
    handler: Handler,
    limits: CallLimits,
    counted: Budget | None,
    max_message_bytes: int | None = None,
    message_timeout_s: float | None = None,
    drain: Drain | None = None,
) -> Handler:
    """``handler`` with its calls counted against ``counted`` (None: not counted), its
    message due within ``message_timeout_s`` (None: ``limits.message_timeout_s``) and
    refused past ``max_message_bytes`` before it is parsed, a unary call counted as in
    flight in ``drain`` (which then waits for it), and every ``Ended`` raised below it set
    on the call as its status. A unary request is taken as a request stream of one message,
    so the call counts from its start, before its message arrives (grpc.aio calls a unary
    handler only once it has), and the message can be given a deadline; the client sees no
    difference on the wire. (Written out rather than with context managers: this runs for
    every call.)"""
    decode: Callable[[bytes], Any] | None = handler.request_deserializer
    encode = handler.response_serializer
    held = limits.message_bytes

    def admitted(context: Context) -> str:
        address = peer_host(context)
        if counted is not None and (refusal := counted.take(address, 1)) is not None:
            limits.refuse(counted, refusal)
        return address

    def leave(address: str) -> None:
        if counted is not None:
            counted.give(address, 1)

    async def request(context: Context, address: str) -> tuple[Any, int]:
        """The call's request, parsed, and its size, counted in ``held``."""
        data = await limits.message(context, message_timeout_s)
        size = len(data)
        if max_message_bytes is not None and size > max_message_bytes:
            http_refused(413, "grpc_control_bytes")
            raise Ended(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"a message of {size} bytes exceeds limits.max_control_body_bytes "
                f"({max_message_bytes})",
            )
        if (refusal := held.take(address, size)) is not None:
            limits.refuse(held, refusal)
        if decode is None:
            return data, size
        try:
            return decode(data), size
        except Exception:
            held.give(address, size)
            raise Ended(grpc.StatusCode.INVALID_ARGUMENT, "the request does not parse") from None

    # (grpc's stubs type the behaviours as synchronous ones.)
    if handler.request_streaming:
        streamed: Any = handler.stream_stream

        async def stream(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
            try:
                address = admitted(context)
                try:
                    async with contextlib.aclosing(streamed(requests, context)) as answers:
                        async for answer in answers:
                            yield answer
                finally:
                    leave(address)
            except Ended as ended:
                ended.end(context)

        return grpc.stream_stream_rpc_method_handler(stream, decode, encode)

    if handler.response_streaming:
        answering: Any = handler.unary_stream

        async def unary_stream(_: Any, context: Context) -> AsyncIterator[Any]:
            try:
                address = admitted(context)
                try:
                    message, size = await request(context, address)
                    try:
                        async with contextlib.aclosing(answering(message, context)) as answers:
                            async for answer in answers:
                                yield answer
                    finally:
                        held.give(address, size)
                finally:
                    leave(address)
            except Ended as ended:
                ended.end(context)

        return grpc.stream_stream_rpc_method_handler(unary_stream, None, encode)

    behaviour: Any = handler.unary_unary

    async def unary(_: Any, context: Context) -> Any:
        with drain.in_flight() if drain is not None else contextlib.nullcontext():
            try:
                address = admitted(context)
                try:
                    message, size = await request(context, address)
                    try:
                        return await behaviour(message, context)
                    finally:
                        held.give(address, size)
                finally:
                    leave(address)
            except Ended as ended:
                ended.end(context)
                return None

    return grpc.stream_unary_rpc_method_handler(unary, None, encode)


def core_options(settings: Settings) -> list[tuple[str, int]]:
    """grpc core's share of the limits (the module's docstring)."""
    limits = settings.limits
    shared_port = settings.server.front_ends > 1 or bool(settings.server.engine_gpus)
    keep_alive_ms = settings.server.keep_alive_s * 1000
    return [
        ("grpc.max_receive_message_length", limits.max_body_bytes),
        ("grpc.max_metadata_size", limits.max_header_bytes),
        ("grpc.max_allowed_incoming_connections", limits.max_connections),
        ("grpc.max_concurrent_streams", MAX_STREAMS),
        ("grpc.max_connection_idle_ms", keep_alive_ms),
        # A connection that has not opened HTTP/2 in this long is closed, as a request head
        # that does not arrive in header_timeout_s is over HTTP (slow-loris).
        ("grpc.server_handshake_timeout_ms", int(limits.header_timeout_s * 1000)),
        # A peer gone without a close (a pulled cable) holds its calls until a ping goes
        # unanswered (20 s, core's keepalive_timeout_ms), not for hours.
        ("grpc.keepalive_time_ms", keep_alive_ms),
        ("grpc.so_reuseport", 1 if shared_port else 0),
    ]
