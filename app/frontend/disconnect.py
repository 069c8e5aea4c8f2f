"""A request's client gone: what cancels its work when the connection is lost.

The protocol (``app.frontend.http_limits.GuardedHttpTools``) puts a ``Disconnect`` in each
request's scope (``extensions[ON_DISCONNECT]``) and tells it in ``connection_lost``;
``unless_disconnected`` runs a request's work and cancels it when told. Where the server is
not ours (a test transport, another ASGI server) a task waits on ``receive`` for
``http.disconnect`` instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")

ON_DISCONNECT = "stoker.on_disconnect"
"""The scope's ``extensions`` key of the request's ``Disconnect``."""


class Disconnect:
    """What the protocol calls when a request's connection is lost before its answer is
    complete (``extensions[ON_DISCONNECT]``): one callback at a time, set with ``watch``.
    It replaces a task per request that waits on ``receive`` for ``http.disconnect`` (a task
    created, started and cancelled for every request: BENCHMARKS.md, "A request's budget"),
    where the server is ours (``app.frontend.http_limits.GuardedHttpTools``)."""

    __slots__ = ("callback", "lost")

    def __init__(self) -> None:
        self.callback: Callable[[], None] | None = None
        self.lost = False

    def watch(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` once the connection is lost (at once, in the next turn of the
        loop, if it already was); None: no longer."""
        self.callback = callback
        if callback is not None and self.lost:
            asyncio.get_running_loop().call_soon(self._fire)

    def connection_lost(self) -> None:
        """The protocol's: the connection went away."""
        self.lost = True
        self._fire()

    def _fire(self) -> None:
        callback, self.callback = self.callback, None
        if callback is not None:
            callback()


async def until_disconnected(request: Request) -> None:
    """Returns when the client goes away (the body has been read, so only that is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Run ``work`` in this task; if the client disconnects first, cancel it (dropping its
    queued request before any compute) and return None. Awaited here rather than in a task
    of its own: a task and the wait on two of them cost more than the work of a small
    request's data plane (BENCHMARKS.md, "A request's budget"). Where the protocol is ours
    it says when the connection is lost (``extensions[ON_DISCONNECT]``); elsewhere (another
    ASGI server, a test transport) a task waits on ``receive`` for it."""
    this = asyncio.current_task()
    assert this is not None
    gone = finished = False

    def disconnected() -> None:
        nonlocal gone
        # A callback already scheduled when the work finished must not cancel what follows.
        if not finished:
            gone = True
            this.cancel()

    extensions = request.scope.get("extensions") or {}
    watch: Disconnect | None = extensions.get(ON_DISCONNECT)
    watcher: asyncio.Task[None] | None = None
    if watch is not None:
        watch.watch(disconnected)
    else:
        watcher = asyncio.create_task(until_disconnected(request))
        watcher.add_done_callback(lambda task: None if task.cancelled() else disconnected())
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise
        this.uncancel()
        return None
    finally:
        finished = True
        if watch is not None:
            watch.watch(None)
        if watcher is not None:
            watcher.cancel()
