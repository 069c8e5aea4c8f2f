"""Choosing a backend is a dict lookup; ``auto`` picks the best one this machine can run."""

from __future__ import annotations

import importlib.util

from engines import onnxruntime
from engines.base import Loader

LOADERS: dict[str, Loader] = {
    onnxruntime.BACKEND: onnxruntime.load,
}


def available() -> list[str]:
    return sorted(LOADERS)


def resolve(name: str) -> str:
    """The concrete backend for a configured name: ``auto`` prefers TensorRT, then torch on
    CUDA, then ONNX Runtime; a backend whose module this install lacks falls through."""
    if name != "auto":
        if name not in LOADERS:
            raise ValueError(f"unknown backend {name!r}; available: {', '.join(available())}")
        return name
    for candidate in ("tensorrt", "torch"):
        if candidate in LOADERS and importlib.util.find_spec(candidate) is not None:
            return candidate
    return onnxruntime.BACKEND


def loader(name: str) -> Loader:
    return LOADERS[resolve(name)]
