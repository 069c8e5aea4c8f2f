"""The control channel between front ends and the engine process: framed messages on a Unix
socket.

A frame is two big-endian 32-bit lengths, a JSON header (orjson) and an optional payload of
raw bytes. Descriptors travel in the header; tensor and image bytes travel in a front end's
shared-memory arena (``app.frontend``) and only when they do not fit there, in the payload.
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


def send(writer: asyncio.StreamWriter, header: dict[str, Any], payload: bytes = b"") -> None:
    """Queue one frame (written whole: no await between its parts, so tasks never interleave
    frames on one connection)."""
    encoded = orjson.dumps(header)
    writer.write(_LENGTHS.pack(len(encoded), len(payload)) + encoded)
    if payload:
        writer.write(payload)


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
