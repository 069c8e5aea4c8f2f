"""ONNX graph helpers that the precision variants share: copying messages, finding the
weight layers, dropping initializers nothing reads.
"""

from __future__ import annotations

from typing import TypeVar

import onnx

_Message = TypeVar("_Message", onnx.NodeProto, onnx.TensorProto)


WEIGHT_OPS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})


def copy_message(message: _Message) -> _Message:
    copied = type(message)()
    copied.CopyFrom(message)
    return copied


def has_subgraph(node: onnx.NodeProto) -> bool:
    return any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute
    )


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


def drop_unused_initializers(graph: onnx.GraphProto) -> None:
    used = {name for node in graph.node for name in node.input}
    used |= {value.name for value in graph.output}
    kept = [copy_message(init) for init in graph.initializer if init.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
