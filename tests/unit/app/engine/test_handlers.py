"""Per-model handlers of uploads: the image classifier on real photos, the choice of handler,
and a model that is not an image classifier served through a handler of its own."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import yaml
from PIL import Image

from app.engine.handlers import HandlerContext, ImageClassifier, handler_for, top_k, top_k_rows
from app.errors import BadRequest
from app.frontend.server import embedded
from app.metrics import ModelMetrics
from app.settings import LimitSettings, Settings
from engines.preprocess import ImagePreprocess
from engines.spec import ModelSpec, TensorSpec
from tests.conftest import TINY_BIAS, TINY_WEIGHTS, tiny_onnx

IMAGE = TensorSpec("input", "FP32", (3, 32, 32))
SPEC = ModelSpec("m", (IMAGE,), (TensorSpec("logits", "FP32", (4,)),), max_batch_size=8)
PREP = ImagePreprocess(resize_shorter=40, crop=32, datatype="UINT8")
_names = iter(range(10**6))


def context(**changes: Any) -> HandlerContext:
    made = HandlerContext(
        name="m",
        spec=SPEC,
        preprocess=PREP,
        postprocess="softmax",
        labels=["a", "b", "c", "d"],
        limits=LimitSettings(),
        metrics=ModelMetrics(f"handler-test-{next(_names)}", "fp32"),
        normalised_by_engine=False,
    )
    return HandlerContext(**{**made.__dict__, **changes})


def png(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return out.getvalue()


def test_the_classifier_decodes_crops_and_normalises_uploads() -> None:
    photo = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    inputs = asyncio.run(ImageClassifier(context()).decode([png(photo), png(photo)]))
    batch = inputs["input"]
    assert batch.shape == (2, 3, 32, 32) and batch.dtype == np.float32
    # 48x64 resized to 40x53 (shorter side 40), then the centre 32x32; a flat image shows
    # the normalisation alone: (v - 127) / 128.
    grey = np.full((48, 64, 3), 200, np.uint8)
    flat = asyncio.run(ImageClassifier(context()).decode([png(grey)]))["input"]
    np.testing.assert_allclose(flat, (200 - 127) / 128, rtol=1e-6)
    untouched = ImageClassifier(context(normalised_by_engine=True))
    assert asyncio.run(untouched.decode([png(grey)]))["input"].dtype == np.uint8


def test_rows_a_front_end_made_are_stacked_normalised_and_counted_as_its() -> None:
    """Two UINT8 rows of the preprocessing's shape become the model's FP32 input, normalised
    as the handler's own decoding normalises (a flat 200 is (200 - 127) / 128), counted as
    made by the front ends; a row of another size is the front end's fault (500)."""
    from tests.unit.app.test_metrics import series

    made = context()
    classifier = ImageClassifier(made)
    flat = np.full((3, 32, 32), 200, np.uint8).tobytes()
    ramp = np.arange(3 * 32 * 32, dtype=np.uint32).astype(np.uint8).tobytes()
    batch = classifier.rows([flat, ramp])["input"]
    assert batch.shape == (2, 3, 32, 32) and batch.dtype == np.float32
    np.testing.assert_allclose(batch[0], (200 - 127) / 128, rtol=1e-6)
    assert batch[1, 0, 0, 5] == pytest.approx((5 - 127) / 128)
    key = ("stoker_image_decode_total", "decoder=pillow_front_ends", "device=cpu", "version=fp32")
    assert series(made.metrics.model)[key] == 2
    with pytest.raises(RuntimeError, match="rows of 3072 bytes expected"):
        classifier.rows([flat[:-1]])


def test_a_handler_takes_rows_made_by_front_ends_when_it_offers_them() -> None:
    """The capability the engine reads at load (``RowsHandler``): the image classifier has
    it; a handler of the user's has it only with both ``row_preprocess`` and ``rows``."""
    from app.engine.handlers import RowsHandler

    class FilesOnly:
        async def decode(self, uploads: Sequence[bytes]) -> dict[str, Any]:
            return {}

        def encode(self, outputs: Mapping[str, np.ndarray], k: int) -> list[Any]:
            return []

        async def close(self) -> None:
            return None

    class WithRows(FilesOnly):
        row_preprocess = PREP

        def rows(self, uploads: Sequence[bytes | memoryview]) -> dict[str, Any]:
            return {}

    assert isinstance(ImageClassifier(context()), RowsHandler)
    assert ImageClassifier(context()).row_preprocess == PREP
    assert isinstance(WithRows(), RowsHandler)
    assert not isinstance(FilesOnly(), RowsHandler)


def test_the_classifier_refuses_what_is_not_an_image() -> None:
    with pytest.raises(BadRequest, match="not an image format this server reads"):
        asyncio.run(ImageClassifier(context()).decode([b"plain text, not a picture"]))


def test_the_classifier_answers_top_k_labels_of_the_softmax() -> None:
    logits = np.array([[0.0, 3.0, 1.0, -1.0]], np.float32)
    (answer,) = ImageClassifier(context()).encode({"logits": logits}, 2)
    expected = np.exp(logits[0]) / np.exp(logits[0]).sum()
    assert [a["label"] for a in answer] == ["b", "c"]
    assert answer[0]["probability"] == pytest.approx(float(expected[1]), rel=1e-6)
    (raw,) = ImageClassifier(context(postprocess="none")).encode({"logits": logits}, 1)
    assert raw == [{"label": "b", "index": 1, "probability": 3.0}]
    assert top_k(logits[0], 9, None)[-1] == {"label": "3", "index": 3, "probability": -1.0}


