"""NVML readings and the GPU gauges on /metrics."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

pytest.importorskip("pynvml", reason="nvidia-ml-py (pynvml) is not installed")

from app import metrics  # registers the GPU collector
from engines.devices import nvml


def test_every_gpu_is_sampled() -> None:
    samples = nvml.sample()
    assert samples, "NVML sees no GPU on a CUDA machine"
    for gpu in samples:
        assert 0.0 <= gpu.utilization <= 1.0
        assert 0 < gpu.memory_used_bytes <= gpu.memory_total_bytes
        assert gpu.power_watts > 0


def test_gauges_are_exported_per_gpu() -> None:
    text = generate_latest().decode()
    for name in metrics.GPU_METRICS:
        assert f'{name}{{gpu="0"}}' in text, name
