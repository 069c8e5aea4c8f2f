"""Precision variants: ONNX graphs derived from the FP32 source, one per precision.

A precision is a property of the graph, not of a builder flag (TensorRT 10.12 deprecated
and TensorRT 11 removed those): an FP16 graph, or an INT8 graph with explicit
QuantizeLinear/DequantizeLinear nodes, compiled strongly typed. ONNX Runtime runs the same
graphs on the CPU, so every variant is testable without a GPU.

- ``to_fp16``: float16 everywhere except numerically sensitive or type-fixed ops, which run in
  FP32 between Casts; the graph's inputs and outputs keep their FP32 types.
- ``to_int8``: Q/DQ with per-channel symmetric INT8 weights; activations as uint8 with a zero
  point (``u8s8``, what ONNX Runtime's CPU kernels are fastest at) or as symmetric int8 with
  zero points of exactly 0 (``s8s8``, what TensorRT requires). Activation ranges come from
  ``engines.calibration``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

if TYPE_CHECKING:
    from engines.calibration import Ranges

_Message = TypeVar("_Message", onnx.NodeProto, onnx.TensorProto)
FLOAT16_MAX = float(np.finfo(np.float16).max)

DEFAULT_FP32_OPS: frozenset[str] = frozenset(
    {
        # Exponentials, normalisations and sums over many terms lose most in float16.
        "Softmax",
        "LogSoftmax",
        "LayerNormalization",
        "GroupNormalization",
        "InstanceNormalization",
        "ReduceMean",
        "ReduceSum",
        "ReduceSumSquare",
        "ReduceMax",
        "ReduceMin",
        "ReduceProd",
        "ReduceL1",
        "ReduceL2",
        "ReduceLogSum",
        "ReduceLogSumExp",
        "CumSum",
        # Inputs that must stay float32 (Resize's and Upsample's scales, QDQ scales before
        # opset 19) or outputs whose type an attribute fixes (random ops, EyeLike).
        "Resize",
        "Upsample",
        "Range",
        "RoiAlign",
        "NonMaxSuppression",
        "TopK",
        "QuantizeLinear",
        "DequantizeLinear",
        "DynamicQuantizeLinear",
        "EyeLike",
        "RandomNormal",
        "RandomNormalLike",
        "RandomUniform",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
    }
)
# Left exactly as they are whatever the configuration: they take any input type and their
# outputs' types do not follow their inputs'.
_TYPE_AGNOSTIC = frozenset({"Cast", "Shape", "Size", "ConstantOfShape"})
WEIGHT_OPS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
INT8_FORMS = ("u8s8", "s8s8")


def _float16(array: np.ndarray) -> np.ndarray:
    """Float16 values of a float32 array, clamped to the finite float16 range."""
    result: np.ndarray = np.clip(array, -FLOAT16_MAX, FLOAT16_MAX).astype(np.float16)
    return result


def _copy(message: _Message) -> _Message:
    copied = type(message)()
    copied.CopyFrom(message)
    return copied


def _has_subgraph(node: onnx.NodeProto) -> bool:
    return any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute
    )


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """The element type of every tensor of the graph that shape inference can type."""
    graph = onnx.shape_inference.infer_shapes(model).graph
    types = {
        v.name: v.type.tensor_type.elem_type
        for v in (*graph.value_info, *graph.input, *graph.output)
        if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type
    }
    types.update({init.name: init.data_type for init in graph.initializer})
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute:
            value = helper.get_attribute_value(node.attribute[0])
            if isinstance(value, onnx.TensorProto):
                types[node.output[0]] = value.data_type
    return types


def _constant_value(node: onnx.NodeProto) -> np.ndarray | None:
    """The float32 array of a Constant node, or None if it holds something else."""
    attribute = node.attribute[0] if node.attribute else None
    if attribute is None:
        return None
    if attribute.name == "value" and attribute.t.data_type == TensorProto.FLOAT:
        return numpy_helper.to_array(attribute.t)
    if attribute.name == "value_float":
        return np.array(attribute.f, dtype=np.float32)
    if attribute.name == "value_floats":
        return np.array(list(attribute.floats), dtype=np.float32)
    return None


@dataclass
class _Fp16Rewrite:
    """The state of one float16 conversion: names taken, casts made, tensors' new types."""

    taken: set[str]
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    casts: dict[tuple[str, int], str] = field(default_factory=dict)
    current: dict[str, int] = field(default_factory=dict)

    def fresh(self, base: str) -> str:
        name, n = base, 1
        while name in self.taken:
            name, n = f"{base}_{n}", n + 1
        self.taken.add(name)
        return name

    def cast(self, tensor: str, to: int) -> str:
        """``tensor`` as type ``to``, through one Cast shared by every consumer."""
        key = (tensor, to)
        if key not in self.casts:
            suffix = "fp16" if to == TensorProto.FLOAT16 else "fp32"
            output = self.fresh(f"{tensor}_{suffix}")
            name = self.fresh(f"{tensor}/cast_{suffix}")
            self.nodes.append(helper.make_node("Cast", [tensor], [output], name=name, to=to))
            self.current[output] = to
            self.casts[key] = output
        return self.casts[key]


