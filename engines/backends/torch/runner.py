"""The torch runner: one execution lane of a ``TorchEngine``.

A runner has its own CUDA stream (``engines.devices.cuda``), pinned host buffers and static
device buffers sized for the max batch, and one CUDA graph per batch bucket (the preferred
sizes, the powers of two and the max batch). A batch is padded up to its bucket; the padding
rows are computed and dropped, never returned. Tensors are channels-last, which cuDNN's
tensor-core convolutions want. When the model's preprocessing is given, the image input also
accepts UINT8 pixels, which are normalised on the GPU inside the graph (a quarter of the bytes
over PCIe). The calling thread waits on a blocking-sync event with the GIL released, so other
runners and the event loop run meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from engines.backends.torch.images import DeviceRows
from engines.backends.torch.precision import compute_dtype, tf32
from engines.backends.torch.staging import staged_copy
from engines.base import split_rows
from engines.devices import cuda
from engines.preprocess import ImagePreprocess
from engines.spec import ModelSpec, TensorSpec

log = logging.getLogger(__name__)


# TF32 is a process-wide switch in torch; a CUDA graph bakes in the kernels chosen while it
# was captured, so each runner's precision is fixed by capturing under the right switch,
# one capture at a time.
_CAPTURE_LOCK = threading.Lock()


TORCH_DTYPES: dict[str, torch.dtype] = {
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


def run_pieces(
    pieces: Sequence[int],
    staged: Sequence[torch.Tensor],
    replay: Callable[[int], Sequence[torch.Tensor]],
    copy_out: Callable[[Sequence[torch.Tensor], int, int], None],
) -> Sequence[torch.Tensor]:
    """Run a batch staged at the front of ``staged`` (every input's device buffer) as graphs
    of ``pieces`` rows (``TorchRunner.pieces``), in order: before each graph after the first,
    its rows are moved to the front of every buffer, where the graphs read their rows (one
    copy that does not overlap, since pieces never grow: the rows moved start at or after the
    piece's own length); ``replay(size)`` runs the graph of ``size`` rows and gives its
    outputs, and ``copy_out(outputs, start, size)`` takes its first ``size`` rows to the
    batch's rows from ``start``. The last graph's outputs are returned (their shapes). All of
    it is queued on the current stream."""
    start = 0
    outputs: Sequence[torch.Tensor] = ()
    for size in pieces:
        if start:
            for buffer in staged:
                buffer[:size].copy_(buffer[start : start + size])
        outputs = replay(size)
        copy_out(outputs, start, size)
        start += size
    return outputs


def pinned(array: Any) -> bool:
    """A host block the GPU can read directly: contiguous, in registered memory."""
    return (
        isinstance(array, np.ndarray)
        and array.flags.c_contiguous
        and cuda.host_registered(array.ctypes.data, array.nbytes)
    )


def follows(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Whether ``after``'s rows start where ``before``'s end in one allocation (the rows of
    requests sliced from one decoded batch, in order): one copy takes both."""
    return (
        before.is_contiguous()
        and after.is_contiguous()
        and before.dtype == after.dtype
        and before.device == after.device
        and before.untyped_storage().data_ptr() == after.untyped_storage().data_ptr()
        and before.data_ptr() + before.nbytes == after.data_ptr()
    )


def adjacent(blocks: list[torch.Tensor]) -> torch.Tensor:
    """Blocks each of which ``follows`` the one before, as one view of their rows."""
    if len(blocks) == 1:
        return blocks[0]
    first = blocks[0]
    rows = sum(int(block.shape[0]) for block in blocks)
    return first.new_empty(0).set_(
        first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]), first.stride()
    )


@dataclass
class _Input:
    spec: TensorSpec
    formats: dict[str, torch.dtype]  # accepted V2 datatype -> device buffer dtype
    host: dict[str, cuda.HostBuffer]
    device: dict[str, torch.Tensor]


class Layout(Protocol):
    """The options of a runner's engine that shape its inputs (``TorchOptions``)."""

    @property
    def image(self) -> ImagePreprocess | None: ...
    @property
    def channels_last(self) -> bool: ...


