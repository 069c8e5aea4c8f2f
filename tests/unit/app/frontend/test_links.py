"""What a front end makes of several engines' answers: one repository index, and the outcome
of a load or unload every engine was asked for."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path
from typing import Any

import pytest

from app import wire
from app.channel import ChannelClosed, Frames
from app.errors import NotFound, Unavailable
from app.frontend.links import EngineLink, RemoteError, every_engine, merged_index


def entry(name: str, state: str, reason: str = "") -> dict[str, str]:
    item = {"name": name, "version": "fp32", "state": state}
    return item | ({"reason": reason} if reason else {})


def test_engines_that_agree_give_their_index_and_disagreement_names_the_engine() -> None:
    zero = [entry("a", "READY"), entry("b", "READY"), entry("c", "UNAVAILABLE", "unloaded")]
    one = [entry("a", "READY"), entry("b", "LOADING"), entry("c", "UNAVAILABLE", "unloaded")]
    assert merged_index([("0", zero)]) == zero
    merged = {i["name"]: i for i in merged_index([("0", zero), ("1", one)])}
    assert merged["a"] == entry("a", "READY")
    assert merged["b"] == entry("b", "LOADING", "GPU 1")  # the one furthest from serving
    assert merged["c"] == entry("c", "UNAVAILABLE", "unloaded")
    only_zero = merged_index([("0", [*zero, entry("d", "READY")]), ("1", one)])
    assert only_zero[-1]["reason"] == "GPU 0 (unknown to GPU 1)"


def links(*labels: str) -> list[EngineLink]:
    return [EngineLink(label, Path(f"/tmp/{label}.sock")) for label in labels]


def test_a_call_to_every_engine_is_done_refused_alike_or_said_to_disagree() -> None:
    two = links("0", "1")
    every_engine("load of 'm'", two, [None, None])
    with pytest.raises(NotFound, match="no model"):
        every_engine("load of 'm'", two, [NotFound("no model"), NotFound("no model")])
    with pytest.raises(RemoteError, match="failed on some engines: GPU 1: out of memory") as some:
        every_engine("load of 'm'", two, [None, RemoteError("out of memory", 503, "x")])
    assert some.value.status == 500
    with pytest.raises(ConnectionError):
        every_engine("load of 'm'", two, [None, ConnectionError("gone")])


class Recorded:
    """A link's writer that keeps what is sent."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, header: bytes, payload: bytes = b"") -> None:
        self.sent.append(header)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


def test_a_reply_goes_to_its_handler_as_it_is_read_and_a_closed_link_fails_the_rest() -> None:
    """A call sent with ``then`` is answered by calling it in the step that reads its reply
    (with the reply and its payload); the calls still open when the channel ends get the
    engine's absence (503), once each, and a handler that raises does not stop the reading."""
    got: dict[str, Any] = {}

    def keep(name: str) -> Any:
        return lambda outcome: got.setdefault(name, outcome)

    def broken(_: Any) -> None:
        raise RuntimeError("a bug in a handler")

    async def main() -> None:
        link = EngineLink("", Path("/tmp/none.sock"))
        link.writer = Recorded()  # type: ignore[assignment]
        bad = link.request(wire.Cancel(1), then=broken)
        answered = link.request(wire.Cancel(2), then=keep("answered"))
        link.request(wire.Cancel(3), then=keep("open"))
        frames = Frames(link.reply)
        for number, data in ((bad, b""), (answered, b"rows")):
            header = wire.encode_answer(number, wire.CANCELLED)
            frames.data_received(struct.pack("!II", len(header), len(data)) + header + data)
        assert "answered" in got  # in the step that read it, before any task ran
        frames.connection_lost(None)
        with pytest.raises(ChannelClosed):  # the end of the stream: the engine went away
            await link.read_replies(frames)
        assert link.then == {} and link.waiting == {}

    asyncio.run(main())
    assert got["answered"] == (wire.CANCELLED, b"rows")
    assert isinstance(got["open"], Unavailable) and got["open"].status == 503
