"""The ResNet-50-shaped model terms the cost scripts (``codec_cost.py``, ``json_cost.py``)
measure against: one FP32 [3,224,224] input, one FP32 [1000] output. The classes come from
the caller, which may have imported them from another tree (``json_cost.py --against``)."""

from __future__ import annotations

from typing import Any


def image_spec(model_spec: Any, tensor_spec: Any, name: str, max_batch_size: int) -> Any:
    """``model_spec(name, ...)`` of the image shape, built with the caller's classes."""
    return model_spec(
        name,
        (tensor_spec("input", "FP32", (3, 224, 224)),),
        (tensor_spec("output", "FP32", (1000,)),),
        max_batch_size=max_batch_size,
    )
