"""The INT8 variant: explicit QuantizeLinear/DequantizeLinear nodes, compiled strongly typed.

``to_int8`` quantizes with per-channel symmetric INT8 weights; activations as uint8 with a
zero point (``u8s8``, what ONNX Runtime's CPU kernels are fastest at) or as symmetric int8
with zero points of exactly 0 (``s8s8``, what TensorRT requires). Activation ranges come
from ``engines.precision.calibration``; ``calibrate_auto`` tries each calibrator and keeps
the one whose variant agrees best with FP32 on held-out rows.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import onnx
from onnx import helper, numpy_helper

from engines.precision.accuracy import mean_kl, run_onnx
from engines.precision.calibration import (
    CALIBRATORS,
    QUANTIZABLE_OPS,
    Progress,
    Ranges,
    calibration_tensors,
    collect_statistics,
    ranges_from_statistics,
)
from engines.precision.graph import copy_message, drop_unused_initializers, weight_nodes

logger = logging.getLogger(__name__)


INT8_FORMS = ("u8s8", "s8s8")


def _named(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` in which every node has a unique name (the quantizer keys on them)."""
    named = onnx.ModelProto()
    named.CopyFrom(model)
    taken = {node.name for node in named.graph.node if node.name}
    for index, node in enumerate(named.graph.node):
        if not node.name:
            name, n = f"{node.op_type}_{index}", 0
            while name in taken:
                n += 1
                name = f"{node.op_type}_{index}_{n}"
            node.name = name
            taken.add(name)
    return named


def _unquantize_outputs(model: onnx.ModelProto) -> None:
    """Remove the Q/DQ pairs that end in a graph output, so outputs keep full precision.

    Logits quantized to 256 levels tie and flip the arg-max for no speed worth having.
    """
    graph = model.graph
    nodes = list(graph.node)
    producer = {output: node for node in nodes for output in node.output}
    removed: list[onnx.NodeProto] = []
    for value in graph.output:
        dq = producer.get(value.name)
        if dq is None or dq.op_type != "DequantizeLinear":
            continue
        q = producer.get(dq.input[0])
        if q is None or q.op_type != "QuantizeLinear":
            continue
        original = q.input[0]
        readers = [n for n in nodes if original in n.input and n is not q]
        source = producer.get(original)
        if readers or source is None:
            continue
        source.output[list(source.output).index(original)] = value.name
        removed += [q, dq]
    gone = {id(node) for node in removed}
    kept = [copy_message(node) for node in nodes if id(node) not in gone]
    del graph.node[:]
    graph.node.extend(kept)
    drop_unused_initializers(graph)


