"""A refusal answered before the application sees the request: ``{"error": ...}`` as JSON
with its status, sent over ASGI by the middleware (API keys, the browser guard) and written
raw by the HTTP protocol's own guard (``app.frontend.http_limits``)."""

from __future__ import annotations

from collections.abc import Sequence

import orjson
from starlette.types import Send

Headers = Sequence[tuple[bytes, bytes]]


def refusal(message: str, headers: Headers = ()) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """A refusal's headers (``headers`` after the content's own) and its body."""
    body = orjson.dumps({"error": message})
    length = str(len(body)).encode()
    return [(b"content-type", b"application/json"), (b"content-length", length), *headers], body


async def refuse(send: Send, status: int, message: str, headers: Headers = ()) -> None:
    head, body = refusal(message, headers)
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})
