"""What a connection may cost before the application sees a request: uvicorn's HTTP protocol
with limits on headers, time and connections (``limits`` in the settings).

uvicorn's httptools protocol reads headers without bound and keeps a connection that never
sends a request open forever. This subclass answers, like nginx and Envoy:

- **400** with a JSON body when the bytes are not HTTP/1.1 (a garbage request line, a
  negative or overflowing ``Content-Length``), where uvicorn answers ``text/plain``;
- **431** when a request's URL and headers exceed ``max_header_bytes`` or ``max_headers``
  (counted as they arrive, so a 159 MiB header is refused at 64 KiB, not buffered, and an
  unterminated one as soon as its bytes pass the limit);
- **408** (or a plain close when nothing was sent) when a connection has not sent a
  request's headers within ``header_timeout_s``: a new connection from its start, a request
  from its first byte (slow-loris);
- **503** once this process holds ``max_connections`` connections, or the client's address
  holds its share of them (``max_share_per_address``), for every route but ``/v2/health/*``,
  so probes keep answering while the server is full. A connection over either cap is not
  counted against them: one address's idle connections never crowd the others out. The
  probes of those have their own budget, ``HEALTH_CONNECTIONS`` at once, and their
  connection closes after the answer, so they cannot pile up past the cap either. When that
  budget is full, a new connection closes the oldest of it that is not answering a probe
  (silent ones first to go): a prober whose address also holds thousands of silent
  connections (kubelet behind SNAT) is still answered.

Each request's scope carries ``BEGAN``, when its first bytes were read: a drain answers the
requests that began before its door closed (``app.drain``).

A cap that stays full turns readiness off (``Saturation``): the orchestrator stops routing
to a process that would refuse what it gets.

Idle kept-alive connections close after ``server.keep_alive_s`` (uvicorn's own timer).
"""

from __future__ import annotations

import asyncio
import select
import time
from collections.abc import Iterable, Mapping
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.frontend.body_sink import BODY_INTO, SCRATCH_BYTES, BodyReader, BodySink
from app.frontend.disconnect import ON_DISCONNECT, Disconnect
from app.frontend.http_write import HeadHeld
from app.frontend.refusal import refusal
from app.metrics import http_refused
from app.settings import LimitSettings

_REASONS = {
    400: b"Bad Request",
    408: b"Request Timeout",
    431: b"Request Header Fields Too Large",
    503: b"Service Unavailable",
}
HEALTH_PREFIX = b"/v2/health/"
REFUSAL_LINGER_S = 1.0
HEALTH_CONNECTIONS = 64
"""Connections over the caps open at once (each may ask ``/v2/health/*`` once); past it the
oldest not answering a probe is closed, so a client cannot hold sockets past the caps by
never sending, nor keep probes out by it."""
BEGAN = "stoker.began"
"""The scope key of when a request's first bytes were read (``time.monotonic``)."""
# What httptools does not hand over of a request line: the spaces, "HTTP/1.1", its CRLF
# and the CRLF that ends the head.
REQUEST_LINE_BYTES = 14


class Saturation:
    """Which of this process's caps are full and since when (one per application: the
    connection cap of its server and the body-bytes cap of its ``BodyLimit`` report here).
    Readiness reads ``reason``: a cap full for ``after_s`` or longer."""

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self._since: dict[str, float] = {}

    def note(self, cap: str, full: bool) -> None:
        if full:
            self._since.setdefault(cap, time.monotonic())
        else:
            self._since.pop(cap, None)

    def reason(self, others: Mapping[str, float | None] | None = None) -> str | None:
        """Why this process should get no new requests now, or None; ``others``: since when
        other caps have been full (None: not full), by name."""
        now = time.monotonic()
        for cap, since in {**self._since, **(others or {})}.items():
            if since is not None and now - since >= self.after_s:
                return f"the {cap} cap has been full for {now - since:.1f} s; retry another replica"
        return None


class Admitted:
    """The connections counted against the caps, in all and per client address, and those
    over them (one per protocol class: per server)."""

    def __init__(self, saturation: Saturation | None = None) -> None:
        self.total = 0
        self.by_address: dict[str, int] = {}
        self.over: dict[GuardedHttpTools, None] = {}
        """The connections over the caps, oldest first."""
        self.saturation = saturation

    def admit(self, address: str, limits: LimitSettings) -> bool:
        share = max(1, int(limits.max_connections * limits.max_share_per_address))
        held = self.by_address.get(address, 0)
        if self.total >= limits.max_connections or held >= share:
            return False
        self.total += 1
        self.by_address[address] = held + 1
        self._note(limits)
        return True

    def release(self, address: str, limits: LimitSettings) -> None:
        self.total -= 1
        left = self.by_address[address] - 1
        if left:
            self.by_address[address] = left
        else:
            del self.by_address[address]
        self._note(limits)

    def _note(self, limits: LimitSettings) -> None:
        if self.saturation is not None:
            self.saturation.note("connection", self.total >= limits.max_connections)

    def take_over(self, connection: GuardedHttpTools) -> bool:
        """Count ``connection`` among those over the caps, closing the oldest of them that is
        not answering a probe when there are ``HEALTH_CONNECTIONS``; False: all of those are
        answering probes, and ``connection`` is not counted."""
        if len(self.over) >= HEALTH_CONNECTIONS:
            oldest = next((c for c in self.over if not c.probing), None)
            if oldest is None:
                return False
            del self.over[oldest]
            http_refused(503, "connections")
            oldest.transport.close()
        self.over[connection] = None
        return True


