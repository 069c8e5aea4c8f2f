"""torch on CUDA: the GPU backend for machines without TensorRT.

The model is the ONNX file itself, converted op by op into a ``torch.nn.Module``
(``engines.backends.torch.convert``). Precision:

- ``fp32``: IEEE float32 (TF32 off for convolutions and matmuls);
- ``tf32``: float32 tensors, TF32 tensor-core math;
- ``fp16`` / ``bf16``: torch-native casting of the FP32 graph's weights and input, outputs
  cast back to the output's declared type. (The ONNX ``fp16`` variant, with its FP32 islands,
  also loads: it is converted as it is, Casts included.)

A runner is one execution lane: its own CUDA stream (``engines.devices.cuda``), pinned host buffers
and static device buffers sized for the max batch, and one CUDA graph per batch bucket (the
preferred sizes, the powers of two and the max batch). A batch is padded up to its bucket;
the padding rows are computed and dropped, never returned. Tensors are channels-last, which
cuDNN's tensor-core convolutions want. When the model's preprocessing is given, the image
input also accepts UINT8 pixels, which are normalised on the GPU inside the graph (a quarter
of the bytes over PCIe). The calling thread waits on a blocking-sync event with the GIL
released, so other runners and the event loop run meanwhile.

With ``gpu.compile`` the module is compiled by ``torch.compile`` before the graphs are
captured (``engines.backends.torch.compiled``; kept in the engine store). The engine's GPU
memory is capped at ``gpu.memory_fraction`` of each GPU: a runner whose graphs do not fit is
retried with smaller max batches, and the model is refused naming the largest that fits, or
served with it (``gpu.on_out_of_memory``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto

from engines.backends.torch import compiled
from engines.backends.torch.convert import OnnxModule, UnsupportedModel, convert
from engines.base import EngineOptions, ModelDoesNotFit
from engines.devices import cuda
from engines.devices.options import GpuOptions
from engines.preprocess import ImagePreprocess
from engines.spec import ModelSpec, TensorSpec
from engines.store import EngineKey

BACKEND = "torch"


PRECISIONS = ("fp32", "tf32", "fp16", "bf16")


log = logging.getLogger(__name__)


# TF32 is a process-wide switch in torch; a CUDA graph bakes in the kernels chosen while it
# was captured, so each runner's precision is fixed by capturing under the right switch,
# one capture at a time.
_CAPTURE_LOCK = threading.Lock()


_NUMPY_TO_TORCH: dict[str, torch.dtype] = {
    "FP32": torch.float32,
    "FP16": torch.float16,
    "BF16": torch.bfloat16,
    "FP64": torch.float64,
    "INT64": torch.int64,
    "INT32": torch.int32,
    "INT8": torch.int8,
    "UINT8": torch.uint8,
    "BOOL": torch.bool,
}


def compute_dtype(precision: str) -> torch.dtype | None:
    """The dtype weights and activations are cast to; None keeps the graph's own."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)


