"""Choosing a backend is a dict lookup; ``auto`` picks the best one this machine can run."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

from engines.backends import onnxruntime
from engines.base import Engine, EngineOptions, Loader
from engines.spec import ModelSpec

log = logging.getLogger(__name__)


def _load_torch(path: Path, spec: ModelSpec, options: EngineOptions) -> Engine:
    # Imported on use: torch takes seconds to import, and only its models should pay that.
    from engines.backends.torch import engine as torch_engine

    return torch_engine.load(path, spec, options)


def _load_tensorrt(path: Path, spec: ModelSpec, options: EngineOptions) -> Engine:
    from engines.backends.tensorrt import engine as tensorrt_engine

    return tensorrt_engine.load(path, spec, options)


LOADERS: dict[str, Loader] = {
    onnxruntime.BACKEND: onnxruntime.load,
    "torch": _load_torch,
    "tensorrt": _load_tensorrt,
}


def cuda_available() -> bool:
    """Whether torch can use a GPU here; answers without importing torch where no NVIDIA
    driver is present."""
    if not os.path.exists("/dev/nvidiactl") or importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def release_device_memory() -> None:
    """Give the GPU memory freed engines left in torch's caching allocator back to the
    driver (what ``nvidia-smi`` and the NVML gauges show), where torch is in use; never
    imports it."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def gpu_image_decode_available() -> bool:
    """Whether JPEGs can be decoded on the GPU here (torchvision's nvJPEG path)."""
    return importlib.util.find_spec("torchvision") is not None and cuda_available()


def tensorrt_available() -> bool:
    """Whether TensorRT can serve here: an NVIDIA driver, a TensorRT that imports (10+, or
    TensorRT for RTX; a stubs-only ``tensorrt`` folder does not count) and a GPU that
    cuda-python sees and that TensorRT runs on (TensorRT for RTX: compute capability 8.0,
    8.6, 8.9, 12.x). ``auto`` says in the log why it passed TensorRT over."""
    if not os.path.exists("/dev/nvidiactl"):
        return False
    from engines.backends.tensorrt import engine as tensorrt_engine
    from engines.backends.tensorrt import runtime as tensorrt_runtime
    from engines.devices import cuda

    if not tensorrt_engine.importable():
        return False
    try:
        if cuda.device_count() == 0:
            return False
        target = tensorrt_runtime.current_target(0)
    except (cuda.CudaUnavailable, tensorrt_runtime.TensorRTUnavailable) as why:
        log.info("backend auto: not tensorrt: %s", why)
        return False
    log.info("backend auto: %s on %s", target.tensorrt_version, target.device_key())
    return True


def _usable(name: str) -> bool:
    if name == "tensorrt":
        return tensorrt_available()
    if importlib.util.find_spec(name) is None:
        return False
    return name != "torch" or cuda_available()


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
        if candidate in LOADERS and _usable(candidate):
            return candidate
    return onnxruntime.BACKEND


def loader(name: str) -> Loader:
    return LOADERS[resolve(name)]
