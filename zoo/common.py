"""What every bundled model shares: the tensor contract, the ONNX version pins, the write."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

IMAGE_SIZE = 224
NUM_CLASSES = 1000


@dataclass
class GraphBuilder:
    """Nodes and initializers being assembled into a graph."""

    nodes: list[onnx.NodeProto] = field(default_factory=list, kw_only=True)
    initializers: list[onnx.TensorProto] = field(default_factory=list, kw_only=True)

    def constant(self, name: str, value: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(value, name))
        return name

    def node(self, op: str, inputs: list[str], out: str, **attrs: Any) -> str:
        """One node named after its single output; returns that output."""
        self.nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out


def classifier(
    name: str, nodes: list[onnx.NodeProto], initializers: list[onnx.TensorProto], doc: str
) -> onnx.ModelProto:
    """``input`` FP32 [batch, 3, 224, 224] to ``logits`` FP32 [batch, 1000], checked."""
    graph = helper.make_graph(
        nodes,
        name,
        [
            helper.make_tensor_value_info(
                "input", TensorProto.FLOAT, ["batch", 3, IMAGE_SIZE, IMAGE_SIZE]
            )
        ],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", NUM_CLASSES])],
        initializers,
    )
    # IR 8 is the version opset 17 came with; pinning it keeps the file loadable by runtimes
    # older than this onnx package (onnxruntime refuses an IR version it does not know).
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17)],
        ir_version=8,
        producer_name="stoker.zoo",
        doc_string=doc,
    )
    onnx.checker.check_model(model, full_check=True)
    return model


def save(model: onnx.ModelProto, model_dir: Path) -> None:
    """Write ``model_dir/model.onnx`` atomically: the server generates models whose file is
    missing, so an interrupted run must not leave a truncated file that looks finished."""
    model_dir.mkdir(parents=True, exist_ok=True)
    partial = model_dir / "model.onnx.partial"
    onnx.save(model, partial)
    os.replace(partial, model_dir / "model.onnx")
