"""TensorRT: a strongly typed plan per precision variant, execution contexts on their own
CUDA streams.

The engine deserializes the plan (built or loaded by ``engines.backends.tensorrt.build``) once
per model and precision. A runner is one execution context with its own non-blocking CUDA stream,
device buffers sized for the max batch and pinned host staging buffers, all through
``engines.devices.cuda``. Per batch it sets every input's shape (``set_input_shape``) and every I/O
tensor's address (``set_tensor_address``, names from ``num_io_tensors`` /
``get_tensor_name`` / ``get_tensor_mode``), enqueues the host-to-device copies,
``execute_async_v3`` and the device-to-host copies on its stream, records an event and waits
for it: a blocking-sync wait with the GIL released, on the runner pool's thread, so the event
loop and the other runners keep going. Optionally each batch size's enqueue is captured into
a CUDA graph and replayed. The runners share the plan's one optimization profile (profile
sharing between contexts is TensorRT's default since 10.0).

Only the TensorRT 10/11 API is used; nothing of 8.x (bindings, ``execute_async_v2``,
``build_engine``, ``max_workspace_size``), which mypy checks against TensorRT's stubs.
The I/O description and buffer sizing are plain functions of what the engine reports,
unit-tested without TensorRT.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engines.backends.tensorrt.build import BACKEND, TensorRTOptions, ensure_plan
from engines.backends.tensorrt.runtime import (
    Shape,
    current_target,
    dims,
    importable,
    tensorrt_logger,
    tensorrt_module,
)
from engines.base import EngineOptions
from engines.devices import cuda
from engines.spec import ModelSpec, numpy_dtype

if TYPE_CHECKING:
    import tensorrt as trt

__all__ = ["BACKEND", "TensorRTEngine", "TensorRTOptions", "TensorRTRunner", "importable", "load"]

log = logging.getLogger(__name__)

# TensorRT's I/O types that have a numpy (and V2) equivalent; FP8, INT4, FP4 and E8M0 do not,
# and a plan with such an input or output is refused when it loads.
TRT_TO_V2 = {
    "FLOAT": "FP32",
    "HALF": "FP16",
    "BF16": "BF16",
    "INT8": "INT8",
    "INT32": "INT32",
    "INT64": "INT64",
    "BOOL": "BOOL",
    "UINT8": "UINT8",
}


# -- what the engine says about its tensors --------------------------------------------------


@dataclass(frozen=True)
class IoTensor:
    """One I/O tensor as the engine reports it: ``shape`` includes the batch dimension of a
    batched model, -1 where dynamic; ``datatype`` is the V2 name."""

    name: str
    is_input: bool
    datatype: str
    shape: Shape


def describe_io(engine: trt.ICudaEngine) -> list[IoTensor]:
    """Every I/O tensor of an engine, by the name-based API.

    Enums are compared by name (``.name`` of TensorRT's pybind11 enums), so any object with
    the same five members answers too: the unit tests' stand-in for an engine.
    """
    tensors = []
    for index in range(engine.num_io_tensors):
        name = engine.get_tensor_name(index)
        mode = engine.get_tensor_mode(name).name
        if mode not in ("INPUT", "OUTPUT"):
            continue
        dtype = engine.get_tensor_dtype(name).name
        datatype = TRT_TO_V2.get(dtype)
        if datatype is None:
            raise ValueError(f"tensor {name!r} is {dtype} in the engine, which numpy cannot hold")
        tensors.append(
            IoTensor(name, mode == "INPUT", datatype, dims(engine.get_tensor_shape(name)))
        )
    return tensors


def match_io(io: Sequence[IoTensor], spec: ModelSpec) -> tuple[list[IoTensor], list[IoTensor]]:
    """The engine's inputs in the contract's order, and its outputs: the contract's first, in
    its order, then any the contract leaves out (they are bound but not returned). Names,
    direction, datatype and rank must agree with the contract."""
    by_name = {t.name: t for t in io}
    problems: list[str] = []
    extra = 1 if spec.batched else 0

    def pick(kind: str, wanted: Sequence[Any], is_input: bool) -> list[IoTensor]:
        found = []
        for want in wanted:
            got = by_name.get(want.name)
            if got is None or got.is_input != is_input:
                problems.append(f"{kind} {want.name!r} is not an {kind} of the engine")
                continue
            if got.datatype != want.datatype:
                problems.append(
                    f"{kind} {want.name!r} is {got.datatype} in the engine, "
                    f"{want.datatype} in the model's contract"
                )
            if len(got.shape) != len(want.shape) + extra:
                problems.append(
                    f"{kind} {want.name!r} has {len(got.shape)} dimensions in the engine, "
                    f"{len(want.shape) + extra} by the model's contract"
                )
            found.append(got)
        return found

    inputs = pick("input", spec.inputs, True)
    outputs = pick("output", spec.outputs, False)
    unknown = [t.name for t in io if t.is_input and spec.input(t.name) is None]
    if unknown:
        problems.append(f"the engine needs inputs {unknown} that the model's contract lacks")
    if problems:
        raise ValueError(f"{spec.name}: the TensorRT engine does not fit: {'; '.join(problems)}")
    outputs += [t for t in io if not t.is_input and spec.output(t.name) is None]
    return inputs, outputs


def max_input_shape(
    tensor: IoTensor, profile_max: Shape | None, max_rows: int, batched: bool
) -> Shape:
    """The largest shape an input takes: the engine's own where static, else the profile's
    max, whose batch dimension must be the max batch size."""
    shape = tensor.shape if -1 not in tensor.shape else profile_max
    if shape is None or -1 in shape:
        raise ValueError(f"input {tensor.name!r}: no profile fixes its shape {list(tensor.shape)}")
    if batched and shape[0] != max_rows:
        raise ValueError(
            f"input {tensor.name!r}: the plan takes up to {shape[0]} rows, the model {max_rows}"
        )
    return shape


def buffer_bytes(shape: Shape, datatype: str) -> int:
    """Bytes of a dense tensor of ``shape``."""
    if any(d < 0 for d in shape):
        raise ValueError(f"shape {list(shape)} is not concrete")
    return prod(shape) * numpy_dtype(datatype).itemsize


# -- engine and runner -----------------------------------------------------------------------


class TensorRTEngine:
    """One deserialized plan, shared by the runners' execution contexts."""

    backend = BACKEND
    pixel_input: str | None = None  # pixels are normalised by the service

    def __init__(
        self,
        path: Path,
        spec: ModelSpec,
        options: EngineOptions,
        trt_options: TensorRTOptions | None = None,
    ) -> None:
        if TYPE_CHECKING:  # the stubs' API, whichever TensorRT runs
            import tensorrt as trt
        else:
            trt = tensorrt_module()

        self.spec = spec
        self.options = trt_options or TensorRTOptions()
        self.device = self.options.device
        self.max_rows = max(1, spec.max_batch_size)
        cuda.set_device(self.device)
        self.target = current_target(self.device)
        plan = ensure_plan(path, spec, options, self.options, self.target)
        self._runtime: trt.Runtime | None = trt.Runtime(tensorrt_logger())
        if self.options.version_compatible:
            # A version-compatible plan carries the lean runtime, which is host code.
            self._runtime.engine_host_code_allowed = True
        engine = self._runtime.deserialize_cuda_engine(plan)
        if engine is None:
            raise RuntimeError(
                f"{spec.name}: TensorRT could not deserialize the plan; its errors are logged"
            )
        self._engine: trt.ICudaEngine | None = engine
        self.inputs, self.outputs = match_io(describe_io(engine), spec)
        self.input_shapes = {
            t.name: max_input_shape(
                t,
                dims(engine.get_tensor_profile_shape(t.name, 0)[2]) if -1 in t.shape else None,
                self.max_rows,
                spec.batched,
            )
            for t in self.inputs
        }

    @property
    def cuda_engine(self) -> trt.ICudaEngine:
        if self._engine is None:
            raise RuntimeError(f"{self.spec.name}: the TensorRT engine is closed")
        return self._engine

    def new_runner(self) -> TensorRTRunner:
        return TensorRTRunner(self)

    def close(self) -> None:
        # The runners' contexts go first (the pool closes them); then the engine, then the
        # runtime that made it.
        self._engine = None
        self._runtime = None


@dataclass
class _Slot:
    tensor: IoTensor
    dtype: np.dtype[Any]
    host: cuda.HostBuffer
    device: cuda.DeviceBuffer


class TensorRTRunner:
    """One lane: an execution context, a stream, an event, pinned and device buffers."""

    def __init__(self, engine: TensorRTEngine) -> None:
        self.engine = engine
        self.device = engine.device
        self._spec = engine.spec
        self._inputs: list[_Slot] = []
        self._outputs: list[_Slot] = []
        self._graphs: dict[int, cuda.Graph] = {}
        self._use_graphs = engine.options.cuda_graphs
        # Looked up once: on every batch it would retry a failing ``import tensorrt``.
        self._trt = tensorrt_module()
        self._stream: cuda.Stream | None = None
        self._done: cuda.Event | None = None
        cuda.set_device(self.device)
        context = engine.cuda_engine.create_execution_context()
        if context is None:
            raise RuntimeError(
                f"{self._spec.name}: TensorRT could not create an execution context "
                "(out of GPU memory?)"
            )
        self._context: trt.IExecutionContext | None = context
        try:
            self._stream = cuda.Stream(self.device)
            self._done = cuda.Event(self.device)
            for tensor in engine.inputs:
                shape = engine.input_shapes[tensor.name]
                self._inputs.append(self._slot(tensor, shape))
                self._set_shape(tensor.name, shape)
            # With every input at its largest, each output's shape is its largest too.
            for tensor in engine.outputs:
                shape = dims(context.get_tensor_shape(tensor.name))
                if -1 in shape:
                    raise ValueError(
                        f"{self._spec.name}: output {tensor.name!r} has a data-dependent shape "
                        f"{list(shape)}, which this backend does not serve"
                    )
                self._outputs.append(self._slot(tensor, shape))
        except BaseException:
            self.close()
            raise

    def _slot(self, tensor: IoTensor, shape: Shape) -> _Slot:
        nbytes = buffer_bytes(shape, tensor.datatype)
        host = cuda.HostBuffer(nbytes)
        try:
            device = cuda.DeviceBuffer(self.device, nbytes)
        except BaseException:
            host.close()
            raise
        return _Slot(tensor, numpy_dtype(tensor.datatype), host, device)

    def _set_shape(self, name: str, shape: Shape) -> None:
        if TYPE_CHECKING:  # the stubs' API, whichever TensorRT runs
            import tensorrt as trt
        else:
            trt = self._trt

        if not self.context.set_input_shape(name, trt.Dims(list(shape))):
            raise ValueError(
                f"input {name!r}: shape {list(shape)} is outside the plan's optimization profile"
            )

    @property
    def context(self) -> trt.IExecutionContext:
        if self._context is None:
            raise RuntimeError(f"{self._spec.name}: the runner is closed")
        return self._context

    @property
    def stream(self) -> cuda.Stream:
        if self._stream is None:
            raise RuntimeError(f"{self._spec.name}: the runner is closed")
        return self._stream

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        with cuda.sticky_errors_are_fatal(self._spec.name):
            return self._run(inputs)

    def _run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        spec, context, stream = self._spec, self.context, self.stream
        cuda.set_device(self.device)
        rows = self._rows(inputs)
        for slot in self._inputs:
            array = inputs[slot.tensor.name]
            if array.dtype != slot.dtype:
                raise ValueError(
                    f"input {slot.tensor.name!r}: {array.dtype}, expected {slot.dtype}"
                )
            # Sized for the largest shape: a larger array fails here, before any copy.
            staged = slot.host.array(slot.dtype, array.shape)
            self._set_shape(slot.tensor.name, tuple(array.shape))
            np.copyto(staged, array, casting="no")
            cuda.copy_to_device(slot.device.ptr, slot.host.ptr, array.nbytes, stream)
        for slot in (*self._inputs, *self._outputs):
            context.set_tensor_address(slot.tensor.name, slot.device.ptr)
        shapes = {}
        for slot in self._outputs:
            shape = dims(context.get_tensor_shape(slot.tensor.name))
            if spec.batched and (not shape or shape[0] != rows):
                raise ValueError(
                    f"output {slot.tensor.name!r} has shape {list(shape)} for a batch of {rows}"
                )
            shapes[slot.tensor.name] = shape
        graph = self._graphs.get(rows)
        if graph is not None:
            graph.launch(stream)
        else:
            self._enqueue()
            if self._use_graphs:
                self._capture(rows)
        views = {}
        for slot in self._outputs:
            shape = shapes[slot.tensor.name]
            nbytes = buffer_bytes(shape, slot.tensor.datatype)
            cuda.copy_to_host(slot.host.ptr, slot.device.ptr, nbytes, stream)
            if spec.output(slot.tensor.name) is not None:
                views[slot.tensor.name] = slot.host.array(slot.dtype, shape)
        assert self._done is not None
        self._done.record(stream)
        self._done.synchronize()
        # The pinned buffers are the next batch's: hand out copies.
        return {name: view.copy() for name, view in views.items()}

    def _rows(self, inputs: Mapping[str, np.ndarray]) -> int:
        missing = [s.tensor.name for s in self._inputs if s.tensor.name not in inputs]
        if missing:
            raise ValueError(f"inputs {missing} are missing")
        if not self._spec.batched:
            return 1
        counts = {int(inputs[s.tensor.name].shape[0]) for s in self._inputs}
        if len(counts) != 1:
            raise ValueError(f"inputs disagree on the batch size: {sorted(counts)}")
        rows = counts.pop()
        if not 1 <= rows <= self.engine.max_rows:
            raise ValueError(
                f"a batch of {rows} rows; this engine takes 1 to {self.engine.max_rows}"
            )
        return rows

    def _enqueue(self) -> None:
        if not self.context.execute_async_v3(self.stream.ptr):
            # A broken context makes the stream fail too: that raises the CUDA error (and a
            # sticky one becomes fatal); otherwise TensorRT has logged why.
            self.stream.synchronize()
            raise RuntimeError(f"{self._spec.name}: execute_async_v3 failed; see TensorRT's log")

    def _capture(self, rows: int) -> None:
        """Capture the enqueue for the next batches of ``rows`` rows. It follows an uncaptured
        enqueue of the same shapes, which did the shape-dependent host work a graph cannot
        hold. A plan that cannot be captured runs uncaptured from then on."""

        def enqueue() -> None:
            if not self.context.execute_async_v3(self.stream.ptr):
                raise RuntimeError("execute_async_v3 failed during CUDA graph capture")

        try:
            self._graphs[rows] = cuda.Graph(self.stream, enqueue)
        except (cuda.CudaError, RuntimeError) as error:
            if isinstance(error, cuda.CudaError) and cuda.is_sticky(error.code):
                raise
            log.warning("%s: no CUDA graph (%s); running without", self._spec.name, error)
            self._use_graphs = False

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        for graph in self._graphs.values():
            graph.close()
        self._graphs.clear()
        for slot in (*self._inputs, *self._outputs):
            slot.host.close()
            slot.device.close()
        self._inputs, self._outputs = [], []
        self._context = None
        if self._done is not None:
            self._done.close()
            self._done = None
        if self._stream is not None:
            self._stream.close()
            self._stream = None


def load(path: Path, spec: ModelSpec, options: EngineOptions) -> TensorRTEngine:
    """The registry's loader: default TensorRT options, GPU 0."""
    return TensorRTEngine(path, spec, options)