def graph_precision(path: Path) -> str:
    """``fp16`` for a float16 variant (float16 initializers), else ``fp32``."""
    graph = onnx.load(str(path), load_external_data=False).graph
    halves = sum(1 for init in graph.initializer if init.data_type == TensorProto.FLOAT16)
    return "fp16-variant" if halves else "fp32"


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """TF32 math on or off for what runs (or is captured) inside."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn


def buckets(max_batch_size: int, preferred: Sequence[int] = ()) -> list[int]:
    """Batch sizes that get a CUDA graph: powers of two, the preferred sizes, the max."""
    sizes = {max_batch_size, *(p for p in preferred if 0 < p <= max_batch_size)}
    power = 1
    while power < max_batch_size:
        sizes.add(power)
        power *= 2
    return sorted(sizes)


# One core copies about 6 GB/s: a batch of 256 FP32 images (154 MB) would take longer to stage
# than the H200 takes to run it. Large batches are copied in slices by several threads
# (np.copyto releases the GIL), shared by every runner of the process.
_COPY_SLICE_BYTES = 4 << 20


_COPY_THREADS = min(8, os.cpu_count() or 1)


_copy_pool: ThreadPoolExecutor | None = None


_copy_pool_lock = threading.Lock()


def staged_copy(dst: np.ndarray, blocks: Sequence[np.ndarray]) -> None:
    """``dst[:] = np.concatenate(blocks)`` without the joined array: each block copied
    straight to its rows of ``dst``, in parallel slices when the whole is large."""
    pieces: list[tuple[np.ndarray, np.ndarray]] = []
    offset = 0
    for block in blocks:
        rows = len(block)
        slices = max(1, min(_COPY_THREADS, block.nbytes // _COPY_SLICE_BYTES, rows))
        bounds = np.linspace(0, rows, slices + 1).astype(int)
        pieces += [
            (dst[offset + a : offset + b], block[a:b]) for a, b in itertools.pairwise(bounds)
        ]
        offset += rows
    if len(pieces) < 2 or dst.nbytes < 2 * _COPY_SLICE_BYTES:
        for target, source in pieces:
            np.copyto(target, source, casting="no")
        return
    global _copy_pool
    with _copy_pool_lock:
        if _copy_pool is None:
            _copy_pool = ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="stage")
        pool = _copy_pool
    # One job per thread, each a share of the pieces: many small blocks (a batch of single
    # images) cost one submit per thread, not one per image.
    shares = [pieces[i::_COPY_THREADS] for i in range(min(_COPY_THREADS, len(pieces)))]
    for job in [pool.submit(_copy_all, share) for share in shares]:
        job.result()


def _copy_all(pieces: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for target, source in pieces:
        np.copyto(target, source, casting="no")


@dataclass(frozen=True)
class TorchOptions:
    """What the torch backend takes beyond ``EngineOptions``.

    ``precision`` is one of ``PRECISIONS`` or None (the graph's own: fp32, or the fp16
    variant as converted). ``devices``: the GPUs runners are placed on, round-robin (one
    copy of the weights per GPU). ``image``: the model's preprocessing, which lets the image
    input take UINT8 pixels normalised on the GPU. ``batch_buckets`` replaces the default
    buckets (``buckets()``). ``cuda_graphs`` off runs eagerly, to measure what graphs save.
    ``gpu``: compiling and the memory the engine may take (the model config's ``gpu:``).
    """

    precision: str | None = None
    devices: tuple[int, ...] = (0,)
    image: ImagePreprocess | None = None
    preferred_batch_sizes: tuple[int, ...] = ()
    batch_buckets: tuple[int, ...] = ()
    cuda_graphs: bool = True
    channels_last: bool = True
    gpu: GpuOptions = field(default_factory=GpuOptions)


# torch caps the caching allocator per process and device; several models in one engine
# process share the cap, so the smallest fraction any of them asked for holds.
_memory_fractions: dict[int, float] = {}


def limit_memory(device: int, fraction: float) -> float:
    """Cap torch's allocator on ``device`` at ``fraction`` of its memory (or a smaller cap
    already set), never below what it already holds (a model loaded later must not starve
    the ones serving); the cap that now holds."""
    held = min(fraction, _memory_fractions.get(device, 1.0))
    in_use = reserved(device) / torch.cuda.get_device_properties(device).total_memory
    if held < in_use:
        log.warning(
            "GPU %d: a memory_fraction of %.2f is below the %.2f already in use; capping at that",
            device,
            held,
            in_use,
        )
        held = min(1.0, in_use)
    _memory_fractions[device] = held
    torch.cuda.set_per_process_memory_fraction(held, device)
    return held


def reserved(device: int) -> int:
    """Bytes torch's allocator holds on ``device`` (weights, buffers, graph pools, cache)."""
    return int(torch.cuda.memory_reserved(device))