def test_the_classifier_refuses_a_model_whose_input_its_preprocessing_cannot_fill() -> None:
    wrong = ModelSpec("m", (TensorSpec("input", "FP32", (3, 64, 64)),), SPEC.outputs, 8)
    with pytest.raises(ValueError, match=r"takes rows of \[3, 64, 64\].*makes \[3, 32, 32\]"):
        ImageClassifier(context(spec=wrong))


def test_the_handler_follows_the_config() -> None:
    assert isinstance(handler_for(None, context()), ImageClassifier)
    assert handler_for(None, context(preprocess=None)) is None
    assert handler_for("none", context()) is None
    allowed = [f"{__name__}:SumOfNumbers"]
    custom = handler_for(f"{__name__}:SumOfNumbers", context(), allowed)
    assert isinstance(custom, SumOfNumbers)
    with pytest.raises(ValueError, match=r"package\.module:Class"):
        handler_for("something-else", context())


def test_a_handler_the_operator_did_not_allow_is_never_imported() -> None:
    """``sys:exit``, named by a config, would stop the server when called."""
    for choice in ("sys:exit", f"{__name__}:SumOfNumbers"):
        with pytest.raises(ValueError, match=r"models\.handlers lists"):
            handler_for(choice, context(), ["os:system"])


class SumOfNumbers:
    """A handler for the tiny model (not an image classifier): each upload is four numbers
    as text, the answer is the model's ``s`` output (their sum) and ``y``."""

    def __init__(self, context: HandlerContext) -> None:
        self.rows = context.spec.inputs[0]

    async def decode(self, uploads: Sequence[bytes]) -> dict[str, np.ndarray]:
        try:
            rows = [np.array(u.decode().split(","), dtype=np.float32) for u in uploads]
        except ValueError:
            raise BadRequest("each upload is four comma-separated numbers") from None
        return {self.rows.name: np.stack(rows)}

    def encode(self, outputs: Mapping[str, np.ndarray], k: int) -> list[Any]:
        return [
            {"sum": float(s[0]), "y": [float(v) for v in y]}
            for s, y in zip(outputs["s"], outputs["y"], strict=True)
        ]

    async def close(self) -> None:
        pass


def test_a_model_that_is_not_an_image_classifier_serves_uploads_through_its_handler(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "repo" / "summer"
    folder.mkdir(parents=True)
    onnx.save(tiny_onnx(), str(folder / "model.onnx"))
    config = {"max_batch_size": 2, "handler": f"{__name__}:SumOfNumbers"}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    settings = Settings(
        models={"repository": tmp_path / "repo", "handlers": [config["handler"]]},  # type: ignore[arg-type]
        store={"path": tmp_path / "store"},  # type: ignore[arg-type]
    )
    uploads = [b"1,2,3,4", b"0.5,0,0,0", b"-1,-1,-1,-1"]  # 3 rows: two batches of at most 2

    async def scenario() -> Any:
        plane = embedded(settings)
        await plane.start()
        try:
            answer = await plane.classify_images("summer", None, uploads, None)
            with pytest.raises(BadRequest, match="four comma-separated numbers"):
                await plane.classify_images("summer", None, [b"x,y"], None)
            return answer
        finally:
            await plane.stop()

    name, version, answers = asyncio.run(scenario())
    assert (name, version) == ("summer", "fp32")
    assert [a["sum"] for a in answers] == [10.0, 0.5, -4.0]
    x = np.array([[1, 2, 3, 4], [0.5, 0, 0, 0], [-1, -1, -1, -1]], np.float32)
    np.testing.assert_allclose([a["y"] for a in answers], x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5)


def test_top_k_orders_as_a_stable_sort_of_every_class_ties_included() -> None:
    rng = np.random.default_rng(3)
    for k in (1, 5, 999, 1000, 2000):
        scores = rng.integers(0, 50, 1000).astype(np.float32)  # many ties
        for nan in (False, True):
            if nan:
                scores[7] = np.nan
            got = [entry["index"] for entry in top_k(scores, k, None)]
            assert got == [int(i) for i in np.argsort(-scores, kind="stable")[:k]]


def test_top_k_of_rows_at_once_is_top_k_of_each_row() -> None:
    """Rows with ties at the k-th place, a NaN, k over the classes: the answers of
    ``top_k_rows`` are ``top_k``'s, row by row, labels and floats included."""
    rng = np.random.default_rng(7)
    labels = [f"class {i}" for i in range(40)]
    for k in (1, 3, 5, 40, 50):
        scores = rng.integers(0, 6, (64, 40)).astype(np.float32)  # ties everywhere
        scores[5, 2] = np.nan
        scores[9] = rng.standard_normal(40)  # no ties
        got = top_k_rows(scores, k, labels)
        assert repr(got) == repr([top_k(row, k, labels) for row in scores])  # NaN != NaN
    assert top_k_rows(np.zeros((0, 10), np.float32), 5, None) == []
