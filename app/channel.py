"""The control channel between front ends and the engine process: framed messages on a Unix
socket.

A frame is two big-endian 32-bit lengths, a header (a ``app.wire`` message, JSON-encoded by
msgspec) and an optional payload of raw bytes. Descriptors travel in the header; tensor and
image bytes travel in a front end's shared-memory arena (``app.frontend.arena``) and only when
they do not fit there, in the payload. Nothing is ever pickled. Calls carry a number; the
engine answers every call once, cancelled ones included, so the front end knows when a slot
is free again.

A header over ``MAX_HEADER_BYTES`` is never sent (``FrameTooLarge``, 413, to its sender); one
that arrives anyway is read past and refused by its number, so it costs neither side its
channel.
"""

from __future__ import annotations

import asyncio
import logging
import re
import struct
from collections.abc import Callable
from typing import Protocol, cast

from app.errors import PayloadTooLarge

log = logging.getLogger(__name__)

_LENGTHS = struct.Struct("!II")
# A frame's header is a descriptor, never data: anything larger is a bug or a hostile peer.
MAX_HEADER_BYTES = 1 << 20
# A header starts with its frame's number (``app.wire.CallHeader``/``ReplyHeader``: ``[id, ...``).
_NUMBER = re.compile(rb"\[(\d{1,20}),")


class ChannelClosed(ConnectionError):
    """The other process went away."""


class FrameTooLarge(PayloadTooLarge):
    """A frame whose header exceeds ``MAX_HEADER_BYTES``: not sent, or read past unread;
    ``number`` is its frame's (-1 where not known)."""

    def __init__(self, size: int, number: int = -1) -> None:
        super().__init__(
            f"a control message of {size} bytes exceeds the {MAX_HEADER_BYTES} bytes a "
            "call between processes may carry"
        )
        self.number = number


class Writable(Protocol):
    """Where a ``Sender`` writes: a transport (``Frames.transport``) or a stream writer."""

    def write(self, data: bytes) -> None: ...

    def is_closing(self) -> bool: ...

    def close(self) -> None: ...


class Sender:
    """A channel's frames: the first of a turn of the event loop written at once, those
    after it in the same turn in one go at the turn's end.

    A batch's answers are set in one turn; sent one by one, each would be a system call of
    its own (the engine spent more on them than on batching). But a frame held to the turn's
    end waits a turn, and under load a loop turns in milliseconds: the engine's answer to a
    front end's frame is mostly the only one to it in its turn, and waited a turn for
    nothing. So the first goes now and the rest of the turn's are gathered: at most two
    writes a turn. Order is kept, nothing waits for a timer, and ``flush`` writes what is
    queued now."""

    def __init__(self, writer: Writable) -> None:
        self.writer = writer
        self._parts: list[bytes] = []
        self._scheduled = False

    def is_closing(self) -> bool:
        return self.writer.is_closing()

    def send(self, header: bytes, payload: bytes = b"") -> None:
        """Send one frame (at once, or queued for the turn's end): an encoded header
        (``app.wire``) and its payload; ``FrameTooLarge`` for a header the other side
        would not take."""
        if len(header) > MAX_HEADER_BYTES:
            raise FrameTooLarge(len(header))
        self._parts.append(_LENGTHS.pack(len(header), len(payload)) + header)
        if payload:
            self._parts.append(payload)
        if not self._scheduled:  # the turn's first: now, and the rest at the turn's end
            self._scheduled = True
            self.flush()
            asyncio.get_running_loop().call_soon(self._scheduled_flush)

    def _scheduled_flush(self) -> None:
        self._scheduled = False
        self.flush()

    def flush(self) -> None:
        parts, self._parts = self._parts, []
        if parts and not self.writer.is_closing():
            self.writer.write(parts[0] if len(parts) == 1 else b"".join(parts))

    def close(self) -> None:
        self.flush()
        self.writer.close()


class Frames(asyncio.Protocol):
    """One end of a channel as the event loop reads it: each whole frame handed to
    ``on_frame(header, payload)`` in the turn its last bytes are read, with no task woken
    first (a reader task took a turn of the loop a burst of frames, and under load a turn
    is a millisecond); a frame whose header is over ``MAX_HEADER_BYTES`` read past and
    handed to ``on_refused`` (its number, to refuse it by). ``closed`` is done when the
    channel ends, with ``ChannelClosed``: the other side hung up or sent what is not a
    Stoker frame, or ``on_frame`` raised (a bug, logged; the channel is then closed, as
    a reader task's error ended it)."""

    def __init__(
        self,
        on_frame: Callable[[bytes, bytes], None],
        on_refused: Callable[[FrameTooLarge], None] | None = None,
    ) -> None:
        self.on_frame = on_frame
        self.on_refused = on_refused
        self.transport: asyncio.Transport | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._buffer = bytearray()
        self._skip = 0  # bytes of a refused frame still to read past

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is none by class

    def data_received(self, data: bytes) -> None:
        if self._skip:
            skipped = min(self._skip, len(data))
            self._skip -= skipped
            data = data[skipped:]
        if not data:
            return
        buffer = self._buffer
        buffer += data
        at = 0
        try:
            while len(buffer) - at >= _LENGTHS.size:
                header_bytes, payload_bytes = _LENGTHS.unpack_from(buffer, at)
                start = at + _LENGTHS.size
                if header_bytes > MAX_HEADER_BYTES:
                    if len(buffer) - start < min(32, header_bytes):
                        break  # its number is not here yet
                    at = self._refuse(buffer, start, header_bytes, payload_bytes)
                    continue
                end = start + header_bytes + payload_bytes
                if len(buffer) < end:
                    break
                header = bytes(buffer[start : start + header_bytes])
                payload = b""
                if payload_bytes:
                    with memoryview(buffer) as view:  # one copy (released before the del)
                        payload = bytes(view[start + header_bytes : end])
                at = end
                self.on_frame(header, payload)
        except ChannelClosed as gone:
            self._end(gone)
        except Exception as error:
            log.error("a frame's handler failed: %r", error, exc_info=error)
            self._end(ChannelClosed(f"a frame's handler failed: {error!r}"))
        finally:
            del buffer[:at]

    def _refuse(self, buffer: bytearray, start: int, header_bytes: int, payload_bytes: int) -> int:
        """Read past a frame whose header is too large: where the next frame starts in
        ``buffer`` (its end, where the rest of it is still to come)."""
        number = _NUMBER.match(bytes(buffer[start : start + min(32, header_bytes)]))
        if number is None:
            raise ChannelClosed(f"a {header_bytes}-byte frame header: not a Stoker peer")
        end = start + header_bytes + payload_bytes
        if end > len(buffer):
            self._skip, end = end - len(buffer), len(buffer)
        refused = FrameTooLarge(header_bytes, int(number[1]))
        if self.on_refused is None:
            raise ChannelClosed(str(refused))
        self.on_refused(refused)
        return end

    def _end(self, gone: ChannelClosed) -> None:
        if not self.closed.done():
            self.closed.set_exception(gone)
            self.closed.exception()  # retrieved: whoever awaits it sees it, nobody must
        if self.transport is not None:
            self.transport.close()

    def eof_received(self) -> bool | None:
        return None  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        left = f", {len(self._buffer)} bytes of a frame unread" if self._buffer else ""
        self._end(ChannelClosed(f"{exc or 'the other side hung up'}{left}"))
        self._buffer.clear()
