"""Small real ONNX graphs and helpers the precision tests share."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

CLASSES = 10


CHANNELS = 8


def small_conv_model(seed: int = 0) -> onnx.ModelProto:
    """Conv+Relu, a Constant scale, GlobalAveragePool, Gemm and Softmax: a tiny classifier."""
    rng = np.random.default_rng(seed)
    weights = {
        "conv.weight": rng.standard_normal((CHANNELS, 3, 3, 3)).astype(np.float32) * 0.3,
        "conv.bias": rng.standard_normal(CHANNELS).astype(np.float32) * 0.1,
        "fc.weight": rng.standard_normal((CLASSES, CHANNELS)).astype(np.float32),
        "fc.bias": rng.standard_normal(CLASSES).astype(np.float32) * 0.1,
    }
    nodes = [
        helper.make_node(
            "Conv", ["input", "conv.weight", "conv.bias"], ["conv"], name="conv", pads=[1] * 4
        ),
        helper.make_node("Relu", ["conv"], ["relu"], name="relu"),
        helper.make_node(
            "Constant",
            [],
            ["two"],
            name="two",
            value=numpy_helper.from_array(np.array(2.0, dtype=np.float32)),
        ),
        helper.make_node("Mul", ["relu", "two"], ["scaled"], name="scale"),
        helper.make_node("GlobalAveragePool", ["scaled"], ["pool"], name="pool"),
        helper.make_node("Flatten", ["pool"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "fc.weight", "fc.bias"], ["logits"], name="fc", transB=1),
        helper.make_node("Softmax", ["logits"], ["probabilities"], name="softmax", axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "small_conv",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 16, 16])],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES]),
            helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", CLASSES]),
        ],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def small_inputs(rows: int = 24, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (rows, 3, 16, 16)).astype(np.float32)


def run(
    model: onnx.ModelProto, feeds: dict[str, np.ndarray], optimize: bool = True
) -> list[np.ndarray]:
    """Every output; ``optimize=False`` runs Q/DQ nodes as written, in float."""
    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        model.SerializeToString(), sess_options=options, providers=["CPUExecutionProvider"]
    )
    return [np.asarray(v) for v in session.run(None, feeds)]


def types_of(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor, from strict shape inference of the whole graph."""
    graph = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph
    types = {v.name: v.type.tensor_type.elem_type for v in (*graph.value_info, *graph.output)}
    types |= {v.name: v.type.tensor_type.elem_type for v in graph.input}
    types |= {init.name: init.data_type for init in graph.initializer}
    return types


def node(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    found: onnx.NodeProto = next(n for n in model.graph.node if n.name == name)
    return found


def io_types(model: onnx.ModelProto) -> list[int]:
    return [v.type.tensor_type.elem_type for v in (*model.graph.input, *model.graph.output)]
