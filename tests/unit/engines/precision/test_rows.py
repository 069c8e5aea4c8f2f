"""The rows variants are checked and calibrated on: made from the spec for a model that takes
no images, the user's arrays where given, and for an FP16 check only the rows it runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from engines.precision import accuracy, calibration_sets
from engines.precision.build import AccuracyBudgetExceeded, BuildPlan, ensure_variant
from engines.precision.options import Budget, Int8Options
from engines.precision.rows import NoCalibrationRows, load_array_rows, spec_rows
from engines.preprocess import ImagePreprocess
from engines.spec import TensorSpec
from engines.store import EngineStore
from tests.conftest import TINY_BIAS, TINY_WEIGHTS, tiny_onnx
from tests.unit.engines.precision.small_models import small_conv_model


def plain_plan(tmp_path: Path, model: onnx.ModelProto, **update: Any) -> BuildPlan:
    """A build plan of a model without preprocessing, saved in ``tmp_path``."""
    onnx.save(model, str(tmp_path / "model.onnx"))
    fields: dict[str, Any] = {"evaluation_samples": 32} | update
    return BuildPlan("plain", tmp_path / "model.onnx", tmp_path, "x", None, (1, 8, 16), **fields)


def test_spec_rows_follow_each_inputs_dtype_and_shape() -> None:
    inputs = (
        TensorSpec("x", "FP32", (-1, 4)),
        TensorSpec("ids", "INT64", (-1, -1)),
        TensorSpec("mask", "BOOL", (-1, 3)),
    )
    rows = spec_rows(inputs, samples=40, seed=0)
    assert rows.arrays["x"].shape == (40, 4) and rows.arrays["x"].dtype == np.float32
    assert rows.arrays["ids"].shape == (40, 8) and rows.arrays["ids"].dtype == np.int64
    assert set(np.unique(rows.arrays["ids"])) <= {0, 1}
    assert rows.arrays["mask"].dtype == np.bool_ and rows.samples == 40
    # Runs of 16 rows of every input at a time, the last one shorter.
    assert [len(run["x"]) for run in rows.runs()] == [16, 16, 8]
    again = spec_rows(inputs, samples=40, seed=0)
    np.testing.assert_array_equal(rows.arrays["x"], again.arrays["x"])


def test_a_static_first_dimension_is_fed_whole() -> None:
    rows = spec_rows((TensorSpec("x", "FP16", (2, 5)),), samples=5)
    assert rows.arrays["x"].shape == (6, 5) and rows.arrays["x"].dtype == np.float16
    assert [run["x"].shape for run in rows.runs()] == [(2, 5)] * 3


def test_the_users_rows_must_have_the_inputs_shape(tmp_path: Path) -> None:
    spec = TensorSpec("x", "FP32", (-1, 4))
    np.save(tmp_path / "a.npy", np.arange(12, dtype=np.float64).reshape(3, 4))
    np.save(tmp_path / "b.npy", np.ones(4))  # one row on its own
    rows = load_array_rows(tmp_path, spec, samples=10)
    assert rows.shape == (4, 4) and rows.dtype == np.float32
    np.save(tmp_path / "c.npy", np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"a row is \[3\], input 'x' takes rows of \[4\]"):
        load_array_rows(tmp_path, spec, samples=10)
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "cat.jpg").write_bytes(b"not read")
    with pytest.raises(NoCalibrationRows, match=r"no \.npy/\.npz rows.*\[4\] float32"):
        load_array_rows(photos, spec, samples=10)


def test_fp16_of_a_plain_model_is_checked_on_rows_made_from_its_spec(tmp_path: Path) -> None:
    """The tiny model ([batch, 4] in; y [batch, 3] and s [batch, 1] out) used to be run on
    the builtin photos and fail with ONNX Runtime's 'Invalid rank'."""
    plan = plain_plan(tmp_path, tiny_onnx())
    path, report = ensure_variant(EngineStore(tmp_path / "store"), plan, "fp16", "onnxruntime")
    assert set(report) == {"max_relative_error", "samples"} and report["samples"] == 32
    # The variant computes y = x @ W + b in float16: a 4-term dot product rounded to 11 bits
    # is within a few 0.1% of the output's scale, and not exactly float32's.
    x = np.random.default_rng(5).standard_normal((8, 4)).astype(np.float32)
    y, s = accuracy.run_outputs(path, [{"x": x}])
    want = x.astype(np.float64) @ TINY_WEIGHTS + TINY_BIAS
    error = np.abs(y - want).max() / np.abs(want).max()
    assert 0 < error < 1e-2
    assert 0 < report["max_relative_error"] < 1e-2
    np.testing.assert_allclose(s[:, 0], x.sum(axis=1), rtol=1e-2)


