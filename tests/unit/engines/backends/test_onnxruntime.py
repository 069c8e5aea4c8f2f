"""The ONNX Runtime backend: tensor contracts read from real ONNX files, real sessions checked
against numpy, the cores divided between runners, and what a wrong input does."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.capi.onnxruntime_pybind11_state import InvalidArgument

from engines.backends import onnxruntime
from engines.base import EngineOptions
from engines.spec import ModelSpec, TensorSpec
from tests.conftest import TINY_BIAS, TINY_WEIGHTS, tiny_onnx

# float32 sums of four products: 1e-5 is far above any CPU's rounding differences.
RTOL = ATOL = 1e-5


def save(model: onnx.ModelProto, folder: Path, name: str = "model.onnx") -> Path:
    path = folder / name
    onnx.save(model, str(path))
    return path


def identity_model(
    inputs: list[onnx.ValueInfoProto],
    initializers: Sequence[onnx.TensorProto] = (),
    ir_version: int = 8,
) -> onnx.ModelProto:
    """Each input passed through to an output named ``<input>_out`` of the same type."""
    nodes, outputs = [], []
    for value in inputs:
        if value.name in {i.name for i in initializers}:
            continue
        nodes.append(helper.make_node("Identity", [value.name], [f"{value.name}_out"]))
        out = onnx.ValueInfoProto()
        out.CopyFrom(value)
        out.name = f"{value.name}_out"
        outputs.append(out)
    graph = helper.make_graph(nodes, "identity", inputs, outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = ir_version
    onnx.checker.check_model(model)
    return model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(tiny_onnx(), tmp_path_factory.mktemp("tiny"))


def test_a_batched_spec_drops_the_batch_dimension(tiny_path: Path) -> None:
    spec = onnxruntime.read_spec(tiny_path, "tiny", 16)
    assert spec == ModelSpec(
        name="tiny",
        inputs=(TensorSpec("x", "FP32", (4,)),),
        outputs=(TensorSpec("y", "FP32", (3,)), TensorSpec("s", "FP32", (1,))),
        max_batch_size=16,
    )
    # The initializers W, b and axes are weights, not inputs.
    assert [t.name for t in spec.inputs] == ["x"]


def test_an_unbatched_spec_keeps_every_dimension_with_symbols_dynamic(tiny_path: Path) -> None:
    spec = onnxruntime.read_spec(tiny_path, "tiny", 0)
    assert not spec.batched
    assert spec.inputs == (TensorSpec("x", "FP32", (-1, 4)),)
    assert spec.outputs == (TensorSpec("y", "FP32", (-1, 3)), TensorSpec("s", "FP32", (-1, 1)))


def test_fixed_and_dynamic_dimensions_and_datatypes_are_read(tmp_path: Path) -> None:
    unknown = helper.make_tensor_value_info("unknown", TensorProto.FLOAT16, [1, 2])
    unknown.type.tensor_type.shape.dim[1].Clear()  # neither a value nor a symbol
    inputs = [
        helper.make_tensor_value_info("image", TensorProto.UINT8, ["n", 3, "h", "w"]),
        helper.make_tensor_value_info("ids", TensorProto.INT64, ["n", 7]),
        helper.make_tensor_value_info("mask", TensorProto.BOOL, ["n", 7]),
        helper.make_tensor_value_info("scale", TensorProto.DOUBLE, [8, 1]),
        helper.make_tensor_value_info("text", TensorProto.STRING, ["n"]),
        helper.make_tensor_value_info("small", TensorProto.INT8, ["n", 2]),
        unknown,
    ]
    path = save(identity_model(inputs), tmp_path)
    spec = onnxruntime.read_spec(path, "mixed", 8)
    assert spec.inputs == (
        TensorSpec("image", "UINT8", (3, -1, -1)),
        TensorSpec("ids", "INT64", (7,)),
        TensorSpec("mask", "BOOL", (7,)),
        TensorSpec("scale", "FP64", (1,)),
        TensorSpec("text", "BYTES", ()),
        TensorSpec("small", "INT8", (2,)),
        TensorSpec("unknown", "FP16", (-1,)),
    )
    assert [t.name for t in spec.outputs] == [f"{t.name}_out" for t in spec.inputs]
    assert [t.datatype for t in spec.outputs] == [t.datatype for t in spec.inputs]


def test_initializers_listed_as_inputs_are_not_inputs(tmp_path: Path) -> None:
    """Files of IR version 3 list every weight among the graph's inputs."""
    weight = numpy_helper.from_array(np.ones((2, 2), np.float32), "weight")
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2]),
        helper.make_tensor_value_info("weight", TensorProto.FLOAT, [2, 2]),
    ]
    path = save(identity_model(inputs, [weight], ir_version=3), tmp_path)
    spec = onnxruntime.read_spec(path, "old", 4)
    assert spec.inputs == (TensorSpec("x", "FP32", (2,)),)


