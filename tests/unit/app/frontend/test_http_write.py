"""A response's head and body leave in one transport call; a head with no body yet still
leaves within the turn of the loop that wrote it."""

from __future__ import annotations

import asyncio
from typing import Any

from app.frontend.http_write import HeadHeld


class Recorded:
    """A transport that records what each call was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def write(self, data: bytes) -> None:
        self.calls.append(("write", bytes(data)))

    def writelines(self, pieces: Any) -> None:
        self.calls.append(("writelines", tuple(bytes(p) for p in pieces)))

    def close(self) -> None:
        self.calls.append(("close", None))

    def is_closing(self) -> bool:
        return False


def test_the_head_and_the_body_go_in_one_call() -> None:
    async def answer() -> list[tuple[str, Any]]:
        transport = Recorded()
        held = HeadHeld(transport)  # type: ignore[arg-type]
        held.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        held.write(b"{}")
        await asyncio.sleep(0)  # the end of the turn writes nothing more
        return transport.calls

    calls = asyncio.run(answer())
    assert calls == [("writelines", (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n", b"{}"))]


def test_a_head_whose_body_comes_later_leaves_at_the_end_of_the_turn() -> None:
    async def stream() -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
        transport = Recorded()
        held = HeadHeld(transport)  # type: ignore[arg-type]
        held.write(b"head")
        assert transport.calls == []
        await asyncio.sleep(0)
        after_turn = list(transport.calls)
        held.write(b"chunk 1")
        held.write(b"chunk 2")
        return after_turn, transport.calls

    after_turn, calls = asyncio.run(stream())
    assert after_turn == [("write", b"head")]
    assert calls == [("write", b"head"), ("write", b"chunk 1"), ("write", b"chunk 2")]


def test_closing_writes_a_held_head_first() -> None:
    async def closed() -> list[tuple[str, Any]]:
        transport = Recorded()
        held = HeadHeld(transport)  # type: ignore[arg-type]
        held.write(b"head")
        held.close()
        await asyncio.sleep(0)
        return transport.calls

    assert asyncio.run(closed()) == [("write", b"head"), ("close", None)]
