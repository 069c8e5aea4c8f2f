"""The INT8 variant: Q/DQ per form, symmetric per-channel weights, exclusions, 7-bit weights
that cannot saturate, bias correction."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from engines.devices import cpu
from engines.precision import calibration, graph, int8
from engines.precision.calibration import Ranges
from tests.conftest import TINY_BIAS, TINY_WEIGHTS, tiny_onnx
from tests.unit.engines.precision.small_models import (
    CHANNELS,
    CLASSES,
    io_types,
    node,
    run,
    small_conv_model,
    small_inputs,
)


@pytest.fixture(scope="module")
def small_ranges() -> Ranges:
    return calibration.collect_ranges(small_conv_model(), small_inputs(), "input", "minmax")


def initializer(model: onnx.ModelProto, name: str) -> np.ndarray:
    (found,) = (i for i in model.graph.initializer if i.name == name)
    return numpy_helper.to_array(found)


def ops(model: onnx.ModelProto, op_type: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == op_type]


def producer(model: onnx.ModelProto, tensor: str) -> onnx.NodeProto | None:
    return next((n for n in model.graph.node if tensor in n.output), None)


def weight_dequantize(model: onnx.ModelProto, node_name: str) -> onnx.NodeProto:
    dq = producer(model, node(model, node_name).input[1])
    assert dq is not None and dq.op_type == "DequantizeLinear"
    return dq


@pytest.mark.parametrize(
    "integer_kernels", [True, False], ids=["fused-integer-kernels", "qdq-in-float"]
)
@pytest.mark.parametrize("form", int8.INT8_FORMS)
def test_int8_runs_close_to_fp32(form: str, integer_kernels: bool, small_ranges: Ranges) -> None:
    """Run as ONNX Runtime serves it (Q/DQ fused into this CPU's integer kernels, with the
    weights this CPU gets) and as written (Q/DQ in float, what a GPU computes)."""
    saturates = cpu.integer_kernels().saturates
    if integer_kernels and form == "s8s8" and saturates:
        pytest.skip(
            f"this CPU ({cpu.integer_kernels().name}) has no VNNI: ONNX Runtime's S8S8 kernels "
            "saturate here, so TensorRT's S8S8 form is judged with Q/DQ in float, as a GPU runs it"
        )
    model = small_conv_model()
    quantized = int8.to_int8(
        model,
        small_ranges,
        form=form,  # type: ignore[arg-type]
        reduce_range=integer_kernels and saturates,
    )
    onnx.checker.check_model(quantized, full_check=True)
    assert io_types(quantized) == [TensorProto.FLOAT] * 3
    x = small_inputs(seed=5)
    want_logits, want_probs = run(model, {"input": x})
    got_logits, got_probs = run(quantized, {"input": x}, optimize=integer_kernels)
    assert np.abs(got_logits - want_logits).max() < 0.05 * np.abs(want_logits).max()
    np.testing.assert_allclose(got_probs, want_probs, atol=0.03)


def test_int8_weights_are_symmetric_per_channel(small_ranges: Ranges) -> None:
    quantized = int8.to_int8(small_conv_model(), small_ranges, form="u8s8")
    for name, channels in (("conv", CHANNELS), ("fc", CLASSES)):
        dq = weight_dequantize(quantized, name)
        assert initializer(quantized, dq.input[0]).dtype == np.int8
        scale = initializer(quantized, dq.input[1])
        assert scale.shape == (channels,)
        assert not initializer(quantized, dq.input[2]).any()
        assert {a.name: a.i for a in dq.attribute}["axis"] == 0

    per_tensor = int8.to_int8(small_conv_model(), small_ranges, form="u8s8", per_channel=False)
    dq = weight_dequantize(per_tensor, "conv")
    assert initializer(per_tensor, dq.input[1]).size == 1


def test_int8_activation_zero_points_per_form(small_ranges: Ranges) -> None:
    """s8s8 (TensorRT): every QuantizeLinear zero point is int8 and exactly 0.
    u8s8 (ONNX Runtime CPU): activations are uint8."""
    symmetric = int8.to_int8(small_conv_model(), small_ranges, form="s8s8")
    quantizers = ops(symmetric, "QuantizeLinear")
    assert quantizers
    for q in quantizers:
        zero = initializer(symmetric, q.input[2])
        assert zero.dtype == np.int8 and not zero.any()

    cpu = int8.to_int8(small_conv_model(), small_ranges, form="u8s8")
    assert ops(cpu, "QuantizeLinear")
    for q in ops(cpu, "QuantizeLinear"):
        assert initializer(cpu, q.input[2]).dtype == np.uint8


def test_int8_honours_exclusions_and_leaves_outputs_unquantized(small_ranges: Ranges) -> None:
    model = small_conv_model()
    by_type = int8.to_int8(model, small_ranges, form="u8s8", exclude_op_types={"Gemm"})
    assert node(by_type, "fc").input[1] == "fc.weight"
    assert initializer(by_type, "fc.weight").dtype == np.float32
    weight_dequantize(by_type, "conv")

    by_name = int8.to_int8(model, small_ranges, form="s8s8", exclude_nodes=["conv"])
    conv = node(by_name, "conv")
    assert conv.input[0] == "input" and conv.input[1] == "conv.weight"
    weight_dequantize(by_name, "fc")

    default = int8.to_int8(model, small_ranges, form="u8s8")
    assert {producer(default, o.name).op_type for o in default.graph.output} == {  # type: ignore[union-attr]
        "Gemm",
        "Softmax",
    }
    quantized_outputs = int8.to_int8(model, small_ranges, form="u8s8", quantize_outputs=True)
    assert producer(quantized_outputs, "probabilities").op_type == "DequantizeLinear"  # type: ignore[union-attr]


def test_int8_of_tiny_model() -> None:
    model = tiny_onnx()
    x = np.random.default_rng(0).standard_normal((32, 4)).astype(np.float32)
    ranges = calibration.collect_ranges(model, x, "x", "minmax")
    assert "x" in ranges.tensors and "y" in ranges.tensors
    quantized = int8.to_int8(model, ranges, form="s8s8")
    y, s = run(quantized, {"x": x})
    np.testing.assert_allclose(y, x @ TINY_WEIGHTS + TINY_BIAS, atol=0.1)
    # ReduceSum is not quantized, but it reads the same (quantized) input as the MatMul.
    np.testing.assert_allclose(s, x.sum(axis=1, keepdims=True), atol=0.1)


def three_layer_model(seed: int = 0) -> onnx.ModelProto:
    """Gemm, Relu, Gemm, Relu, Gemm: a first, a middle and a last weight layer."""
    rng = np.random.default_rng(seed)
    sizes = [(16, 8), (16, 16), (CLASSES, 16)]
    nodes, inits, current = [], [], "x"
    for i, shape in enumerate(sizes):
        inits += [
            numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), f"w{i}"),
            numpy_helper.from_array(np.zeros(shape[0], dtype=np.float32), f"b{i}"),
        ]
        out = "logits" if i == len(sizes) - 1 else f"h{i}"
        nodes.append(
            helper.make_node("Gemm", [current, f"w{i}", f"b{i}"], [out], f"fc{i}", transB=1)
        )
        if out != "logits":
            nodes.append(helper.make_node("Relu", [out], [f"r{i}"], f"relu{i}"))
            current = f"r{i}"
    graph = helper.make_graph(
        nodes,
        "three",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def quantized_weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Weight node name -> its INT8 weight, for every weight node fed by a DequantizeLinear."""
    found = {}
    for weight in model.graph.node:
        if weight.op_type not in graph.WEIGHT_OPS:
            continue
        dq = producer(model, weight.input[1])
        if dq is not None and dq.op_type == "DequantizeLinear":
            found[weight.name] = initializer(model, dq.input[0])
    return found


