"""When grpc.aio hands each call to Python, and whether calls have arrived that it has not
handed over yet: what a drain's door waits for over gRPC.

grpc core reads the connections in its own threads and queues each call it has taken until
grpc.aio asks for the next, one at a time, through the event loop. So a call written whole
before a SIGTERM may, at the signal, still be bytes in the kernel that core has not read
(its threads share the cores with the runners), or a call in core's queue, which no socket
shows. ``Arrivals.unread`` says whether either holds one: the kernel (a gRPC connection to be
accepted, or bytes on one) or core (it has taken more calls, channelz's ``calls_started``,
than were handed over); the data plane's drain keeps its door open while it does
(``DataPlane.hold_door``, at most its ``DOOR_MAX_S``). Each call is stamped with when it was
handed over (``ARRIVED``), which the drain judges it by, as an HTTP request by when its
first bytes were read.
"""

from __future__ import annotations

import contextvars
import json
import select
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

# channelz's counts, read as the grpcio-channelz package reads them (grpcio has no public call)
from grpc._cython import cygrpc  # type: ignore[attr-defined]

from app.frontend.grpc.connections import sockets_on

if TYPE_CHECKING:
    from typing import TypeAlias

    Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]

ARRIVED: contextvars.ContextVar[float | None] = contextvars.ContextVar("arrived", default=None)
"""When grpc.aio handed the current call to Python (``time.monotonic``), set in the call's
own task before its handler runs."""


def server_ids() -> set[int]:
    """The channelz ids of this process's gRPC servers (none where channelz is off)."""
    answer = json.loads(cygrpc.channelz_get_servers(0))
    return {int(server["ref"]["serverId"]) for server in answer.get("server", [])}


def calls_started(server_id: int) -> int:
    """How many calls grpc core has taken on server ``server_id`` since it started (0 once
    it is gone: channelz then raises ValueError)."""
    try:
        answer = json.loads(cygrpc.channelz_get_server(server_id))
    except ValueError:
        return 0
    return int(answer.get("server", {}).get("data", {}).get("callsStarted", 0))


class Arrivals(grpc.aio.ServerInterceptor):
    """Counts the calls of one server grpc.aio hands over and stamps each with ``ARRIVED``;
    the first of the interceptors, so that every call counts, a refused one too."""

    def __init__(self) -> None:
        self.server_id: int | None = None
        """The server's channelz id (None: channelz is off: core's queue is not seen)."""
        self.port = 0
        """The port it serves on (``server.start`` sets both)."""
        self.handed_over = 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        self.handed_over += 1
        ARRIVED.set(time.monotonic())
        return await continuation(details)

    def unread(self) -> bool:
        """Whether calls have arrived that were not handed over yet: taken by core, or in the
        kernel. (A call its client cancelled before it was handed over never is: a drain's
        door then waits until its ``DOOR_MAX_S``.) Looks at every socket of the process
        while core holds none: asked only during a drain's first second."""
        if self.server_id is not None and self.handed_over < calls_started(self.server_id):
            return True
        poller = select.poll()
        socks = list(sockets_on(self.port)) if self.port else []
        try:
            for _, sock in socks:
                poller.register(sock, select.POLLIN)
            return any(events & select.POLLIN for _, events in poller.poll(0))
        finally:
            for _, sock in socks:
                sock.close()
