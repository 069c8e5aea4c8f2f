"""A declared body read straight into the application's buffer (``app.frontend.body_sink``),
through a real uvicorn server with Stoker's protocol and ``BodyLimit`` on a free port: the
bytes arrive whole and in order however the client splits them, after a ``100 Continue``
when asked, pipelined bodies stay apart, a client that leaves mid-body is seen as gone, and
a body that stalls gets ``BodyLimit``'s 408."""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import uvicorn
from starlette.requests import ClientDisconnect

from app.errors import StokerError
from app.frontend.body_sink import BODY_INTO, BodySink
from app.frontend.http_limits import guarded
from app.frontend.server import BodyLimit
from app.settings import LimitSettings
from bench.launch import free_port

BOUND_S = 60.0


class Seen:
    def __init__(self) -> None:
        self.disconnected = threading.Event()
        self.wakeups: list[int] = []


def sink_app(seen: Seen) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        length = int(dict(scope["headers"])[b"content-length"])
        backing = bytearray(length)
        buffer = memoryview(backing)
        read = scope["extensions"][BODY_INTO]
        status = 200
        try:
            filled = await read(buffer[:length])  # a slice, as read_body hands a slot
            answer = {"filled": filled, "sha256": hashlib.sha256(buffer[:filled]).hexdigest()}
            buffer.release()
            try:  # nothing of the server still holds the buffer (a slot goes back whole)
                backing.append(0)
                answer["held"] = False
            except BufferError:
                answer["held"] = True
        except ClientDisconnect:
            seen.disconnected.set()
            return
        except StokerError as error:  # as the application's handlers answer it
            status, answer = error.status, {"error": error.message}
        body = orjson.dumps(answer)
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[int, Seen]]:
    seen = Seen()
    port = free_port()
    app = BodyLimit(sink_app(seen), 64 << 20, 256 << 20, timeout_s=2.0)
    limits = LimitSettings()
    config = uvicorn.Config(
        app, port=port, http=guarded(limits), log_level="warning", access_log=False
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + BOUND_S
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    yield port, seen
    server.should_exit = True
    thread.join(timeout=BOUND_S)


def head(length: int, extra: bytes = b"") -> bytes:
    return (
        b"POST /sink HTTP/1.1\r\nhost: x\r\ncontent-type: application/octet-stream\r\n"
        b"content-length: %d\r\n%s\r\n" % (length, extra)
    )


def answers(sock: socket.socket, count: int) -> list[dict[str, Any]]:
    """``count`` JSON answers read off the connection."""
    sock.settimeout(BOUND_S)
    data, found = b"", list[dict[str, Any]]()
    while len(found) < count:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {len(found)} answers: {data!r}"
        data += chunk
        while b"\r\n\r\n" in data:
            top, rest = data.split(b"\r\n\r\n", 1)
            if top.startswith(b"HTTP/1.1 100"):
                data = rest
                continue
            size = int(top.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            if len(rest) < size:
                break
            assert top.startswith(b"HTTP/1.1 200"), top
            found.append(orjson.loads(rest[:size]))
            data = rest[size:]
    return found


def test_a_body_in_many_pieces_arrives_whole(served: tuple[int, Seen]) -> None:
    port, _ = served
    body = bytes(range(256)) * (6 * 4096 + 7)  # 6 MiB and some, not a multiple of a read
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head(len(body)))
        for at in range(0, len(body), 40_000):
            sock.sendall(body[at : at + 40_000])
        (answer,) = answers(sock, 1)
    assert answer == {
        "filled": len(body),
        "sha256": hashlib.sha256(body).hexdigest(),
        "held": False,
    }


def test_a_client_that_expects_100_continue_gets_it_before_sending(
    served: tuple[int, Seen],
) -> None:
    port, _ = served
    body = b"\x01\x02\x03" * 400_000
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head(len(body), b"expect: 100-continue\r\n"))
        sock.settimeout(BOUND_S)
        assert sock.recv(64).startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(body)
        (answer,) = answers(sock, 1)
    assert answer == {
        "filled": len(body),
        "sha256": hashlib.sha256(body).hexdigest(),
        "held": False,
    }


def test_pipelined_bodies_stay_apart(served: tuple[int, Seen]) -> None:
    port, _ = served
    first, second = b"a" * 300_000, b"b" * 500_001
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head(len(first)) + first + head(len(second)) + second)
        got = answers(sock, 2)
    assert got == [
        {"filled": len(first), "sha256": hashlib.sha256(first).hexdigest(), "held": False},
        {"filled": len(second), "sha256": hashlib.sha256(second).hexdigest(), "held": False},
    ]


def test_a_client_gone_mid_body_is_seen_as_gone(served: tuple[int, Seen]) -> None:
    port, seen = served
    seen.disconnected.clear()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head(1_000_000) + b"x" * 300_000)
    assert seen.disconnected.wait(BOUND_S)


def test_a_stalled_body_gets_a_408(served: tuple[int, Seen]) -> None:
    port, _ = served
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head(1_000_000) + b"x" * 1000)  # the rest never comes
        sock.settimeout(BOUND_S)
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"1000 of 1000000 body bytes arrived" in answer, answer


def test_the_socket_reads_a_waiting_body_into_its_buffer(
    served: tuple[int, Seen], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under uvicorn's loop (uvloop where installed) the body's reads land in the buffer
    itself: the chunks httptools hands over are counted, not copied (``Reads``)."""
    taken = {True: 0, False: 0}
    take = BodySink.take

    def counted(sink: BodySink, chunk: bytes) -> bool:
        taken[sink.in_place] += 1
        return take(sink, chunk)

    monkeypatch.setattr(BodySink, "take", counted)
    port, _ = served
    body = b"z" * 3_000_000
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head(len(body)))
        for at in range(0, len(body), 100_000):
            sock.sendall(body[at : at + 100_000])
        (answer,) = answers(sock, 1)
    assert answer["filled"] == len(body)
    assert taken[True] > 0 and taken[False] == 0, taken
