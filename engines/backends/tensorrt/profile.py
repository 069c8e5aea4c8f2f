"""The optimization profile of a TensorRT plan, from the model's spec and ONNX file.

One profile covers the inputs: the batch dimension from the batching config (min 1, opt the
largest preferred size, max the max batch size), every other dimension fixed at the ONNX
file's value or, where the file leaves it dynamic, the model config's. Plain Python: no
TensorRT needed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import onnx

from engines.backends.tensorrt.runtime import (
    Shape,
)
from engines.spec import ModelSpec

if TYPE_CHECKING:
    pass


ProfileShapes = dict[str, tuple[Shape, Shape, Shape]]


def batch_profile(spec: ModelSpec, profile: Sequence[int] = ()) -> tuple[int, int, int]:
    """(min, opt, max) rows: the batching config's, else 1 to the max batch size.

    The max must be the model's max batch size: the batcher sends batches that large and
    the runners' buffers are sized for them.
    """
    if not spec.batched:
        return (1, 1, 1)
    maximum = spec.max_batch_size
    if not profile:
        return (1, maximum, maximum)
    if len(profile) != 3:
        raise ValueError(f"{spec.name}: a batch profile is (min, opt, max), got {list(profile)}")
    low, opt, high = (int(v) for v in profile)
    if not 1 <= low <= opt <= high:
        raise ValueError(f"{spec.name}: batch profile {list(profile)} needs 1 <= min <= opt <= max")
    if high != maximum:
        raise ValueError(
            f"{spec.name}: batch profile max {high} is not the max batch size {maximum}"
        )
    return low, opt, high


def profile_shapes(
    spec: ModelSpec, rows: tuple[int, int, int], network_inputs: Mapping[str, Shape]
) -> ProfileShapes:
    """The optimization profile: (min, opt, max) full shapes of every dynamic input.

    ``network_inputs`` are the ONNX inputs' shapes (-1 where the file leaves a dimension
    dynamic). The batch dimension spans ``rows``; every other dimension is the file's, or
    the spec's (the model config's declaration) where the file leaves it dynamic. A fully
    static input needs no entry. Anything that cannot make a valid profile is refused with
    the input and dimension named.
    """
    problems: list[str] = []
    missing = [t.name for t in spec.inputs if t.name not in network_inputs]
    if missing:
        problems.append(f"inputs {missing} are not in the ONNX file")
    undeclared = sorted(set(network_inputs) - {t.name for t in spec.inputs})
    if undeclared:
        problems.append(f"the ONNX file's inputs {undeclared} are not in the model's contract")
    shapes: ProfileShapes = {}
    for tensor in spec.inputs:
        if tensor.name not in network_inputs:
            continue
        dims = tuple(network_inputs[tensor.name])
        rank = len(tensor.shape) + (1 if spec.batched else 0)
        if len(dims) != rank:
            problems.append(
                f"input {tensor.name!r} has {len(dims)} dimensions in the ONNX file, "
                f"{rank} in the model's contract"
            )
            continue
        batch, rest = (dims[0], dims[1:]) if spec.batched else (None, dims)
        offset = 1 if spec.batched else 0
        row: list[int] = []
        for axis, (have, want) in enumerate(zip(rest, tensor.shape, strict=True), offset):
            if have == -1 and want == -1:
                problems.append(
                    f"input {tensor.name!r} dimension {axis} is dynamic in the ONNX file and "
                    "in the config: declare it (inputs: shape of one row) so the profile can "
                    "fix it"
                )
            elif -1 not in (have, want) and have != want:
                problems.append(
                    f"input {tensor.name!r} dimension {axis} is {have} in the ONNX file "
                    f"but {want} in the config"
                )
            row.append(want if have == -1 else have)
        if batch is not None and batch != -1 and (rows[0] != batch or rows[2] != batch):
            problems.append(
                f"input {tensor.name!r} has a fixed batch dimension of {batch} in the ONNX "
                f"file; export it with a dynamic first dimension to batch {rows[0]} to "
                f"{rows[2]} rows"
            )
        if -1 not in dims:
            continue
        if batch is None:
            shapes[tensor.name] = (tuple(row), tuple(row), tuple(row))
        else:
            low, opt, high = rows
            shapes[tensor.name] = ((low, *row), (opt, *row), (high, *row))
    if problems:
        raise ValueError(f"{spec.name}: no TensorRT profile: {'; '.join(problems)}")
    return shapes


def read_onnx(path: Path) -> tuple[dict[str, Shape], str]:
    """The ONNX file's input shapes (-1 where dynamic) and the precision its graph is in."""
    graph = onnx.load(str(path), load_external_data=False).graph
    initializers = {init.name for init in graph.initializer}
    inputs = {
        value.name: tuple(
            d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1
            for d in value.type.tensor_type.shape.dim
        )
        for value in graph.input
        if value.name not in initializers
    }
    ops = {node.op_type for node in graph.node}
    if ops & {"QuantizeLinear", "DequantizeLinear"}:
        precision = "int8"
    elif any(init.data_type == onnx.TensorProto.FLOAT16 for init in graph.initializer):
        precision = "fp16"
    else:
        precision = "fp32"
    return inputs, precision