def _dequantized_weights(quantized: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Node name -> the weight (input 1) a Conv or Gemm really computes with after Q/DQ."""
    graph = quantized.graph
    constants = {init.name: init for init in graph.initializer}
    producer = {output: node for node in graph.node for output in node.output}
    weights: dict[str, np.ndarray] = {}
    for node in graph.node:
        dq = producer.get(node.input[1]) if len(node.input) > 1 else None
        if node.op_type not in ("Conv", "Gemm") or dq is None or dq.op_type != "DequantizeLinear":
            continue
        if dq.input[0] not in constants or dq.input[1] not in constants:
            continue
        values = numpy_helper.to_array(constants[dq.input[0]]).astype(np.float64)
        scale = numpy_helper.to_array(constants[dq.input[1]]).astype(np.float64)
        zero = (
            numpy_helper.to_array(constants[dq.input[2]]).astype(np.float64)
            if len(dq.input) > 2 and dq.input[2] in constants
            else np.zeros_like(scale)
        )
        if scale.size > 1:
            axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
            shape = [1] * values.ndim
            shape[axis] = -1
            scale, zero = scale.reshape(shape), zero.reshape(shape)
        weights[node.name] = (values - zero) * scale
    return weights


def _bias_shift(node: onnx.NodeProto, delta: np.ndarray, mean: np.ndarray) -> np.ndarray | None:
    """E[delta * x] per output channel: how much rounding the weights moves the output."""
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Conv":
        group = int(attributes.get("group", 1))
        outputs, per_group = delta.shape[0], delta.shape[1]
        if mean.size != per_group * group or outputs % group:
            return None
        summed = delta.reshape(outputs, per_group, -1).sum(axis=-1)
        shift = np.einsum(
            "gpi,gi->gp",
            summed.reshape(group, outputs // group, per_group),
            mean.reshape(group, per_group),
        )
        result: np.ndarray = shift.reshape(outputs)
        return result
    if node.op_type == "Gemm" and not attributes.get("transA", 0):
        weight = delta if attributes.get("transB", 0) else delta.T
        if weight.ndim != 2 or weight.shape[1] != mean.size:
            return None
        alpha = float(attributes.get("alpha", 1.0))
        beta = float(attributes.get("beta", 1.0))
        return alpha * (weight @ mean) / beta if beta else None
    return None


def correct_biases(
    model: onnx.ModelProto,
    dequantized: Mapping[str, np.ndarray],
    channel_means: Mapping[str, tuple[float, ...]],
) -> onnx.ModelProto:
    """A copy of ``model`` whose Conv/Gemm biases absorb the mean error of rounded weights.

    Rounding a weight matrix W to W' shifts each output channel's mean by (W' - W) E[x]; with
    the input's per-channel means from calibration that shift is subtracted from the bias
    (Nagel et al., 2019, "Data-Free Quantization Through Weight Equalization and Bias
    Correction"). It matters most for depthwise convolutions, whose few weights per channel
    round coarsely. Nodes without a known input mean or a matching weight are left alone.
    """
    corrected = onnx.ModelProto()
    corrected.CopyFrom(model)
    graph = corrected.graph
    constants = {init.name: init for init in graph.initializer}
    taken = set(constants) | {name for node in graph.node for name in (*node.input, *node.output)}
    added: list[onnx.TensorProto] = []
    for node in graph.node:
        if node.name not in dequantized or node.input[0] not in channel_means:
            continue
        if node.input[1] not in constants:
            continue
        weight = numpy_helper.to_array(constants[node.input[1]]).astype(np.float64)
        if weight.shape != dequantized[node.name].shape:
            continue
        mean = np.asarray(channel_means[node.input[0]], dtype=np.float64)
        shift = _bias_shift(node, dequantized[node.name] - weight, mean)
        if shift is None:
            continue
        has_bias = len(node.input) > 2 and node.input[2] != ""
        if has_bias and node.input[2] not in constants:
            continue
        bias = (
            numpy_helper.to_array(constants[node.input[2]]).astype(np.float64)
            if has_bias
            else np.zeros(shift.shape)
        )
        if bias.shape != shift.shape:
            continue
        name = f"{node.input[2] if has_bias else node.name + '.bias'}_corrected"
        while name in taken:
            name += "_"
        taken.add(name)
        added.append(numpy_helper.from_array((bias - shift).astype(np.float32), name))
        if has_bias:
            node.input[2] = name
        else:
            node.input.append(name)
    graph.initializer.extend(added)
    drop_unused_initializers(graph)
    return corrected


def to_int8(
    model: onnx.ModelProto,
    ranges: Ranges,
    *,
    form: Literal["u8s8", "s8s8"],
    exclude_op_types: Collection[str] = (),
    exclude_nodes: Collection[str] = (),
    per_channel: bool = True,
    reduce_range: bool = False,
    keep_first_and_last: bool = False,
    bias_correction: bool = True,
    quantize_outputs: bool = False,
    extra_options: Mapping[str, Any] | None = None,
) -> onnx.ModelProto:
    """An INT8 copy of ``model`` with explicit QuantizeLinear/DequantizeLinear nodes.

    Weights are INT8, symmetric, per output channel unless ``per_channel`` is False.
    Activations use ``ranges`` (every input and output of a quantizable node needs one):
    ``u8s8`` quantizes them to uint8 with a zero point, the fast form on ONNX Runtime's CPU;
    ``s8s8`` to int8 with zero points of exactly 0, what TensorRT requires, with dedicated
    Q/DQ pairs per consumer and float biases as TensorRT's parser expects. Nodes of
    ``exclude_op_types``, named in ``exclude_nodes`` and, with ``keep_first_and_last``, the
    first and last weight nodes (``weight_nodes``) stay in float. ``reduce_range`` quantizes
    weights to 7 bits, which x86 CPUs without VNNI need (``engines.devices.cpu``). With
    ``bias_correction`` and the input means that calibration records, biases absorb the mean
    error of the rounded weights
    (``correct_biases``). Graph outputs are left unquantized unless ``quantize_outputs``.
    ``extra_options`` go to ONNX Runtime's quantizer last, overriding.
    """
    if form not in INT8_FORMS:
        raise ValueError(f"unknown INT8 form {form!r}; choose one of {', '.join(INT8_FORMS)}")
    symmetric = form == "s8s8"
    options: dict[str, Any] = {"WeightSymmetric": True, "ActivationSymmetric": symmetric}
    if symmetric:
        options |= {"DedicatedQDQPair": True, "QuantizeBias": False}
    options |= dict(extra_options or {})

    def quantize(source: onnx.ModelProto) -> onnx.ModelProto:
        return _quantize_qdq(
            source,
            ranges,
            symmetric=symmetric,
            per_channel=per_channel,
            reduce_range=reduce_range,
            exclude_op_types=exclude_op_types,
            exclude_nodes=exclude_nodes,
            options=options,
        )

    missing = [name for name in calibration_tensors(model) if name not in ranges.tensors]
    if missing:
        raise ValueError(
            f"the ranges lack {len(missing)} of the model's activations (such as "
            f"{', '.join(map(repr, missing[:3]))}): were they calibrated on this model?"
        )
    prepared = onnx.shape_inference.infer_shapes(_named(model))
    if keep_first_and_last:
        weighted = weight_nodes(prepared)
        edges = {prepared.graph.node[i].name for i in weighted[:1] + weighted[-1:]}
        exclude_nodes = [*exclude_nodes, *sorted(edges - set(exclude_nodes))]
    quantized = quantize(prepared)
    if bias_correction and ranges.channel_means:
        # The rounded weights are whatever ONNX Runtime's quantizer made of them: read them
        # back, correct the float biases, and quantize again (the weights round the same).
        corrected = correct_biases(prepared, _dequantized_weights(quantized), ranges.channel_means)
        quantized = quantize(corrected)
    if not quantize_outputs:
        _unquantize_outputs(quantized)
    onnx.checker.check_model(quantized)
    return quantized


def _quantize_qdq(
    model: onnx.ModelProto,
    ranges: Ranges,
    *,
    symmetric: bool,
    per_channel: bool,
    reduce_range: bool,
    exclude_op_types: Collection[str],
    exclude_nodes: Collection[str],
    options: dict[str, Any],
) -> onnx.ModelProto:
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData
    from onnxruntime.quantization.qdq_quantizer import QDQQuantizer

    tensors_range = TensorsData(
        CalibrationMethod.MinMax,
        {
            name: TensorData(
                lowest=np.array(low, dtype=np.float32), highest=np.array(high, dtype=np.float32)
            )
            for name, (low, high) in ranges.tensors.items()
        },
    )
    quantizer = QDQQuantizer(
        model,
        per_channel,
        reduce_range,
        QuantType.QInt8,
        QuantType.QInt8 if symmetric else QuantType.QUInt8,
        tensors_range,
        [],
        list(exclude_nodes),
        sorted(QUANTIZABLE_OPS - set(exclude_op_types)),
        dict(options),
    )
    try:
        quantizer.quantize_model()
    except (ValueError, RuntimeError) as error:
        raise ValueError(
            f"INT8 quantization failed (were the ranges calibrated on this model?): {error}"
        ) from error
    quantizer.model.topological_sort()
    quantized: onnx.ModelProto = quantizer.model.model
    return quantized


def calibrate_auto(
    model: onnx.ModelProto,
    data: np.ndarray,
    input_name: str,
    form: Literal["u8s8", "s8s8"],
    *,
    held_out_fraction: float = 0.2,
    methods: Sequence[str] = CALIBRATORS,
    percentile: float = 99.99,
    stride: int = 16,
    bins: int = 2048,
    threads: int = 0,
    progress: Progress | None = None,
    exclude_op_types: Collection[str] = (),
    exclude_nodes: Collection[str] = (),
    per_channel: bool = True,
    reduce_range: bool = False,
    keep_first_and_last: bool = False,
    integer_kernels: bool = True,
) -> tuple[Ranges, dict[str, float]]:
    """Calibrate with each method on the first rows; keep the best on the held-out rest.

    Each method's INT8 variant is scored by the mean KL divergence of its softmax from
    FP32's on the held-out rows (run through this CPU's integer kernels, or with
    ``integer_kernels=False`` as written, in float, as a GPU computes them); the lowest wins
    (ties go to the earlier method). The statistics are collected once for all methods.
    Returns the winner's ranges and every method's KL.
    """
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must be between 0 and 1, got {held_out_fraction}")
    held = max(1, round(len(data) * held_out_fraction))
    if held >= len(data):
        raise ValueError(f"{len(data)} rows are too few to hold {held} out for scoring")
    calibration, scoring = data[:-held], data[-held:]
    needs_histograms = any(method != "minmax" for method in methods)
    stats = collect_statistics(
        model,
        calibration,
        input_name,
        histograms=needs_histograms,
        bins=bins,
        stride=stride,
        threads=threads,
        progress=progress,
    )
    reference = run_onnx(model, scoring, input_name, threads=threads)
    scores: dict[str, float] = {}
    best: Ranges | None = None
    for method in methods:
        ranges = ranges_from_statistics(stats, method, percentile=percentile, bins=bins)
        variant = to_int8(
            model,
            ranges,
            form=form,
            exclude_op_types=exclude_op_types,
            exclude_nodes=exclude_nodes,
            per_channel=per_channel,
            reduce_range=reduce_range,
            keep_first_and_last=keep_first_and_last,
        )
        got = run_onnx(variant, scoring, input_name, threads=threads, optimize=integer_kernels)
        scores[method] = mean_kl(reference, got)
        logger.info("calibrator %s: held-out KL %.5f", method, scores[method])
        if best is None or scores[method] < scores[best.method]:
            best = ranges
    if best is None:
        raise ValueError("no calibrator to try")
    return best, scores
