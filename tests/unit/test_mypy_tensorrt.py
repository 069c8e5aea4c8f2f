"""The static check that stands in for running TensorRT here: mypy, with the project's own
configuration, reads TensorRT's type stubs (tensorrt-stubs 10.13, patched into build/typings
by ``make typecheck``) and refuses TensorRT 8's API, which TensorRT 10 removed.

None of this runs TensorRT. It proves that the check CI runs over ``engines/tensorrt*.py``
would catch an 8.x call: if the stubs were silently missing, mypy would take ``tensorrt`` as
Any and pass everything, so the first test also asserts that the stubs' types are the ones in
use.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUBS = ROOT / "build" / "typings"

# TensorRT 10/11 calls, as engines/tensorrt*.py make them: none may be an error.
CURRENT_API = """
import tensorrt as trt


def build(logger: trt.ILogger, path: str) -> bytes:
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(path):
        errors = [parser.get_error(i) for i in range(parser.num_errors)]
        raise ValueError([(e.node(), e.node_name(), e.desc()) for e in errors])
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, 1 << 30)
    config.builder_optimization_level = 3
    config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    config.hardware_compatibility_level = trt.HardwareCompatibilityLevel.AMPERE_PLUS
    config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)
    profile = builder.create_optimization_profile()
    profile.set_shape("x", trt.Dims([1, 4]), trt.Dims([8, 4]), trt.Dims([32, 4]))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    reveal_type(plan)
    return bytes(plan) + bytes(config.get_timing_cache().serialize())


def run(logger: trt.ILogger, plan: bytes, stream: int, address: int) -> bool:
    engine = trt.Runtime(logger).deserialize_cuda_engine(plan)
    context = engine.create_execution_context()
    for index in range(engine.num_io_tensors):
        name = engine.get_tensor_name(index)
        if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
            context.set_input_shape(name, trt.Dims([8, 4]))
        context.set_tensor_address(name, address)
    return context.execute_async_v3(stream)
"""

# TensorRT 8.x calls, one per line, each with the attribute mypy must report missing.
OLD_API = {
    "context.execute_async_v2([0, 0], 0)": "execute_async_v2",
    "context.execute_async(1, [0, 0], 0)": "execute_async",
    "builder.build_engine(network, config)": "build_engine",
    "config.max_workspace_size = 1 << 30": "max_workspace_size",
    "builder.max_batch_size = 8": "max_batch_size",
    "engine.get_binding_index('x')": "get_binding_index",
    "engine.binding_is_input(0)": "binding_is_input",
    "engine.num_bindings": "num_bindings",
    "context.set_binding_shape(0, (8, 4))": "set_binding_shape",
}


def old_api_module() -> str:
    body = "\n".join(f"    {line}" for line in OLD_API)
    return (
        "import tensorrt as trt\n\n\n"
        "def old(builder: trt.Builder, network: trt.INetworkDefinition, "
        "config: trt.IBuilderConfig, engine: trt.ICudaEngine, "
        "context: trt.IExecutionContext) -> None:\n" + body + "\n"
    )


def mypy(tmp_path: Path, *files: Path) -> subprocess.CompletedProcess[str]:
    """mypy with the repository's configuration (strict, mypy_path = build/typings)."""
    command = [
        sys.executable,
        "-m",
        "mypy",
        "--config-file",
        str(ROOT / "pyproject.toml"),
        "--cache-dir",
        str(tmp_path / "cache"),
        *map(str, files),
    ]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def stubs() -> Path:
    if not (STUBS / "tensorrt" / "__init__.pyi").exists():
        message = (
            "the patched tensorrt-stubs are not in build/typings: `make typecheck` installs "
            "and patches them (scripts/patch-tensorrt-stubs.sh)"
        )
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must run this test")
        pytest.skip(message)
    return STUBS


def test_mypy_refuses_the_tensorrt_8_api_and_accepts_10_against_the_stubs(
    stubs: Path, tmp_path: Path
) -> None:
    current = tmp_path / "current_api.py"
    current.write_text(CURRENT_API)
    old = tmp_path / "old_api.py"
    old.write_text(old_api_module())
    result = mypy(tmp_path, current, old)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    # The stubs are in use, not an Any that would let everything through.
    assert re.search(r'current_api\.py:\d+: note: Revealed type is "[\w.]*IHostMemory"', output), (
        output
    )
    errors = [line for line in output.splitlines() if ": error:" in line]
    assert not [e for e in errors if "current_api.py" in e], output
    lines = old.read_text().splitlines()
    flagged = {int(m.group(1)) for m in re.finditer(r"old_api\.py:(\d+): error:", output)}
    for call, attribute in OLD_API.items():
        number = next(i for i, line in enumerate(lines, 1) if line.strip() == call)
        assert number in flagged, f"mypy let TensorRT 8's {attribute} through:\n{output}"
        assert f'has no attribute "{attribute}"' in output, output
