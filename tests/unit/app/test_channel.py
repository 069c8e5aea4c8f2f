"""The control channel's framing. As the event loop reads it (``app.channel.Frames``): whole
frames handed on in the read that completes them, however the bytes are cut; a frame with a
header over the bound read past and refused by its number; the end of the channel, a
foreign frame or a failing handler end it with ``ChannelClosed``. As it is written
(``Sender``): a turn's first frame at once, the rest of the turn's in one write."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import pytest

from app.channel import MAX_HEADER_BYTES, ChannelClosed, Frames, FrameTooLarge, Sender

LENGTHS = struct.Struct("!II")


def frame(header: bytes, payload: bytes = b"") -> bytes:
    return LENGTHS.pack(len(header), len(payload)) + header + payload


class Transport(asyncio.Transport):
    """The channel's socket, as far as ``Frames`` uses it."""

    def __init__(self) -> None:
        super().__init__()
        self.closing = False

    def close(self) -> None:
        self.closing = True


def read(chunks: list[bytes], on_frame: Any = None) -> tuple[list[Any], Frames, Transport]:
    """``chunks`` through a ``Frames``: what it handed on, in order (frames, refusals)."""
    got: list[Any] = []

    async def main() -> tuple[Frames, Transport]:
        frames = Frames(on_frame or (lambda h, p: got.append((h, p))), got.append)
        transport = Transport()
        frames.connection_made(transport)
        for chunk in chunks:
            frames.data_received(chunk)
        return frames, transport

    frames, transport = asyncio.run(main())
    return got, frames, transport


def test_frames_are_handed_on_whole_however_the_bytes_are_cut() -> None:
    too_large = b"[9," + b"x" * MAX_HEADER_BYTES
    stream = (
        frame(b"[1,first]")
        + frame(b"[2,second]", b"payload" * 1000)
        + frame(too_large, b"refused payload")
        + frame(b"[3,third]")
    )
    whole, _, transport = read([stream])
    assert [type(item) for item in whole] == [tuple, tuple, FrameTooLarge, tuple]
    assert whole[0] == (b"[1,first]", b"")
    assert whole[1] == (b"[2,second]", b"payload" * 1000)
    assert whole[2].number == 9 and whole[2].status == 413
    assert whole[3] == (b"[3,third]", b"")
    assert not transport.closing
    for size in (1, 7, 4096, 65536):  # a byte at a time, and reads cutting anywhere
        cut = [stream[at : at + size] for at in range(0, len(stream), size)]
        pieces, _, _ = read(cut)
        assert [p if isinstance(p, tuple) else p.number for p in pieces] == [
            *whole[:2],
            9,
            whole[3],
        ], size


def test_a_frame_is_handed_on_in_the_read_that_completes_it() -> None:
    data = frame(b"[1,a]", b"0123456789")
    got, frames, _ = read([data[:-1]])
    assert got == []
    frames.data_received(data[-1:])
    assert got == [(b"[1,a]", b"0123456789")]


def test_the_end_of_the_channel_mid_frame_closes_it_saying_so() -> None:
    got, frames, _ = read([frame(b"[1,a]"), frame(b"[2,b]", b"cut")[:-2]])
    assert got == [(b"[1,a]", b"")]
    frames.connection_lost(None)
    with pytest.raises(ChannelClosed, match="hung up, 14 bytes of a frame unread"):
        frames.closed.result()


def test_a_foreign_frame_or_a_failing_handler_closes_the_channel() -> None:
    _, foreign, transport = read([frame(b"{" + b"x" * MAX_HEADER_BYTES)])
    with pytest.raises(ChannelClosed, match="not a Stoker peer"):
        foreign.closed.result()
    assert transport.closing

    def failing(header: bytes, payload: bytes) -> None:
        raise RuntimeError("a bug")

    _, failed, transport = read([frame(b"[1,a]") + frame(b"[2,b]")], failing)
    with pytest.raises(ChannelClosed, match="handler failed: RuntimeError"):
        failed.closed.result()
    assert transport.closing


def test_a_frame_too_large_without_a_refusal_handler_closes_the_channel() -> None:
    async def main() -> Frames:
        frames = Frames(lambda h, p: None)
        frames.connection_made(Transport())
        frames.data_received(frame(b"[4," + b"x" * MAX_HEADER_BYTES))
        return frames

    frames = asyncio.run(main())
    with pytest.raises(ChannelClosed, match=f"exceeds the {MAX_HEADER_BYTES} bytes"):
        frames.closed.result()


class Written:
    """A writer that keeps each write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


def test_a_turns_first_frame_is_written_at_once_and_the_rest_in_one_write_at_its_end() -> None:
    async def main() -> list[list[bytes]]:
        written = Written()
        out = Sender(written)
        seen = []
        out.send(b"[1,a]")
        seen.append(list(written.writes))  # the first: before the turn ends
        out.send(b"[2,b]", b"payload")
        out.send(b"[3,c]")
        seen.append(list(written.writes))  # the others wait for the turn's end
        await asyncio.sleep(0)
        seen.append(list(written.writes))
        out.send(b"[4,d]")  # a new turn's first
        seen.append(list(written.writes))
        await asyncio.sleep(0)
        seen.append(list(written.writes))
        return seen

    first, same_turn, turn_end, next_first, quiet = asyncio.run(main())
    assert first == same_turn == [frame(b"[1,a]")]
    assert turn_end == [frame(b"[1,a]"), frame(b"[2,b]", b"payload") + frame(b"[3,c]")]
    assert next_first == [*turn_end, frame(b"[4,d]")]
    assert quiet == next_first  # nothing queued: nothing more written
