"""The TensorRT backend for real: FP32, FP16 and INT8 plans of EfficientNet-Lite0 against
ONNX Runtime on the CPU, and several execution contexts at once.

Skipped, with the exact reason, where no TensorRT can run a plan: where none imports, where
there is no GPU, and on a GPU that the TensorRT present does not run on (TensorRT for RTX runs
on compute capability 8.0, 8.6, 8.9 and 12.x, not on the H200's 9.0). These tests have not yet
run anywhere. Run them in the gpu image (NVIDIA's TensorRT container) or with TensorRT for RTX
on an A100 or an RTX card: `pytest tests/gpu/test_tensorrt.py`. The tolerances are first
estimates, to be confirmed by the first run. The build path without a GPU is tested in
tests/unit/engines/backends/tensorrt/test_rtx.py.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from engines.backends.onnxruntime import read_spec
from engines.backends.tensorrt.build import BuildError
from engines.backends.tensorrt.engine import TensorRTEngine, TensorRTOptions
from engines.backends.tensorrt.runtime import current_target
from engines.base import EngineOptions
from engines.precision import accuracy, calibration, calibration_sets, fp16, int8
from engines.preprocess import ImagePreprocess
from engines.spec import ModelSpec
from engines.store import EngineStore


def why_not_here() -> str | None:
    """Why no plan can run here, or None where one can."""
    try:
        current_target(0)
    except Exception as why:  # TensorRTUnavailable, or no CUDA device or driver
        return f"TensorRT cannot run a plan here: {why}"
    return None


pytestmark = pytest.mark.skipif(why_not_here() is not None, reason=why_not_here() or "")

MAX_BATCH = 8
PROFILE = (1, 4, MAX_BATCH)


@pytest.fixture(scope="module")
def photos() -> np.ndarray:
    """Preprocessed photos (scikit-image's, augmented): real inputs, so that top-1 means
    something; held apart from the calibration rows by their seed."""
    return calibration_sets.augmented_builtin_set(ImagePreprocess(), samples=24, seed=1)


@pytest.fixture(scope="module")
def model(efficientnet_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The FP32 source and its FP16 and INT8 (symmetric S8S8, TensorRT's form) variants."""
    source = efficientnet_dir / "model.onnx"
    folder = tmp_path_factory.mktemp("variants")
    fp32 = onnx.load(str(source))
    input_name = fp32.graph.input[0].name
    rows = calibration_sets.augmented_builtin_set(ImagePreprocess(), samples=64, seed=0)
    ranges = calibration.collect_ranges(fp32, rows, input_name, "entropy")
    paths = {"fp32": source, "fp16": folder / "fp16.onnx", "int8": folder / "int8.onnx"}
    onnx.save(fp16.to_fp16(fp32, keep_fp32_ops=fp16.DEFAULT_FP32_OPS), str(paths["fp16"]))
    onnx.save(int8.to_int8(fp32, ranges, form="s8s8"), str(paths["int8"]))
    return paths


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> EngineStore:
    return EngineStore(tmp_path_factory.mktemp("store"))


def spec_of(path: Path) -> ModelSpec:
    return read_spec(path, "efficientnet_lite0", MAX_BATCH)


def load(
    path: Path, store: EngineStore, precision: str, runners: int = 1, **options: object
) -> TensorRTEngine:
    engine_options = EngineOptions(
        runners=runners, store=store, profile=PROFILE, precision=precision
    )
    return TensorRTEngine(path, spec_of(path), engine_options, TensorRTOptions(**options))  # type: ignore[arg-type]


def onnxruntime(path: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    result: np.ndarray = session.run(None, {session.get_inputs()[0].name: x})[0]
    return result


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


@pytest.mark.parametrize(
    ("precision", "tolerance", "agreement"),
    [("fp32", 1e-3, 1.0), ("fp16", 3e-2, 0.95), ("int8", 0.2, 0.85)],
)
def test_plans_match_onnxruntime_on_the_same_variant(
    model: dict[str, Path],
    store: EngineStore,
    photos: np.ndarray,
    precision: str,
    tolerance: float,
    agreement: float,
) -> None:
    path = model[precision]
    engine = load(path, store, precision)
    runner = engine.new_runner()
    try:
        for rows in (1, 5, MAX_BATCH):
            x = photos[:rows]
            got = runner.run({spec_of(path).inputs[0].name: x})
            [name] = got
            want = onnxruntime(path, x)
            assert got[name].shape == want.shape
            assert relative_error(got[name], want) <= tolerance
        x = photos[:MAX_BATCH]
        got_logits = next(iter(runner.run({spec_of(path).inputs[0].name: x}).values()))
        fp32 = onnxruntime(model["fp32"], x)
        assert accuracy.top1_agreement(fp32, got_logits) >= agreement
    finally:
        runner.close()
        engine.close()


def test_a_plan_is_built_once_then_loaded_from_the_store(
    model: dict[str, Path], tmp_path: Path
) -> None:
    store = EngineStore(tmp_path)
    load(model["fp32"], store, "fp32").close()
    plans = list(tmp_path.rglob("*.plan"))
    [plan] = plans
    built = plan.stat().st_mtime_ns
    load(model["fp32"], store, "fp32").close()
    assert plan.stat().st_mtime_ns == built
    assert list(tmp_path.rglob("timing-cache-*.cache"))


def test_contexts_run_concurrently_each_on_its_own_stream(
    model: dict[str, Path], store: EngineStore, photos: np.ndarray
) -> None:
    path = model["fp16"]
    engine = load(path, store, "fp16", runners=4)
    runners = [engine.new_runner() for _ in range(4)]
    name = spec_of(path).inputs[0].name
    batches = [photos[i : i + 1 + i % MAX_BATCH] for i in range(len(runners))]
    expected = [next(iter(runners[0].run({name: b}).values())) for b in batches]
    failures: list[BaseException] = []

    def lane(index: int) -> None:
        try:
            for _ in range(25):
                got = next(iter(runners[index].run({name: batches[index]}).values()))
                np.testing.assert_array_equal(got, expected[index])
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=lane, args=(i,)) for i in range(len(runners))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert not failures, failures[0]
        assert len({r.stream.ptr for r in runners}) == len(runners)
    finally:
        for runner in runners:
            runner.close()
        engine.close()


def test_cuda_graphs_replay_what_the_enqueue_computes(
    model: dict[str, Path], store: EngineStore, photos: np.ndarray
) -> None:
    path = model["fp32"]
    name = spec_of(path).inputs[0].name
    plain, graphed = load(path, store, "fp32"), load(path, store, "fp32", cuda_graphs=True)
    first, second = plain.new_runner(), graphed.new_runner()
    try:
        for rows in (3, MAX_BATCH, 3):
            want = first.run({name: photos[:rows]})
            got = second.run({name: photos[:rows]})
            for key, value in want.items():
                np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-5)
    finally:
        first.close()
        second.close()


def test_parser_errors_name_the_node(tmp_path: Path, store: EngineStore) -> None:
    graph = helper.make_graph(
        [helper.make_node("NoSuchOp", ["x"], ["y"], name="mystery", domain="com.example")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)],
    )
    path = tmp_path / "bad.onnx"
    onnx.save(model, str(path))
    with pytest.raises(BuildError, match="mystery"):
        TensorRTEngine(path, read_spec(path, "bad", 4), EngineOptions(store=store))


def test_a_batch_larger_than_the_profile_is_refused(
    model: dict[str, Path], store: EngineStore, photos: np.ndarray
) -> None:
    engine = load(model["fp32"], store, "fp32")
    runner = engine.new_runner()
    try:
        batch = np.concatenate([photos, photos])[: MAX_BATCH + 1]
        with pytest.raises(ValueError, match="this engine takes 1 to 8"):
            runner.run({spec_of(model["fp32"]).inputs[0].name: batch})
    finally:
        runner.close()
        engine.close()
