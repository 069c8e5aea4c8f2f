"""The ONNX element types the spec names by number are onnx's own."""

from __future__ import annotations

from onnx import TensorProto

from engines.spec import ONNX_TO_V2


def test_the_onnx_type_numbers_are_onnxs() -> None:
    expected = {
        TensorProto.BOOL: "BOOL",
        TensorProto.UINT8: "UINT8",
        TensorProto.UINT16: "UINT16",
        TensorProto.UINT32: "UINT32",
        TensorProto.UINT64: "UINT64",
        TensorProto.INT8: "INT8",
        TensorProto.INT16: "INT16",
        TensorProto.INT32: "INT32",
        TensorProto.INT64: "INT64",
        TensorProto.FLOAT16: "FP16",
        TensorProto.FLOAT: "FP32",
        TensorProto.DOUBLE: "FP64",
        TensorProto.BFLOAT16: "BF16",
        TensorProto.STRING: "BYTES",
    }
    assert expected == ONNX_TO_V2
