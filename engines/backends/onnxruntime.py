"""ONNX Runtime on the CPU: the embedded default backend, for laptops, CI and GPU-less nodes."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort

from engines.base import EngineOptions
from engines.spec import ONNX_TO_V2, ModelSpec, TensorSpec

BACKEND = "onnxruntime"


def read_spec(path: Path, name: str, max_batch_size: int) -> ModelSpec:
    """The tensor contract declared by an ONNX file.

    With ``max_batch_size > 0`` the first dimension of every input and output is the batch
    dimension and is dropped from the row shape; symbolic dimensions become -1.
    """
    graph = onnx.load(str(path), load_external_data=False).graph
    initializers = {init.name for init in graph.initializer}

    def tensors(values: list[onnx.ValueInfoProto]) -> tuple[TensorSpec, ...]:
        result = []
        for value in values:
            if value.name in initializers:
                continue
            tensor_type = value.type.tensor_type
            dims = tuple(
                d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1
                for d in tensor_type.shape.dim
            )
            if max_batch_size > 0:
                if not dims:
                    raise ValueError(f"{path}: {value.name!r} is a scalar but the model is batched")
                dims = dims[1:]
            result.append(TensorSpec(value.name, ONNX_TO_V2[tensor_type.elem_type], dims))
        return tuple(result)

    return ModelSpec(
        name=name,
        inputs=tensors(list(graph.input)),
        outputs=tensors(list(graph.output)),
        max_batch_size=max_batch_size,
    )


def threads_per_runner(options: EngineOptions) -> int:
    """Divide the cores between runners so that together they never oversubscribe."""
    cores = options.cpu_threads or os.cpu_count() or 1
    return max(1, cores // max(1, options.runners))


def cpu_session(model: bytes | str, threads: int, *, optimize: bool = True) -> ort.InferenceSession:
    """A CPU session as the runners use it: ``threads`` intra-op threads (0: ONNX Runtime's
    choice), one inter-op thread, all graph optimizations (none with ``optimize=False``: Q/DQ
    nodes then run in float instead of fused into integer kernels)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if optimize
        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    # Spinning threads burn the cores other runners need while they wait for work.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model, sess_options=options, providers=["CPUExecutionProvider"])


BF16 = np.dtype(ml_dtypes.bfloat16)


def ort_value(array: np.ndarray) -> ort.OrtValue:
    """``array`` as an OrtValue over its memory; a BF16 one by its 16-bit patterns, which
    ONNX Runtime takes as BFLOAT16 (its numpy conversion knows no bfloat16)."""
    if array.dtype == BF16:
        bits = np.ascontiguousarray(array).view(np.uint16)
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, onnx.TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array))


def array_of(value: ort.OrtValue) -> np.ndarray:
    """An output OrtValue as a numpy array of its own; a BF16 one copied out bit for bit
    (``OrtValue.numpy`` refuses it)."""
    if value.data_type() != "tensor(bfloat16)":
        result: np.ndarray = value.numpy()
        return result
    out = np.empty(tuple(value.shape()), BF16)
    if out.size:
        ctypes.memmove(out.ctypes.data, value.data_ptr(), out.nbytes)
    return out


class OrtRunner:
    def __init__(self, model: bytes, spec: ModelSpec, threads: int) -> None:
        self._session = cpu_session(model, threads)
        self._output_names = [t.name for t in spec.outputs]
        # ONNX Runtime runs BF16 graphs (Identity, Cast...) but its Python API cannot take or
        # give a numpy bfloat16: such a model's tensors go through OrtValues.
        self._through_values = any(t.datatype == "BF16" for t in (*spec.inputs, *spec.outputs))

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._through_values:
            feeds = {name: ort_value(array) for name, array in inputs.items()}
            outputs = self._session.run_with_ort_values(self._output_names, feeds)
            return {n: array_of(v) for n, v in zip(self._output_names, outputs, strict=True)}
        values = self._session.run(self._output_names, dict(inputs))
        return dict(zip(self._output_names, values, strict=True))

    def close(self) -> None:
        del self._session


class OrtEngine:
    backend = BACKEND
    pixel_input: str | None = None  # pixels are normalised by the service
    text_inputs = True
    """BYTES inputs go in as ``str``: ONNX Runtime's Python API makes a bytes element its
    repr (the service decodes them from UTF-8 first, ``app.engine.models.InputPolicy``)."""

    def __init__(self, path: Path, spec: ModelSpec, options: EngineOptions) -> None:
        self.spec = spec
        self._model = path.read_bytes()
        self._threads = threads_per_runner(options)

    def new_runner(self) -> OrtRunner:
        return OrtRunner(self._model, self.spec, self._threads)

    def close(self) -> None:
        self._model = b""


def load(path: Path, spec: ModelSpec, options: EngineOptions) -> OrtEngine:
    return OrtEngine(path, spec, options)