def test_a_scalar_input_of_a_batched_model_is_refused_by_name(tmp_path: Path) -> None:
    inputs = [helper.make_tensor_value_info("temperature", TensorProto.FLOAT, [])]
    path = save(identity_model(inputs), tmp_path)
    with pytest.raises(ValueError, match="'temperature' is a scalar but the model is batched"):
        onnxruntime.read_spec(path, "scalar", 4)
    assert onnxruntime.read_spec(path, "scalar", 0).inputs == (
        TensorSpec("temperature", "FP32", ()),
    )


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_a_runner_computes_what_numpy_computes(tiny_path: Path, rows: int) -> None:
    spec = onnxruntime.read_spec(tiny_path, "tiny", 16)
    engine = onnxruntime.load(tiny_path, spec, EngineOptions())
    assert engine.backend == "onnxruntime" and engine.spec is spec
    assert engine.pixel_input is None  # pixels reach it normalised by the service
    runner = engine.new_runner()
    try:
        x = np.random.default_rng(rows).standard_normal((rows, 4)).astype(np.float32)
        outputs = runner.run({"x": x})
    finally:
        runner.close()
        engine.close()
    assert list(outputs) == ["y", "s"]
    assert outputs["y"].dtype == np.float32 and outputs["y"].shape == (rows, 3)
    np.testing.assert_allclose(outputs["y"], x @ TINY_WEIGHTS + TINY_BIAS, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(outputs["s"], x.sum(axis=1, keepdims=True), rtol=RTOL, atol=ATOL)


def test_runners_of_one_engine_are_independent(tiny_path: Path) -> None:
    spec = onnxruntime.read_spec(tiny_path, "tiny", 16)
    engine = onnxruntime.load(tiny_path, spec, EngineOptions(runners=2))
    first, second = engine.new_runner(), engine.new_runner()
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    try:
        first.close()
        y = second.run({"x": x})["y"]
    finally:
        second.close()
    np.testing.assert_allclose(y, x @ TINY_WEIGHTS + TINY_BIAS, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    ("cpu_threads", "runners", "threads"),
    [(8, 1, 8), (8, 2, 4), (8, 3, 2), (8, 16, 1), (6, 0, 6), (1, 4, 1)],
)
def test_the_cores_are_divided_between_runners(
    cpu_threads: int, runners: int, threads: int
) -> None:
    options = EngineOptions(runners=runners, cpu_threads=cpu_threads)
    assert onnxruntime.threads_per_runner(options) == threads


def test_without_a_thread_count_the_machines_cores_are_divided(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 12)
    assert onnxruntime.threads_per_runner(EngineOptions(runners=4)) == 3
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert onnxruntime.threads_per_runner(EngineOptions(runners=4)) == 1


def test_a_session_runs_sequentially_without_spinning_on_the_cpu() -> None:
    session = onnxruntime.cpu_session(tiny_onnx().SerializeToString(), 3)
    options = session.get_session_options()
    assert options.intra_op_num_threads == 3 and options.inter_op_num_threads == 1
    assert options.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert session.get_providers() == ["CPUExecutionProvider"]
    plain = onnxruntime.cpu_session(tiny_onnx().SerializeToString(), 0, optimize=False)
    level = plain.get_session_options().graph_optimization_level
    assert level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL


def test_each_runner_gets_its_share_of_the_threads(
    tiny_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[ort.InferenceSession] = []
    real = onnxruntime.cpu_session

    def recording(model: bytes | str, threads: int, *, optimize: bool = True) -> object:
        session = real(model, threads, optimize=optimize)
        made.append(session)
        return session

    monkeypatch.setattr(onnxruntime, "cpu_session", recording)
    spec = onnxruntime.read_spec(tiny_path, "tiny", 16)
    engine = onnxruntime.load(tiny_path, spec, EngineOptions(runners=3, cpu_threads=9))
    runners = [engine.new_runner() for _ in range(3)]
    for runner in runners:
        runner.close()
    assert [s.get_session_options().intra_op_num_threads for s in made] == [3, 3, 3]


@pytest.mark.parametrize(
    ("inputs", "says"),
    [
        ({"x": np.zeros((2, 4), np.float64)}, "Unexpected input data type"),
        ({"x": np.zeros((2, 5), np.float32)}, "invalid dimensions for input: x"),
        ({"x": np.zeros((4,), np.float32)}, "Invalid rank for input: x"),
        ({"x": np.zeros((2, 4), np.float32), "z": np.zeros((2, 4), np.float32)}, "name: z"),
    ],
    ids=["dtype", "shape", "rank", "extra"],
)
def test_a_wrong_input_raises_and_leaves_the_runner_usable(
    tiny_path: Path, inputs: dict[str, np.ndarray], says: str
) -> None:
    """The runner does not validate (the protocol layer does): ONNX Runtime refuses, naming
    the problem, and the next good batch still runs."""
    spec = onnxruntime.read_spec(tiny_path, "tiny", 16)
    runner = onnxruntime.load(tiny_path, spec, EngineOptions()).new_runner()
    try:
        with pytest.raises(InvalidArgument, match=says):
            runner.run(inputs)
        x = np.ones((1, 4), np.float32)
        np.testing.assert_allclose(
            runner.run({"x": x})["y"], x @ TINY_WEIGHTS + TINY_BIAS, rtol=RTOL, atol=ATOL
        )
    finally:
        runner.close()


def test_a_missing_input_is_named(tiny_path: Path) -> None:
    spec = onnxruntime.read_spec(tiny_path, "tiny", 16)
    runner = onnxruntime.load(tiny_path, spec, EngineOptions()).new_runner()
    try:
        with pytest.raises(ValueError, match=r"Required inputs \(\['x'\]\) are missing"):
            runner.run({})
    finally:
        runner.close()


def test_an_engine_reads_the_file_once_at_load(tiny_path: Path, tmp_path: Path) -> None:
    """Runners made later are not affected by the file changing or going away."""
    path = save(tiny_onnx(), tmp_path, "moving.onnx")
    spec = onnxruntime.read_spec(path, "tiny", 16)
    engine = onnxruntime.load(path, spec, EngineOptions())
    path.unlink()
    runner = engine.new_runner()
    try:
        x = np.ones((2, 4), np.float32)
        np.testing.assert_allclose(
            runner.run({"x": x})["y"], x @ TINY_WEIGHTS + TINY_BIAS, rtol=RTOL, atol=ATOL
        )
    finally:
        runner.close()


def test_bf16_tensors_go_in_and_come_out_bit_for_bit(tmp_path: Path) -> None:
    """ONNX Runtime's Python API takes and gives no numpy bfloat16; the runner does: a BF16
    input cast to FP32 gives its values, an FP32 input cast to BF16 gives the rounded ones,
    and an empty batch gives empty arrays."""
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["b"], ["widened"], to=TensorProto.FLOAT),
            helper.make_node("Cast", ["f"], ["narrowed"], to=TensorProto.BFLOAT16),
        ],
        "casts",
        [
            helper.make_tensor_value_info("b", TensorProto.BFLOAT16, ["batch", 3]),
            helper.make_tensor_value_info("f", TensorProto.FLOAT, ["batch", 3]),
        ],
        [
            helper.make_tensor_value_info("widened", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("narrowed", TensorProto.BFLOAT16, ["batch", 3]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = save(model, tmp_path)
    spec = onnxruntime.read_spec(path, "casts", 8)
    runner = onnxruntime.load(path, spec, EngineOptions()).new_runner()
    # bfloat16 bit patterns: 1.0, -2.5, the largest finite, -0.0, the smallest normal, 0.1
    bits = np.array([[0x3F80, 0xC020, 0x7F7F], [0x8000, 0x0080, 0x3DCD]], np.uint16)
    b = bits.view(ml_dtypes.bfloat16)
    widened = (bits.astype(np.uint32) << 16).view(np.float32)
    f = np.array([[1.0, 1.00390625, 3.0e38], [-0.0, np.pi, 65504.0]], np.float32)
    try:
        outputs = runner.run({"b": b, "f": f})
        empty = runner.run({"b": b[:0], "f": f[:0]})
    finally:
        runner.close()
    assert outputs["widened"].dtype == np.float32
    assert outputs["widened"].tobytes() == widened.tobytes()
    assert outputs["narrowed"].dtype == ml_dtypes.bfloat16
    assert outputs["narrowed"].tobytes() == f.astype(ml_dtypes.bfloat16).tobytes()
    assert empty["narrowed"].shape == (0, 3) and empty["widened"].shape == (0, 3)