class TorchEngine:
    backend = BACKEND

    def __init__(
        self, path: Path, spec: ModelSpec, options: EngineOptions, torch_options: TorchOptions
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("the torch backend needs CUDA; use backend: onnxruntime")
        dynamic = [t.name for t in (*spec.inputs, *spec.outputs) if not t.is_static]
        if dynamic:
            raise UnsupportedModel(
                f"{spec.name}: {', '.join(dynamic)} have dynamic dimensions besides the batch; "
                "the torch backend's static buffers and CUDA graphs need fixed row shapes"
            )
        precision = torch_options.precision or graph_precision(path)
        if precision not in (*PRECISIONS, "fp16-variant"):
            raise ValueError(f"unknown precision {precision!r}; one of {', '.join(PRECISIONS)}")
        self.spec = spec
        self.precision = precision
        self.options = torch_options
        # The image input takes UINT8 pixels too, normalised inside the CUDA graph.
        self.pixel_input = spec.inputs[0].name if torch_options.image is not None else None
        self.devices = torch_options.devices or (0,)
        self.cuda_graphs = torch_options.cuda_graphs
        if not spec.batched:
            self.buckets = [0]
        elif torch_options.batch_buckets:
            self.buckets = sorted(torch_options.batch_buckets)
            if self.buckets[-1] < spec.max_batch_size:
                raise ValueError(f"batch buckets {self.buckets} do not reach the max batch")
        else:
            self.buckets = buckets(spec.max_batch_size, torch_options.preferred_batch_sizes)
        # cuDNN times its algorithms once per shape; the graphs then replay the winner.
        torch.backends.cudnn.benchmark = True
        dtype = compute_dtype(precision)
        gpu = torch_options.gpu
        self._store = options.store
        self._modules: dict[int, OnnxModule] = {}
        self._calls: dict[int, Any] = {}
        self._artifacts: dict[int, EngineKey] = {}
        self._unsaved: set[int] = set()
        self._compiled_on: set[int] = set()
        self.weight_bytes: dict[int, int] = {}
        """Per GPU, the bytes of the engine's copy of the weights (parameters and buffers)."""
        self.runner_bytes: list[int] = []
        """Per runner, in order made, what its buffers and graphs took of the allocator."""
        for device in self.devices:
            self.memory_fraction = limit_memory(device, gpu.memory_fraction)
            module = convert(path).to(device=torch.device("cuda", device), dtype=dtype)
            if torch_options.channels_last:
                for attr, buffer in list(module.named_buffers()):
                    if buffer.dim() == 4:
                        setattr(module, attr, buffer.contiguous(memory_format=torch.channels_last))
            self._modules[device] = module
            self.weight_bytes[device] = sum(
                t.numel() * t.element_size()
                for t in itertools.chain(module.parameters(), module.buffers())
            )
            self._calls[device] = module
            if gpu.compile != "none":
                key = compiled.artifact_key(
                    path,
                    spec.name,
                    precision,
                    gpu.compile,
                    torch.device("cuda", device),
                    self.buckets,
                    {"channels_last": torch_options.channels_last},
                )
                self._artifacts[device] = key
                if not compiled.load_artifacts(self._store, key):
                    self._unsaved.add(device)
                self._calls[device] = compiled.compile_module(
                    module, gpu.compile, len(self.buckets)
                )
        self._next = 0
        self._lock = threading.Lock()

    def module(self, device: int) -> OnnxModule:
        return self._modules[device]

    def call(self, device: int) -> Any:
        """What a runner on ``device`` runs: the module, or the module compiled."""
        return self._calls[device]

    def new_runner(self) -> TorchRunner:
        with self._lock:
            device = self.devices[self._next % len(self.devices)]
            self._next += 1
        before = reserved(device)
        fell_back = False
        try:
            runner = self._runner_or_none(device)
        except Exception as error:
            if not self._compiles(device):
                raise
            # A graph the converter runs but Inductor cannot compile still serves,
            # uncompiled (slower: the warning says so), rather than not at all.
            log.warning(
                "%s: torch.compile failed on GPU %d (%s: %s); serving the converted graph "
                "uncompiled",
                self.spec.name,
                device,
                type(error).__name__,
                str(error).splitlines()[0][:300] if str(error) else "",
            )
            self._calls[device] = self._modules[device]
            self._unsaved.discard(device)
            fell_back = True
        if fell_back:  # made again here, once the failed one's memory went with the error
            runner = self._runner_or_none(device)
        if runner is None:
            runner = self._fit(device)
        self._compiled_on.add(device)
        self.runner_bytes.append(reserved(device) - before)
        if device in self._unsaved and compiled.save_artifacts(
            self._store, self._artifacts[device]
        ):
            self._unsaved.discard(device)
        return runner

    def _compiles(self, device: int) -> bool:
        return self._calls[device] is not self._modules[device]

    def _runner_or_none(self, device: int) -> TorchRunner | None:
        """A runner with every bucket; None where it does not fit the memory left. The first
        runner on a GPU compiles (or traces, with kernels from the store) and logs each bucket
        as it goes, the first build being minutes long."""
        announce = self._compiles(device) and device not in self._compiled_on
        try:
            return TorchRunner(self, device, self.buckets, announce=announce)
        except torch.OutOfMemoryError:
            return None  # the caller retries smaller, once this runner's memory is released

    def _fit(self, device: int) -> TorchRunner:
        """A runner with the largest max batch that fits the memory left, tried from the
        next smaller bucket down; kept as the new max (``shrink``) or refused."""
        wanted = self.buckets[-1]
        runner, largest = None, 0
        for size in reversed(self.buckets[:-1]):
            torch.cuda.empty_cache()
            try:
                runner = TorchRunner(self, device, [b for b in self.buckets if b <= size])
            except torch.OutOfMemoryError:
                continue
            largest = size
            break
        gib = torch.cuda.get_device_properties(device).total_memory * self.memory_fraction / 2**30
        where = (
            f"{self.spec.name}: a batch of {wanted} does not fit "
            f"{self.memory_fraction:.0%} of GPU {device} ({gib:.1f} GiB) with "
            f"{len(self.runner_bytes)} runner(s) already made"
        )
        if runner is not None and self.options.gpu.on_out_of_memory == "shrink":
            log.warning("%s; serving with a max batch of %d (gpu.on_out_of_memory: shrink)",
                        where, largest)  # fmt: skip
            self.buckets = [b for b in self.buckets if b <= largest]
            self.spec = dataclasses.replace(self.spec, max_batch_size=largest)
            return runner
        if runner is not None:
            runner.close()
        fits = f"the largest that fits is {largest}" if largest else "not even a batch of 1 fits"
        raise ModelDoesNotFit(
            f"{where}; {fits}: lower max_batch_size or runners, raise gpu.memory_fraction "
            "or set gpu.on_out_of_memory: shrink"
        )

    def close(self) -> None:
        self._calls.clear()
        self._modules.clear()
        torch.cuda.empty_cache()


@dataclass
class _Input:
    spec: TensorSpec
    formats: dict[str, torch.dtype]  # accepted V2 datatype -> device buffer dtype
    host: dict[str, cuda.HostBuffer]
    device: dict[str, torch.Tensor]


class TorchRunner:
    """One lane: a stream, pinned staging, static device buffers and a graph per bucket."""

    def __init__(
        self, engine: TorchEngine, device: int, buckets: Sequence[int], announce: bool = False
    ) -> None:
        self.engine = engine
        self.device = device
        spec = engine.spec
        self._spec = spec
        self._module = engine.call(device)
        self._buckets = list(buckets)
        self._announce = announce
        self._max = max(1, self._buckets[-1]) if spec.batched else 1
        self._dtype = compute_dtype(engine.precision)
        image = engine.options.image
        self._image_input = engine.pixel_input
        self._normalize: tuple[torch.Tensor, torch.Tensor] | None = None
        torch_device = torch.device("cuda", device)
        # Filled as they are made, so that a runner failing half-way (out of memory while
        # capturing, or even while allocating its buffers) frees what it made.
        self._inputs: list[_Input] = []
        self._outputs: dict[str, cuda.HostBuffer] = {}
        self._graphs: dict[tuple[int, str], tuple[torch.cuda.CUDAGraph, tuple[Any, ...]]] = {}
        with torch.cuda.device(device):
            self._stream = cuda.Stream(device)
            self._done = cuda.Event(device)
            self._torch_stream = torch.cuda.ExternalStream(  # type: ignore[no-untyped-call]
                self._stream.ptr, device=torch_device
            )
            try:
                if image is not None:
                    shape = (1, 3, 1, 1) if image.layout == "NCHW" else (1, 1, 1, 3)
                    mean = torch.tensor(image.mean, dtype=torch.float32, device=torch_device)
                    inv_std = 1.0 / torch.tensor(
                        image.std, dtype=torch.float32, device=torch_device
                    )
                    self._normalize = (mean.reshape(shape), inv_std.reshape(shape))
                with torch.cuda.stream(self._torch_stream):
                    for t in spec.inputs:
                        self._make_input(t, torch_device)
                    for t in spec.outputs:
                        self._outputs[t.name] = cuda.HostBuffer(self._rows_bytes(t, self._max))
                if engine.cuda_graphs:
                    self._capture_all()
            except BaseException:
                self.close()
                raise

    # -- setup ----------------------------------------------------------------------------

    def _rows_bytes(self, tensor: TensorSpec, rows: int) -> int:
        return tensor.row_bytes() * (rows if self._spec.batched else 1)

    def _shape(self, tensor: TensorSpec, rows: int) -> tuple[int, ...]:
        row = tuple(1 if d == -1 else d for d in tensor.shape)
        return (rows, *row) if self._spec.batched else row

    def _make_input(self, tensor: TensorSpec, device: torch.device) -> None:
        formats = {tensor.datatype: _NUMPY_TO_TORCH[tensor.datatype]}
        if tensor.name == self._image_input:
            formats["UINT8"] = torch.uint8
        slot = _Input(tensor, formats, {}, {})
        self._inputs.append(slot)
        for datatype, dtype in formats.items():
            itemsize = torch.empty((), dtype=dtype).element_size()
            shape = self._shape(tensor, self._max)
            slot.host[datatype] = cuda.HostBuffer(int(np.prod(shape)) * itemsize)
            slot.device[datatype] = torch.empty(shape, dtype=dtype, device=device)

    def _formats(self) -> list[str]:
        """Input datatypes of the image input to capture graphs for (the declared one first)."""
        image = next((i for i in self._inputs if i.spec.name == self._image_input), None)
        return list(image.formats) if image else [self._inputs[0].spec.datatype]

    def _prepare(self, fmt: str, rows: int) -> list[torch.Tensor]:
        """The module's inputs from the static device buffers (inside the graph)."""
        values = []
        for slot in self._inputs:
            datatype = fmt if fmt in slot.formats else slot.spec.datatype
            raw = slot.device[datatype]
            x = raw[:rows] if self._spec.batched else raw
            if datatype == "UINT8" and self._normalize is not None:
                mean, inv_std = self._normalize
                x = (x.to(torch.float32) - mean) * inv_std
            if self._dtype is not None and x.is_floating_point():
                x = x.to(self._dtype)
            if self.engine.options.channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            values.append(x)
        return values

    def _forward(self, fmt: str, rows: int) -> tuple[torch.Tensor, ...]:
        outputs = self._module(*self._prepare(fmt, rows))
        result = []
        for tensor, value in zip(self._spec.outputs, outputs, strict=True):
            want = _NUMPY_TO_TORCH[tensor.datatype]
            result.append(value.to(want).contiguous())
        return tuple(result)

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        with _CAPTURE_LOCK, torch.no_grad(), tf32(self.engine.precision == "tf32"):
            # Largest first: the smaller graphs then fit in the memory the pool already has.
            for fmt in self._formats():
                for i, bucket in enumerate(sorted(self._buckets, reverse=True)):
                    started = time.perf_counter()
                    with torch.cuda.stream(self._torch_stream):
                        # cuDNN picks its algorithms (and torch.compile compiles) outside the
                        # capture
                        for _ in range(2):
                            self._forward(fmt, bucket)
                    self._stream.synchronize()
                    if self._announce and fmt == self._formats()[0]:
                        log.info("%s: batch %d compiled (%d of %d buckets) in %.1f s",
                                 self._spec.name, bucket, i + 1, len(self._buckets),
                                 time.perf_counter() - started)  # fmt: skip
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(
                        graph,
                        pool=pool,
                        stream=self._torch_stream,
                        capture_error_mode="thread_local",
                    ):
                        outputs = self._forward(fmt, bucket)
                    self._graphs[(bucket, fmt)] = (graph, outputs)
        self._stream.synchronize()

    # -- running --------------------------------------------------------------------------

    def bucket(self, rows: int) -> int:
        for size in self._buckets:
            if size >= rows:
                return size
        raise ValueError(f"batch of {rows} rows exceeds the max batch size {self._max}")

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.run_blocks([inputs])

    def run_blocks(self, blocks: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """One batch given as blocks of rows, each copied straight into the pinned staging
        buffer (``engines.base.BlockRunner``)."""
        with cuda.sticky_errors_are_fatal(self._spec.name):
            return self._run(blocks)

    def _run(self, blocks: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        spec = self._spec
        name = spec.inputs[0].name
        rows = sum(int(block[name].shape[0]) for block in blocks) if spec.batched else 1
        bucket = self.bucket(rows) if spec.batched else 0
        fmt = spec.inputs[0].datatype
        with torch.cuda.device(self.device):
            for slot in self._inputs:
                arrays = [block[slot.spec.name] for block in blocks]
                array = arrays[0]
                datatype = "UINT8" if array.dtype == np.uint8 and "UINT8" in slot.formats else None
                datatype = datatype or slot.spec.datatype
                if slot.spec.name == self._image_input:
                    fmt = datatype
                self._stage(slot, datatype, arrays, rows)
            if self.engine.cuda_graphs:
                graph, outputs = self._graphs[(bucket, fmt)]
                with torch.cuda.stream(self._torch_stream):
                    graph.replay()
            else:
                with (
                    torch.cuda.stream(self._torch_stream),
                    torch.no_grad(),
                    tf32(self.engine.precision == "tf32"),
                ):
                    outputs = self._forward(fmt, rows)
            views = {}
            for tensor, value in zip(spec.outputs, outputs, strict=True):
                host = self._outputs[tensor.name]
                nbytes = self._rows_bytes(tensor, rows)
                cuda.copy_to_host(host.ptr, value.data_ptr(), nbytes, self._stream)
                shape = (rows, *value.shape[1:]) if spec.batched else tuple(value.shape)
                views[tensor.name] = host.array(tensor.dtype, shape)
            self._done.record(self._stream)
            self._done.synchronize()
        # The pinned buffers are reused by the next batch: hand out copies.
        return {name: view.copy() for name, view in views.items()}

    def _stage(self, slot: _Input, datatype: str, arrays: list[np.ndarray], rows: int) -> None:
        """Pageable request memory -> pinned staging -> device buffer, on the runner's stream;
        ``arrays``: the batch's blocks of rows for this input, joined in the pinned buffer."""
        dtype = slot.formats.get(datatype)
        if dtype is None:
            raise ValueError(f"input {slot.spec.name!r}: datatype {datatype} not accepted")
        device = slot.device[datatype]
        host = slot.host[datatype]
        batched = self._spec.batched
        want = tuple(device.shape[1:]) if batched else tuple(device.shape)
        expected = np.dtype(np.uint8) if datatype == "UINT8" else slot.spec.dtype
        for array in arrays:
            got = tuple(array.shape[1:]) if batched else tuple(array.shape)
            if got != want:
                raise ValueError(
                    f"input {slot.spec.name!r}: rows of {list(got)}, expected {list(want)}"
                )
            if array.dtype != expected:
                raise ValueError(f"input {slot.spec.name!r}: {array.dtype}, expected {expected}")
        staging = host.array(expected, (rows, *want) if batched else want)
        if batched:
            staged_copy(staging, arrays)
        else:
            np.copyto(staging, arrays[0], casting="no")
        cuda.copy_to_device(device.data_ptr(), host.ptr, staging.nbytes, self._stream)

    def graph(self, bucket: int, datatype: str) -> torch.cuda.CUDAGraph:
        """The captured graph of one bucket and input datatype (to time the GPU alone)."""
        return self._graphs[(bucket, datatype)][0]

    @property
    def stream(self) -> torch.cuda.Stream:
        return self._torch_stream

    def close(self) -> None:
        self._stream.synchronize()
        self._graphs.clear()
        for slot in self._inputs:
            for buffer in slot.host.values():
                buffer.close()
        for buffer in self._outputs.values():
            buffer.close()
        self._done.close()
        self._stream.close()


def load(path: Path, spec: ModelSpec, options: EngineOptions) -> TorchEngine:
    """The registry's loader: the graph's own precision; the GPUs, batch buckets and image
    preprocessing the service passes (UINT8 pixels are then normalised on the GPU)."""
    image = options.image
    first = spec.inputs[0] if spec.inputs else None
    takes_pixels = (
        image is not None
        and first is not None
        and first.datatype in ("FP32", "FP16", "BF16")
        and tuple(first.shape) == image.row_shape()
    )
    return TorchEngine(
        path,
        spec,
        options,
        TorchOptions(
            devices=options.devices or (0,),
            image=image if takes_pixels else None,
            preferred_batch_sizes=options.preferred_batch_sizes,
            gpu=options.gpu,
        ),
    )
