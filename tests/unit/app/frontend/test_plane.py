"""The data plane without HTTP: a real registry of real ONNX Runtime models behind it, V2
bodies in, answers out; validation, deadlines, uploads through the handler, draining."""

from __future__ import annotations

import asyncio
import io
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import onnx
import orjson
import pytest
import yaml
from PIL import Image

from app.contract import Contract, Frame, Part, batch_key, validate_inputs
from app.engine.local import LocalEngine
from app.errors import BadRequest, DeadlineExceeded, NotFound, Reloaded, Unavailable
from app.frontend.gathering import again_if_reloaded
from app.frontend.plane import DataPlane
from app.frontend.server import embedded
from app.protocol import RequestedOutput
from app.settings import Settings
from engines.spec import ModelSpec, TensorSpec
from tests.conftest import TINY_BIAS, TINY_WEIGHTS, configure, slow_onnx, tiny_onnx

T = TypeVar("T")
IMAGE = TensorSpec("input", "FP32", (3, 224, 224))
SPEC = ModelSpec("m", (IMAGE,), (TensorSpec("logits", "FP32", (10,)),), max_batch_size=8)


def local(plane: DataPlane) -> LocalEngine:
    """The engine in this process that the plane's frames go to (``embedded``)."""
    assert isinstance(plane.client, LocalEngine)
    return plane.client


def v2_body(x: np.ndarray, **extra: Any) -> bytes:
    tensor = {"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}
    return orjson.dumps({"inputs": [tensor], **extra})


def write_model(folder: Path, model: onnx.ModelProto, **config: Any) -> None:
    folder.mkdir(parents=True)
    onnx.save(model, str(folder / "model.onnx"))
    (folder / "config.yaml").write_text(yaml.safe_dump({"max_batch_size": 8, **config}))


def with_plane(
    tmp_path: Path,
    scenario: Callable[[DataPlane], Awaitable[T]],
    control: str = "none",
    **limits: Any,
) -> T:
    """Run ``scenario`` against a started data plane over ``tmp_path/repo``, then stop it."""
    settings = Settings(
        # Model control without keys: these planes have none.
        models={"repository": tmp_path / "repo", "control": control, "control_without_keys": True},  # type: ignore[arg-type]
        store={"path": tmp_path / "store"},  # type: ignore[arg-type]
        limits=limits,  # type: ignore[arg-type]
    )

    async def run() -> T:
        plane = embedded(settings)
        await plane.start()
        try:
            return await scenario(plane)
        finally:
            await plane.stop()

    return asyncio.run(run())


@pytest.fixture
def tiny_repo(tmp_path: Path) -> Path:
    write_model(tmp_path / "repo" / "tiny", tiny_onnx())
    return tmp_path


def test_a_v2_request_is_answered_with_the_models_outputs(tiny_repo: Path) -> None:
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)

    async def scenario(plane: DataPlane) -> Any:
        assert plane.is_ready and plane.alive
        return await plane.infer("tiny", None, v2_body(x, id="r1"), None)

    answer = with_plane(tiny_repo, scenario)
    document = orjson.loads(answer.content)
    assert (answer.model, answer.version, document["id"]) == ("tiny", "fp32", "r1")
    got = {out["name"]: np.array(out["data"]).reshape(out["shape"]) for out in document["outputs"]}
    np.testing.assert_allclose(got["y"], x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["s"], x.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-5)


def test_bad_requests_are_refused_with_the_reason_and_counted(tiny_repo: Path) -> None:
    async def scenario(plane: DataPlane) -> dict[str, Any]:
        refusals = {}
        x = np.zeros((1, 4), np.float32)
        for label, body, error in [
            ("shape", v2_body(np.zeros((1, 5), np.float32)), BadRequest),
            ("priority", v2_body(x, parameters={"priority": 3}), BadRequest),
            ("output", v2_body(x, outputs=[{"name": "nope"}]), BadRequest),
        ]:
            with pytest.raises(error) as caught:
                await plane.infer("tiny", None, body, None)
            refusals[label] = caught.value.message
        with pytest.raises(NotFound):
            await plane.infer("nope", None, v2_body(x), None)
        return {"refusals": refusals, "stats": await plane.control("statistics", "tiny")}

    seen = with_plane(tiny_repo, scenario)
    assert "does not match" in seen["refusals"]["shape"]
    assert "exceeds the model's 1 level" in seen["refusals"]["priority"]
    assert "unknown output(s): nope" in seen["refusals"]["output"]
    (stats,) = seen["stats"]
    assert stats["inference_stats"]["fail"]["count"] == 3


def test_a_deadline_spent_before_the_queue_is_a_504(tmp_path: Path) -> None:
    write_model(tmp_path / "repo" / "slow", slow_onnx(64, 2))

    async def scenario(plane: DataPlane) -> str:
        x = np.zeros((1, 1, 1), np.float32)
        tensor = {"name": "x", "datatype": "FP32", "shape": [1, 1, 1], "data": x.ravel().tolist()}
        # One microsecond: spent on decoding the request, before it could be queued.
        body = orjson.dumps({"inputs": [tensor], "parameters": {"timeout": 1}})
        with pytest.raises(DeadlineExceeded) as caught:
            await plane.infer("slow", None, body, None)
        return caught.value.message

    assert "passed while decoding" in with_plane(tmp_path, scenario)


def test_a_draining_plane_refuses_new_requests_and_is_not_ready(tiny_repo: Path) -> None:
    """Readiness goes at once; the door closes a few turns of the loop later, and from then
    on only a request that began before it is answered."""

    async def scenario(plane: DataPlane) -> tuple[str, bool, bool]:
        body = v2_body(np.zeros((1, 4), np.float32))
        began = time.monotonic()
        plane.begin_drain()
        assert not plane.is_ready
        await plane.drain_state.door_closed()
        with pytest.raises(Unavailable, match="shutting down"):
            await plane.infer("tiny", None, body, None)
        answered = await plane.infer("tiny", None, body, None, began=began)
        await plane.drain()
        return answered.model, plane.is_ready, plane.alive

    assert with_plane(tiny_repo, scenario) == ("tiny", False, True)


@pytest.mark.parametrize(
    ("control", "refusal"),
    [("none", "model control is off"), ("poll", "not allowed in poll mode")],
)
def test_loads_and_unloads_are_refused_where_the_mode_does_not_take_them(
    tiny_repo: Path, control: str, refusal: str
) -> None:
    async def scenario(plane: DataPlane) -> None:
        for call in (plane.control("load", "tiny"), plane.control("unload", "tiny")):
            with pytest.raises(BadRequest, match=refusal):
                await call
        assert plane.is_ready

    with_plane(tiny_repo, scenario, control)


def test_loads_and_unloads_are_refused_while_draining(tiny_repo: Path) -> None:
    async def scenario(plane: DataPlane) -> None:
        await plane.control("unload", "tiny")
        await plane.control("load", "tiny")
        plane.begin_drain()
        for call in (plane.control("load", "tiny"), plane.control("unload", "tiny")):
            with pytest.raises(Unavailable, match="shutting down"):
                await call
        # The engine refuses too, on its own drain (an engine process drains on SIGTERM).
        plane.client.begin_drain()
        with pytest.raises(Unavailable, match="shutting down"):
            await plane.client.control("load", "tiny")

    with_plane(tiny_repo, scenario, "explicit")


def test_a_request_decoded_against_a_replaced_contract_runs_if_it_fits_or_is_checked_again(
    tiny_repo: Path,
) -> None:
    """Frames decoded against the contract of a version a reload replaced (max batch 8, then
    4): one the new version takes runs; one it does not (6 rows) is refused before it runs,
    and the plane checks such a request against the new contract (400), once."""
    two, six = np.ones((2, 4), np.float32), np.ones((6, 4), np.float32)

    async def scenario(plane: DataPlane) -> tuple[int, int, list[str]]:
        before = await plane.client.contract("tiny")
        await plane.control("load", "tiny", {"max_batch_size": 4})
        after = await plane.client.contract("tiny")
        wanted = [RequestedOutput("y", True)]
        fits = Frame("tiny", "fp32", [Part({"x": two}, 2, wanted)], None, 0, "", before.serial)
        ran = await local(plane).run(fits)
        np.testing.assert_allclose(ran.outputs[0][0][1], two @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5)
        stale = Frame("tiny", "fp32", [Part({"x": six}, 6, wanted)], None, 0, "", before.serial)
        with pytest.raises(Reloaded):
            await local(plane).run(stale)
        with pytest.raises(BadRequest, match="the model takes 1 to 4"):
            await plane.infer("tiny", None, v2_body(six), None)
        # A contract cached before the reload (as a front end's is): decoded against it, the
        # request is refused as reloaded by the engine and checked against the new one.
        real, asked = local(plane).contract, []

        async def cached(name: str | None, version: str | None = None) -> Contract:
            asked.append(name)
            return before if len(asked) == 1 else await real(name, version)

        local(plane).contract = cached  # type: ignore[method-assign]
        with pytest.raises(BadRequest, match="the model takes 1 to 4"):
            await plane.infer("tiny", None, v2_body(six), None)
        assert asked == ["tiny", "tiny"]
        local(plane).contract = real  # type: ignore[method-assign]
        attempts: list[str] = []

        async def attempt() -> str:
            attempts.append("sent")
            if len(attempts) == 1:
                raise Reloaded("reloaded")
            return "answered"

        async def refused() -> str:
            attempts.append("sent")
            raise Reloaded("reloaded")

        async def again() -> str:
            attempts.append("made again")
            raise Reloaded("reloaded again")

        assert await again_if_reloaded(attempt) == "answered"
        with pytest.raises(Reloaded, match="again"):  # the second refusal stands
            await again_if_reloaded(refused, again)
        return before.spec.max_batch_size, after.spec.max_batch_size, attempts

    assert with_plane(tiny_repo, scenario, "explicit") == (
        8,
        4,
        ["sent", "sent", "sent", "made again"],
    )


