"""The bench's lean HTTP/1.1 client: what it sends, how it reads answers, when it reuses a
connection. The server here is a few lines of asyncio (what answers is outside the unit); the
client against real uvicorn servers is tests/integration/test_bench.py's."""

from __future__ import annotations

import asyncio

import pytest

from bench.http_wire import HttpStatusError, RawHttpClient, read_answer
from bench.payloads import Payload


def read_one(data: bytes) -> tuple[int, bool]:
    """``read_answer``'s status and keep over ``data`` (a reader made on the loop that reads
    it)."""

    async def read() -> tuple[int, bool]:
        status, keep, _, _ = await read_answer(reader_of(data))
        return status, keep

    return asyncio.run(read())


def reader_of(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def test_answers_by_length_and_by_chunks_are_read_whole_one_after_another() -> None:
    asyncio.run(answers_in_a_row())


async def answers_in_a_row() -> None:
    reader = reader_of(
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"
        b"HTTP/1.1 400 Bad Request\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n4;ext=1\r\ndefg\r\n0\r\n\r\n"
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 204 No Content\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\nok\r\n0\r\nServer-Timing: x\r\n\r\n"
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n"
        b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\nInference-Header-Content-Length: 2\r\n\r\n"
        b"{}\x01\x02\x03\x04\x05\x06\x07"
    )
    assert await read_answer(reader) == (200, True, b"hello", None)
    assert await read_answer(reader) == (400, True, b"abcdefg", None)  # the chunks joined
    assert await read_answer(reader) == (204, True, b"", None)  # after the interim 100
    assert await read_answer(reader) == (200, True, b"ok", None)  # chunks, a trailer field
    assert await read_answer(reader) == (503, True, b"", None)
    assert await read_answer(reader) == (200, True, b"{}\x01\x02\x03\x04\x05\x06\x07", 2)
    assert reader.at_eof() or await reader.read() == b""


@pytest.mark.parametrize(
    ("head", "keep"),
    [
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\ncontent-length: 0\r\n\r\n", False),
        (b"HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n", False),
        (b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n", True),
    ],
)
def test_a_connection_is_kept_only_where_the_answer_allows(head: bytes, keep: bool) -> None:
    status, kept = read_one(head)
    assert kept is keep
    assert status == int(head.split(b" ")[1])


def test_a_body_delimited_by_the_close_is_read_to_the_end() -> None:
    data = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nbody until close"
    assert read_one(data) == (200, False)


@pytest.mark.parametrize(
    "data",
    [
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nServer: x\r\n\r\nbody until close",
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n",
    ],
)
def test_an_answer_it_cannot_read_is_an_error_not_a_status(data: bytes) -> None:
    with pytest.raises(HttpStatusError):
        read_one(data)


class Answering:
    """A server that records each request's bytes and answers 200, closing the connection
    after each answer when ``close``."""

    def __init__(self, close: bool) -> None:
        self.close = close
        self.connections = 0
        self.requests: list[bytes] = []
        self.writers: list[asyncio.StreamWriter] = []

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                self.requests.append(head + await reader.readexactly(length))
                closing = b"Connection: close\r\n" if self.close else b""
                writer.write(b"HTTP/1.1 200 OK\r\n" + closing + b"content-length: 2\r\n\r\nok")
                await writer.drain()
                if self.close:
                    break
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()


@pytest.mark.parametrize("close", [False, True])
def test_requests_are_sent_whole_over_kept_connections(close: bool) -> None:
    answering = Answering(close)
    port = asyncio.run(send_six(answering))
    assert len(answering.requests) == 6
    head, _, body = answering.requests[0].partition(b"\r\n\r\n")
    assert body == PAYLOAD.body
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v2/models/m/infer HTTP/1.1"
    assert f"Host: 127.0.0.1:{port}".encode() in lines
    assert b"Content-Length: 80000" in lines
    assert b"Inference-Header-Content-Length: 7" in lines
    assert answering.connections == (6 if close else 2)


PAYLOAD = Payload(1, b"\x00\x01" * 40_000, {"Inference-Header-Content-Length": "7"})


async def send_six(answering: Answering) -> int:
    """Three requests one after another, two at once, one more: the server's port."""
    server = await asyncio.start_server(answering, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = RawHttpClient(f"http://127.0.0.1:{port}", "/v2/models/m/infer", timeout_s=30)
    payload = PAYLOAD
    try:
        for _ in range(3):
            assert await client.send(payload) == 200
        # Two at once need two connections; the second goes back to the pool too.
        assert list(await asyncio.gather(client.send(payload), client.send(payload))) == [200, 200]
        assert await client.send(payload) == 200
    finally:
        await client.close()
        server.close()
        await server.wait_closed()
    return int(port)


def test_a_connection_the_server_closed_while_idle_is_not_used_again() -> None:
    """A server closes idle connections after its keep-alive; the next request opens a new
    one instead of failing on the dead one."""
    answering = Answering(close=False)

    async def twice() -> list[int | str]:
        server = await asyncio.start_server(answering, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = RawHttpClient(f"http://127.0.0.1:{port}", "/", timeout_s=30)
        try:
            first = await client.send(PAYLOAD)
            # The server closes the kept connection, as at the end of its keep-alive.
            for writer in answering.writers:
                writer.close()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while not all(reader.at_eof() for reader, _ in client._idle):
                assert loop.time() < deadline, "the client never saw the close"
                await asyncio.sleep(0.01)
            second = await client.send(PAYLOAD)
        finally:
            await client.close()
            server.close()
            await server.wait_closed()
        return [first, second]

    assert asyncio.run(twice()) == [200, 200]
    assert answering.connections == 2
