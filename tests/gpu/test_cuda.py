"""engines.devices.cuda on a real GPU: copies through pinned memory, events, errors, the GIL."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the GPU tests need torch")
cuda_bindings = pytest.importorskip("cuda.bindings", reason="needs cuda-python")

from cuda.bindings import driver, runtime  # noqa: E402

from engines.devices import cuda  # noqa: E402


def test_round_trip_through_pinned_and_device_memory() -> None:
    rng = np.random.default_rng()
    data = rng.standard_normal((256, 1000)).astype(np.float32)
    stream = cuda.Stream(0)
    src, dst = cuda.HostBuffer(data.nbytes), cuda.HostBuffer(data.nbytes)
    device = cuda.DeviceBuffer(0, data.nbytes)
    done = cuda.Event(0)
    try:
        src.array(np.float32, data.shape)[:] = data
        out = dst.array(np.float32, data.shape)
        out[:] = np.nan  # poisoned: every element must be written by the copy back
        cuda.copy_to_device(device.ptr, src.ptr, data.nbytes, stream)
        cuda.copy_to_host(dst.ptr, device.ptr, data.nbytes, stream)
        done.record(stream)
        done.synchronize()
        assert done.query()
        np.testing.assert_array_equal(out, data)
    finally:
        for resource in (device, src, dst, done, stream):
            resource.close()


def test_failures_raise_naming_the_call() -> None:
    with pytest.raises(cuda.CudaError, match=r"cudaMalloc failed: cudaErrorMemoryAllocation"):
        cuda.DeviceBuffer(0, 1 << 60)
    # The driver API's success code is success too.
    assert cuda.call(driver.cuInit, 0) is None
    with pytest.raises(cuda.CudaError, match=r"cuDeviceGet failed: CUDA_ERROR_INVALID_DEVICE"):
        cuda.call(driver.cuDeviceGet, 1 << 20)
    with pytest.raises(cuda.CudaError, match=r"cudaSetDevice failed"):
        cuda.set_device(1 << 20)
    cuda.set_device(0)
    assert cuda.check("cudaRuntimeGetVersion", runtime.cudaRuntimeGetVersion()) > 0


def _busy_gpu(stream: cuda.Stream, seconds: float) -> None:
    """Enqueue a kernel that spins the GPU for at least ``seconds`` (it counts cycles, and no
    GPU here clocks above 2 GHz)."""
    external = torch.cuda.ExternalStream(stream.ptr, device=torch.device("cuda", 0))
    with torch.cuda.stream(external):
        torch.cuda._sleep(int(seconds * 2e9))


def test_event_wait_releases_the_gil() -> None:
    """A runner thread waiting for the GPU must not stall other Python threads."""
    stream, done = cuda.Stream(0), cuda.Event(0)
    try:
        _busy_gpu(stream, 0.5)
        done.record(stream)
        waited: list[float] = []

        def wait() -> None:
            started = time.perf_counter()
            done.synchronize()
            waited.append(time.perf_counter() - started)

        thread = threading.Thread(target=wait)
        thread.start()
        longest, last = 0.0, time.perf_counter()
        while thread.is_alive():
            now = time.perf_counter()
            longest, last = max(longest, now - last), now
        thread.join()
        assert waited and waited[0] > 0.2, "the GPU work finished too soon to tell"
        assert longest < 0.05, f"the main thread stalled {longest * 1000:.0f} ms"
    finally:
        done.close()
        stream.close()


def test_completed_awaits_without_blocking_the_loop() -> None:
    stream, done = cuda.Stream(0), cuda.Event(0)

    async def scenario() -> int:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        task = asyncio.create_task(ticker())
        _busy_gpu(stream, 0.3)
        done.record(stream)
        await cuda.completed(done)
        task.cancel()
        return ticks

    try:
        assert asyncio.run(scenario()) >= 10
    finally:
        done.close()
        stream.close()