def test_seven_bit_weights_cannot_saturate_int16() -> None:
    """x86 without VNNI adds two uint8 x int8 products in int16 (vpmaddubsw): with every
    weight within 7 bits the worst pair, 2 x 255 x 64 = 32,640, fits in 32,767; with 8 bits
    it does not."""
    model = three_layer_model()
    rows = np.random.default_rng(2).standard_normal((32, 8)).astype(np.float32)
    ranges = calibration.collect_ranges(model, rows, "x", "minmax")
    reduced = quantized_weights(int8.to_int8(model, ranges, form="u8s8", reduce_range=True))
    full = quantized_weights(int8.to_int8(model, ranges, form="u8s8"))
    assert set(reduced) == set(full) == {"fc0", "fc1", "fc2"}
    worst = max(int(np.abs(w.astype(np.int32)).max()) for w in reduced.values())
    assert 2 * 255 * worst <= np.iinfo(np.int16).max
    assert max(int(np.abs(w.astype(np.int32)).max()) for w in full.values()) == 127


def test_keep_first_and_last_leaves_the_edge_weight_layers_in_float() -> None:
    model = three_layer_model()
    rows = np.random.default_rng(2).standard_normal((32, 8)).astype(np.float32)
    ranges = calibration.collect_ranges(model, rows, "x", "minmax")
    kept = int8.to_int8(model, ranges, form="u8s8", keep_first_and_last=True)
    assert set(quantized_weights(kept)) == {"fc1"}
    assert initializer(kept, "w0").dtype == initializer(kept, "w2").dtype == np.float32
    want = run(model, {"x": rows})[0]
    got = run(kept, {"x": rows})[0]
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


