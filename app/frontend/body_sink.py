"""A request body of declared length read straight into the buffer that keeps it.

uvicorn's httptools protocol appends each chunk httptools hands it to the request's
``bytearray``, wakes the application once per socket read, and ``receive`` copies what is
there into a new ``bytes``, which the application copies again into its own buffer (a
shared-memory slot of the arena): three copies of every byte in this process and a turn of
the loop per 64-256 KiB, about half of a front end's CPU for a 4.8 MB request of 32 images
(BENCHMARKS.md, "The hot path on this CPU"). ``BodySink`` lets the application name its
buffer instead, and the protocol (``app.frontend.http_limits.GuardedHttpTools``, an
``asyncio.BufferedProtocol``) has the socket's reads land in it: the body's bytes are copied
by the kernel into the slot and by httptools once more (the chunk it hands over, counted
and dropped), and the application is woken once, when the body is whole or the client has
gone.

The application finds the reader in its scope, under ``extensions[BODY_INTO]``
(``BodyReader``): ``await read(buffer)`` fills ``buffer`` (at least the declared length)
and returns the bytes read; ``BodyLimit`` puts its deadline around it, as around
``receive``. A body without a declared
length, or one the application wants as ``bytes``, is read through ``receive`` as before.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import ClientDisconnect

BODY_INTO = "stoker.body_into"
"""The scope's ``extensions`` key of the reader: ``(buffer: memoryview) -> Awaitable[int]``."""

ReadInto = Callable[[memoryview], Awaitable[int]]


SCRATCH_BYTES = 256 * 1024
"""The buffer a server's connections read what no waiting body takes into (requests' heads,
small bodies): one a server (``http_limits.guarded``), since its loop hands each read to
the parser, which copies what it keeps, before the next read begins
(``asyncio.BufferedProtocol``, as uvloop calls it); two servers' loops on two threads of a
process read at once, so they do not share one."""


class BodySink:
    """Where the chunks of one request's body go while its application waits for them."""

    __slots__ = ("buffer", "cycle", "filled", "in_place")

    def __init__(self, cycle: Any, buffer: memoryview, filled: int) -> None:
        self.cycle = cycle
        self.buffer = buffer
        self.filled = filled
        self.in_place = False
        """Set while the parser reads bytes the socket put in the buffer itself (``room``)."""

    def room(self) -> memoryview:
        """The rest of the buffer, for the next read off the socket to land in."""
        return self.buffer[self.filled :]

    def take(self, chunk: bytes) -> bool:
        """Copy ``chunk`` in after what arrived before (or count it, when the read put it
        there: ``in_place``); False if it does not fit (the protocol keeps it as uvicorn
        would, and the application sees a body too long)."""
        end = self.filled + len(chunk)
        if end > len(self.buffer):
            return False
        if not self.in_place:
            self.buffer[self.filled : end] = chunk
        self.filled = end
        return True


class BodyReader:
    """The scope's reader of one request's body (``extensions[BODY_INTO]``): ``await
    reader(buffer)`` fills ``buffer`` with the body, what uvicorn holds of it already, then
    each chunk as the protocol receives it (``protocol.sink``), and returns the bytes read.
    Raises ``ClientDisconnect`` when the client goes away first, as Starlette's stream
    does."""

    __slots__ = ("cycle", "protocol", "sink")

    def __init__(self, protocol: Any, cycle: Any) -> None:
        self.protocol = protocol
        self.cycle = cycle
        self.sink: BodySink | None = None

    @property
    def waits(self) -> bool:
        """Whether reading the body would wait for bytes still to come (False: what there
        is of it is here, or the client is gone; ``BodyLimit`` times only a read that
        waits)."""
        cycle = self.cycle
        return bool(cycle.more_body) and not cycle.disconnected and not cycle.response_complete

    @property
    def received(self) -> int:
        """The body's bytes so far (a timeout says how many came)."""
        return self.sink.filled if self.sink is not None else len(self.cycle.body)

    async def __call__(self, buffer: memoryview) -> int:
        protocol, cycle = self.protocol, self.cycle
        if cycle.waiting_for_100_continue and not protocol.transport.is_closing():
            protocol.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            cycle.waiting_for_100_continue = False
        held = len(cycle.body)
        if held > len(buffer):
            return held  # longer than declared: the caller refuses it by its length
        buffer[:held] = cycle.body
        cycle.body = bytearray()
        sink = self.sink = BodySink(cycle, buffer, held)
        if cycle.more_body and protocol.cycle is cycle:
            protocol.sink = sink
        try:
            while cycle.more_body and not cycle.disconnected and not cycle.response_complete:
                cycle.flow.resume_reading()
                await cycle.message_event.wait()
                cycle.message_event.clear()
                if cycle.body:  # a chunk the sink did not take (too long): the caller refuses
                    return sink.filled + len(cycle.body)
        finally:
            if protocol.sink is sink:
                protocol.sink = None
            sink.buffer = memoryview(b"")  # the slot is not held past the read (its count is)
        if cycle.disconnected:
            raise ClientDisconnect()
        return sink.filled
