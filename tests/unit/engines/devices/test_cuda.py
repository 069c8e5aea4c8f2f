"""engines.devices.cuda's error checking, without a GPU: every non-success code raises, naming the
call; both APIs' success codes pass; anything else is refused."""

from __future__ import annotations

import pytest

from engines.devices import cuda

bindings = pytest.importorskip("cuda.bindings", reason="cuda-bindings is not installed")

from cuda.bindings import driver, runtime  # noqa: E402


def test_success_codes_of_both_apis_pass_through_with_their_values() -> None:
    assert cuda.check("cudaStreamSynchronize", (runtime.cudaError_t.cudaSuccess,)) is None
    assert cuda.check("cuInit", (driver.CUresult.CUDA_SUCCESS,)) is None
    assert cuda.check("cudaMalloc", (runtime.cudaError_t.cudaSuccess, 1234)) == 1234
    assert cuda.check("cuMemGetInfo", (driver.CUresult.CUDA_SUCCESS, 1, 2)) == (1, 2)
    assert cuda.check("cuCtxSynchronize", driver.CUresult.CUDA_SUCCESS) is None


@pytest.mark.parametrize(
    "code",
    [
        runtime.cudaError_t.cudaErrorMemoryAllocation,
        runtime.cudaError_t.cudaErrorNotReady,
        driver.CUresult.CUDA_ERROR_INVALID_VALUE,
        driver.CUresult.CUDA_ERROR_NOT_INITIALIZED,
    ],
)
def test_every_other_code_raises_naming_the_call(code: object) -> None:
    with pytest.raises(cuda.CudaError) as caught:
        cuda.check("cudaSomething", (code, 42))
    assert caught.value.call == "cudaSomething"
    assert caught.value.code == code
    assert str(caught.value).startswith(f"cudaSomething failed: {code.name}")  # type: ignore[attr-defined]


def test_runtime_errors_carry_the_library_description() -> None:
    with pytest.raises(cuda.CudaError, match="out of memory"):
        cuda.check("cudaMalloc", (runtime.cudaError_t.cudaErrorMemoryAllocation, None))


def test_a_result_that_is_not_a_cuda_status_is_refused() -> None:
    for result in ((0,), (None, 1), (), "ok"):
        with pytest.raises(TypeError, match="cudaFoo"):
            cuda.check("cudaFoo", result)


def test_call_names_the_function() -> None:
    def cudaFake(value: int) -> tuple[object, int]:
        return (runtime.cudaError_t.cudaErrorInvalidValue, value)

    with pytest.raises(cuda.CudaError, match=r"^cudaFake failed: cudaErrorInvalidValue \(1\)"):
        cuda.call(cudaFake, 3)


def test_an_error_that_breaks_the_context_is_fatal_for_every_gpu_runner() -> None:
    """The torch and TensorRT runners both run a batch inside this: after an illegal address
    the context is unusable, so the model must stop; an ordinary error stays ordinary."""
    from engines.base import FatalEngineError

    class Code:
        def __init__(self, name: str) -> None:
            self.name = name

    fatal = pytest.raises(FatalEngineError, match="m: cudaMemcpyAsync failed")
    with fatal, cuda.sticky_errors_are_fatal("m"):
        raise cuda.CudaError("cudaMemcpyAsync", Code("cudaErrorIllegalAddress"))
    with pytest.raises(cuda.CudaError) as ordinary, cuda.sticky_errors_are_fatal("m"):
        raise cuda.CudaError("cudaMalloc", Code("cudaErrorMemoryAllocation"))
    assert not isinstance(ordinary.value, FatalEngineError)


def test_host_ranges_find_a_block_only_inside_one_range() -> None:
    ranges = cuda.HostRanges()
    ranges.add(0x1000, 0x1000)
    ranges.add(0x4000, 0x2000)
    assert ranges.covers(0x1000, 0x1000)
    assert ranges.covers(0x4800, 0x100)
    assert not ranges.covers(0x1800, 0x1000)  # runs past the first range's end
    assert not ranges.covers(0x2000, 0x10)  # between the two
    assert not ranges.covers(0x0800, 0x10)  # before both
    with pytest.raises(ValueError, match="overlaps"):
        ranges.add(0x5000, 0x100)
    with pytest.raises(ValueError, match="overlaps"):
        ranges.add(0x3F00, 0x200)
    assert ranges.remove(0x4000)
    assert not ranges.remove(0x4000)
    assert not ranges.covers(0x4800, 0x100)
    ranges.add(0x3F00, 0x200)  # the room it left is free again
    assert ranges.covers(0x3F00, 0x200)


def test_without_a_gpu_nothing_is_registered() -> None:
    if cuda.device_count():
        pytest.skip("a CUDA device is visible: tests/gpu registers memory for real")
    buffer = bytearray(4096)
    import ctypes

    start = ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))
    assert not cuda.register_host(start, len(buffer))
    assert not cuda.host_registered(start, len(buffer))
    cuda.unregister_host(start)  # nothing registered: nothing to undo, and no error
