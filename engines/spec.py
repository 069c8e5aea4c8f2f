"""Tensor and model contracts, declared once.

Request validation, model metadata, optimization profiles and test inputs are all derived
from these frozen dataclasses. Shapes exclude the batch dimension (Triton's convention when
``max_batch_size > 0``); ``-1`` marks a dynamic dimension.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

import ml_dtypes
import numpy as np
from pydantic import ConfigDict

# V2 / Open Inference Protocol datatypes and their numpy equivalents. BYTES travels as an
# object array of ``bytes``; BF16 uses ml_dtypes, which onnx already depends on.
V2_TO_NUMPY: dict[str, np.dtype[np.generic]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "BYTES": np.dtype(np.object_),
}
NUMPY_TO_V2: dict[np.dtype[np.generic], str] = {v: k for k, v in V2_TO_NUMPY.items()}
NUMPY_TO_V2[np.dtype(np.bytes_)] = "BYTES"

# ONNX's TensorProto.DataType numbers (fixed by the ONNX spec), written out so that a front
# end that decodes requests with a spec never imports onnx (tests/unit/engines/test_spec.py
# checks them against onnx itself).
ONNX_TO_V2: dict[int, str] = {
    9: "BOOL",
    2: "UINT8",
    4: "UINT16",
    12: "UINT32",
    13: "UINT64",
    3: "INT8",
    5: "INT16",
    6: "INT32",
    7: "INT64",
    10: "FP16",
    1: "FP32",
    11: "FP64",
    16: "BF16",
    8: "BYTES",
}


def numpy_dtype(datatype: str) -> np.dtype[np.generic]:
    """The numpy dtype of a V2 datatype; raises KeyError for an unknown name."""
    return V2_TO_NUMPY[datatype]


def v2_datatype(dtype: np.dtype[np.generic]) -> str:
    """The V2 datatype of a numpy dtype (unicode and bytes strings map to BYTES)."""
    if dtype.kind in ("U", "S", "O"):
        return "BYTES"
    return NUMPY_TO_V2[dtype]


@dataclass(frozen=True)
class TensorSpec:
    """One input or output: name, V2 datatype and the shape of one row (no batch dim).

    Also what a model config's ``inputs:`` and ``outputs:`` list (pydantic validates it as
    it is, ``__post_init__`` included).
    """

    __pydantic_config__ = ConfigDict(extra="forbid")

    name: str
    datatype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.datatype not in V2_TO_NUMPY:
            raise ValueError(f"tensor {self.name!r}: unknown datatype {self.datatype!r}")
        if any(d < -1 or d == 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: dimensions must be positive or -1")

    @property
    def dtype(self) -> np.dtype[np.generic]:
        return V2_TO_NUMPY[self.datatype]

    @property
    def is_static(self) -> bool:
        return -1 not in self.shape

    def matches(self, shape: tuple[int, ...]) -> bool:
        """Whether a concrete row shape fits this spec (dynamic dims match anything)."""
        return len(shape) == len(self.shape) and all(
            want in (-1, got) for want, got in zip(self.shape, shape, strict=True)
        )

    def row_bytes(self) -> int:
        """Bytes of one row; only defined for static, fixed-size tensors."""
        if not self.is_static or self.datatype == "BYTES":
            raise ValueError(f"tensor {self.name!r} has no fixed row size")
        return prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class ModelSpec:
    """The tensor contract of a model. ``max_batch_size == 0`` means no batch dimension."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int = 0
    _by_name: dict[str, TensorSpec] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        for tensor in (*self.inputs, *self.outputs):
            self._by_name[tensor.name] = tensor

    @property
    def batched(self) -> bool:
        return self.max_batch_size > 0

    def input(self, name: str) -> TensorSpec | None:
        spec = self._by_name.get(name)
        return spec if spec in self.inputs else None

    def output(self, name: str) -> TensorSpec | None:
        spec = self._by_name.get(name)
        return spec if spec in self.outputs else None

    def full_shape(self, tensor: TensorSpec) -> list[int]:
        """The shape as clients see it in metadata: a leading -1 when batched."""
        return [-1, *tensor.shape] if self.batched else list(tensor.shape)

    def metadata(self, versions: list[str], platform: str) -> dict[str, object]:
        """The V2 model-metadata response."""

        def tensors(specs: tuple[TensorSpec, ...]) -> list[dict[str, object]]:
            return [
                {"name": t.name, "datatype": t.datatype, "shape": self.full_shape(t)} for t in specs
            ]

        return {
            "name": self.name,
            "versions": versions,
            "platform": platform,
            "inputs": tensors(self.inputs),
            "outputs": tensors(self.outputs),
        }
