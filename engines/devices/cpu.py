"""Which integer kernels ONNX Runtime runs on this CPU, and the INT8 recipe that is right there.

ONNX Runtime's U8S8 kernels on x86 without VNNI (AVX2 and AVX-512 machines before Cascade
Lake, AMD Zen 2/3) multiply with ``vpmaddubsw``, which adds two uint8 x int8 products into
an int16 that saturates: 2 x 255 x 127 does not fit. On those CPUs the weights are quantized
to 7 bits (``reduce_range``: |w| <= 64, so a pair stays within 2 x 255 x 64 = 32,640) and
the first and last weight layers stay in float, as ONNX Runtime's quantization guide
advises. VNNI (``vpdpbusd``, AVX-512 VNNI or AVX-VNNI) accumulates in int32 and Arm's
kernels widen before they add, so those keep full 8-bit weights.

The features are read with CPUID (numpy's dispatcher), not from ``/proc/cpuinfo``, so an
emulated CPU (``qemu-x86_64 -cpu Haswell``) reports what ONNX Runtime will dispatch on. The
one exception is AVX-VNNI, which numpy does not report: it is read from the kernel's flags,
so under emulation on a host that has it (Alder Lake, Sapphire Rapids, Zen 5) the host's
answer wins.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path


@dataclass(frozen=True)
class IntegerKernels:
    """The class of integer GEMM kernels a CPU gets, as far as INT8 results and speed go."""

    name: str
    """``x86_64-avx512vnni``, ``x86_64-avxvnni``, ``x86_64-avx512``, ``x86_64-avx2``,
    ``x86_64-sse``, ``aarch64-dotprod``, ``aarch64`` or ``<machine>``: part of the engine
    store's key, so a store moved to another CPU rebuilds what it must."""
    saturates: bool
    """U8S8 products saturate in int16 with full 8-bit weights (x86 without VNNI)."""


def kernels_of(
    machine: str, features: Mapping[str, bool], cpuinfo_flags: frozenset[str]
) -> IntegerKernels:
    """The kernel class of a CPU from its architecture and feature flags.

    ``features`` are numpy's CPUID names (``AVX2``, ``AVX512BW``, ``AVX512VNNI``,
    ``ASIMDDP``); ``cpuinfo_flags`` the kernel's flags, read only for AVX-VNNI, which numpy
    does not report.
    """
    arch = machine.lower()
    if arch in ("x86_64", "amd64"):
        if features.get("AVX512VNNI"):
            return IntegerKernels("x86_64-avx512vnni", saturates=False)
        if "avx_vnni" in cpuinfo_flags and features.get("AVX2"):
            return IntegerKernels("x86_64-avxvnni", saturates=False)
        if features.get("AVX512BW"):
            return IntegerKernels("x86_64-avx512", saturates=True)
        if features.get("AVX2"):
            return IntegerKernels("x86_64-avx2", saturates=True)
        # SSE4.1's pmaddubsw saturates the same way.
        return IntegerKernels("x86_64-sse", saturates=True)
    if arch in ("aarch64", "arm64"):
        name = "aarch64-dotprod" if features.get("ASIMDDP") else "aarch64"
        return IntegerKernels(name, saturates=False)
    # An architecture whose kernels we have not checked: take the form that cannot saturate.
    return IntegerKernels(arch or "unknown", saturates=True)


def _cpuinfo_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def _numpy_features() -> dict[str, bool]:
    import importlib

    try:
        umath = importlib.import_module("numpy._core._multiarray_umath")
    except ImportError:  # pragma: no cover - numpy < 2
        umath = importlib.import_module("numpy.core._multiarray_umath")
    return {str(k): bool(v) for k, v in umath.__cpu_features__.items()}


@cache
def integer_kernels() -> IntegerKernels:
    """This CPU's kernel class (read once per process)."""
    return kernels_of(platform.machine(), _numpy_features(), _cpuinfo_flags())
