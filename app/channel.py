"""The control channel between front ends and the engine process: framed messages on a Unix
socket.

A frame is two big-endian 32-bit lengths, a JSON header (orjson) and an optional payload of
raw bytes. Descriptors travel in the header; tensor and image bytes travel in a front end's
shared-memory arena (``app.frontend.remote``) and only when they do not fit there, in the payload.
Nothing is ever pickled. Requests carry an ``id``; the engine answers every request once,
cancelled ones included, so the front end knows when a slot is free again.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import orjson

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

    def send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        """Queue one frame; raises what ``orjson.dumps`` raises for a header it cannot
        encode, and then queues nothing."""
        encoded = orjson.dumps(header)
        self._parts.append(_LENGTHS.pack(len(encoded), len(payload)) + encoded)
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


async def receive(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes]:
    """The next frame; ``ChannelClosed`` at the end of the stream."""
    try:
        header_bytes, payload_bytes = _LENGTHS.unpack(await reader.readexactly(_LENGTHS.size))
        if header_bytes > MAX_HEADER_BYTES:
            raise ChannelClosed(f"a {header_bytes}-byte frame header: not a Stoker peer")
        header = orjson.loads(await reader.readexactly(header_bytes))
        payload = await reader.readexactly(payload_bytes) if payload_bytes else b""
    except (asyncio.IncompleteReadError, ConnectionError) as gone:
        raise ChannelClosed(str(gone)) from None
    if not isinstance(header, dict):
        raise ChannelClosed("a frame header that is not an object")
    return header, payload