def overflowing_onnx() -> onnx.ModelProto:
    """y = (x * 1e6) * 1e-6: exact in float32, an overflow in float16 (max 65504)."""
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "big"], ["scaled"]),
            helper.make_node("Mul", ["scaled", "small"], ["y"]),
        ],
        "overflowing",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        initializer=[
            numpy_helper.from_array(np.array(1e6, np.float32), "big"),
            numpy_helper.from_array(np.array(1e-6, np.float32), "small"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_an_fp16_variant_off_by_more_than_fp16_rounds_is_refused(tmp_path: Path) -> None:
    plan = plain_plan(tmp_path, overflowing_onnx())
    store = EngineStore(tmp_path / "store")
    with pytest.raises(AccuracyBudgetExceeded, match="largest error relative to the output"):
        ensure_variant(store, plan, "fp16", "onnxruntime")
    # The budget's own bound replaces FP16's tolerance.
    allowed = {"fp16": Budget(min_top1_agreement=0.99, max_relative_error=float("inf"))}
    loose = plain_plan(tmp_path, overflowing_onnx(), budgets=allowed)
    _, report = ensure_variant(store, loose, "fp16", "onnxruntime")
    assert report["max_relative_error"] > 0.5


def test_int8_of_a_plain_model_without_rows_is_refused_saying_what_to_give(
    tmp_path: Path,
) -> None:
    plan = plain_plan(tmp_path, tiny_onnx())
    with pytest.raises(NoCalibrationRows) as refused:
        ensure_variant(EngineStore(tmp_path / "store"), plan, "int8", "onnxruntime")
    message = str(refused.value)
    assert "takes no images" in message and "int8.calibration" in message
    assert "[4] float32 for input 'x'" in message and str(tmp_path) not in message


def test_int8_and_fp16_of_a_plain_model_use_the_users_rows(tmp_path: Path) -> None:
    rows = np.random.default_rng(3).standard_normal((48, 4)).astype(np.float32)
    (tmp_path / "rows").mkdir()
    np.save(tmp_path / "rows" / "part.npy", rows)
    int8 = Int8Options(calibration="rows", samples=32, calibrator="minmax")
    plan = plain_plan(tmp_path, tiny_onnx(), int8=int8, evaluation_samples=16, budgets={})
    store = EngineStore(tmp_path / "store")
    _, report = ensure_variant(store, plan, "int8", "onnxruntime")
    assert report["samples"] == 16 and report["max_relative_error"] < 0.1
    _, checked = ensure_variant(store, plan, "fp16", "onnxruntime")
    assert checked["samples"] == 16


def test_an_image_models_fp16_check_loads_only_the_rows_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not the calibration set as well (issue 41: 516 rows loaded for a 16-row check)."""
    asked: list[int] = []
    builtin = calibration_sets.augmented_builtin_set

    def counting(prep: ImagePreprocess, *args: Any, **kwargs: Any) -> np.ndarray:
        rows = builtin(prep, *args, **kwargs)
        asked.append(len(rows))
        return rows

    monkeypatch.setattr(calibration_sets, "augmented_builtin_set", counting)
    onnx.save(small_conv_model(), str(tmp_path / "model.onnx"))
    plan = BuildPlan(
        "small",
        tmp_path / "model.onnx",
        tmp_path,
        "input",
        ImagePreprocess(resize_shorter=16, crop=16),
        (1, 8, 16),
        int8=Int8Options(samples=40, calibrator="minmax"),
        evaluation_samples=12,
        override_accuracy=True,
    )
    store = EngineStore(tmp_path / "store")
    _, report = ensure_variant(store, plan, "fp16", "onnxruntime")
    assert asked == [12] and report["samples"] == 12
    assert {"top1_agreement", "mean_kl"} <= set(report)
    ensure_variant(store, plan, "int8", "onnxruntime")
    assert asked == [12, 52]
