"""The FP16 variant: float16 everywhere except numerically sensitive or type-fixed ops, which
run in FP32 between Casts; the graph's inputs and outputs keep their FP32 types.

A precision is a property of the graph, not of a builder flag (TensorRT 10.12 deprecated
and TensorRT 11 removed those), so ONNX Runtime runs the same graph on the CPU and every
variant is testable without a GPU.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from engines.precision.graph import (
    copy_message,
    drop_unused_initializers,
    has_subgraph,
    weight_nodes,
)

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


def _float16(array: np.ndarray) -> np.ndarray:
    """Float16 values of a float32 array, clamped to the finite float16 range."""
    result: np.ndarray = np.clip(array, -FLOAT16_MAX, FLOAT16_MAX).astype(np.float16)
    return result


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
    if any(has_subgraph(node) for node in model.graph.node):
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
    new_nodes = [copy_message(node) for node in rewrite.nodes]
    new_initializers = [copy_message(init) for init in initializers]
    del graph.node[:]
    graph.node.extend(new_nodes)
    del graph.initializer[:]
    graph.initializer.extend(new_initializers)
    for info in graph.value_info:
        if rewrite.current.get(info.name) == TensorProto.FLOAT16:
            info.type.tensor_type.elem_type = TensorProto.FLOAT16
    drop_unused_initializers(graph)
    onnx.checker.check_model(source)
    return source