def weight_nodes(model: onnx.ModelProto) -> list[int]:
    """Indices of the Conv/ConvTranspose/Gemm/MatMul nodes with a constant input, in order."""
    graph = model.graph
    constants = {init.name for init in graph.initializer}
    constants |= {n.output[0] for n in graph.node if n.op_type == "Constant"}
    return [
        index
        for index, node in enumerate(graph.node)
        if node.op_type in WEIGHT_OPS and any(name in constants for name in node.input)
    ]


def to_fp16(
    model: onnx.ModelProto,
    *,
    keep_fp32_ops: Collection[str] = DEFAULT_FP32_OPS,
    keep_fp32_nodes: Collection[str] = (),
    keep_first_and_last: bool = False,
) -> onnx.ModelProto:
    """A float16 copy of ``model``; the graph's inputs and outputs keep their FP32 types.

    Nodes of ``keep_fp32_ops`` types, nodes named in ``keep_fp32_nodes`` and, with
    ``keep_first_and_last``, the first and last weight-bearing nodes (``weight_nodes``) run in
    FP32 with Casts around them; every other node that handles float tensors runs in float16.
    Float initializers and Constant nodes are converted (clamped to float16's finite range)
    where float16 nodes consume them, and kept in FP32 where FP32 nodes do (both, if both do).

    ONNX Runtime's CPU provider has few float16 kernels on x86 and inserts Casts of its own
    around the rest, so this variant runs there but is not faster there; it is meant for GPUs.
    """
    if any(_has_subgraph(node) for node in model.graph.node):
        raise ValueError("to_fp16 does not convert models with control flow (If, Loop, Scan)")
    source = onnx.ModelProto()
    source.CopyFrom(model)
    graph = source.graph
    types = _elem_types(source)

    kept_names = set(keep_fp32_nodes)
    kept_indices: set[int] = set()
    if keep_first_and_last:
        weighted = weight_nodes(source)
        kept_indices = set(weighted[:1] + weighted[-1:])
    nodes = list(graph.node)

    def runs_fp16(index: int, node: onnx.NodeProto) -> bool:
        if node.domain not in ("", "ai.onnx") or node.op_type in _TYPE_AGNOSTIC:
            return False
        if node.op_type in keep_fp32_ops or node.name in kept_names or index in kept_indices:
            return False
        tensors = [name for name in (*node.input, *node.output) if name]
        if any(name not in types for name in node.output if name):
            return False
        return any(types[name] == TensorProto.FLOAT for name in tensors if name in types)

    fp16 = [node.op_type != "Constant" and runs_fp16(i, node) for i, node in enumerate(nodes)]
    graph_inputs = {value.name for value in graph.input}
    graph_outputs = {value.name for value in graph.output}

    # Who consumes each float constant decides whether it is converted, kept, or both.
    consumers: dict[str, set[bool]] = {}
    for index, node in enumerate(nodes):
        for name in node.input:
            consumers.setdefault(name, set()).add(fp16[index])
    for name in graph_outputs:
        consumers.setdefault(name, set()).add(False)

    rewrite = _Fp16Rewrite(
        taken={n.name for n in graph.node}
        | {name for n in graph.node for name in (*n.input, *n.output)}
        | {init.name for init in graph.initializer}
        | graph_inputs
    )
    rewrite.current = dict(types)
    fp16_constant: dict[str, str] = {}

    initializers: list[onnx.TensorProto] = []
    for init in graph.initializer:
        uses = consumers.get(init.name, set())
        if init.data_type != TensorProto.FLOAT or True not in uses or init.name in graph_inputs:
            initializers.append(init)
            continue
        half = _float16(numpy_helper.to_array(init))
        if False in uses:
            initializers.append(init)
            fp16_constant[init.name] = rewrite.fresh(f"{init.name}_fp16")
        else:
            fp16_constant[init.name] = init.name
        initializers.append(numpy_helper.from_array(half, fp16_constant[init.name]))

    renamed: dict[str, str] = {}
    for index, node in enumerate(nodes):
        if node.op_type == "Constant":
            value = _constant_value(node)
            uses = consumers.get(node.output[0], set())
            if value is None or True not in uses:
                rewrite.nodes.append(node)
                continue
            output = node.output[0]
            if False in uses:
                rewrite.nodes.append(node)
                fp16_constant[output] = rewrite.fresh(f"{output}_fp16")
            else:
                fp16_constant[output] = output
            tensor = numpy_helper.from_array(_float16(value), fp16_constant[output])
            rewrite.nodes.append(
                helper.make_node(
                    "Constant",
                    [],
                    [fp16_constant[output]],
                    name=rewrite.fresh(f"{output}/fp16"),
                    value=tensor,
                )
            )
            continue

        in_fp16 = fp16[index]
        inputs = []
        for name in node.input:
            source_name = renamed.get(name, name)
            if not name or types.get(name) != TensorProto.FLOAT:
                inputs.append(source_name)
            elif in_fp16 and name in fp16_constant:
                inputs.append(fp16_constant[name])
            elif node.op_type in _TYPE_AGNOSTIC:
                inputs.append(source_name)
            else:
                want = TensorProto.FLOAT16 if in_fp16 else TensorProto.FLOAT
                have = rewrite.current.get(source_name, TensorProto.FLOAT)
                inputs.append(source_name if have == want else rewrite.cast(source_name, want))
        del node.input[:]
        node.input.extend(inputs)
        if in_fp16:
            for position, name in enumerate(node.output):
                if types.get(name) != TensorProto.FLOAT:
                    continue
                if name in graph_outputs:
                    renamed[name] = rewrite.fresh(f"{name}_fp16")
                    node.output[position] = renamed[name]
                rewrite.current[node.output[position]] = TensorProto.FLOAT16
        rewrite.nodes.append(node)

    for name in graph_outputs:
        if name in renamed:
            rewrite.nodes.append(
                helper.make_node(
                    "Cast",
                    [renamed[name]],
                    [name],
                    name=rewrite.fresh(f"{name}/cast_fp32"),
                    to=TensorProto.FLOAT,
                )
            )

    # Copies: the messages still belong to the lists about to be cleared.
    new_nodes = [_copy(node) for node in rewrite.nodes]
    new_initializers = [_copy(init) for init in initializers]
    del graph.node[:]
    graph.node.extend(new_nodes)
    del graph.initializer[:]
    graph.initializer.extend(new_initializers)
    for value in graph.value_info:
        if rewrite.current.get(value.name) == TensorProto.FLOAT16:
            value.type.tensor_type.elem_type = TensorProto.FLOAT16
    _drop_unused_initializers(graph)
    onnx.checker.check_model(source)
    return source


def _drop_unused_initializers(graph: onnx.GraphProto) -> None:
    used = {name for node in graph.node for name in node.input}
    used |= {value.name for value in graph.output}
    kept = [_copy(init) for init in graph.initializer if init.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)


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
    kept = [_copy(node) for node in nodes if id(node) not in gone]
    del graph.node[:]
    graph.node.extend(kept)
    _drop_unused_initializers(graph)


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
    _drop_unused_initializers(graph)
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
    weights to 7 bits, which x86 CPUs without VNNI need (``engines.cpu``). With
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

    from engines.calibration import calibration_tensors

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

    from engines.calibration import QUANTIZABLE_OPS

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
