"""The CUDA pieces a GPU runner is built from, through cuda-python (``cuda.bindings``).

One runner owns one ``Stream``, the pinned ``HostBuffer`` staging areas and ``DeviceBuffer``
tensors it copies through, and an ``Event`` it records after the last copy of a batch. The
runner's thread waits on that event: the bindings release the GIL around every CUDA call
(cuda-bindings 12.9.1 and later), and a blocking-sync event makes the thread sleep instead of
spinning a core, so other runners and the event loop keep running while the GPU works.
``completed`` turns the same wait into an awaitable for code on the event loop.

Every call goes through ``check``, which raises ``CudaError`` naming the call for any code
other than success. Both APIs' success codes count as success (``cudaSuccess`` of the
runtime, ``CUDA_SUCCESS`` of the driver); a result of any other type is refused rather than
guessed at. The TensorRT backend's runners are built from these pieces, and capture their
enqueue into a CUDA graph with ``Graph``; the torch backend captures its own CUDA graphs and
runs them on a ``Stream`` from here.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import ctypes
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from typing import Any

import numpy as np

from engines.base import FatalEngineError

log = logging.getLogger(__name__)

try:
    from cuda.bindings import driver, runtime
except ImportError:  # the CPU install: errors still format, nothing else works
    driver = None
    runtime = None


class CudaError(RuntimeError):
    """A CUDA call returned something other than success."""

    def __init__(self, call: str, code: object, detail: str = "") -> None:
        self.call = call
        self.code = code
        name = getattr(code, "name", None) or repr(code)
        value = int(code) if isinstance(code, int) else code
        message = f"{call} failed: {name} ({value})"
        super().__init__(f"{message}: {detail}" if detail else message)


# After one of these the CUDA context is unusable: every later call fails the same way until
# the process restarts (CUDA's documentation says so of each).
STICKY_CUDA_ERRORS = frozenset(
    {
        "cudaErrorIllegalAddress",
        "cudaErrorLaunchFailure",
        "cudaErrorHardwareStackError",
        "cudaErrorIllegalInstruction",
        "cudaErrorMisalignedAddress",
        "cudaErrorInvalidAddressSpace",
        "cudaErrorInvalidPc",
        "cudaErrorLaunchTimeout",
        "cudaErrorECCUncorrectable",
        "CUDA_ERROR_ILLEGAL_ADDRESS",
        "CUDA_ERROR_LAUNCH_FAILED",
        "CUDA_ERROR_HARDWARE_STACK_ERROR",
        "CUDA_ERROR_ILLEGAL_INSTRUCTION",
        "CUDA_ERROR_MISALIGNED_ADDRESS",
        "CUDA_ERROR_INVALID_ADDRESS_SPACE",
        "CUDA_ERROR_INVALID_PC",
        "CUDA_ERROR_LAUNCH_TIMEOUT",
        "CUDA_ERROR_ECC_UNCORRECTABLE",
    }
)


def is_sticky(code: object) -> bool:
    """Whether a CUDA error code leaves the context unusable."""
    return getattr(code, "name", None) in STICKY_CUDA_ERRORS


@contextlib.contextmanager
def sticky_errors_are_fatal(label: str) -> Iterator[None]:
    """Re-raise a CUDA error that leaves the context unusable as ``FatalEngineError`` (the
    service then stops the model and turns readiness off); other errors pass unchanged.
    Every GPU runner's ``run`` goes through this."""
    try:
        yield
    except CudaError as error:
        if is_sticky(error.code):
            raise FatalEngineError(f"{label}: {error}") from error
        raise


class CudaUnavailable(RuntimeError):
    """cuda-python is not installed, so nothing here can run."""


def _bindings() -> tuple[Any, Any]:
    if driver is None or runtime is None:
        raise CudaUnavailable("cuda-python is not installed: pip install 'stoker[gpu]'")
    return driver, runtime


def _success_codes() -> dict[type, object]:
    if driver is None or runtime is None:
        return {}
    return {
        driver.CUresult: driver.CUresult.CUDA_SUCCESS,
        runtime.cudaError_t: runtime.cudaError_t.cudaSuccess,
    }


def _describe(code: object) -> str:
    """The library's own words for an error code; empty where they cannot be had (no
    driver on this machine, or the lookup itself failing)."""
    try:
        if driver is not None and isinstance(code, driver.CUresult):
            err, text = driver.cuGetErrorString(code)
            if err == driver.CUresult.CUDA_SUCCESS and text:
                return bytes(text).decode(errors="replace")
        if runtime is not None and isinstance(code, runtime.cudaError_t):
            err, text = runtime.cudaGetErrorString(code)
            if err == runtime.cudaError_t.cudaSuccess and text:
                return bytes(text).decode(errors="replace")
    except Exception:
        return ""
    return ""