class GuardedHttpTools(HttpToolsProtocol):
    limits: LimitSettings = LimitSettings()
    admitted: Admitted = Admitted()
    scratch = memoryview(bytearray(SCRATCH_BYTES))
    """Where reads land that no waiting body takes: one buffer a server (``guarded``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_bytes = 0  # the URL and the complete headers, exactly
        self._head_received = 0  # the bytes of a still-incomplete head, in earlier reads
        self._in_read = 0  # the bytes of this read that httptools has handed over
        self._began_at: int | None = None  # where in this read a request began, about
        self._header_count = 0
        self._refused = False
        self._over_capacity = False
        self._header_timer: asyncio.TimerHandle | None = None
        self._headers_done = True
        self._address: str | None = None
        """The client's address while this connection counts against the caps."""
        self.probing = False
        """Whether this connection, over the caps, is answering a ``/v2/health/*`` probe."""
        self.sink: BodySink | None = None
        """Where the body's chunks go while the application waits for them (``BodyReader``)."""
        self._direct: BodySink | None = None
        """The sink the read in progress lands in (``get_buffer``), if any."""
        self.disconnect: Disconnect | None = None
        """The request in progress's ``Disconnect``: told when the connection is lost."""

    # -- the header timer

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self._headers_done:  # a new connection that never sent a byte
            self.transport.close()
        else:
            limit = self.limits.header_timeout_s
            self._refuse(408, f"request headers not received within {limit:g} s", "header_timeout")

    def send_400_response(self, msg: str) -> None:
        # uvicorn's own answer to bytes httptools cannot parse is text/plain; ours is JSON.
        self._refuse(
            400,
            "not a valid HTTP/1.1 request (its request line, a header or its Content-Length)",
            "http_parse",
        )

    def _refuse(self, status: int, message: str, reason: str) -> None:
        if self._refused or self.transport.is_closing():
            return
        self._refused = True
        http_refused(status, reason)
        self._disarm()
        headers, body = refusal(message, [(b"connection", b"close")])
        head = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status])
        head += b"".join(b"%s: %s\r\n" % header for header in headers)
        self.transport.write(head + b"\r\n" + body)
        # Closing with unread bytes would reset the connection and lose the answer: what
        # still arrives is read and dropped (data_received) until the close a moment later.
        self.loop.call_later(REFUSAL_LINGER_S, self.transport.close)

    # -- protocol callbacks

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        self._over_capacity = not self.admitted.admit(address, self.limits)
        if not self._over_capacity:
            self._address = address
        elif not self.admitted.take_over(self):
            http_refused(503, "connections")
            transport.close()
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._address is not None:
            self.admitted.release(self._address, self.limits)
            self._address = None
        self.admitted.over.pop(self, None)
        self.sink = self._direct = None  # no slot held by a closed connection
        super().connection_lost(exc)
        disconnect, self.disconnect = self.disconnect, None
        if disconnect is not None:
            disconnect.connection_lost()

    def _check_size(self, received: int) -> None:
        if received > self.limits.max_header_bytes:
            limit = self.limits.max_header_bytes
            self._refuse(431, f"the request line and headers exceed {limit} bytes", "header_bytes")

    # -- reads: straight into a waiting body's buffer, else into the process's scratch

    def get_buffer(self, sizehint: int) -> memoryview:
        sink = self.sink
        if sink is not None and sink.cycle is self.cycle and not self._refused:
            room = sink.room()
            if room:  # the body's rest: this read cannot pass its end
                self._direct = sink
                return room
        self._direct = None
        return self.scratch

    def buffer_updated(self, nbytes: int) -> None:
        sink, self._direct = self._direct, None
        if sink is None:
            self.data_received(self.scratch[:nbytes])  # type: ignore[arg-type]
            return
        sink.in_place = True  # httptools hands these bytes over as a chunk: counted only
        try:
            self.data_received(sink.buffer[sink.filled : sink.filled + nbytes])  # type: ignore[arg-type]
        finally:
            sink.in_place = False

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._in_read = 0
        self._began_at = None
        super().data_received(data)
        if self._refused:
            return
        if not self._headers_done:
            # httptools hands a header over only once it is complete, so a head that is
            # still incomplete is counted by the bytes its reads brought: in the read where
            # it began, those after what the previous request had in it (its body's end).
            self._head_received += len(data) - (self._began_at or 0)
            self._check_size(self._head_received)
        elif (
            self._header_timer is None
            and self.timeout_keep_alive_task is None
            and (self.cycle is None or self.cycle.response_complete)
        ):
            # Bytes between requests (a bare CRLF) stopped uvicorn's keep-alive timer
            # without starting a request: the header timer holds the connection to account.
            self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[BEGAN] = time.monotonic()  # type: ignore[literal-required]
        self._header_bytes = 0
        self._head_received = 0
        self._began_at = self._in_read
        self._header_count = 0
        self._headers_done = False
        self._arm()

    def on_url(self, url: bytes) -> None:
        self._header_bytes += len(url)
        self._in_read += len(url)
        self._check_size(self._header_bytes)
        if not self._refused:
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._header_bytes += len(name) + len(value) + 4  # ": " and CRLF
        self._in_read += len(name) + len(value) + 4
        if self._header_count > self.limits.max_headers:
            limit = self.limits.max_headers
            self._refuse(431, f"more than {limit} request headers", "header_count")
            return
        self._check_size(self._header_bytes)
        if not self._refused:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._headers_done = True
        self._in_read += len(self.parser.get_method()) + REQUEST_LINE_BYTES
        self._disarm()
        if self._refused:
            return
        if self._over_capacity and not self.url.startswith(HEALTH_PREFIX):
            limit = self.limits.max_connections
            self._refuse(
                503,
                f"this server holds its {limit} connections, or this address its share of "
                "them; retry later",
                "connections",
            )
            return
        if self._over_capacity:
            self.probing = True  # answered, then closed (keep_alive below): not evicted
        super().on_headers_complete()
        if self.cycle is not None:
            self.cycle.transport = HeadHeld(self.transport)  # type: ignore[assignment]
            extensions: dict[str, Any] = self.cycle.scope.setdefault("extensions", {})
            extensions[BODY_INTO] = BodyReader(self, self.cycle)
            self.disconnect = extensions[ON_DISCONNECT] = Disconnect()
        if self._over_capacity and self.cycle is not None:
            self.cycle.keep_alive = False

    def on_body(self, body: bytes) -> None:
        self._in_read += len(body)
        if self._refused:
            return
        sink = self.sink
        if sink is not None and sink.cycle is self.cycle and sink.take(body):
            return  # copied once, where the application keeps it; woken at the end
        super().on_body(body)

    def on_message_complete(self) -> None:
        self.sink = None  # a pipelined request's body is not this one's
        if not self._refused:
            super().on_message_complete()


