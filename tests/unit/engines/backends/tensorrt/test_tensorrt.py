"""The TensorRT backend's own logic, on machines without TensorRT: none of these is a
TensorRT run, and every name says so.

Plain functions (profile derivation, store keys, I/O mapping, buffer sizing) are tested
directly. The build and the runner are driven through a stand-in ``tensorrt`` module put in
``sys.modules``: it records what the backend asks of TensorRT and, to "run" a plan, runs the
ONNX file with ONNX Runtime through the runner's own buffers and addresses (with stand-ins for
``engines.devices.cuda`` that copy host memory). It checks the wiring (which calls, in which order,
with which shapes, through which buffers); whether TensorRT accepts the calls is checked by
mypy against TensorRT's stubs (``test_mypy_tensorrt.py``) and, on a TensorRT machine, by
``tests/gpu/test_tensorrt.py``.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import logging
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from engines import backends
from engines.backends.tensorrt import build as tensorrt_build
from engines.backends.tensorrt import engine as trt_backend
from engines.backends.tensorrt import runtime as tensorrt_runtime
from engines.backends.tensorrt.build import (
    BuildError,
    TensorRTOptions,
    load_timing_cache,
    plan_key,
    save_timing_cache,
)
from engines.backends.tensorrt.engine import (
    IoTensor,
    buffer_bytes,
    describe_io,
    match_io,
    max_input_shape,
)
from engines.backends.tensorrt.profile import batch_profile, profile_shapes, read_onnx
from engines.backends.tensorrt.runtime import Target
from engines.base import EngineOptions, FatalEngineError
from engines.devices import cuda
from engines.spec import ModelSpec, TensorSpec
from engines.store import EngineStore
from tests.conftest import tiny_onnx

TARGET = Target("tensorrt 10.13.0.35", "NVIDIA H200", (9, 0))


def image_spec(max_batch: int = 32, row: tuple[int, ...] = (3, 224, 224)) -> ModelSpec:
    return ModelSpec(
        "net",
        (TensorSpec("input", "FP32", row),),
        (TensorSpec("logits", "FP32", (1000,)),),
        max_batch_size=max_batch,
    )


# -- the profile ------------------------------------------------------------------------------


def test_profile_shapes_from_batching_config_without_tensorrt() -> None:
    spec = image_spec()
    rows = batch_profile(spec, (1, 16, 32))
    assert rows == (1, 16, 32)
    shapes = profile_shapes(spec, rows, {"input": (-1, 3, 224, 224)})
    assert shapes == {"input": ((1, 3, 224, 224), (16, 3, 224, 224), (32, 3, 224, 224))}


def test_batch_profile_defaults_and_refusals_without_tensorrt() -> None:
    spec = image_spec(max_batch=8)
    assert batch_profile(spec) == (1, 8, 8)
    assert batch_profile(image_spec(max_batch=0)) == (1, 1, 1)
    with pytest.raises(ValueError, match="1 <= min <= opt <= max"):
        batch_profile(spec, (4, 2, 8))
    with pytest.raises(ValueError, match="not the max batch size 8"):
        batch_profile(spec, (1, 4, 4))
    with pytest.raises(ValueError, match=r"\(min, opt, max\)"):
        batch_profile(spec, (1, 8))


def test_profile_takes_dynamic_non_batch_dims_from_the_config_without_tensorrt() -> None:
    spec = image_spec(row=(3, 320, 320))  # the config's declaration
    shapes = profile_shapes(spec, (1, 8, 32), {"input": (-1, 3, -1, -1)})
    assert shapes["input"] == ((1, 3, 320, 320), (8, 3, 320, 320), (32, 3, 320, 320))


def test_profile_refuses_what_no_profile_can_fix_without_tensorrt() -> None:
    with pytest.raises(ValueError, match=r"'input' dimension 2 is dynamic .* declare it"):
        profile_shapes(image_spec(row=(3, -1, 224)), (1, 8, 32), {"input": (-1, 3, -1, 224)})
    with pytest.raises(ValueError, match="dimension 3 is 224 in the ONNX file but 256"):
        profile_shapes(image_spec(row=(3, 224, 256)), (1, 8, 32), {"input": (-1, 3, 224, 224)})
    with pytest.raises(ValueError, match="fixed batch dimension of 1"):
        profile_shapes(image_spec(), (1, 8, 32), {"input": (1, 3, 224, 224)})
    with pytest.raises(ValueError, match=r"inputs \['input'\] are not in the ONNX file"):
        profile_shapes(image_spec(), (1, 8, 32), {"x": (-1, 3, 224, 224)})
    with pytest.raises(ValueError, match="has 3 dimensions in the ONNX file, 4"):
        profile_shapes(image_spec(), (1, 8, 32), {"input": (-1, 3, 224)})


def test_static_inputs_need_no_profile_without_tensorrt() -> None:
    spec = image_spec(max_batch=0)
    assert profile_shapes(spec, (1, 1, 1), {"input": (3, 224, 224)}) == {}
    # A fixed batch dimension that is the whole range is fine too.
    assert profile_shapes(image_spec(max_batch=4), (4, 4, 4), {"input": (4, 3, 224, 224)}) == {}


def test_read_onnx_gives_input_shapes_and_precision_without_tensorrt(tmp_path: Path) -> None:
    path = tmp_path / "tiny.onnx"
    onnx.save(tiny_onnx(), str(path))
    assert read_onnx(path) == ({"x": (-1, 4)}, "fp32")


# -- store keys -------------------------------------------------------------------------------


def test_plan_key_holds_everything_the_plan_depends_on_without_tensorrt() -> None:
    spec = image_spec()
    rows = (1, 16, 32)
    shapes = profile_shapes(spec, rows, {"input": (-1, 3, 224, 224)})
    options = TensorRTOptions()
    key = plan_key(spec, "hash", "int8", TARGET, rows, shapes, options)
    assert key.backend == "tensorrt"
    assert key.backend_version == "tensorrt 10.13.0.35"
    assert key.device == "NVIDIA H200 sm_90"
    assert key.profile == rows
    assert key.options["shapes"] == {
        "input": [[1, 3, 224, 224], [16, 3, 224, 224], [32, 3, 224, 224]]
    }
    assert key.options["strongly_typed"] is True
    variants = [
        plan_key(spec, "other", "int8", TARGET, rows, shapes, options),
        plan_key(spec, "hash", "fp16", TARGET, rows, shapes, options),
        plan_key(
            spec, "hash", "int8", Target("10.14.1", "NVIDIA H200", (9, 0)), rows, shapes, options
        ),
        plan_key(
            spec,
            "hash",
            "int8",
            Target("tensorrt 10.13.0.35", "NVIDIA L4", (8, 9)),
            rows,
            shapes,
            options,
        ),
        plan_key(spec, "hash", "int8", TARGET, (1, 8, 32), shapes, options),
        plan_key(
            spec, "hash", "int8", TARGET, rows, shapes, TensorRTOptions(workspace_bytes=1 << 30)
        ),
        plan_key(spec, "hash", "int8", TARGET, rows, shapes, TensorRTOptions(optimization_level=5)),
        plan_key(
            spec, "hash", "int8", TARGET, rows, shapes, TensorRTOptions(version_compatible=True)
        ),
    ]
    digests = {key.digest(), *(k.digest() for k in variants)}
    assert len(digests) == 1 + len(variants)
    # Runtime-only options do not change the plan.
    same = plan_key(spec, "hash", "int8", TARGET, rows, shapes, TensorRTOptions(cuda_graphs=True))
    assert same.digest() == key.digest()


def test_hardware_compatible_plans_are_keyed_by_level_not_gpu_without_tensorrt() -> None:
    spec = image_spec()
    rows = (1, 32, 32)
    shapes = profile_shapes(spec, rows, {"input": (-1, 3, 224, 224)})
    options = TensorRTOptions(hardware_compatibility="ampere_plus")
    h200 = plan_key(spec, "h", "fp16", TARGET, rows, shapes, options)
    l4 = plan_key(
        spec, "h", "fp16", Target("tensorrt 10.13.0.35", "NVIDIA L4", (8, 9)), rows, shapes, options
    )
    assert h200.device == l4.device == "hardware-compatible:ampere_plus"
    assert h200.digest() == l4.digest()
    same_cc = TensorRTOptions(hardware_compatibility="same_compute_capability")
    assert TARGET.device_key(same_cc.hardware_compatibility) == "hardware-compatible:sm_90"
    with pytest.raises(ValueError, match="hardware_compatibility"):
        TensorRTOptions(hardware_compatibility="hopper")


def test_timing_cache_generations_in_the_store_without_tensorrt(tmp_path: Path) -> None:
    store = EngineStore(tmp_path)
    assert load_timing_cache(store, TARGET) == (0, b"")
    save_timing_cache(store, TARGET, 1, b"first")
    save_timing_cache(store, TARGET, 2, b"second")
    assert load_timing_cache(store, TARGET) == (2, b"second")
    # Another GPU or TensorRT version has caches of its own.
    assert load_timing_cache(store, Target("tensorrt 10.13.0.35", "NVIDIA L4", (8, 9))) == (0, b"")
    # A generation that does not verify is passed over for the one before.
    newest = store.path_for(tensorrt_build.timing_cache_key(TARGET, 2), ".cache")
    newest.write_bytes(b"corrupted")
    assert load_timing_cache(store, TARGET) == (1, b"first")
    # Whoever stores a generation first wins; the loser's timings are not kept.
    save_timing_cache(store, TARGET, 1, b"late")
    assert store.path_for(tensorrt_build.timing_cache_key(TARGET, 1), ".cache").read_bytes() == (
        b"first"
    )


# -- a stand-in for tensorrt ------------------------------------------------------------------


class _Enum:
    """Like TensorRT's pybind11 enum members: a name and an int."""

    def __init__(self, name: str, value: int = 0) -> None:
        self.name, self.value = name, value

    def __int__(self) -> int:
        return self.value


