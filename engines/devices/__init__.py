"""The hardware under the engines: the CPU's integer kernels, CUDA streams and buffers, NVML
gauges; the host's shared memory (``SHM_ROOT``)."""

from pathlib import Path

SHM_ROOT = Path("/dev/shm")
"""Where POSIX shared memory lives (Linux): front ends' arenas, clients' regions, decode
processes' buffers."""
