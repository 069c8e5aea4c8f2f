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
import re
import struct

from app.errors import PayloadTooLarge

_LENGTHS = struct.Struct("!II")
# A frame's header is a descriptor, never data: anything larger is a bug or a hostile peer.
MAX_HEADER_BYTES = 1 << 20
# A header starts with its frame's number (``app.wire.CallHeader``/``ReplyHeader``: ``[id, ...``).
_NUMBER = re.compile(rb"\[(\d{1,20}),")
_DISCARD_BYTES = 64 * 1024


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


class Sender:
    """The frames of one turn of the event loop, written in one go at its end.

    A batch's answers are set in one turn; sent one by one, each would be a system call of
    its own (the engine spent more on them than on batching). Order is kept, and a frame
    goes out at the latest in the next turn, so nothing waits for a timer; ``flush`` writes
    what is queued now, where a turn is a round trip's cost (a front end's loop under load
    turns in milliseconds)."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self._parts: list[bytes] = []
        self._scheduled = False

    def is_closing(self) -> bool:
        return self.writer.is_closing()

    def send(self, header: bytes, payload: bytes = b"") -> None:
        """Queue one frame: an encoded header (``app.wire``) and its payload;
        ``FrameTooLarge`` for a header the other side would not take."""
        if len(header) > MAX_HEADER_BYTES:
            raise FrameTooLarge(len(header))
        self._parts.append(_LENGTHS.pack(len(header), len(payload)) + header)
        if payload:
            self._parts.append(payload)
        if not self._scheduled:
            self._scheduled = True
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


async def receive(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """The next frame's header and payload; ``ChannelClosed`` at the end of the stream;
    ``FrameTooLarge`` for a frame with a header over ``MAX_HEADER_BYTES``, once it has been
    read past (``ChannelClosed`` if it does not begin with a frame's number)."""
    try:
        header_bytes, payload_bytes = _LENGTHS.unpack(await reader.readexactly(_LENGTHS.size))
        if header_bytes > MAX_HEADER_BYTES:
            raise await _skipped(reader, header_bytes, payload_bytes)
        header = await reader.readexactly(header_bytes)
        payload = await reader.readexactly(payload_bytes) if payload_bytes else b""
    except (asyncio.IncompleteReadError, ConnectionError) as gone:
        raise ChannelClosed(str(gone)) from None
    return header, payload


async def _skipped(
    reader: asyncio.StreamReader, header_bytes: int, payload_bytes: int
) -> Exception:
    """Read past a frame whose header is too large, a piece at a time: what it is refused
    with."""
    start = await reader.readexactly(min(32, header_bytes))
    number = _NUMBER.match(start)
    if number is None:
        return ChannelClosed(f"a {header_bytes}-byte frame header: not a Stoker peer")
    left = header_bytes - len(start) + payload_bytes
    while left:
        left -= len(await reader.readexactly(min(left, _DISCARD_BYTES)))
    return FrameTooLarge(header_bytes, int(number[1]))