def _ort_type(value: str) -> str:
    return {"tensor(float)": "FLOAT", "tensor(float16)": "HALF", "tensor(int64)": "INT64"}[value]


def _shape(value: list[Any]) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) and d > 0 else -1 for d in value)


class StandIn:
    """A ``tensorrt`` module that records every call; ``fail_build`` makes the build return
    None, a node of op type ``Unsupported`` makes the parser fail on it."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail_build = False
        self.executions = 0
        self.module = self._module()

    def _module(self) -> types.ModuleType:
        stand_in = self
        trt = types.ModuleType("tensorrt")
        trt.__version__ = "10.13.0.35"  # type: ignore[attr-defined]

        class ILogger:
            def __init__(self) -> None:
                pass

        class IProgressMonitor:
            def __init__(self) -> None:
                pass

        class Tensor:
            def __init__(self, name: str, shape: tuple[int, ...]) -> None:
                self.name, self.shape = name, shape

        class Network:
            def __init__(self, flags: int) -> None:
                self.flags = flags
                self.inputs: list[Tensor] = []
                self.outputs: list[Tensor] = []
                self.path = ""

            @property
            def num_inputs(self) -> int:
                return len(self.inputs)

            @property
            def num_outputs(self) -> int:
                return len(self.outputs)

            def get_input(self, index: int) -> Tensor:
                return self.inputs[index]

            def get_output(self, index: int) -> Tensor:
                return self.outputs[index]

        class Error:
            def __init__(self, node: int, name: str, op: str, desc: str) -> None:
                self._node, self._name, self._op, self._desc = node, name, op, desc

            def node(self) -> int:
                return self._node

            def node_name(self) -> str:
                return self._name

            def node_operator(self) -> str:
                return self._op

            def desc(self) -> str:
                return self._desc

        class OnnxParser:
            def __init__(self, network: Network, logger: ILogger) -> None:
                self.network = network
                self.errors: list[Error] = []

            @property
            def num_errors(self) -> int:
                return len(self.errors)

            def get_error(self, index: int) -> Error:
                return self.errors[index]

            def parse_from_file(self, path: str) -> bool:
                stand_in.calls.append(("parse_from_file", Path(path).name))
                graph = onnx.load(path).graph
                for index, node in enumerate(graph.node):
                    if node.op_type == "Unsupported":
                        desc = f"No importer registered for op: {node.op_type}"
                        self.errors.append(Error(index, node.name, node.op_type, desc))
                if self.errors:
                    return False
                dims = {v.name: v.type.tensor_type.shape.dim for v in graph.input}
                for name, dim in dims.items():
                    shape = tuple(d.dim_value if d.dim_value > 0 else -1 for d in dim)
                    self.network.inputs.append(Tensor(name, shape))
                self.network.outputs = [Tensor(v.name, ()) for v in graph.output]
                self.network.path = path
                return True

        class Profile:
            def __init__(self) -> None:
                self.shapes: dict[str, list[tuple[int, ...]]] = {}

            def set_shape(self, name: str, low: Any, opt: Any, high: Any) -> None:
                self.shapes[name] = [tuple(low), tuple(opt), tuple(high)]

        class TimingCache:
            def __init__(self, data: bytes) -> None:
                self.data = data

            def serialize(self) -> bytes:
                return self.data + b"+timings"

        class Config:
            def __init__(self) -> None:
                self.flags: list[str] = []
                self.pool: dict[str, int] = {}
                self.builder_optimization_level = 3
                self.hardware_compatibility_level = _Enum("NONE")
                self.profiles: list[Profile] = []
                self.cache: TimingCache | None = None
                self.progress_monitor: Any = None

            def set_memory_pool_limit(self, pool: _Enum, size: int) -> None:
                self.pool[pool.name] = size

            def set_flag(self, flag: _Enum) -> None:
                self.flags.append(flag.name)

            def add_optimization_profile(self, profile: Profile) -> int:
                self.profiles.append(profile)
                return len(self.profiles) - 1

            def create_timing_cache(self, data: bytes) -> TimingCache:
                return TimingCache(bytes(data))

            def set_timing_cache(self, cache: TimingCache, ignore_mismatch: bool) -> bool:
                if cache.data == b"foreign" and not ignore_mismatch:
                    return False
                self.cache = cache
                return True

            def get_timing_cache(self) -> TimingCache:
                assert self.cache is not None
                return self.cache

        class Builder:
            def __init__(self, logger: ILogger) -> None:
                assert isinstance(logger, ILogger)

            def create_network(self, flags: int) -> Network:
                return Network(flags)

            def create_builder_config(self) -> Config:
                return Config()

            def create_optimization_profile(self) -> Profile:
                return Profile()

            def build_serialized_network(self, network: Network, config: Config) -> bytes | None:
                monitor = config.progress_monitor
                monitor.phase_start("Building engine", None, 2)
                monitor.phase_start("Timing tactics", "Building engine", 1)
                monitor.step_complete("Timing tactics", 0)
                monitor.phase_finish("Timing tactics")
                monitor.step_complete("Building engine", 0)
                monitor.phase_finish("Building engine")
                assert config.cache is not None
                stand_in.calls.append(
                    (
                        "build",
                        {
                            "flags": network.flags,
                            "pool": config.pool,
                            "level": config.builder_optimization_level,
                            "builder_flags": config.flags,
                            "hardware": config.hardware_compatibility_level.name,
                            "profiles": [p.shapes for p in config.profiles],
                            "timing_cache": config.cache.data,
                        },
                    )
                )
                if stand_in.fail_build:
                    return None
                shapes = config.profiles[0].shapes if config.profiles else {}
                return json.dumps({"onnx": network.path, "shapes": shapes}).encode()

        class Runtime:
            def __init__(self, logger: ILogger) -> None:
                self.engine_host_code_allowed = False

            def deserialize_cuda_engine(self, plan: bytes) -> Engine:
                stand_in.calls.append(("deserialize", self.engine_host_code_allowed))
                return Engine(json.loads(plan))

        class Engine:
            """Runs the plan's ONNX file with ONNX Runtime, reading and writing the memory
            at the addresses it is given."""

            def __init__(self, plan: dict[str, Any]) -> None:
                self.session = ort.InferenceSession(
                    plan["onnx"], providers=["CPUExecutionProvider"]
                )
                self.profiles = plan["shapes"]
                self.io = [(t, "INPUT") for t in self.session.get_inputs()]
                self.io += [(t, "OUTPUT") for t in self.session.get_outputs()]

            @property
            def num_io_tensors(self) -> int:
                return len(self.io)

            def _get(self, name: str) -> tuple[Any, str]:
                return next(entry for entry in self.io if entry[0].name == name)

            def get_tensor_name(self, index: int) -> str:
                return str(self.io[index][0].name)

            def get_tensor_mode(self, name: str) -> _Enum:
                return _Enum(self._get(name)[1])

            def get_tensor_dtype(self, name: str) -> _Enum:
                return _Enum(_ort_type(self._get(name)[0].type))

            def get_tensor_shape(self, name: str) -> tuple[int, ...]:
                return _shape(self._get(name)[0].shape)

            def get_tensor_profile_shape(self, name: str, index: int) -> list[tuple[int, ...]]:
                return [tuple(s) for s in self.profiles[name]]

            def create_execution_context(self) -> Context:
                return Context(self)

        class Context:
            def __init__(self, engine: Engine) -> None:
                self.engine = engine
                self.shapes: dict[str, tuple[int, ...]] = {}
                self.addresses: dict[str, int] = {}

            def set_input_shape(self, name: str, shape: Any) -> bool:
                low, _, high = self.engine.profiles[name]
                shape = tuple(shape)
                if len(shape) != len(low) or not all(
                    a <= s <= b for a, s, b in zip(low, shape, high, strict=True)
                ):
                    return False
                self.shapes[name] = shape
                return True

            def get_tensor_shape(self, name: str) -> tuple[int, ...]:
                if name in self.shapes:
                    return self.shapes[name]
                rows = next(iter(self.shapes.values()))[0]
                return (rows, *self.engine.get_tensor_shape(name)[1:])

            def set_tensor_address(self, name: str, address: int) -> bool:
                self.addresses[name] = address
                return True

            def _array(self, name: str, dtype: Any) -> np.ndarray:
                shape = self.get_tensor_shape(name)
                count = int(np.prod(shape)) * np.dtype(dtype).itemsize
                raw = (ctypes.c_uint8 * count).from_address(self.addresses[name])
                return np.frombuffer(raw, dtype=dtype).reshape(shape)

            def execute_async_v3(self, stream: int) -> bool:
                stand_in.executions += 1
                assert stream == FakeStream.ptr
                feeds = {
                    t.name: self._array(t.name, np.float32).copy()
                    for t in self.engine.session.get_inputs()
                }
                names = [t.name for t in self.engine.session.get_outputs()]
                for name, value in zip(names, self.engine.session.run(names, feeds), strict=True):
                    self._array(name, value.dtype)[...] = value
                return True

        trt.ILogger = ILogger  # type: ignore[attr-defined]
        trt.IProgressMonitor = IProgressMonitor  # type: ignore[attr-defined]
        trt.Builder = Builder  # type: ignore[attr-defined]
        trt.Runtime = Runtime  # type: ignore[attr-defined]
        trt.OnnxParser = OnnxParser  # type: ignore[attr-defined]
        trt.Dims = tuple  # type: ignore[attr-defined]
        trt.NetworkDefinitionCreationFlag = types.SimpleNamespace(  # type: ignore[attr-defined]
            STRONGLY_TYPED=_Enum("STRONGLY_TYPED", 1)
        )
        trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE=_Enum("WORKSPACE"))  # type: ignore[attr-defined]
        trt.BuilderFlag = types.SimpleNamespace(  # type: ignore[attr-defined]
            VERSION_COMPATIBLE=_Enum("VERSION_COMPATIBLE", 13)
        )
        trt.HardwareCompatibilityLevel = types.SimpleNamespace(  # type: ignore[attr-defined]
            AMPERE_PLUS=_Enum("AMPERE_PLUS", 1),
            SAME_COMPUTE_CAPABILITY=_Enum("SAME_COMPUTE_CAPABILITY", 2),
        )
        return trt

    def builds(self) -> list[dict[str, Any]]:
        return [call[1] for call in self.calls if call[0] == "build"]


class FakeHost(cuda.HostBuffer):
    """Host memory from numpy instead of cudaMallocHost; ``array`` is the real one."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = max(1, nbytes)
        self._memory = np.zeros(self.nbytes, np.uint8)
        self.ptr = int(self._memory.ctypes.data)

    def close(self) -> None:
        self.ptr = 0


