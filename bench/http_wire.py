"""The bench's lean HTTP/1.1 client: each payload's request bytes made once, written whole to
a kept-alive connection, and the answer read by its ``Content-Length`` (or chunks).

A general client costs the generator CPU the server is then charged for: aiohttp spent
about 490 us of the client's CPU a request on a 600 KB V2 body on a 2-core machine, where the
client shares the cores with the server (this one: about 190 us, BENCHMARKS.md, "The client's
share"). Triton's perf_analyzer is C++ for the same reason. The answers' bodies are read and
dropped, as the aiohttp client does (with ``--check-answers`` each is compared with the
request's answer alone, ``bench.answers``); a status other than 2xx is the step's outcome as
it is.
``--http-client aiohttp`` keeps the general client, for a server this one cannot speak to.
"""

from __future__ import annotations

import asyncio
from functools import partial
from urllib.parse import urlsplit

from bench.answers import check, decode
from bench.payloads import Payload

READ_LIMIT = 1 << 20
"""How long a response head may be (asyncio's stream limit)."""


class HttpStatusError(Exception):
    """A response this client cannot read (no status line, no length or chunks)."""


class RawHttpClient:
    """Closed-loop and open-loop clients' requests over a pool of kept-alive connections: a
    request takes an idle one or opens one, and gives it back once its answer is read."""

    def __init__(self, url: str, path: str, timeout_s: float) -> None:
        parts = urlsplit(url.rstrip("/") + path)
        if parts.scheme != "http":
            raise ValueError(
                f"the lean client speaks http://, not {parts.scheme}:// (--http-client aiohttp)"
            )
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or 80
        self._target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._authority = parts.netloc
        self._timeout_s = timeout_s
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._requests: dict[int, bytes] = {}

    def request(self, payload: Payload) -> bytes:
        """The payload's request, head and body, made once."""
        made = self._requests.get(id(payload))
        if made is None:
            head = [
                f"POST {self._target} HTTP/1.1",
                f"Host: {self._authority}",
                f"Content-Length: {len(payload.body)}",
                *(f"{name}: {value}" for name, value in payload.headers.items()),
            ]
            made = self._requests[id(payload)] = (
                "\r\n".join(head) + "\r\n\r\n"
            ).encode() + payload.body
        return made

    async def send(self, payload: Payload) -> int | str:
        data = self.request(payload)
        async with asyncio.timeout(self._timeout_s):
            reader, writer = await self._connection()
            try:
                writer.write(data)
                status, keep, body, header_length = await read_answer(reader)
            except BaseException:
                writer.close()
                raise
        if keep:
            self._idle.append((reader, writer))
        else:
            writer.close()
        if payload.expected is not None:
            return check(payload, status, partial(decode, body, header_length))
        return status

    async def _connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """An idle connection the server has not closed (a server closes idle ones after its
        keep-alive, which a target waiting its turn in a sweep may outlast), or a new one."""
        while self._idle:
            reader, writer = self._idle.pop()
            if not (reader.at_eof() or writer.is_closing()):
                return reader, writer
            writer.close()
        return await asyncio.open_connection(self._host, self._port, limit=READ_LIMIT)

    async def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, bool, bytes, int | None]:
    """One response read whole off ``reader`` (interim ``1xx`` answers before it skipped):
    its status, whether the connection may be used again, its body and its
    ``Inference-Header-Content-Length`` (a V2 binary answer's JSON header), if any."""
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status_line = lines[0].split(b" ", 2)
        if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/1."):
            raise HttpStatusError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        status = int(status_line[1])
        if status == 101:
            raise HttpStatusError("the server switched protocols")
        if not 100 <= status < 200:
            break
    length: int | None = None
    header_length: int | None = None
    chunked = False
    keep = status_line[0] == b"HTTP/1.1"
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"inference-header-content-length":
            header_length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        elif name == b"connection":
            keep = b"close" not in value.lower()
    body = b""
    if chunked:
        chunks = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":
                    pass  # trailer fields, up to the empty line
                break
            chunks.append((await reader.readexactly(size + 2))[:-2])
        body = b"".join(chunks)
    elif length is not None:
        body = await reader.readexactly(length)
    elif status not in (204, 304):
        if keep:
            raise HttpStatusError("a response with neither Content-Length nor chunks")
        body = await reader.read()  # delimited by the connection's close
    return status, keep, body, header_length