def check(call: str, result: Any) -> Any:
    """The values of a cuda-python call's result; ``CudaError`` naming ``call`` unless its
    code is success.

    cuda-python returns ``(code,)``, ``(code, value)`` or ``(code, *values)``; this returns
    ``None``, ``value`` or the tuple of values. The code's type says which API it came from;
    a type that is not a known CUDA status is a ``TypeError``, never silently accepted.
    """
    if isinstance(result, tuple):
        if not result:
            raise TypeError(f"{call} returned an empty tuple, not a CUDA status")
        code, values = result[0], result[1:]
    else:
        code, values = result, ()
    success = _success_codes().get(type(code))
    if success is None:
        raise TypeError(f"{call} returned {type(code).__name__}, not a CUDA status code")
    if code != success:
        if runtime is not None and isinstance(code, runtime.cudaError_t):
            # The runtime also keeps a non-sticky error as the thread's "last error"; it is
            # an exception now, so clear it before it fails an unrelated later launch check.
            with contextlib.suppress(Exception):
                runtime.cudaGetLastError()
        raise CudaError(call, code, _describe(code))
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def call(fn: Callable[..., Any], *args: Any) -> Any:
    """``check`` a call named by the function itself: ``call(runtime.cudaMalloc, n)``."""
    return check(getattr(fn, "__name__", repr(fn)), fn(*args))


def handle(obj: Any) -> int:
    """The address behind a cuda-python handle (stream, event, pointer)."""
    try:
        from cuda.bindings.utils import get_cuda_native_handle
    except ImportError:  # cuda-bindings before 12.9.1
        return int(obj)
    return int(get_cuda_native_handle(obj))


def device_count() -> int:
    _, rt = _bindings()
    try:
        return int(call(rt.cudaGetDeviceCount))
    except CudaError:
        return 0


def set_device(index: int) -> None:
    """Make ``index`` the calling thread's device (runtime calls act on it)."""
    _, rt = _bindings()
    call(rt.cudaSetDevice, index)


def device_properties(index: int) -> tuple[str, tuple[int, int]]:
    """The name and compute capability of a device: what a compiled engine is valid for."""
    _, rt = _bindings()
    props = call(rt.cudaGetDeviceProperties, index)
    raw = props.name
    name = raw.split(b"\0", 1)[0].decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    return name.strip(), (int(props.major), int(props.minor))


class Stream:
    """A non-blocking stream: it never waits for work on the legacy default stream."""

    def __init__(self, device: int) -> None:
        _, rt = _bindings()
        set_device(device)
        self.device = device
        self.handle = call(rt.cudaStreamCreateWithFlags, rt.cudaStreamNonBlocking)
        self.ptr = handle(self.handle)

    def synchronize(self) -> None:
        call(runtime.cudaStreamSynchronize, self.handle)

    def close(self) -> None:
        if self.handle is not None:
            call(runtime.cudaStreamDestroy, self.handle)
            self.handle = None


class Event:
    """A completion marker on a stream. ``synchronize`` sleeps the calling thread (blocking
    sync, not a spin) with the GIL released until the GPU reaches the marker."""

    def __init__(self, device: int) -> None:
        _, rt = _bindings()
        set_device(device)
        flags = rt.cudaEventBlockingSync | rt.cudaEventDisableTiming
        self.handle = call(rt.cudaEventCreateWithFlags, flags)

    def record(self, stream: Stream) -> None:
        call(runtime.cudaEventRecord, self.handle, stream.handle)

    def synchronize(self) -> None:
        call(runtime.cudaEventSynchronize, self.handle)

    def query(self) -> bool:
        """True once the GPU has passed the marker; never blocks."""
        code = runtime.cudaEventQuery(self.handle)[0]
        if code == runtime.cudaError_t.cudaErrorNotReady:
            return False
        check("cudaEventQuery", (code,))
        return True

    def close(self) -> None:
        if self.handle is not None:
            call(runtime.cudaEventDestroy, self.handle)
            self.handle = None


class HostBuffer:
    """Page-locked host memory: the GPU's copy engines read and write it directly, so
    copies through it are asynchronous and run at full link speed (pageable memory is
    staged by the driver through a bounce buffer, synchronously)."""

    def __init__(self, nbytes: int) -> None:
        _, rt = _bindings()
        self.nbytes = max(1, nbytes)
        self.ptr: int = int(call(rt.cudaMallocHost, self.nbytes))

    def array(self, dtype: np.dtype[Any] | type, shape: tuple[int, ...]) -> np.ndarray:
        """A numpy view of the buffer's first bytes; valid until ``close``."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape)) * dtype.itemsize
        if count > self.nbytes:
            raise ValueError(f"{count} bytes do not fit a host buffer of {self.nbytes}")
        raw = memoryview((ctypes.c_uint8 * count).from_address(self.ptr)).cast("B")
        view: np.ndarray = np.frombuffer(raw, dtype=dtype).reshape(shape)
        return view

    def close(self) -> None:
        if self.ptr:
            call(runtime.cudaFreeHost, self.ptr)
            self.ptr = 0


class HostRanges:
    """Address ranges of host memory, looked up by a block's start and length."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, start: int, nbytes: int) -> None:
        with self._lock:
            at = bisect.bisect(self._starts, start)
            if (at and self._ends[at - 1] > start) or (
                at < len(self._starts) and self._starts[at] < start + nbytes
            ):
                raise ValueError(f"range at {start:#x} overlaps one already held")
            self._starts.insert(at, start)
            self._ends.insert(at, start + nbytes)

    def remove(self, start: int) -> bool:
        with self._lock:
            at = bisect.bisect_left(self._starts, start)
            if at == len(self._starts) or self._starts[at] != start:
                return False
            del self._starts[at], self._ends[at]
            return True

    def covers(self, start: int, nbytes: int) -> bool:
        """Whether ``nbytes`` from ``start`` lie inside one range."""
        with self._lock:
            at = bisect.bisect(self._starts, start) - 1
            return at >= 0 and start + nbytes <= self._ends[at]


