"""The FP16 variant: close to FP32, FP32 I/O, sensitive ops kept in FP32, clamped weights."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from engines.precision import fp16
from tests.conftest import TINY_BIAS, TINY_WEIGHTS, tiny_onnx
from tests.unit.engines.precision.small_models import (
    io_types,
    node,
    run,
    small_conv_model,
    small_inputs,
    types_of,
)


def test_fp16_runs_close_to_fp32_and_keeps_fp32_io() -> None:
    model = small_conv_model()
    half = fp16.to_fp16(model)
    onnx.checker.check_model(half, full_check=True)
    assert io_types(half) == [TensorProto.FLOAT] * 3
    x = small_inputs()
    want_logits, want_probs = run(model, {"input": x})
    got_logits, got_probs = run(half, {"input": x})
    assert got_logits.dtype == np.float32
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(got_probs, want_probs, atol=2e-3)


def test_fp16_converts_weights_and_keeps_sensitive_ops_in_fp32() -> None:
    half = fp16.to_fp16(small_conv_model())
    types = types_of(half)
    conv, fc, softmax = node(half, "conv"), node(half, "fc"), node(half, "softmax")
    # Weight-bearing nodes compute in float16 on float16 weights; the input is cast once.
    assert all(types[name] == TensorProto.FLOAT16 for name in (*conv.input, *conv.output))
    assert all(types[name] == TensorProto.FLOAT16 for name in fc.input)
    assert types["conv.weight"] == types["fc.weight"] == TensorProto.FLOAT16
    # Softmax, in DEFAULT_FP32_OPS, reads and writes float32 between Casts.
    assert "Softmax" in fp16.DEFAULT_FP32_OPS
    assert types[softmax.input[0]] == types[softmax.output[0]] == TensorProto.FLOAT
    # The Constant feeding a float16 Mul became float16 too.
    constant = next(n for n in half.graph.node if n.op_type == "Constant")
    assert constant.attribute[0].t.data_type == TensorProto.FLOAT16


def test_fp16_keep_first_and_last_and_named_nodes() -> None:
    model = small_conv_model()
    kept = fp16.to_fp16(model, keep_first_and_last=True)
    types = types_of(kept)
    for name in ("conv", "fc"):
        assert all(types[t] == TensorProto.FLOAT for t in (*node(kept, name).input,))
    assert types["conv.weight"] == types["fc.weight"] == TensorProto.FLOAT
    assert types[node(kept, "scale").output[0]] == TensorProto.FLOAT16

    by_name = fp16.to_fp16(model, keep_fp32_nodes=["scale"])
    types = types_of(by_name)
    scale = node(by_name, "scale")
    assert all(types[t] == TensorProto.FLOAT for t in (*scale.input, *scale.output))
    assert types["conv.weight"] == TensorProto.FLOAT16
    x = small_inputs()
    np.testing.assert_allclose(
        run(kept, {"input": x})[0], run(model, {"input": x})[0], rtol=1e-2, atol=1e-2
    )


def test_fp16_of_tiny_model_shares_inputs_between_precisions() -> None:
    """tiny_onnx: MatMul runs in float16 while ReduceSum keeps reading the FP32 input."""
    model = tiny_onnx()
    half = fp16.to_fp16(model)
    onnx.checker.check_model(half, full_check=True)
    types = types_of(half)
    reduce_sum = next(n for n in half.graph.node if n.op_type == "ReduceSum")
    assert reduce_sum.input[0] == "x" and types["x"] == TensorProto.FLOAT
    assert types["W"] == TensorProto.FLOAT16
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    y, s = run(half, {"x": x})
    np.testing.assert_allclose(y, x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(s, x.sum(axis=1, keepdims=True), rtol=1e-6)


def test_fp16_clamps_weights_to_the_float16_range_and_converts_shared_weights_twice() -> None:
    """A weight read by a float16 node and an FP32 node exists in both types; huge values
    saturate at float16's largest finite value instead of becoming inf."""
    huge = np.array([[1e6, -1e6], [1.0, 2.0]], dtype=np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["y"], name="matmul"),
            helper.make_node("ReduceSum", ["W"], ["total"], name="sum", keepdims=0),
        ],
        "shared",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2]),
            helper.make_tensor_value_info("total", TensorProto.FLOAT, []),
        ],
        [numpy_helper.from_array(huge, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    half = fp16.to_fp16(model)
    onnx.checker.check_model(half, full_check=True)
    weights = {init.name: numpy_helper.to_array(init) for init in half.graph.initializer}
    assert weights["W"].dtype == np.float32
    (half_name,) = (name for name, w in weights.items() if w.dtype == np.float16)
    assert node(half, "matmul").input[1] == half_name
    assert np.isfinite(weights[half_name]).all()
    assert weights[half_name].max() == np.finfo(np.float16).max
    y, total = run(half, {"x": np.array([[0.0, 1.0]], dtype=np.float32)})
    np.testing.assert_allclose(y, [[1.0, 2.0]])
    assert total == pytest.approx(3.0)


def test_fp16_refuses_control_flow() -> None:
    branch = helper.make_graph([], "branch", [], [helper.make_tensor_value_info("x", 1, [1])])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch)],
        "cf",
        [
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    with pytest.raises(ValueError, match="control flow"):
        fp16.to_fp16(helper.make_model(graph))
