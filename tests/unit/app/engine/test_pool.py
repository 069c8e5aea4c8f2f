"""The runner pool: warm-up, lending runners one batch at a time, and teardown, with ONNX
Runtime on the tiny model and, where the engine itself is what is watched, a fake one."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping
from functools import partial
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest

from app.engine.pool import RunnerPool, warmup_inputs
from engines.backends import onnxruntime
from engines.base import EngineOptions, Runner
from engines.spec import ModelSpec, TensorSpec
from tests.conftest import TINY_BIAS, TINY_WEIGHTS, tiny_onnx

FAKE_SPEC = ModelSpec(
    name="fake",
    inputs=(TensorSpec("x", "FP32", (2,)),),
    outputs=(TensorSpec("y", "FP32", (2,)),),
    max_batch_size=8,
)


class FakeRunner:
    """Records each run as (runner index, thread name, input shapes); ``barrier`` makes a run
    wait for the others, ``fail`` makes it raise."""

    def __init__(self, engine: FakeEngine, index: int) -> None:
        self.engine = engine
        self.index = index

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.engine.started.set()
        if self.engine.barrier is not None:
            self.engine.barrier.wait()
        if self.index in self.engine.fail:
            raise RuntimeError(f"runner {self.index} broke")
        shapes = {name: value.shape for name, value in inputs.items()}
        self.engine.runs.append((self.index, threading.current_thread().name, shapes))
        if self.engine.work_s:
            time.sleep(self.engine.work_s)
            self.engine.events.append(f"run {self.index} done")
        return {"y": np.asarray(inputs["x"]) * 2}

    def close(self) -> None:
        self.engine.events.append(f"close runner {self.index}")


class FakeEngine:
    backend = "fake"
    pixel_input: str | None = None

    def __init__(self, spec: ModelSpec = FAKE_SPEC) -> None:
        self.spec = spec
        self.runs: list[tuple[int, str, dict[str, tuple[int, ...]]]] = []
        self.events: list[str] = []
        self.barrier: threading.Barrier | None = None
        self.fail: set[int] = set()
        self.work_s = 0.0
        self.started = threading.Event()
        self.made = 0

    def new_runner(self) -> FakeRunner:
        runner = FakeRunner(self, self.made)
        self.made += 1
        return runner

    def close(self) -> None:
        self.events.append("close engine")


class RecordingRunner:
    """A real runner whose batches are recorded: what goes in and what comes out."""

    def __init__(
        self, inner: Runner, log: list[tuple[int, np.ndarray, dict[str, np.ndarray]]]
    ) -> None:
        self.inner = inner
        self.log = log

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self.inner.run(inputs)
        self.log.append((id(self), np.array(inputs["x"]), outputs))
        return outputs

    def close(self) -> None:
        self.inner.close()


class RecordingEngine:
    """ONNX Runtime's engine, its runners recorded."""

    def __init__(self, inner: onnxruntime.OrtEngine) -> None:
        self.inner = inner
        self.spec = inner.spec
        self.backend = inner.backend
        self.pixel_input = inner.pixel_input
        self.log: list[tuple[int, np.ndarray, dict[str, np.ndarray]]] = []

    def new_runner(self) -> RecordingRunner:
        return RecordingRunner(self.inner.new_runner(), self.log)

    def close(self) -> None:
        self.inner.close()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "model.onnx"
    onnx.save(tiny_onnx(), str(path))
    return path


def ort_engine(path: Path, runners: int, max_batch: int = 16) -> onnxruntime.OrtEngine:
    spec = onnxruntime.read_spec(path, "tiny", max_batch)
    return onnxruntime.load(path, spec, EngineOptions(runners=runners))


