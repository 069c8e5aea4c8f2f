"""GPU utilization, memory and power per GPU, read through NVML (``nvidia-ml-py``).

Read when asked (at scrape time), so a value is never older than the scrape; NVML's own
utilization is already an average over its last sample period (1/6 s to 1 s by GPU). Where
there is no NVIDIA driver or no ``nvidia-ml-py``, there are no GPUs to report: ``sample``
returns an empty list and never raises.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuSample:
    index: int
    name: str
    utilization: float
    """Fraction of the last sample period in which a kernel was running (0 to 1)."""
    memory_used_bytes: int
    memory_total_bytes: int
    power_watts: float
    uuid: str = ""
    """NVML's UUID of the GPU (``GPU-...``): Triton labels its GPU gauges by it."""


class Nvml:
    """A lazily initialised NVML session; ``sample()`` is safe to call from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nvml: Any = None
        self._handles: list[Any] | None = None

    def _open(self) -> list[Any]:
        if self._handles is not None:
            return self._handles
        self._handles = []
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._nvml = pynvml
        except Exception as exc:  # no library, no driver, no GPU: nothing to report
            log.debug("NVML unavailable: %s", exc)
        return self._handles

    def sample(self) -> list[GpuSample]:
        with self._lock:
            handles = self._open()
            nvml = self._nvml
            samples = []
            for index, handle in enumerate(handles):
                try:
                    name = nvml.nvmlDeviceGetName(handle)
                    utilization = nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
                    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                    power = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0  # milliwatts
                    uuid = nvml.nvmlDeviceGetUUID(handle)
                except Exception as exc:  # one GPU's failure must not hide the others
                    log.warning("NVML: GPU %d could not be read: %s", index, exc)
                    continue
                samples.append(
                    GpuSample(
                        index=index,
                        name=name.decode() if isinstance(name, bytes) else str(name),
                        utilization=float(utilization),
                        memory_used_bytes=int(memory.used),
                        memory_total_bytes=int(memory.total),
                        power_watts=float(power),
                        uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                    )
                )
            return samples


_SESSION = Nvml()


def sample() -> list[GpuSample]:
    """Every GPU this process can see through NVML; empty without one."""
    return _SESSION.sample()