def test_a_frame_cancelled_before_its_first_step_is_still_answered(tiny_repo: Path) -> None:
    """Every caller of a frame left before the task that runs it took a step: its answer
    is still delivered, once (503), so the gathering's count of frames in flight comes down
    and nobody waits on it."""
    two = np.ones((2, 4), np.float32)

    async def scenario(plane: DataPlane) -> list[Any]:
        contract = await plane.client.contract("tiny")
        part = Part({"x": two}, 2, [RequestedOutput("y", True)])
        frame = Frame("tiny", "fp32", [part], None, 0, "", contract.serial)
        delivered: list[Any] = []
        stop = plane.client.submit(frame, delivered.append)
        stop()
        for _ in range(100):
            if delivered:
                break
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)  # nothing more comes
        return delivered

    (answer,) = with_plane(tiny_repo, scenario)
    assert isinstance(answer, Unavailable)


def test_metadata_and_config_describe_the_served_model(tiny_repo: Path) -> None:
    async def scenario(plane: DataPlane) -> tuple[Any, Any, Any]:
        return (
            await plane.control("metadata", "tiny"),
            await plane.control("model_config", "tiny"),
            await plane.control("version_ready", "tiny"),
        )

    metadata, config, ready = with_plane(tiny_repo, scenario)
    assert metadata["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    assert metadata["versions"] == ["fp32"] and "unavailable_versions" not in metadata
    assert config["max_batch_size"] == 8 and config["input"][0]["dims"] == [4]
    assert ready == {"name": "tiny", "version": "fp32", "ready": True}


def test_uploads_go_through_the_models_handler(tmp_path: Path, efficientnet_dir: Path) -> None:
    import shutil

    shutil.copytree(efficientnet_dir, tmp_path / "repo" / "efficientnet_lite0")
    configure(tmp_path / "repo" / "efficientnet_lite0", {"precisions": ["fp32"]})  # no INT8
    write_model(tmp_path / "repo" / "tiny", tiny_onnx())
    photo = io.BytesIO()
    gradient = np.linspace(0, 255, 64 * 48 * 3).reshape(48, 64, 3).astype(np.uint8)
    Image.fromarray(gradient).save(photo, format="PNG")

    async def scenario(plane: DataPlane) -> Any:
        name, version, predictions = await plane.classify_images(
            None, None, [photo.getvalue()] * 3, 2
        )
        with pytest.raises(BadRequest, match="does not take image uploads"):
            await plane.classify_images("tiny", None, [photo.getvalue()], None)
        with pytest.raises(BadRequest, match="no image in the request"):
            await plane.classify_images(None, None, [], None)
        with pytest.raises(BadRequest, match="4 images in one request; the limit is 3"):
            await plane.classify_images(None, None, [photo.getvalue()] * 4, None)
        return name, version, predictions

    name, version, predictions = with_plane(tmp_path, scenario, max_images_per_request=3)
    assert (name, version) == ("efficientnet_lite0", "fp32")
    assert len(predictions) == 3 and all(len(p) == 2 for p in predictions)
    assert predictions[0] == predictions[1] == predictions[2]  # the same photo thrice
    probabilities = [p["probability"] for p in predictions[0]]
    assert probabilities == sorted(probabilities, reverse=True) and 0 < sum(probabilities) <= 1


def test_rows_a_front_end_makes_answer_as_the_engines_decode_and_are_made_again_on_reload(
    tmp_path: Path, efficientnet_dir: Path
) -> None:
    """An engine that decodes on the CPU publishes the model's preprocessing; a front end's
    plane (an engine not in its process) makes the rows itself, to the answers the engine's
    own decoding gives. Rows made with a replaced preprocessing are refused by the engine as
    reloaded (nothing ran) and made again with the contract asked anew."""
    import dataclasses
    import shutil

    from app.frontend.upload_rows import RowMaker
    from tests.conftest import sample_jpegs

    shutil.copytree(efficientnet_dir, tmp_path / "repo" / "efficientnet_lite0")
    configure(tmp_path / "repo" / "efficientnet_lite0", {"precisions": ["fp32"]})  # no INT8
    photos = sample_jpegs()[:3]

    async def scenario(plane: DataPlane) -> Any:
        contract = await plane.client.contract(None)
        prep = contract.row_preprocess
        assert prep is not None and prep.datatype == "UINT8"
        assert plane.row_maker is None  # in one process nothing is gained
        _, _, by_engine = await plane.classify_images(None, None, photos, 3)
        plane.row_maker = RowMaker(plane.settings)
        sent: list[Any] = []
        real_classify, real_contract = plane.client.classify, plane.client.contract

        async def classify(uploads: Any) -> Any:
            sent.append(uploads.row_preprocess)
            return await real_classify(uploads)

        stale = [
            dataclasses.replace(
                contract, row_preprocess=prep.model_copy(update={"resize_shorter": 300})
            )
        ]

        async def described(name: Any, version: Any = None) -> Any:
            return stale.pop() if stale else await real_contract(name, version)

        plane.client.classify = classify  # type: ignore[method-assign]
        plane.client.contract = described  # type: ignore[method-assign]
        try:
            _, _, by_rows = await plane.classify_images(None, None, photos, 3)
        finally:
            plane.row_maker.close()
        return contract, by_engine, by_rows, sent

    contract, by_engine, by_rows, sent = with_plane(tmp_path, scenario)
    assert by_rows == by_engine
    stale = contract.row_preprocess.model_copy(update={"resize_shorter": 300})
    # the stale rows once (refused as reloaded, not sent again as they were), then the
    # rows made with the contract asked anew
    assert sent == [stale, contract.row_preprocess]


def test_uploads_of_one_turn_are_one_engine_call_and_a_bad_one_fails_alone(
    tmp_path: Path, efficientnet_dir: Path
) -> None:
    """Five upload requests at once: the one with a PNG cut short is refused by the data
    plane from its header (it never reaches the engine); the other four are one call to the
    engine with each request's images counted; the one whose upload is no image gets the
    handler's 400, the other three their answers, and each is counted as it ended."""
    import shutil

    from tests.conftest import sample_jpegs
    from tests.unit.app.test_metrics import series

    shutil.copytree(efficientnet_dir, tmp_path / "repo" / "efficientnet_lite0")
    configure(tmp_path / "repo" / "efficientnet_lite0", {"precisions": ["fp32"]})  # no INT8
    jpeg = sample_jpegs()[1]
    png = io.BytesIO()
    Image.open(io.BytesIO(jpeg)).save(png, format="PNG")
    requests = [
        [jpeg],
        [png.getvalue(), jpeg],
        [b"not an image"],
        [jpeg, b"\x89PNG\r\n\x1a\n" + bytes(20)],
        [jpeg],
    ]

    async def scenario(plane: DataPlane) -> Any:
        calls: list[tuple[int, ...]] = []
        real = plane.client.classify

        async def counting(uploads: Any) -> Any:
            calls.append(uploads.counts)
            return await real(uploads)

        plane.client.classify = counting  # type: ignore[method-assign]
        before = series("efficientnet_lite0")
        results = await asyncio.gather(
            *(plane.classify_images(None, None, r, 1) for r in requests), return_exceptions=True
        )
        return calls, results, before, series("efficientnet_lite0")

    calls, results, before, after = with_plane(tmp_path, scenario)
    assert calls == [(1, 2, 1, 1)]
    for i in (2, 3):
        assert isinstance(results[i], BadRequest), results[i]
    assert "not an image format" in results[2].message
    assert "PNG" in results[3].message
    answers = [results[i][2] for i in (0, 1, 4)]
    assert [len(a) for a in answers] == [1, 2, 1]
    labels = {a[-1][0]["label"] for a in answers} | {answers[1][0][0]["label"]}
    assert len(labels) == 1  # the same photo (and its PNG) gets the same label everywhere

    def delta(name: str, *labels: str) -> float:
        key = (name, *labels, "version=fp32")
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("stoker_inference_request_success_total") == 3
    assert delta("stoker_inference_request_failure_total", "reason=invalid") == 1


def test_requests_arriving_one_a_turn_gather_while_frames_of_their_key_are_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``frames_in_flight`` 1 (front ends: the default is 4), a first request's frame is
    in flight, held in the engine; five more, each arriving in a turn of the loop of its own
    (as gRPC calls do), gather while it is, and cross as one frame of five once it is
    answered; a request of 8 rows (an eighth of the max batch of 64) among them is not held
    back. With no limit (one process) the same arrivals cross as frames of one request.
    Every answer is the model's, and the held frame's requests keep the time they arrived
    (the engine counts each deadline from it, so the hold is spent from their timeouts).
    With the hold's time bound (``MAX_HOLD_S``, 5 ms) every request reaches the engine
    while the first frame is still held there."""
    import app.frontend.gathering as gathering_module

    write_model(tmp_path / "repo" / "tiny", tiny_onnx(), max_batch_size=64)
    rows = np.random.default_rng(3).standard_normal((6, 1, 4)).astype(np.float32)
    large = np.random.default_rng(4).standard_normal((8, 4)).astype(np.float32)

    timeout = {"parameters": {"timeout": 60_000_000}}
    hold_s = 0.2

    async def scenario(
        plane: DataPlane, limit: int, until_all_sent: bool = False
    ) -> tuple[list[tuple[int, Any]], list[Any]]:
        plane.gatherer.frames_in_flight = limit
        frames: list[tuple[int, Any]] = []  # each frame's requests and its earliest arrival
        gate = asyncio.Event()
        real = local(plane).run

        async def held(frame: Frame) -> Any:
            frames.append((len(frame.parts), min(p.arrived or math.inf for p in frame.parts)))
            if len(frames) == 1:
                await gate.wait()
            return await real(frame)

        local(plane).run = held  # type: ignore[method-assign]
        first = v2_body(rows[0], **timeout)
        tasks = [asyncio.create_task(plane.infer("tiny", None, first, None))]
        for _ in range(1000):
            if frames:
                break
            await asyncio.sleep(0)
        for x in [large, *rows[1:]]:
            body = v2_body(x, **timeout) if x is not large else v2_body(x)
            tasks.append(asyncio.create_task(plane.infer("tiny", None, body, None)))
            for _ in range(5):  # a few turns between arrivals
                await asyncio.sleep(0)
        if until_all_sent:  # the engine still holds the first frame meanwhile
            deadline = asyncio.get_running_loop().time() + 30
            while sum(count for count, _ in frames) < 7:
                assert asyncio.get_running_loop().time() < deadline, frames
                await asyncio.sleep(0.01)
        else:
            await asyncio.sleep(hold_s)  # the five are held this long at least
        frames.append((0, time.monotonic()))  # when the hold ended
        gate.set()
        return frames, await asyncio.gather(*tasks)

    async def held_once(plane: DataPlane) -> Any:
        return await scenario(plane, 1)

    async def unlimited(plane: DataPlane) -> Any:
        return await scenario(plane, 0)

    async def bounded(plane: DataPlane) -> Any:
        return await scenario(plane, 1, until_all_sent=True)

    bounded_frames, _ = with_plane(tmp_path, bounded)  # MAX_HOLD_S as shipped
    assert sum(count for count, _ in bounded_frames) == 7
    monkeypatch.setattr(gathering_module, "MAX_HOLD_S", 3600.0)  # held until the first returns
    gathered, answers = with_plane(tmp_path, held_once)
    apart, _ = with_plane(tmp_path, unlimited)
    # The large request went at once, the five together.
    assert [count for count, _ in gathered] == [1, 1, 0, 5]  # 0: when the hold ended
    assert [count for count, _ in apart] == [1] * 7 + [0]
    assert gathered[3][1] <= gathered[2][1] - hold_s  # they arrived before the hold
    for x, answer in zip([rows[0], large, *rows[1:]], answers, strict=True):
        out = {o["name"]: o for o in orjson.loads(answer.content)["outputs"]}
        got = np.array(out["y"]["data"]).reshape(out["y"]["shape"])
        np.testing.assert_allclose(got, x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5, atol=1e-5)


def test_a_held_frame_goes_after_a_tenth_of_its_soonest_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the time bound of the hold out of the way (an hour), requests of a 5 s timeout
    held behind a frame of their key that the engine keeps are still sent while it keeps
    it: after a tenth of their timeout (``hold_s``), so a short deadline is not spent
    waiting to gather. They are answered, by the model."""
    import app.frontend.gathering as gathering_module

    monkeypatch.setattr(gathering_module, "MAX_HOLD_S", 3600.0)
    write_model(tmp_path / "repo" / "tiny", tiny_onnx(), max_batch_size=64)
    rows = np.random.default_rng(5).standard_normal((4, 1, 4)).astype(np.float32)
    timeout = {"parameters": {"timeout": 5_000_000}}

    async def scenario(plane: DataPlane) -> tuple[list[int], list[Any]]:
        plane.gatherer.frames_in_flight = 1
        frames: list[int] = []
        gate = asyncio.Event()
        real = local(plane).run

        async def held(frame: Frame) -> Any:
            frames.append(len(frame.parts))
            if len(frames) == 1:
                await gate.wait()
            return await real(frame)

        local(plane).run = held  # type: ignore[method-assign]
        first = asyncio.create_task(plane.infer("tiny", None, v2_body(rows[0], **timeout), None))
        for _ in range(1000):
            if frames:
                break
            await asyncio.sleep(0)
        tasks = []
        for x in rows[1:]:
            tasks.append(
                asyncio.create_task(plane.infer("tiny", None, v2_body(x, **timeout), None))
            )
            for _ in range(5):
                await asyncio.sleep(0)
        deadline = asyncio.get_running_loop().time() + 30  # far below the hour
        while len(frames) < 2:
            assert asyncio.get_running_loop().time() < deadline, frames
            await asyncio.sleep(0.01)
        sent = list(frames)  # the engine still keeps the first frame here
        answers = await asyncio.gather(*tasks)
        gate.set()
        await first
        return sent, answers

    sent, answers = with_plane(tmp_path, scenario)
    assert sent == [1, 3]
    for x, answer in zip(rows[1:], answers, strict=True):
        out = {o["name"]: o for o in orjson.loads(answer.content)["outputs"]}
        got = np.array(out["y"]["data"]).reshape(out["y"]["shape"])
        np.testing.assert_allclose(got, x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5, atol=1e-5)


def test_hold_takes_at_most_a_tenth_of_a_timeout() -> None:
    from app.frontend.gathering import MAX_HOLD_S, hold_s

    assert hold_s(None) == MAX_HOLD_S == hold_s(60_000_000)
    assert hold_s(2_000) == pytest.approx(0.0002)
    assert hold_s(0) == 0.0


def test_validation_counts_rows_and_keys_separate_pixels_from_floats() -> None:
    pixels = np.zeros((2, 3, 224, 224), np.uint8)
    floats = np.zeros((2, 3, 224, 224), np.float32)
    assert validate_inputs(SPEC, {"input": pixels}, "input") == 2
    assert validate_inputs(SPEC, {"input": floats}, "input") == 2
    assert batch_key(SPEC, {"input": pixels}) != batch_key(SPEC, {"input": floats})
    with pytest.raises(BadRequest, match=r"datatype UINT8, the model takes FP32$"):
        validate_inputs(SPEC, {"input": pixels})
    with pytest.raises(BadRequest, match=r"datatype INT32, the model takes FP32 \(or UINT8"):
        validate_inputs(SPEC, {"input": pixels.astype(np.int32)}, "input")
    with pytest.raises(BadRequest, match="does not match"):
        validate_inputs(SPEC, {"input": np.zeros((1, 224, 224, 3), np.uint8)}, "input")
    with pytest.raises(BadRequest, match="batch of 9 rows; the model takes 1 to 8"):
        validate_inputs(SPEC, {"input": np.zeros((9, 3, 224, 224), np.float32)})


def test_deadline_classes_join_timeouts_within_a_percent_and_keep_none_and_zero_apart() -> None:
    from app.frontend.gathering import deadline_class

    assert deadline_class(60_000_000) == deadline_class(60_000_400) == deadline_class(59_999_000)
    assert deadline_class(60_000_000) != deadline_class(1_000_000)
    # Two timeouts 1.02% or more apart are never in one class (a class is 1.01 wide).
    for timeout in (1, 999, 50_000, 3_000_000, 59_999_000, 10**12):
        assert deadline_class(timeout) != deadline_class(math.ceil(timeout * 1.0102) + 1)
    assert deadline_class(None) is None
    assert deadline_class(0) == 0 != deadline_class(1)