def test_warmup_inputs_are_zero_batches_with_dynamic_dims_of_one() -> None:
    spec = ModelSpec(
        name="mixed",
        inputs=(
            TensorSpec("image", "FP32", (3, -1, 2)),
            TensorSpec("ids", "INT64", (-1,)),
            TensorSpec("pixels", "UINT8", (4,)),
            TensorSpec("half", "BF16", (2,)),
            TensorSpec("text", "BYTES", (-1, 2)),
        ),
        outputs=(TensorSpec("y", "FP32", (1,)),),
        max_batch_size=32,
    )
    inputs = warmup_inputs(spec, 5)
    assert list(inputs) == ["image", "ids", "pixels", "half", "text"]
    assert {name: value.shape for name, value in inputs.items()} == {
        "image": (5, 3, 1, 2),
        "ids": (5, 1),
        "pixels": (5, 4),
        "half": (5, 2),
        "text": (5, 1, 2),
    }
    assert inputs["image"].dtype == np.float32 and inputs["ids"].dtype == np.int64
    assert inputs["pixels"].dtype == np.uint8
    assert inputs["half"].dtype == np.dtype(ml_dtypes.bfloat16)
    for name in ("image", "ids", "pixels", "half"):
        assert not inputs[name].astype(np.float64).any()
    assert inputs["text"].dtype == object
    assert all(item == b"" for item in inputs["text"].ravel())


def test_warmup_inputs_of_an_unbatched_model_have_no_batch_dimension() -> None:
    spec = ModelSpec(
        name="unbatched",
        inputs=(TensorSpec("x", "FP16", (-1, 7)),),
        outputs=(TensorSpec("y", "FP16", (-1,)),),
    )
    inputs = warmup_inputs(spec, 1)
    assert inputs["x"].shape == (1, 7) and inputs["x"].dtype == np.float16


def test_create_makes_the_runners_it_is_asked_for() -> None:
    engine = FakeEngine()

    async def main() -> None:
        pool = await RunnerPool.create(engine, 3, "fake")
        try:
            assert pool.size == 3 and engine.made == 3
        finally:
            pool.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("max_batch", "rows"), [(8, [1, 8]), (1, [1]), (0, [None])], ids=["batched", "one", "unbatched"]
)
def test_warm_runs_every_runner_at_batch_one_and_at_the_max(
    max_batch: int, rows: list[int | None]
) -> None:
    spec = ModelSpec(
        name="fake",
        inputs=(TensorSpec("x", "FP32", (2,)),),
        outputs=(TensorSpec("y", "FP32", (2,)),),
        max_batch_size=max_batch,
    )
    engine = FakeEngine(spec)

    async def main() -> None:
        pool = await RunnerPool.create(engine, 3, "fake")
        try:
            await pool.warm()
        finally:
            pool.close()

    asyncio.run(main())
    for index in range(3):
        shapes = [s["x"] for i, _, s in engine.runs if i == index]
        assert shapes == [(2,) if r is None else (r, 2) for r in rows]


def test_warm_runs_the_runners_at_once_each_on_its_own_pool_thread() -> None:
    engine = FakeEngine()
    # Every run waits for the other two: a warm-up that ran runners one after another would
    # break the barrier (after its timeout) instead of passing it.
    engine.barrier = threading.Barrier(3, timeout=10)

    async def main() -> None:
        pool = await RunnerPool.create(engine, 3, "warmlabel")
        try:
            await pool.warm()
        finally:
            pool.close()

    asyncio.run(main())
    assert len(engine.runs) == 6
    threads = {thread for _, thread, _ in engine.runs}
    assert all(name.startswith("warmlabel") for name in threads)
    assert threading.main_thread().name not in threads
    for rows in (1, 8):
        batch = [(i, t) for i, t, s in engine.runs if s["x"][0] == rows]
        assert sorted(i for i, _ in batch) == [0, 1, 2]
        assert len({t for _, t in batch}) == 3


def test_warm_gives_every_runner_back_even_when_one_fails() -> None:
    engine = FakeEngine()
    engine.fail = {1}

    async def main() -> None:
        pool = await RunnerPool.create(engine, 3, "fake")
        try:
            with pytest.raises(RuntimeError, match="runner 1 broke"):
                await pool.warm()
            lent = [await asyncio.wait_for(pool.acquire(), 1) for _ in range(3)]
            assert sorted(r.index for r in lent) == [0, 1, 2]  # type: ignore[attr-defined]
        finally:
            pool.close()

    asyncio.run(main())


