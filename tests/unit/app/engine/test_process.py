"""The engine process's control server over a real Unix socket, with a real engine on the
tiny model: every call is a typed ``app.wire`` message, dispatched by its type; it answers
every call exactly once, a cancelled one included; what cannot cross the channel as a
descriptor crosses as payload; a frame of another wire version or an unknown op is refused
with a reason."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import onnx
import orjson
import pytest
import yaml

from app import wire
from app.channel import MAX_HEADER_BYTES, Frames, FrameTooLarge, Sender
from app.engine.local import LocalEngine
from app.engine.process import EngineServer, visible_device
from app.settings import Settings
from app.tensor_data import unpack_tensor
from tests.conftest import TINY_BIAS, TINY_WEIGHTS, tiny_onnx

T = TypeVar("T")


def body(x: np.ndarray) -> bytes:
    tensor = {"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}
    return orjson.dumps({"inputs": [tensor]})


def framed(header: bytes, payload: bytes = b"") -> bytes:
    """A frame's bytes as the channel carries them."""
    return struct.pack("!II", len(header), len(payload)) + header + payload


Incoming = asyncio.Queue[tuple[bytes, bytes]]
"""The frames a test's end of the channel read, in order."""


async def receive(reader: Incoming) -> tuple[bytes, bytes]:
    return await reader.get()


async def replies(reader: Incoming, count: int) -> dict[int, wire.ReplyHeader]:
    """The next ``count`` answers, by call number (they may come in any order)."""
    found: dict[int, wire.ReplyHeader] = {}
    while len(found) < count:
        header, _ = await receive(reader)
        answer = wire.decode_answer(header)
        found[answer.id] = answer
    return found


def with_engine(
    tmp_path: Path,
    talk: Callable[[Incoming, asyncio.Transport], Awaitable[T]],
) -> T:
    folder = tmp_path / "repo" / "tiny"
    folder.mkdir(parents=True)
    onnx.save(tiny_onnx(), str(folder / "model.onnx"))
    (folder / "config.yaml").write_text(yaml.safe_dump({"max_batch_size": 8}))
    settings = Settings(
        models={"repository": tmp_path / "repo"},  # type: ignore[arg-type]
        store={"path": tmp_path / "store"},  # type: ignore[arg-type]
    )
    path = str(tmp_path / "engine.sock")

    async def main() -> T:
        engine = LocalEngine(settings)
        await engine.start()
        server = await EngineServer(engine).listen(path)
        try:
            reader: Incoming = asyncio.Queue()
            loop = asyncio.get_running_loop()
            _, frames = await loop.create_unix_connection(
                lambda: Frames(lambda header, payload: reader.put_nowait((header, payload))), path
            )
            writer = frames.transport
            assert writer is not None
            try:
                return await asyncio.wait_for(talk(reader, writer), 20)
            finally:
                writer.close()
        finally:
            server.close()
            await engine.stop()

    return asyncio.run(main())


def test_an_inference_is_answered_with_its_encoded_response(tmp_path: Path) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)

    async def talk(reader: Incoming, writer: asyncio.Transport) -> Any:
        out = Sender(writer)
        out.send(wire.encode_call(7, wire.Infer("tiny", None, None, "")), body(x))
        return await receive(reader)

    header, payload = with_engine(tmp_path, talk)
    answer = wire.decode_answer(header)
    assert answer.id == 7 and isinstance(answer.reply, wire.Inferred)
    assert (answer.reply.model, answer.reply.version) == ("tiny", "fp32")
    outputs = {o["name"]: o for o in orjson.loads(payload)["outputs"]}
    np.testing.assert_allclose(
        np.array(outputs["y"]["data"]).reshape(2, 3), x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5
    )


def test_a_request_cancelled_before_it_ran_is_still_answered(tmp_path: Path) -> None:
    """The request and its cancel in one write: the engine reads both in one turn, so the
    request's task is cancelled before it ever ran; the front end must still hear of it."""

    async def talk(reader: Incoming, writer: asyncio.Transport) -> Any:
        x = np.ones((1, 4), np.float32)
        writer.write(
            framed(wire.encode_call(1, wire.Infer("tiny", None, None, "")), body(x))
            + framed(wire.encode_call(0, wire.Cancel(1)))
            + framed(wire.encode_call(2, wire.State()))
        )
        return await replies(reader, 2)

    answers = with_engine(tmp_path, talk)
    assert answers[1].reply == wire.Failure("cancelled", 499, "cancelled")
    state = answers[2].reply
    assert isinstance(state, wire.EngineState) and state.alive and state.ready
    assert state.serving == (wire.Serving("tiny", "fp32", 8),)