class Reads(asyncio.BufferedProtocol):
    """A connection's protocol as the event loop sees it, in front of its
    ``GuardedHttpTools``: uvloop reads into a protocol's buffer (``get_buffer``) only when the
    protocol is not an ``asyncio.Protocol``, and uvicorn's is one, so this one is only a
    ``BufferedProtocol`` and hands every event on. The reads land in a waiting body's slot
    or in the process's scratch buffer instead of a new ``bytes`` each."""

    __slots__ = ("http",)

    def __init__(self, http: GuardedHttpTools) -> None:
        self.http = http

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.http.connection_made(transport)  # type: ignore[arg-type]

    def connection_lost(self, exc: Exception | None) -> None:
        self.http.connection_lost(exc)

    def pause_writing(self) -> None:
        self.http.pause_writing()

    def resume_writing(self) -> None:
        self.http.resume_writing()

    def eof_received(self) -> None:
        self.http.eof_received()  # None: the transport closes itself

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.http.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.http.buffer_updated(nbytes)


def guarded(limits: LimitSettings, saturation: Saturation | None = None) -> Any:
    """The protocol class for uvicorn's ``http=``, with these limits (a ``Reads`` before a
    ``GuardedHttpTools``: uvicorn's hint names ``asyncio.Protocol``, it takes any protocol
    class); a full connection cap is noted in ``saturation``."""
    admitted = Admitted(saturation)
    scratch = memoryview(bytearray(SCRATCH_BYTES))
    protocol = type(
        "GuardedHttpTools",
        (GuardedHttpTools,),
        {"limits": limits, "admitted": admitted, "scratch": scratch},
    )

    class GuardedReads(Reads):
        __slots__ = ()

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(protocol(*args, **kwargs))

    return GuardedReads


def unread(listeners: Iterable[Any], connections: Iterable[Any]) -> bool:
    """Whether the kernel holds what this process has not read yet: a connection waiting on
    one of ``listeners`` to be accepted, or bytes on one of ``connections`` (protocols with a
    ``transport``). A drain's door waits for them (``DataPlane.begin_drain``)."""
    poller = select.poll()
    for sock in listeners:
        poller.register(sock.fileno(), select.POLLIN)
    for protocol in connections:
        transport = getattr(protocol, "transport", None)
        if transport is None or transport.is_closing():
            continue
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.fileno() >= 0:
            poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))