class FakeDevice(cuda.DeviceBuffer):
    def __init__(self, device: int, nbytes: int) -> None:
        self.device, self.nbytes = device, max(1, nbytes)
        self._memory = np.zeros(self.nbytes, np.uint8)
        self.ptr = int(self._memory.ctypes.data)

    def close(self) -> None:
        self.ptr = 0


class FakeStream:
    ptr = 0x5EED

    def __init__(self, device: int) -> None:
        self.handle = object()

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        pass


class FakeEvent:
    def __init__(self, device: int) -> None:
        pass

    def record(self, stream: object) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        pass


class FakeGraph:
    """Captures by remembering the enqueue; a launch replays it."""

    captured = 0

    def __init__(self, stream: object, enqueue: Any) -> None:
        FakeGraph.captured += 1
        self._enqueue = enqueue

    def launch(self, stream: object) -> None:
        self._enqueue()

    def close(self) -> None:
        pass


def _copy(dst: int, src: int, nbytes: int, stream: object) -> None:
    ctypes.memmove(dst, src, nbytes)


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[StandIn]:
    fake = StandIn()
    monkeypatch.setitem(sys.modules, "tensorrt", fake.module)
    monkeypatch.setattr(tensorrt_runtime, "_logger", None)
    monkeypatch.setattr(cuda, "device_properties", lambda device: ("NVIDIA H200", (9, 0)))
    monkeypatch.setattr(cuda, "set_device", lambda device: None)
    monkeypatch.setattr(cuda, "HostBuffer", FakeHost)
    monkeypatch.setattr(cuda, "DeviceBuffer", FakeDevice)
    monkeypatch.setattr(cuda, "Stream", FakeStream)
    monkeypatch.setattr(cuda, "Event", FakeEvent)
    monkeypatch.setattr(cuda, "Graph", FakeGraph)
    monkeypatch.setattr(cuda, "copy_to_device", _copy)
    monkeypatch.setattr(cuda, "copy_to_host", _copy)
    yield fake


