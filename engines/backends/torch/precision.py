"""The torch backend's precisions, and the switches and dtypes that make them.

- ``fp32``: IEEE float32 (TF32 off for convolutions and matmuls);
- ``tf32``: float32 tensors, TF32 tensor-core math;
- ``fp16`` / ``bf16``: torch-native casting of the FP32 graph's weights and input, outputs
  cast back to the output's declared type. (The ONNX ``fp16`` variant, with its FP32 islands,
  also loads: it is converted as it is, Casts included.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import onnx
import torch
from onnx import TensorProto

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")


def compute_dtype(precision: str) -> torch.dtype | None:
    """The dtype weights and activations are cast to; None keeps the graph's own."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)


def graph_precision(path: Path) -> str:
    """``fp16-variant`` for a float16 variant (float16 initializers), else ``fp32``."""
    graph = onnx.load(str(path), load_external_data=False).graph
    halves = sum(1 for init in graph.initializer if init.data_type == TensorProto.FLOAT16)
    return "fp16-variant" if halves else "fp32"


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """TF32 math on or off for what runs (or is captured) inside."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn
