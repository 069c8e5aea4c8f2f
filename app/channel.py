"""The control channel between front ends and the engine process: framed messages on a Unix
socket.

A frame is two big-endian 32-bit lengths, a header (a ``app.wire`` message, JSON-encoded by
msgspec) and an optional payload of raw bytes. Descriptors travel in the header; tensor and
image bytes travel in a front end's shared-memory arena (``app.frontend.arena``) and only when
they do not fit there, in the payload. Nothing is ever pickled. Calls carry a number; the
engine answers every call once, cancelled ones included, so the front end knows when a slot
is free again.
"""

from __future__ import annotations

import asyncio
import struct

_LENGTHS = struct.Struct("!II")
# A frame's header is a descriptor, never data: anything larger is a bug or a hostile peer.
MAX_HEADER_BYTES = 1 << 20


class ChannelClosed(ConnectionError):
    """The other process went away."""


class Sender:
    """The frames of one turn of the event loop, written in one go at its end.

    A batch's answers are set in one turn; sent one by one, each would be a system call of
    its own (the engine spent more on them than on batching). Order is kept, and a frame
    still goes out in the same turn it was queued, so nothing waits for a timer."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self._parts: list[bytes] = []
        self._scheduled = False

    def is_closing(self) -> bool:
        return self.writer.is_closing()

    def send(self, header: bytes, payload: bytes = b"") -> None:
        """Queue one frame: an encoded header (``app.wire``) and its payload."""
        self._parts.append(_LENGTHS.pack(len(header), len(payload)) + header)
        if payload:
            self._parts.append(payload)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        parts, self._parts = self._parts, []
        if parts and not self.writer.is_closing():
            self.writer.write(parts[0] if len(parts) == 1 else b"".join(parts))

    def close(self) -> None:
        self._flush()
        self.writer.close()


async def receive(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """The next frame's header and payload; ``ChannelClosed`` at the end of the stream."""
    try:
        header_bytes, payload_bytes = _LENGTHS.unpack(await reader.readexactly(_LENGTHS.size))
        if header_bytes > MAX_HEADER_BYTES:
            raise ChannelClosed(f"a {header_bytes}-byte frame header: not a Stoker peer")
        header = await reader.readexactly(header_bytes)
        payload = await reader.readexactly(payload_bytes) if payload_bytes else b""
    except (asyncio.IncompleteReadError, ConnectionError) as gone:
        raise ChannelClosed(str(gone)) from None
    return header, payload