@pytest.fixture
def tiny(tmp_path: Path) -> tuple[Path, ModelSpec]:
    path = tmp_path / "tiny.onnx"
    onnx.save(tiny_onnx(), str(path))
    spec = ModelSpec(
        "tiny",
        (TensorSpec("x", "FP32", (4,)),),
        (TensorSpec("y", "FP32", (3,)), TensorSpec("s", "FP32", (1,))),
        max_batch_size=8,
    )
    return path, spec


def reference(path: Path, x: np.ndarray) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    y, s = session.run(["y", "s"], {"x": x})
    return {"y": y, "s": s}


# -- the build, through the stand-in -----------------------------------------------------------


def test_build_asks_tensorrt_for_a_strongly_typed_profiled_plan_with_a_stand_in_not_tensorrt(
    stand_in: StandIn,
    tiny: tuple[Path, ModelSpec],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path, spec = tiny
    store = EngineStore(tmp_path / "store")
    options = EngineOptions(store=store, profile=(1, 4, 8), precision="fp32")
    trt_options = TensorRTOptions(
        workspace_bytes=1 << 28,
        optimization_level=5,
        version_compatible=True,
        hardware_compatibility="ampere_plus",
    )
    with caplog.at_level(logging.INFO, logger="engines.backends.tensorrt.build"):
        engine = trt_backend.TensorRTEngine(path, spec, options, trt_options)
    [build] = stand_in.builds()
    assert build == {
        "flags": 1 << 1,
        "pool": {"WORKSPACE": 1 << 28},
        "level": 5,
        "builder_flags": ["VERSION_COMPATIBLE"],
        "hardware": "AMPERE_PLUS",
        "profiles": [{"x": [(1, 4), (4, 4), (8, 4)]}],
        "timing_cache": b"",
    }
    assert ("deserialize", True) in stand_in.calls  # version-compatible: host code allowed
    assert "tiny fp32: Building engine (2 steps)" in caplog.text
    assert "tiny fp32: Building engine done in" in caplog.text
    assert "Timing tactics (1 steps)" not in caplog.text  # nested phases stay quiet
    assert [t.name for t in engine.inputs] == ["x"]
    assert [t.name for t in engine.outputs] == ["y", "s"]
    assert engine.input_shapes == {"x": (8, 4)}

    # Loaded from the store the second time; the timing cache went in as generation 1.
    trt_backend.TensorRTEngine(path, spec, options, trt_options)
    assert len(stand_in.builds()) == 1
    target = Target("tensorrt 10.13.0.35", "NVIDIA H200", (9, 0))
    assert load_timing_cache(store, target) == (1, b"+timings")

    # Another plan (another profile) starts from that cache and stores the next generation.
    other = EngineOptions(store=store, profile=(1, 8, 8), precision="fp32")
    trt_backend.TensorRTEngine(path, spec, other, trt_options)
    assert stand_in.builds()[-1]["timing_cache"] == b"+timings"
    assert load_timing_cache(store, target) == (2, b"+timings+timings")


def test_parser_errors_name_their_nodes_with_a_stand_in_not_tensorrt(
    stand_in: StandIn, tmp_path: Path
) -> None:
    graph = helper.make_graph(
        [helper.make_node("Unsupported", ["x"], ["y"], name="mystery")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    path = tmp_path / "bad.onnx"
    onnx.save(helper.make_model(graph), str(path))
    spec = ModelSpec("bad", (TensorSpec("x", "FP32", (4,)),), (TensorSpec("y", "FP32", (4,)),), 4)
    with pytest.raises(BuildError) as caught:
        trt_backend.TensorRTEngine(path, spec, EngineOptions(store=EngineStore(tmp_path / "s")))
    assert str(caught.value) == (
        "bad fp32: TensorRT's ONNX parser refused bad.onnx: node 0 (Unsupported 'mystery'): "
        "No importer registered for op: Unsupported"
    )


def test_a_failed_build_stores_nothing_with_a_stand_in_not_tensorrt(
    stand_in: StandIn, tiny: tuple[Path, ModelSpec], tmp_path: Path
) -> None:
    path, spec = tiny
    store = EngineStore(tmp_path / "store")
    stand_in.fail_build = True
    with pytest.raises(BuildError, match="could not build the plan; its errors are logged above"):
        trt_backend.TensorRTEngine(path, spec, EngineOptions(store=store))
    assert not list((tmp_path / "store").rglob("*.plan"))
    stand_in.fail_build = False
    trt_backend.TensorRTEngine(path, spec, EngineOptions(store=store))
    assert len(stand_in.builds()) == 2


def test_a_timing_cache_that_does_not_fit_is_replaced_with_a_stand_in_not_tensorrt(
    stand_in: StandIn,
    tiny: tuple[Path, ModelSpec],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path, spec = tiny
    store = EngineStore(tmp_path / "store")
    save_timing_cache(store, Target("tensorrt 10.13.0.35", "NVIDIA H200", (9, 0)), 1, b"foreign")
    with caplog.at_level(logging.WARNING):
        trt_backend.TensorRTEngine(path, spec, EngineOptions(store=store))
    assert "the stored timing cache does not fit" in caplog.text
    assert stand_in.builds()[0]["timing_cache"] == b""


def test_without_a_store_the_plan_is_built_in_memory_with_a_stand_in_not_tensorrt(
    stand_in: StandIn, tiny: tuple[Path, ModelSpec]
) -> None:
    path, spec = tiny
    trt_backend.TensorRTEngine(path, spec, EngineOptions())
    trt_backend.TensorRTEngine(path, spec, EngineOptions())
    assert len(stand_in.builds()) == 2


# -- the runtime --------------------------------------------------------------------------------


def test_tensor_names_and_io_mapping_without_tensorrt() -> None:
    class Engine:
        io: ClassVar = [
            ("s", "OUTPUT", "FLOAT", (-1, 1)),
            ("x", "INPUT", "FLOAT", (-1, 4)),
            ("debug", "OUTPUT", "HALF", (-1, 2)),
            ("y", "OUTPUT", "FLOAT", (-1, 3)),
        ]
        num_io_tensors = len(io)

        def _get(self, name: str) -> tuple[str, str, str, tuple[int, ...]]:
            return next(t for t in self.io if t[0] == name)

        def get_tensor_name(self, index: int) -> str:
            return self.io[index][0]

        def get_tensor_mode(self, name: str) -> _Enum:
            return _Enum(self._get(name)[1])

        def get_tensor_dtype(self, name: str) -> _Enum:
            return _Enum(self._get(name)[2])

        def get_tensor_shape(self, name: str) -> tuple[int, ...]:
            return self._get(name)[3]

    io = describe_io(Engine())  # type: ignore[arg-type]
    assert io[0] == IoTensor("s", False, "FP32", (-1, 1))
    assert io[2] == IoTensor("debug", False, "FP16", (-1, 2))
    spec = ModelSpec(
        "tiny",
        (TensorSpec("x", "FP32", (4,)),),
        (TensorSpec("y", "FP32", (3,)), TensorSpec("s", "FP32", (1,))),
        8,
    )
    inputs, outputs = match_io(io, spec)
    assert [t.name for t in inputs] == ["x"]
    # The contract's outputs in its order, then the engine's others (bound, not returned).
    assert [t.name for t in outputs] == ["y", "s", "debug"]

    wrong = ModelSpec(
        "tiny", (TensorSpec("x", "FP16", (4, 1)),), (TensorSpec("z", "FP32", (3,)),), 8
    )
    with pytest.raises(ValueError) as caught:
        match_io(io, wrong)
    message = str(caught.value)
    assert "input 'x' is FP32 in the engine, FP16 in the model's contract" in message
    assert "input 'x' has 2 dimensions in the engine, 3 by the model's contract" in message
    assert "output 'z' is not an output of the engine" in message


def test_engine_types_without_numpy_equivalents_are_refused_without_tensorrt() -> None:
    class Engine:
        num_io_tensors = 1

        def get_tensor_name(self, index: int) -> str:
            return "q"

        def get_tensor_mode(self, name: str) -> _Enum:
            return _Enum("INPUT")

        def get_tensor_dtype(self, name: str) -> _Enum:
            return _Enum("FP8")

        def get_tensor_shape(self, name: str) -> tuple[int, ...]:
            return (-1, 4)

    with pytest.raises(ValueError, match="'q' is FP8 in the engine, which numpy cannot hold"):
        describe_io(Engine())  # type: ignore[arg-type]


def test_buffer_sizing_without_tensorrt() -> None:
    image = IoTensor("input", True, "FP32", (-1, 3, 224, 224))
    shape = max_input_shape(image, (32, 3, 224, 224), 32, batched=True)
    assert shape == (32, 3, 224, 224)
    assert buffer_bytes(shape, "FP32") == 32 * 3 * 224 * 224 * 4
    assert buffer_bytes((32, 1000), "FP16") == 64_000
    assert buffer_bytes((8, 16), "INT8") == 128
    static = IoTensor("input", True, "UINT8", (3, 224, 224))
    assert max_input_shape(static, None, 1, batched=False) == (3, 224, 224)
    with pytest.raises(ValueError, match="takes up to 16 rows, the model 32"):
        max_input_shape(image, (16, 3, 224, 224), 32, batched=True)
    with pytest.raises(ValueError, match="no profile fixes"):
        max_input_shape(image, None, 32, batched=True)
    with pytest.raises(ValueError, match="not concrete"):
        buffer_bytes((-1, 3), "FP32")


@pytest.mark.parametrize("graphs", [False, True])
def test_runner_moves_batches_through_its_buffers_with_a_stand_in_not_tensorrt(
    stand_in: StandIn, tiny: tuple[Path, ModelSpec], graphs: bool
) -> None:
    path, spec = tiny
    engine = trt_backend.TensorRTEngine(
        path, spec, EngineOptions(), TensorRTOptions(cuda_graphs=graphs)
    )
    runner = engine.new_runner()
    other = engine.new_runner()
    FakeGraph.captured = 0
    rng = np.random.default_rng(0)
    try:
        for rows in (1, 8, 3, 8, 1):
            x = rng.standard_normal((rows, 4)).astype(np.float32)
            got = runner.run({"x": x})
            want = reference(path, x)
            assert set(got) == {"y", "s"}
            for name in ("y", "s"):
                assert got[name].shape == want[name].shape
                np.testing.assert_allclose(got[name], want[name], rtol=1e-6)
            # A second lane's buffers are its own.
            np.testing.assert_allclose(
                other.run({"x": x[::-1].copy()})["y"], want["y"][::-1], rtol=1e-6
            )
        if graphs:
            assert FakeGraph.captured == 2 * 3  # each runner, each of its batch sizes once
    finally:
        runner.close()
        other.close()
        engine.close()


def test_a_plan_that_cannot_be_captured_runs_without_graphs_with_a_stand_in_not_tensorrt(
    stand_in: StandIn,
    tiny: tuple[Path, ModelSpec],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def refuse(stream: object, enqueue: Any) -> None:
        raise cuda.CudaError("cudaStreamEndCapture", _Enum("cudaErrorStreamCaptureInvalidated"))

    monkeypatch.setattr(cuda, "Graph", refuse)
    path, spec = tiny
    engine = trt_backend.TensorRTEngine(
        path, spec, EngineOptions(), TensorRTOptions(cuda_graphs=True)
    )
    runner = engine.new_runner()
    x = np.ones((2, 4), np.float32)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            np.testing.assert_allclose(
                runner.run({"x": x})["y"], reference(path, x)["y"], rtol=1e-6
            )
    assert caplog.text.count("no CUDA graph") == 1
    runner.close()


def test_runner_refuses_bad_batches_before_copying_with_a_stand_in_not_tensorrt(
    stand_in: StandIn, tiny: tuple[Path, ModelSpec]
) -> None:
    path, spec = tiny
    engine = trt_backend.TensorRTEngine(path, spec, EngineOptions())
    runner = engine.new_runner()
    executions = stand_in.executions
    with pytest.raises(ValueError, match="a batch of 9 rows; this engine takes 1 to 8"):
        runner.run({"x": np.zeros((9, 4), np.float32)})
    with pytest.raises(ValueError, match="float64, expected float32"):
        runner.run({"x": np.zeros((2, 4), np.float64)})
    with pytest.raises(ValueError, match="outside the plan's optimization profile"):
        runner.run({"x": np.zeros((2, 3), np.float32)})
    with pytest.raises(ValueError, match=r"inputs \['x'\] are missing"):
        runner.run({})
    assert stand_in.executions == executions
    runner.close()


def test_a_sticky_cuda_error_is_fatal_with_a_stand_in_not_tensorrt(
    stand_in: StandIn, tiny: tuple[Path, ModelSpec], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, spec = tiny
    runner = trt_backend.TensorRTEngine(path, spec, EngineOptions()).new_runner()

    def fail(code: str) -> Any:
        def copy(*args: object) -> None:
            raise cuda.CudaError("cudaMemcpyAsync", _Enum(code, 700))

        return copy

    monkeypatch.setattr(cuda, "copy_to_device", fail("cudaErrorIllegalAddress"))
    with pytest.raises(FatalEngineError, match="cudaMemcpyAsync failed: cudaErrorIllegalAddress"):
        runner.run({"x": np.zeros((2, 4), np.float32)})
    monkeypatch.setattr(cuda, "copy_to_device", fail("cudaErrorInvalidValue"))
    with pytest.raises(cuda.CudaError):
        runner.run({"x": np.zeros((2, 4), np.float32)})
    assert cuda.is_sticky(_Enum("CUDA_ERROR_ILLEGAL_ADDRESS"))
    assert not cuda.is_sticky(_Enum("cudaErrorMemoryAllocation"))


# -- choosing the backend -----------------------------------------------------------------------


def test_auto_prefers_tensorrt_when_it_imports_and_a_gpu_is_present_without_tensorrt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert "tensorrt" in backends.available()
    monkeypatch.setattr(backends, "tensorrt_available", lambda: True)
    assert backends.resolve("auto") == "tensorrt"
    monkeypatch.setattr(backends, "tensorrt_available", lambda: False)
    monkeypatch.setattr(backends, "cuda_available", lambda: False)
    assert backends.resolve("auto") == "onnxruntime"
    assert backends.resolve("tensorrt") == "tensorrt"  # asked for by name: its loader explains


def test_a_stubs_only_tensorrt_folder_does_not_count_without_tensorrt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bare ``tensorrt`` folder (type stubs) is not TensorRT proper: it is passed over for
    TensorRT for RTX where that is installed, and refused where nothing else is."""
    if (
        "tensorrt" in sys.modules
        and tensorrt_runtime.flavour(sys.modules["tensorrt"]) == "tensorrt"
    ):
        pytest.skip("a real TensorRT proper is imported here, and a bare folder cannot shadow it")
    (tmp_path / "tensorrt").mkdir()
    (tmp_path / "tensorrt" / "__init__.pyi").write_text("class Builder: ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = sys.modules.pop("tensorrt", None)
    try:
        rtx = importlib.util.find_spec("tensorrt_rtx_bindings") is not None
        if rtx:
            assert tensorrt_runtime.require_tensorrt().startswith("tensorrt-rtx ")
        monkeypatch.setitem(sys.modules, "tensorrt_rtx_bindings", None)
        assert not tensorrt_runtime.importable()
        with pytest.raises(tensorrt_runtime.TensorRTUnavailable, match="not TensorRT"):
            tensorrt_runtime.require_tensorrt()
    finally:
        sys.modules.pop("tensorrt", None)
        if saved is not None:
            sys.modules["tensorrt"] = saved


def test_the_backend_says_how_to_get_tensorrt_where_it_is_missing_without_tensorrt(
    tiny: tuple[Path, ModelSpec], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError
    monkeypatch.setitem(sys.modules, "tensorrt_rtx_bindings", None)  # and TensorRT for RTX
    path, spec = tiny
    with pytest.raises(
        tensorrt_runtime.TensorRTUnavailable, match="TensorRT is not installed"
    ) as caught:
        backends.loader("tensorrt")(path, spec, EngineOptions())
    assert "NVIDIA's TensorRT container" in str(caught.value)
    assert "stoker[tensorrt-rtx]" in str(caught.value)