def test_a_runner_is_lent_to_one_batch_at_a_time() -> None:
    engine = FakeEngine()

    async def main() -> None:
        pool = await RunnerPool.create(engine, 2, "fake")
        try:
            first, second = await pool.acquire(), await pool.acquire()
            assert first is not second
            waiting = asyncio.ensure_future(pool.acquire())
            await asyncio.sleep(0.05)
            assert not waiting.done(), "a third batch got a runner while both were lent"
            pool.release(second)
            assert await asyncio.wait_for(waiting, 1) is second
            pool.release(first)
            assert await asyncio.wait_for(pool.acquire(), 1) is first
        finally:
            pool.close()

    asyncio.run(main())


def test_close_waits_for_running_work_then_closes_runners_then_the_engine() -> None:
    engine = FakeEngine()
    engine.work_s = 0.2

    async def main() -> None:
        pool = await RunnerPool.create(engine, 2, "fake")
        runner = await pool.acquire()
        running = asyncio.ensure_future(
            pool.call(partial(runner.run, {"x": np.ones((1, 2), np.float32)}))
        )
        assert await asyncio.to_thread(engine.started.wait, 10)
        pool.close()
        assert (await running)["y"].tolist() == [[2.0, 2.0]]
        with pytest.raises(RuntimeError):
            await pool.call(lambda: None)

    asyncio.run(main())
    assert engine.events == ["run 0 done", "close runner 0", "close runner 1", "close engine"]


def test_close_drops_work_that_has_not_started() -> None:
    """With one runner, a second call waits for the pool's one thread; close() drops it."""
    engine = FakeEngine()
    engine.work_s = 0.2

    async def main() -> None:
        pool = await RunnerPool.create(engine, 1, "fake")
        runner = await pool.acquire()
        batch = {"x": np.ones((1, 2), np.float32)}
        running = asyncio.ensure_future(pool.call(partial(runner.run, batch)))
        assert await asyncio.to_thread(engine.started.wait, 10)
        queued = asyncio.ensure_future(pool.call(partial(runner.run, batch)))
        await asyncio.sleep(0)  # the second call is handed to the executor
        pool.close()
        assert (await running)["y"].tolist() == [[2.0, 2.0]]
        with pytest.raises(asyncio.CancelledError):
            await queued

    asyncio.run(main())
    assert engine.events == ["run 0 done", "close runner 0", "close engine"]


def test_a_real_engine_warms_on_zeros_and_then_serves(tiny_path: Path) -> None:
    engine = RecordingEngine(ort_engine(tiny_path, runners=2, max_batch=16))
    x = np.random.default_rng(3).standard_normal((5, 4)).astype(np.float32)

    async def main() -> dict[str, np.ndarray]:
        pool = await RunnerPool.create(engine, 2, "tiny")
        try:
            await pool.warm()
            runner = await pool.acquire()
            try:
                return await pool.call(partial(runner.run, {"x": x}))
            finally:
                pool.release(runner)
        finally:
            pool.close()

    served = asyncio.run(main())
    warm = engine.log[:4]
    # Two runners, each at batch 1 and batch 16, on zeros: y is the bias, s is 0.
    assert len({runner for runner, _, _ in warm}) == 2
    assert sorted(inputs.shape[0] for _, inputs, _ in warm) == [1, 1, 16, 16]
    for _, inputs, outputs in warm:
        rows = inputs.shape[0]
        assert inputs.dtype == np.float32 and not inputs.any()
        np.testing.assert_array_equal(outputs["y"], np.tile(TINY_BIAS, (rows, 1)))
        np.testing.assert_array_equal(outputs["s"], np.zeros((rows, 1), np.float32))
    # float32 sums of four products: 1e-5 is far above any CPU's rounding differences.
    np.testing.assert_allclose(served["y"], x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(served["s"], x.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-5)


def test_a_runner_that_cannot_be_made_closes_the_ones_made_before_it() -> None:
    """The third runner does not fit (a GPU engine's ``ModelDoesNotFit``): the two made
    before it are closed, not left holding their pinned buffers and streams."""

    class Full(FakeEngine):
        def new_runner(self) -> FakeRunner:
            if self.made == 2:
                raise MemoryError("the third runner does not fit")
            return super().new_runner()

    engine = Full()
    with pytest.raises(MemoryError, match="third runner"):
        asyncio.run(RunnerPool.create(engine, 3, "full"))
    assert sorted(engine.events) == ["close runner 0", "close runner 1"]