def test_errors_keep_their_status_and_foreign_frames_are_refused_with_why(
    tmp_path: Path,
) -> None:
    lengths = struct.Struct("!II")

    async def talk(reader: Incoming, writer: asyncio.Transport) -> Any:
        out = Sender(writer)
        out.send(wire.encode_call(1, wire.Infer("nope", None, None, "")), b"{}")
        out.send(f'[2,{wire.WIRE_VERSION},{{"op":"teleport"}}]'.encode())
        newer = f'[3,{wire.WIRE_VERSION + 1},{{"op":"metrics"}}]'.encode()
        out.send(newer)
        out.send(f'[4,{wire.WIRE_VERSION},{{"op":"describe","name":7}}]'.encode())
        found = await replies(reader, 4)
        # Still serving after all of them.
        writer.write(lengths.pack(len(state := wire.encode_call(5, wire.State())), 0) + state)
        found |= await replies(reader, 1)
        return found

    got = with_engine(tmp_path, talk)
    replies_ = {number: answer.reply for number, answer in got.items()}
    for number in (1, 2, 3, 4):
        assert isinstance(replies_[number], wire.Failure), number
    unknown, teleport, newer, typed = (replies_[n] for n in (1, 2, 3, 4))
    assert isinstance(unknown, wire.Failure) and unknown.status == 404
    assert "unknown model" in unknown.error
    assert isinstance(teleport, wire.Failure) and "'teleport'" in teleport.error
    assert isinstance(newer, wire.Failure)
    assert f"wire version {wire.WIRE_VERSION + 1}" in newer.error
    assert f"speaks {wire.WIRE_VERSION}" in newer.error
    assert isinstance(typed, wire.Failure) and "$.name" in typed.error
    assert isinstance(replies_[5], wire.EngineState) and replies_[5].alive


def test_gathered_requests_run_as_one_and_each_gets_its_own_rows(tmp_path: Path) -> None:
    """Three decoded requests of 1, 2 and 3 rows in one frame, their tensors in the payload
    (no arena): one queue entry (one executed batch of 6 rows), and each item's outputs are
    its own rows, the third as top-2 classes as it asked."""
    xs = [np.full((n, 4), float(n), np.float32) for n in (1, 2, 3)]
    payload, items, at = b"", [], 0
    for i, x in enumerate(xs):
        tensor = wire.TensorRef("x", "FP32", x.shape, at, x.nbytes)
        wanted = wire.Wanted("y", 2 if i == 2 else 0)
        items.append(wire.RunItem((tensor,), len(x), (wanted,)))
        payload += x.tobytes()
        at += x.nbytes

    async def talk(reader: Incoming, writer: asyncio.Transport) -> Any:
        out = Sender(writer)
        call = wire.Run("tiny", "fp32", None, 0, "", tuple(items))
        out.send(wire.encode_call(3, call), payload)
        reply = await receive(reader)
        out.send(wire.encode_call(4, wire.Control("statistics", ("tiny",))))
        return reply, await receive(reader)

    (header, data), (stats_header, _) = with_engine(tmp_path, talk)
    answer = wire.decode_answer(header)
    ran = answer.reply
    assert answer.id == 3 and isinstance(ran, wire.RanReply) and len(ran.items) == 3
    got = []
    for part in ran.items:
        assert part.in_slot is False
        (t,) = part.outputs
        source = memoryview(data)[t.offset : t.offset + t.size]
        got.append(unpack_tensor("y", t.datatype, list(t.shape), source))
    for x, y in zip(xs[:2], got[:2], strict=True):
        np.testing.assert_allclose(y, x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5)
    scores = xs[2] @ TINY_WEIGHTS + TINY_BIAS
    assert got[2].shape == (3, 2)
    assert [int(e.split(b":")[1]) for e in got[2][0]] == list(np.argsort(-scores[0])[:2])
    stats = wire.decode_answer(stats_header).reply
    assert isinstance(stats, wire.Value)
    (model,) = stats.value
    assert model["execution_count"] == 1 and model["inference_count"] == 6
    assert model["inference_stats"]["success"]["count"] == 3


@pytest.mark.parametrize(
    ("gpu", "inherited", "visible"),
    [(1, None, "1"), (0, "", "0"), (1, "2,3", "3"), (0, " 5 , 7", "5")],
)
def test_an_engine_sees_its_gpu_within_the_mask_it_inherited(
    gpu: int, inherited: str | None, visible: str
) -> None:
    assert visible_device(gpu, inherited) == visible


def test_an_engine_gpu_outside_the_inherited_mask_is_refused() -> None:
    with pytest.raises(ValueError, match=r"names GPU 2, but CUDA_VISIBLE_DEVICES='4,5' shows 2"):
        visible_device(2, "4,5")


def test_a_frame_too_large_is_refused_by_its_number_and_the_channel_keeps_serving(
    tmp_path: Path,
) -> None:
    """A load whose config is 1.1 MB: the front end's ``Sender`` will not send it (413 to its
    caller); written raw, the engine reads past it, answers its number with 413 and goes on
    (it used to close the channel, which cost the front end its life)."""
    lengths = struct.Struct("!II")
    config = {"labels": ["x" * 100] * 11_000}
    header = wire.encode_call(1, wire.Control("load", ("tiny", config)))
    assert len(header) > MAX_HEADER_BYTES

    async def talk(reader: Incoming, writer: asyncio.Transport) -> Any:
        with pytest.raises(FrameTooLarge) as refused:
            Sender(writer).send(header)
        assert refused.value.status == 413
        writer.write(lengths.pack(len(header), 3) + header + b"abc")
        writer.write(lengths.pack(len(state := wire.encode_call(2, wire.State())), 0) + state)
        return await replies(reader, 2)

    got = with_engine(tmp_path, talk)
    too_large = got[1].reply
    assert isinstance(too_large, wire.Failure) and too_large.status == 413
    assert f"exceeds the {MAX_HEADER_BYTES} bytes" in too_large.error
    assert isinstance(got[2].reply, wire.EngineState) and got[2].reply.alive