_registered = HostRanges()
"""Host memory this process registered with CUDA (``register_host``)."""


def register_host(start: int, nbytes: int) -> bool:
    """Page-lock host memory this process did not allocate (a front end's shared-memory
    arena) with ``cudaHostRegister``, so a copy from it to a GPU is DMA and asynchronous,
    as from a ``HostBuffer``. False, with the reason logged, where it cannot be: no CUDA
    device, or the driver refuses (a container's locked-memory limit, ``ulimit -l``)."""
    try:
        _, rt = _bindings()
        if device_count() == 0:
            return False
        call(rt.cudaHostRegister, start, nbytes, rt.cudaHostRegisterPortable)
    except (CudaUnavailable, CudaError) as error:
        log.warning("%d bytes at %#x stay pageable: %s", nbytes, start, error)
        return False
    _registered.add(start, nbytes)
    return True


def unregister_host(start: int) -> None:
    """Undo ``register_host`` (before the memory is unmapped)."""
    if _registered.remove(start):
        with contextlib.suppress(CudaError):
            call(runtime.cudaHostUnregister, start)


def host_registered(start: int, nbytes: int) -> bool:
    """Whether a block lies in memory ``register_host`` page-locked."""
    return _registered.covers(start, nbytes)


class DeviceBuffer:
    """Device memory of a fixed size, for backends that manage their own tensors
    (TensorRT binds addresses; torch tensors bring their own allocator)."""

    def __init__(self, device: int, nbytes: int) -> None:
        _, rt = _bindings()
        set_device(device)
        self.device = device
        self.nbytes = max(1, nbytes)
        self.ptr: int = int(call(rt.cudaMalloc, self.nbytes))

    def close(self) -> None:
        if self.ptr:
            call(runtime.cudaFree, self.ptr)
            self.ptr = 0


def copy_to_device(dst: int, src: int, nbytes: int, stream: Stream) -> None:
    """Enqueue a host-to-device copy on ``stream``; asynchronous when ``src`` is pinned."""
    kind = runtime.cudaMemcpyKind.cudaMemcpyHostToDevice
    call(runtime.cudaMemcpyAsync, dst, src, nbytes, kind, stream.handle)


def copy_to_host(dst: int, src: int, nbytes: int, stream: Stream) -> None:
    """Enqueue a device-to-host copy on ``stream``; asynchronous when ``dst`` is pinned."""
    kind = runtime.cudaMemcpyKind.cudaMemcpyDeviceToHost
    call(runtime.cudaMemcpyAsync, dst, src, nbytes, kind, stream.handle)


class Graph:
    """The work ``enqueue`` puts on ``stream``, captured once and replayed by one launch.

    Capture is thread-local, so other threads' CUDA calls neither join nor break it. If
    ``enqueue`` fails, the capture is ended and discarded and its error is the one raised.
    """

    def __init__(self, stream: Stream, enqueue: Callable[[], None]) -> None:
        _, rt = _bindings()
        mode = rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        call(rt.cudaStreamBeginCapture, stream.handle, mode)
        try:
            enqueue()
        except BaseException:
            with contextlib.suppress(CudaError):
                call(rt.cudaGraphDestroy, call(rt.cudaStreamEndCapture, stream.handle))
            raise
        self._graph = call(rt.cudaStreamEndCapture, stream.handle)
        try:
            self._exec = call(rt.cudaGraphInstantiate, self._graph, 0)
        except CudaError:
            call(rt.cudaGraphDestroy, self._graph)
            raise

    def launch(self, stream: Stream) -> None:
        call(runtime.cudaGraphLaunch, self._exec, stream.handle)

    def close(self) -> None:
        if self._graph is not None:
            call(runtime.cudaGraphExecDestroy, self._exec)
            call(runtime.cudaGraphDestroy, self._graph)
            self._graph = None


async def completed(event: Event, executor: Executor | None = None) -> None:
    """Wait for ``event`` from the event loop without blocking it: the blocking wait runs on
    a worker thread, which sleeps in the driver with the GIL released."""
    await asyncio.get_running_loop().run_in_executor(executor, event.synchronize)
