"""The CPU's integer-kernel class, and the INT8 recipe that follows from it."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnxruntime
import pytest

from engines.devices import cpu
from engines.precision.build import BuildPlan, variant_key
from engines.precision.options import Int8Options, int8_recipe
from engines.store import EngineKey
from tests.conftest import tiny_onnx

AVX2 = {"SSE41": True, "AVX": True, "AVX2": True, "FMA3": True}
AVX512 = {**AVX2, "AVX512F": True, "AVX512BW": True, "AVX512VL": True}
VNNI = {**AVX512, "AVX512VNNI": True}


@pytest.mark.parametrize(
    ("machine", "features", "flags", "name", "saturates"),
    [
        # An AVX2-only AMD EPYC (Zen 2/3) and a Haswell Xeon: vpmaddubsw saturates.
        ("x86_64", AVX2, frozenset({"avx2"}), "x86_64-avx2", True),
        # Skylake-SP: AVX-512 without VNNI still multiplies through int16.
        ("x86_64", AVX512, frozenset({"avx512bw"}), "x86_64-avx512", True),
        ("x86_64", VNNI, frozenset({"avx512_vnni"}), "x86_64-avx512vnni", False),
        # Alder Lake: AVX-VNNI, which numpy does not report, without AVX-512.
        ("x86_64", AVX2, frozenset({"avx2", "avx_vnni"}), "x86_64-avxvnni", False),
        ("x86_64", {"SSE41": True}, frozenset(), "x86_64-sse", True),
        ("aarch64", {"ASIMD": True, "ASIMDDP": True}, frozenset(), "aarch64-dotprod", False),
        ("arm64", {"ASIMD": True}, frozenset(), "aarch64", False),
        ("riscv64", {}, frozenset(), "riscv64", True),
    ],
)
def test_kernel_class_of_each_cpu(
    machine: str, features: dict[str, bool], flags: frozenset[str], name: str, saturates: bool
) -> None:
    kernels = cpu.kernels_of(machine, features, flags)
    assert kernels == cpu.IntegerKernels(name, saturates)


def test_this_machine_is_classified_from_what_numpy_dispatches_on() -> None:
    import platform

    from numpy._core._multiarray_umath import __cpu_features__

    kernels = cpu.integer_kernels()
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        assert kernels.name.startswith("aarch64") and not kernels.saturates
    elif __cpu_features__.get("AVX512VNNI"):
        assert kernels.name == "x86_64-avx512vnni" and not kernels.saturates
    elif kernels.name == "x86_64-avxvnni":
        assert __cpu_features__.get("AVX2") and not kernels.saturates
    else:
        assert kernels.saturates, kernels


def test_recipe_per_backend_and_cpu() -> None:
    auto = Int8Options()
    saturating = cpu.IntegerKernels("x86_64-avx2", saturates=True)
    vnni = cpu.IntegerKernels("x86_64-avx512vnni", saturates=False)

    on_avx2 = int8_recipe("onnxruntime", auto, saturating)
    assert (on_avx2.form, on_avx2.reduce_range, on_avx2.keep_first_and_last) == (
        "u8s8",
        True,
        True,
    )
    on_vnni = int8_recipe("onnxruntime", auto, vnni)
    assert (on_vnni.form, on_vnni.reduce_range, on_vnni.keep_first_and_last) == (
        "u8s8",
        False,
        False,
    )
    # A GPU's INT8 does not saturate whatever CPU built the plan.
    trt = int8_recipe("tensorrt", auto, saturating)
    assert (trt.form, trt.reduce_range, trt.kernels) == ("s8s8", False, "tensorrt")
    # Explicit options win over the CPU.
    forced = int8_recipe(
        "onnxruntime", Int8Options(reduce_range=False, keep_first_and_last=True), saturating
    )
    assert (forced.reduce_range, forced.keep_first_and_last) == (False, True)


def test_a_store_moved_to_another_cpu_builds_what_that_cpu_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The variant's key names the kernel class and the recipe: an AVX2 machine never loads
    a variant made for VNNI; two VNNI machines share one."""
    source = tmp_path / "model.onnx"
    onnx.save(tiny_onnx(), str(source))
    plan = BuildPlan("tiny", source, tmp_path, "x", None, (1, 8, 16))

    def key_on(name: str, saturates: bool, precision: str = "int8") -> EngineKey:
        monkeypatch.setattr(cpu, "integer_kernels", lambda: cpu.IntegerKernels(name, saturates))
        return variant_key(plan, precision, "onnxruntime")

    vnni, avx2 = key_on("x86_64-avx512vnni", False), key_on("x86_64-avx2", True)
    assert vnni.digest() != avx2.digest()
    assert (vnni.device, avx2.device) == ("cpu-x86_64-avx512vnni", "cpu-x86_64-avx2")
    assert vnni.options["recipe"]["reduce_range"] is False
    assert avx2.options["recipe"]["reduce_range"] is True
    assert key_on("x86_64-avx512vnni", False).digest() == vnni.digest()
    assert vnni.backend_version == onnxruntime.__version__
