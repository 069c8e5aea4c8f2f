"""What the routes do themselves: read a body exactly as declared, into a buffer that grows
with what arrives rather than with what is declared.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import pytest

from app.errors import BadRequest


@pytest.mark.parametrize(
    ("declared", "chunks", "problem"),
    [
        (10, [b"01234", b"56789"], None),
        (None, [b"abc", b"def"], None),
        (4, [b"01234"], "longer than its Content-Length"),
        (8, [b"0123"], "shorter than its Content-Length"),
    ],
)
def test_a_declared_body_is_read_exactly_or_refused(
    declared: int | None, chunks: list[bytes], problem: str | None
) -> None:
    from starlette.requests import Request

    from app.frontend.routes import read_body

    headers = [] if declared is None else [(b"content-length", str(declared).encode())]
    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]

    async def receive() -> dict[str, object]:
        return messages.pop(0)

    async def read() -> bytes | bytearray | memoryview:
        scope = {"type": "http", "method": "POST", "path": "/", "headers": headers}
        return await read_body(Request(scope, receive))

    if problem is None:
        assert bytes(asyncio.run(read())) == b"".join(chunks)
    else:
        with pytest.raises(BadRequest, match=problem):
            asyncio.run(read())


def test_a_body_buffer_follows_what_arrives_not_what_is_declared() -> None:
    """A client that declares 64 MiB and sends one byte before it goes away holds at most
    the up-front buffer (4 MiB); a body that does arrive in full is read exactly, across
    buffer growths."""
    import tracemalloc

    from starlette.requests import ClientDisconnect, Request

    from app.frontend.routes import UPFRONT_BODY_BYTES, read_body

    def reader(declared: int, messages: list[dict[str, object]]) -> Request:
        async def receive() -> dict[str, object]:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        headers = [(b"content-length", str(declared).encode())]
        return Request({"type": "http", "method": "POST", "path": "/", "headers": headers}, receive)

    tracemalloc.start()
    try:
        with pytest.raises(ClientDisconnect):
            request = reader(64 << 20, [{"type": "http.request", "body": b"{", "more_body": True}])
            asyncio.run(read_body(request))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < UPFRONT_BODY_BYTES + (1 << 20), peak

    body = bytes(range(256)) * (40 << 10)  # 10 MiB: two growths past the up-front buffer
    chunks = [body[i : i + 65536] for i in range(0, len(body), 65536)]
    messages: list[dict[str, object]] = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    assert bytes(asyncio.run(read_body(reader(len(body), messages)))) == body


@pytest.mark.parametrize("watch", ["protocol", "task"])
def test_a_failed_request_keeps_nothing_alive_without_a_collection(watch: str) -> None:
    """What a failed request built (its parsed document) is freed when its error is, by
    reference counting alone: no cycle through the task that ran it (with the cycle, five
    64 MiB JSON bodies kept 8 GB until a full collection). Both ways of watching for the
    client's disconnect: the protocol's ``Disconnect``, and a task on ``receive``."""
    import gc
    import weakref

    from app.frontend.disconnect import ON_DISCONNECT, Disconnect, unless_disconnected

    class Document:
        """Stands for a parsed request body."""

    seen: list[weakref.ref[Document]] = []

    async def work() -> None:
        document = Document()
        seen.append(weakref.ref(document))
        raise BadRequest("no such input")

    disconnect = Disconnect()

    class Connected:
        scope = {"extensions": {ON_DISCONNECT: disconnect}} if watch == "protocol" else {}

        async def receive(self) -> dict[str, str]:
            await asyncio.sleep(3600)  # the client stays connected
            return {"type": "http.disconnect"}

    async def request() -> None:
        with pytest.raises(BadRequest):
            await unless_disconnected(Connected(), work())  # type: ignore[arg-type]

    gc.disable()
    try:
        asyncio.run(request())
        assert seen and seen[0]() is None
        assert disconnect.callback is None  # nothing of the request left on the connection
    finally:
        gc.enable()


@pytest.mark.parametrize("lost", ["while it runs", "before it began"])
def test_a_lost_connection_told_by_the_protocol_drops_the_work(lost: str) -> None:
    """The protocol's ``Disconnect`` (``connection_lost``) cancels the request's work and
    answers None, whether the connection goes while the work waits or went before the
    request watched for it; no task waits on ``receive`` for it."""
    from app.frontend.disconnect import ON_DISCONNECT, Disconnect, unless_disconnected

    disconnect = Disconnect()
    cancelled = asyncio.Event()

    async def work() -> str:
        try:
            await asyncio.sleep(3600)  # a queued request
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "answered"

    class Watched:
        scope: ClassVar[dict[str, Any]] = {"extensions": {ON_DISCONNECT: disconnect}}

        async def receive(self) -> dict[str, str]:
            raise AssertionError("the protocol says when the client goes: receive is not read")

    async def request() -> str | None:
        if lost == "before it began":
            disconnect.connection_lost()
        else:
            asyncio.get_running_loop().call_later(0.01, disconnect.connection_lost)
        answer = await asyncio.wait_for(unless_disconnected(Watched(), work()), 60)  # type: ignore[arg-type]
        assert cancelled.is_set()
        return answer

    assert asyncio.run(request()) is None
    assert disconnect.callback is None