class Engine(Protocol):
    """What a runner reads of its engine (``TorchEngine``, which makes runners)."""

    @property
    def spec(self) -> ModelSpec: ...
    @property
    def precision(self) -> str: ...
    @property
    def options(self) -> Layout: ...
    @property
    def pixel_input(self) -> str | None: ...
    @property
    def cuda_graphs(self) -> bool: ...
    @property
    def split_batches(self) -> bool: ...
    def call(self, device: int) -> Any: ...


class TorchRunner:
    """One lane: a stream, pinned staging, static device buffers and a graph per bucket."""

    def __init__(self, engine: Engine, device: int, buckets: Sequence[int]) -> None:
        self.engine = engine
        self.device = device
        spec = engine.spec
        self._spec = spec
        self._module = engine.call(device)
        self._buckets = list(buckets)
        self._plans: dict[int, list[int]] = {}
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
        formats = {tensor.datatype: TORCH_DTYPES[tensor.datatype]}
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
            want = TORCH_DTYPES[tensor.datatype]
            result.append(value.to(want).contiguous())
        return tuple(result)

    def _capture_all(self) -> None:
        began = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        with _CAPTURE_LOCK, torch.no_grad(), tf32(self.engine.precision == "tf32"):
            # Largest first: the smaller graphs then fit in the memory the pool already has.
            for fmt in self._formats():
                for i, bucket in enumerate(sorted(self._buckets, reverse=True)):
                    started = time.perf_counter()
                    with torch.cuda.stream(self._torch_stream):
                        # cuDNN picks its algorithms outside the capture
                        for _ in range(2):
                            self._forward(fmt, bucket)
                    self._stream.synchronize()
                    log.debug("%s: batch %d warmed (%d of %d buckets) in %.1f s",
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
        log.info("%s: %d CUDA graphs captured on GPU %d in %.1f s", self._spec.name,
                 len(self._graphs), self.device, time.perf_counter() - began)  # fmt: skip

    # -- running --------------------------------------------------------------------------

    def bucket(self, rows: int) -> int:
        for size in self._buckets:
            if size >= rows:
                return size
        raise ValueError(f"batch of {rows} rows exceeds the max batch size {self._max}")

    def pieces(self, rows: int) -> list[int]:
        """The rows of each graph a batch of ``rows`` runs as, in order (one graph but with
        ``gpu.split_batches``)."""
        if not (self.engine.split_batches and self._spec.batched):
            return [rows]
        plan = self._plans.get(rows)
        if plan is None:  # 14-40 us a plan: made once a row count
            plan = self._plans[rows] = split_rows(rows, self._buckets)
        return plan

    def rows_padded_to(self, rows: int) -> int:
        """The rows a batch of ``rows`` runs as: its graphs' buckets' with CUDA graphs, its own
        eagerly (``engines.base.PaddingRunner``)."""
        if not (self.engine.cuda_graphs and self._spec.batched):
            return rows
        return sum(self.bucket(piece) for piece in self.pieces(rows))

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
        if spec.batched:
            self.bucket(rows)  # more rows than the max batch: refused before any is staged
        fmt = spec.inputs[0].datatype
        staged: list[torch.Tensor] = []
        with torch.cuda.device(self.device):
            for slot in self._inputs:
                arrays = [block[slot.spec.name] for block in blocks]
                array = arrays[0]
                datatype = "UINT8" if array.dtype == np.uint8 and "UINT8" in slot.formats else None
                datatype = datatype or slot.spec.datatype
                if slot.spec.name == self._image_input:
                    fmt = datatype
                self._stage(slot, datatype, arrays, rows)
                staged.append(slot.device[datatype])
            if self.engine.cuda_graphs:

                def replay(size: int) -> tuple[torch.Tensor, ...]:
                    graph, outputs = self._graphs[(self.bucket(size) if spec.batched else 0, fmt)]
                    graph.replay()
                    return outputs

                with torch.cuda.stream(self._torch_stream):
                    outputs = run_pieces(self.pieces(rows), staged, replay, self._copy_out)
            else:
                with (
                    torch.cuda.stream(self._torch_stream),
                    torch.no_grad(),
                    tf32(self.engine.precision == "tf32"),
                ):
                    outputs = self._forward(fmt, rows)
                self._copy_out(outputs, 0, rows)
            views = {}
            for tensor, value in zip(spec.outputs, outputs, strict=True):
                shape = (rows, *value.shape[1:]) if spec.batched else tuple(value.shape)
                views[tensor.name] = self._outputs[tensor.name].array(tensor.dtype, shape)
            self._done.record(self._stream)
            self._done.synchronize()
        # The pinned buffers are reused by the next batch: hand out copies.
        return {name: view.copy() for name, view in views.items()}

    def _copy_out(self, outputs: Sequence[torch.Tensor], start: int, rows: int) -> None:
        """A graph's (or the eager call's) first ``rows`` rows of each output into the pinned
        output buffers at row ``start``, on the runner's stream."""
        for tensor, value in zip(self._spec.outputs, outputs, strict=True):
            host = self._outputs[tensor.name]
            offset = self._rows_bytes(tensor, start) if start else 0
            nbytes = self._rows_bytes(tensor, rows)
            cuda.copy_to_host(host.ptr + offset, value.data_ptr(), nbytes, self._stream)

    def _stage(self, slot: _Input, datatype: str, arrays: list[Any], rows: int) -> None:
        """Request memory -> pinned staging -> device buffer, on the runner's stream;
        ``arrays``: the batch's blocks of rows for this input, joined in the pinned buffer.
        Blocks already on a device (``DeviceRows``: JPEGs decoded there) are copied into
        the device buffer directly, never through the host."""
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
        if not batched:
            np.copyto(staging, np.asarray(arrays[0]), casting="no")
        else:
            direct = [pinned(array) for array in arrays]
            if any(direct) or any(isinstance(array, DeviceRows) for array in arrays):
                self._stage_mixed(staging, host, device, arrays, direct)
                return
            staged_copy(staging, arrays)
        cuda.copy_to_device(device.data_ptr(), host.ptr, staging.nbytes, self._stream)

    def _stage_mixed(
        self,
        staging: np.ndarray,
        host: cuda.HostBuffer,
        device: torch.Tensor,
        arrays: list[Any],
        direct: list[bool],
    ) -> None:
        """Blocks on a device copied device to device into their rows, blocks in registered
        host memory (a front end's arena) copied from there by DMA, the others through the
        pinned buffer (consecutive ones in one copy), all on the runner's stream in order.
        ``direct``: per block, whether it is in registered memory (``pinned``)."""
        row_bytes = staging[0].nbytes
        offset, run_start = 0, 0
        run: list[np.ndarray] = []  # staged blocks waiting for one copy
        on_device: list[torch.Tensor] = []  # adjacent device blocks waiting for one copy
        device_start = 0

        def flush_device() -> None:
            if on_device:
                joined = adjacent(on_device)
                with torch.cuda.stream(self._torch_stream):
                    device[device_start : device_start + len(joined)].copy_(
                        joined, non_blocking=True
                    )
                on_device.clear()

        def flush() -> None:
            flush_device()
            if run:
                piece = staging[run_start:offset]
                staged_copy(piece, run)
                start = run_start * row_bytes
                cuda.copy_to_device(
                    device.data_ptr() + start, host.ptr + start, piece.nbytes, self._stream
                )
                run.clear()

        for array, from_registered in zip(arrays, direct, strict=True):
            count = len(array)
            if isinstance(array, DeviceRows):
                if run or (on_device and not follows(on_device[-1], array.tensor)):
                    flush()
                if not on_device:
                    device_start = offset
                on_device.append(array.tensor)
            elif from_registered:
                flush()
                cuda.copy_to_device(
                    device.data_ptr() + offset * row_bytes,
                    array.ctypes.data,
                    array.nbytes,
                    self._stream,
                )
            else:
                flush_device()
                if not run:
                    run_start = offset
                run.append(array)
            offset += count
        flush()

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
