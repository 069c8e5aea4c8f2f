"""The engine process's control server over a real Unix socket, with a real data plane on the
tiny model: it answers every request exactly once, a cancelled one included, and what cannot
cross the channel as a descriptor crosses as payload."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import onnx
import orjson
import pytest
import yaml

from app.channel import Sender, receive
from app.frontend.plane import DataPlane
from app.engine.process import EngineServer, visible_device
from app.settings import Settings
from tests.conftest import TINY_BIAS, TINY_WEIGHTS, tiny_onnx

T = TypeVar("T")


def body(x: np.ndarray) -> bytes:
    tensor = {"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}
    return orjson.dumps({"inputs": [tensor]})


async def replies(reader: asyncio.StreamReader, count: int) -> dict[int, dict[str, Any]]:
    """The next ``count`` answers' headers, by call number (they may come in any order)."""
    found: dict[int, dict[str, Any]] = {}
    while len(found) < count:
        header, _ = await receive(reader)
        found[header["id"]] = header
    return found


def with_engine(
    tmp_path: Path,
    talk: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[T]],
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
        plane = DataPlane(settings)
        await plane.start()
        server = await asyncio.start_unix_server(EngineServer(plane).serve, path=path)
        try:
            reader, writer = await asyncio.open_unix_connection(path)
            try:
                return await asyncio.wait_for(talk(reader, writer), 20)
            finally:
                writer.close()
        finally:
            server.close()
            await plane.stop()

    return asyncio.run(main())


def test_an_inference_is_answered_with_its_encoded_response(tmp_path: Path) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)

    async def talk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Any:
        out = Sender(writer)  # the frames of one turn in one write
        out.send({"op": "infer", "id": 7, "name": "tiny", "header_length": None}, body(x))
        return await receive(reader)

    header, payload = with_engine(tmp_path, talk)
    assert header["id"] == 7 and header["model"] == "tiny" and header["version"] == "fp32"
    outputs = {o["name"]: o for o in orjson.loads(payload)["outputs"]}
    np.testing.assert_allclose(
        np.array(outputs["y"]["data"]).reshape(2, 3), x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5
    )


def test_a_request_cancelled_before_it_ran_is_still_answered(tmp_path: Path) -> None:
    """The request and its cancel in one write: the engine reads both in one turn, so the
    request's task is cancelled before it ever ran; the front end must still hear of it."""

    async def talk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Any:
        out = Sender(writer)  # the frames of one turn in one write
        x = np.ones((1, 4), np.float32)
        out.send({"op": "infer", "id": 1, "name": "tiny", "header_length": None}, body(x))
        out.send({"op": "cancel", "of": 1})
        out.send({"op": "state", "id": 2})
        return await replies(reader, 2)

    answers = with_engine(tmp_path, talk)
    assert answers[1]["status"] == 499 and answers[1]["error"] == "cancelled"
    assert answers[2]["alive"] is True


def test_errors_keep_their_status_and_unknown_calls_are_500(tmp_path: Path) -> None:
    async def talk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Any:
        out = Sender(writer)  # the frames of one turn in one write
        out.send({"op": "infer", "id": 1, "name": "nope", "header_length": None}, b"{}")
        out.send({"op": "teleport", "id": 2})
        return await replies(reader, 2)

    got = with_engine(tmp_path, talk)
    assert got[1]["status"] == 404 and "unknown model" in got[1]["error"]
    assert got[2]["status"] == 500 and got[2]["error"] == "internal server error"


def test_gathered_requests_run_as_one_and_each_gets_its_own_rows(tmp_path: Path) -> None:
    """Three decoded requests of 1, 2 and 3 rows in one frame, their tensors in the payload
    (no arena): one queue entry (one executed batch of 6 rows), and each item's outputs are
    its own rows, the third as top-2 classes as it asked."""
    xs = [np.full((n, 4), float(n), np.float32) for n in (1, 2, 3)]
    payload, items, at = b"", [], 0
    for i, x in enumerate(xs):
        items.append(
            {
                "inputs": [["x", "FP32", list(x.shape), at, x.nbytes]],
                "rows": len(x),
                "outputs": [["y", 2 if i == 2 else 0]],
            }
        )
        payload += x.tobytes()
        at += x.nbytes

    async def talk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Any:
        out = Sender(writer)  # the frames of one turn in one write
        header = {"op": "run", "id": 3, "name": "tiny", "version": None, "items": items}
        out.send(header, payload)
        reply = await receive(reader)
        out.send({"op": "statistics", "id": 4, "name": "tiny"})
        return reply, await receive(reader)

    (reply, data), (stats, _) = with_engine(tmp_path, talk)
    assert reply["id"] == 3 and len(reply["items"]) == 3
    from app.protocol import unpack_tensor

    got = []
    for part in reply["items"]:
        assert part["in_slot"] is False
        ((datatype, shape, start, size),) = part["outputs"]
        got.append(unpack_tensor("y", datatype, shape, memoryview(data)[start : start + size]))
    for x, y in zip(xs[:2], got[:2], strict=True):
        np.testing.assert_allclose(y, x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5)
    scores = xs[2] @ TINY_WEIGHTS + TINY_BIAS
    assert got[2].shape == (3, 2)
    assert [int(e.split(b":")[1]) for e in got[2][0]] == list(np.argsort(-scores[0])[:2])
    (model,) = stats["value"]
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