def test_wrong_ranges_or_form_are_refused(small_ranges: Ranges) -> None:
    with pytest.raises(ValueError, match="form"):
        int8.to_int8(small_conv_model(), small_ranges, form="u8u8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="calibrated on this model"):
        int8.to_int8(small_conv_model(), Ranges("minmax", {}), form="u8s8")


def test_bias_correction_subtracts_the_mean_weight_error() -> None:
    """(W' - W) E[x] per output channel, for a depthwise conv, a dense conv and both Gemm
    layouts."""
    rng = np.random.default_rng(3)
    mean = rng.uniform(0, 2, 4)

    def shift_of(
        op: str, weight: np.ndarray, outputs: int, **attrs: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """(how much the bias moved, the weight error that moved it)."""
        bias = rng.standard_normal(outputs).astype(np.float32)
        layer = helper.make_node(op, ["x", "w", "b"], ["y"], name="n")
        layer.attribute.extend(helper.make_attribute(k, v) for k, v in attrs.items())
        graph = helper.make_graph(
            [layer],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b")],
        )
        delta = rng.standard_normal(weight.shape) * 0.01
        fixed = int8.correct_biases(
            helper.make_model(graph), {"n": weight + delta}, {"x": tuple(mean)}
        )
        return bias - initializer(fixed, node(fixed, "n").input[2]), delta

    depthwise = rng.standard_normal((4, 1, 3, 3)).astype(np.float32)
    shift, delta = shift_of("Conv", depthwise, 4, group=4)
    np.testing.assert_allclose(shift, delta.sum(axis=(1, 2, 3)) * mean, rtol=1e-4, atol=1e-6)

    dense = rng.standard_normal((6, 4, 1, 1)).astype(np.float32)
    shift, delta = shift_of("Conv", dense, 6)
    np.testing.assert_allclose(shift, delta[:, :, 0, 0] @ mean, rtol=1e-4, atol=1e-6)

    for trans_b in (0, 1):
        gemm = rng.standard_normal((5, 4) if trans_b else (4, 5)).astype(np.float32)
        shift, delta = shift_of("Gemm", gemm, 5, transB=trans_b)
        np.testing.assert_allclose(
            shift, (delta if trans_b else delta.T) @ mean, rtol=1e-4, atol=1e-6
        )
