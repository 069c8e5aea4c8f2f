"""The dynamic batcher's semantics, with a fake engine (the engine is outside the unit)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pytest
from prometheus_client import REGISTRY

from app.engine.batcher import Batcher
from app.engine.pool import RunnerPool
from app.engine.repository import DynamicBatching
from app.errors import BadRequest, DeadlineExceeded, EngineError, QueueFull, Unavailable
from app.metrics import ModelMetrics
from engines.spec import ModelSpec, TensorSpec

SPEC = ModelSpec(
    name="fake",
    inputs=(TensorSpec("x", "FP32", (-1,)),),
    outputs=(TensorSpec("y", "FP32", (-1,)),),
    max_batch_size=8,
)
_models = iter(range(10**6))


class FakeRunner:
    """Doubles its input. ``gate`` holds every run until set; ``batches`` records each batch."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.engine.gate.wait(timeout=10)
        x = inputs["x"]
        if self.engine.fits is not None and len(x) > self.engine.fits:
            raise self.engine.too_big(f"cannot allocate {len(x)} rows")
        self.engine.batches.append(x.copy())
        y = x * 2
        if self.engine.drop_a_row:
            y = y[:-1]
        return {"y": y}

    def close(self) -> None:
        pass


class FakeEngine:
    backend = "fake"
    pixel_input: str | None = None

    def __init__(self) -> None:
        self.spec = SPEC
        self.gate = threading.Event()
        self.gate.set()
        self.batches: list[np.ndarray] = []
        self.drop_a_row = False
        self.fits: int | None = None
        """Batches of more rows raise ``too_big`` (an allocation that failed)."""
        self.too_big: Callable[[str], Exception] = MemoryError
        self.blocks: list[list[int]] = []
        """Per batch a block runner ran, the rows of each block it was handed."""

    def new_runner(self) -> FakeRunner:
        return FakeRunner(self)

    def close(self) -> None:
        pass


def run(
    scenario: Callable[[Batcher, FakeEngine], Awaitable[None]],
    runners: int = 1,
    max_batch_size: int = 8,
    **policy: Any,
) -> FakeEngine:
    engine = FakeEngine()

    async def main() -> None:
        pool = await RunnerPool.create(engine, runners, "test")
        metrics = ModelMetrics(f"fake{next(_models)}", "fp32")
        batcher = Batcher(pool, DynamicBatching(**policy), metrics, max_batch_size)
        batcher.start()
        try:
            await scenario(batcher, engine)
        finally:
            engine.gate.set()
            await batcher.close(drain_timeout_s=5)
            pool.close()

    asyncio.run(main())
    return engine


def rows(n: int, start: float = 0.0, width: int = 1) -> np.ndarray:
    return np.arange(start, start + n * width, dtype=np.float32).reshape(n, width)


async def infer(
    batcher: Batcher, x: np.ndarray, timeout_s: float | None = 5.0, priority: int = 0
) -> np.ndarray:
    out = await batcher.infer({"x": x}, len(x), (x.shape[1:],), timeout_s, priority)
    return out["y"]


async def occupy(batcher: Batcher, engine: FakeEngine) -> asyncio.Task[np.ndarray]:
    """Block the only runner with one request, so later ones queue behind it."""
    engine.gate.clear()
    task = asyncio.create_task(infer(batcher, rows(1, 1000)))
    await asyncio.sleep(0.02)
    assert batcher.queued == 0, "the blocking request should be on the runner by now"
    return task


def batch_sizes(engine: FakeEngine) -> list[int]:
    return [len(b) for b in engine.batches]


def test_queued_requests_fill_one_batch_and_each_gets_its_own_rows() -> None:
    async def scenario(batcher: Batcher, engine: FakeEngine) -> None:
        first = await occupy(batcher, engine)
        tasks = [
            asyncio.create_task(infer(batcher, rows(n, 10 * i))) for i, n in enumerate([1, 2, 3])
        ]
        await asyncio.sleep(0.02)
        engine.gate.set()
        results = await asyncio.gather(first, *tasks)
        for i, n in enumerate([1, 2, 3]):
            np.testing.assert_array_equal(results[i + 1], rows(n, 10 * i) * 2)

    engine = run(scenario, max_queue_delay_us=0)
    assert batch_sizes(engine) == [1, 6]


def test_batch_never_exceeds_max_rows_and_keeps_queue_order() -> None:
    async def scenario(batcher: Batcher, engine: FakeEngine) -> None:
        first = await occupy(batcher, engine)
        tasks = [asyncio.create_task(infer(batcher, rows(3, 10 * i))) for i in range(4)]
        await asyncio.sleep(0.02)
        engine.gate.set()
        await asyncio.gather(first, *tasks)

    engine = run(scenario, max_queue_delay_us=0)
    assert batch_sizes(engine) == [1, 6, 6]
    assert engine.batches[1][0, 0] == 0 and engine.batches[2][0, 0] == 20


def test_a_request_larger_than_any_batch_is_refused_not_left_queued() -> None:
    """Only a stale contract (the model was reloaded smaller) can send one: 400 at once."""

    async def scenario(batcher: Batcher, engine: FakeEngine) -> None:
        with pytest.raises(BadRequest, match="batch of 9 rows; the model takes 1 to 8"):
            await infer(batcher, rows(9))
        assert batcher.pending == 0

    assert batch_sizes(run(scenario)) == []


def test_delay_is_measured_from_the_oldest_request() -> None:
    delay = 0.2
    done_at: dict[str, float] = {}

    async def scenario(batcher: Batcher, engine: FakeEngine) -> None:
        start = time.monotonic()

        async def timed(name: str, x: np.ndarray) -> None:
            await infer(batcher, x)
            done_at[name] = time.monotonic() - start

        first = asyncio.create_task(timed("first", rows(1)))
        await asyncio.sleep(delay / 2)
        await timed("second", rows(1, 5))
        await first

    engine = run(scenario, max_queue_delay_us=int(delay * 1e6))
    assert batch_sizes(engine) == [2]
    # Both leave when the first has waited the delay, not when the second has.
    assert delay * 0.9 <= done_at["first"] < delay * 1.4
    assert done_at["second"] < delay * 1.4


def test_zero_delay_sends_a_lone_request_at_once() -> None:
    elapsed: list[float] = []

    async def scenario(batcher: Batcher, engine: FakeEngine) -> None:
        start = time.monotonic()
        await infer(batcher, rows(1))
        elapsed.append(time.monotonic() - start)

    run(scenario, max_queue_delay_us=0)
    assert elapsed[0] < 0.1


def test_largest_preferred_size_is_sent_without_waiting_for_the_delay() -> None:
    elapsed: list[float] = []

    async def scenario(batcher: Batcher, engine: FakeEngine) -> None:
        start = time.monotonic()
        await asyncio.gather(*(infer(batcher, rows(1, i)) for i in range(4)))
        elapsed.append(time.monotonic() - start)

    engine = run(scenario, max_queue_delay_us=5_000_000, preferred_batch_size=[2, 4])
    assert batch_sizes(engine) == [4]
    assert elapsed[0] < 1.0


def test_on_delay_expiry_a_batch_is_cut_to_a_preferred_size() -> None:
    async def scenario(batcher: Batcher, engine: FakeEngine) -> None:
        await asyncio.gather(*(infer(batcher, rows(1, i)) for i in range(3)))

    engine = run(scenario, max_queue_delay_us=50_000, preferred_batch_size=[2, 4])
    assert batch_sizes(engine) == [2, 1]


def test_requests_of_different_shapes_never_share_a_batch() -> None:
    async def scenario(batcher: Batcher, engine: FakeEngine) -> None:
        first = await occupy(batcher, engine)
        tasks = [asyncio.create_task(infer(batcher, rows(1, i, width=1 + i % 2))) for i in range(4)]
        await asyncio.sleep(0.02)
        engine.gate.set()
        await asyncio.gather(first, *tasks)

    engine = run(scenario, max_queue_delay_us=0)
    assert sorted(b.shape for b in engine.batches[1:]) == [(2, 1), (2, 2)]


def test_full_queue_refuses_with_429() -> None:
    async def scenario(batcher: Batcher, engine: FakeEngine) -> None:
        first = await occupy(batcher, engine)
        queued = [asyncio.create_task(infer(batcher, rows(1))) for _ in range(2)]
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFull):
            await infer(batcher, rows(1))
        engine.gate.set()
        await asyncio.gather(first, *queued)

    run(scenario, max_queue_delay_us=0, max_queue_size=2)


def test_expired_request_gets_504_and_never_reaches_a_runner() -> None:
    async def scenario(batcher: Batcher, engine: FakeEngine) -> None:
        first = await occupy(batcher, engine)
        with pytest.raises(DeadlineExceeded, match="queued"):
            await infer(batcher, rows(1, 77), timeout_s=0.05)
        assert batcher.queued == 0
        engine.gate.set()
        await first
        np.testing.assert_array_equal(await infer(batcher, rows(1, 5)), rows(1, 5) * 2)

    engine = run(scenario, max_queue_delay_us=0)
    assert all(77 not in b for b in engine.batches)


def test_cancelled_request_is_dropped_before_compute() -> None:
    async def scenario(batcher: Batcher, engine: FakeEngine) -> None:
        first = await occupy(batcher, engine)
        doomed = asyncio.create_task(infer(batcher, rows(1, 55)))
        await asyncio.sleep(0.01)
        doomed.cancel()
        await asyncio.gather(doomed, return_exceptions=True)
        assert batcher.queued == 0
        engine.gate.set()
        await first

    engine = run(scenario, max_queue_delay_us=0)
    assert batch_sizes(engine) == [1]


def test_output_with_wrong_rows_fails_that_batch_only() -> None:
    async def scenario(batcher: Batcher, engine: FakeEngine) -> None:
        engine.drop_a_row = True
        with pytest.raises(EngineError, match="rows for a batch of 2"):
            await infer(batcher, rows(2))
        engine.drop_a_row = False
        np.testing.assert_array_equal(await infer(batcher, rows(2)), rows(2) * 2)

    run(scenario, max_queue_delay_us=0)


@pytest.mark.parametrize(
    "error",
    [
        lambda text: __import__("torch").cuda.OutOfMemoryError(f"CUDA out of memory: {text}"),
        lambda text: RuntimeError(f"Failed to allocate memory for requested buffer: {text}"),
        MemoryError,
    ],
    ids=["torch", "onnxruntime", "MemoryError"],
)
def test_out_of_memory_fails_that_batch_with_503_and_the_runner_serves_on(
    error: Callable[[str], Exception],
) -> None:
    error("made once here")  # torch's class imports torch: seconds, not inside a deadline

    async def scenario(batcher: Batcher, engine: FakeEngine) -> None:
        engine.fits, engine.too_big = 4, error
        with pytest.raises(Unavailable, match="out of memory for a batch of 6 rows"):
            await infer(batcher, rows(6))
        np.testing.assert_array_equal(await infer(batcher, rows(3)), rows(3) * 2)
        assert batcher.failed is None

    run(scenario, max_queue_delay_us=0)


def test_an_error_that_is_not_about_memory_stays_a_500() -> None:
    async def scenario(batcher: Batcher, engine: FakeEngine) -> None:
        engine.fits, engine.too_big = 4, ValueError
        with pytest.raises(EngineError, match="inference failed: ValueError"):
            await infer(batcher, rows(6))

    run(scenario, max_queue_delay_us=0)


def test_higher_priority_is_served_first() -> None:
    async def scenario(batcher: Batcher, engine: FakeEngine) -> None:
        first = await occupy(batcher, engine)
        low = asyncio.create_task(infer(batcher, rows(1, 100, width=2), priority=2))
        await asyncio.sleep(0.01)
        high = asyncio.create_task(infer(batcher, rows(1, 200, width=3), priority=1))
        await asyncio.sleep(0.01)
        engine.gate.set()
        await asyncio.gather(first, low, high)

    engine = run(scenario, max_queue_delay_us=0, priority_levels=2)
    assert [b.shape[1] for b in engine.batches[1:]] == [3, 2]


def test_several_runners_execute_batches_concurrently() -> None:
    peak = 0

    async def scenario(batcher: Batcher, engine: FakeEngine) -> None:
        nonlocal peak
        engine.gate.clear()
        tasks = [asyncio.create_task(infer(batcher, rows(8, i))) for i in range(3)]
        await asyncio.sleep(0.05)
        peak = 3 - batcher.queued
        engine.gate.set()
        await asyncio.gather(*tasks)

    run(scenario, runners=3, max_queue_delay_us=0)
    assert peak == 3


def test_closed_batcher_refuses_new_requests() -> None:
    async def scenario(batcher: Batcher, engine: FakeEngine) -> None:
        await batcher.close(drain_timeout_s=1)
        with pytest.raises(Unavailable):
            await infer(batcher, rows(1))

    run(scenario)


def test_a_request_past_its_deadline_never_reaches_a_runner() -> None:
    """A free runner's dispatcher wakes as soon as a request arrives, before the request's
    own timeout can fire: a request whose deadline has passed by then (here 1 us, as a
    request that spent its time being decoded) must be passed over. It gets 504; the runner
    sees only the request after it."""

    async def scenario(batcher: Batcher, engine: FakeEngine) -> None:
        for _ in range(5):
            with pytest.raises(DeadlineExceeded):
                await infer(batcher, rows(1, 7), timeout_s=1e-6)
        np.testing.assert_array_equal(await infer(batcher, rows(1, 9)), rows(1, 9) * 2)

    # No queue delay: the dispatcher takes what has arrived at once (the default CPU config).
    engine = run(scenario, max_queue_delay_us=0)
    assert np.concatenate(engine.batches).ravel().tolist() == [9.0]


def test_a_light_client_is_not_queued_behind_a_flooding_one() -> None:
    async def scenario(batcher: Batcher, engine: FakeEngine) -> None:
        first = await occupy(batcher, engine)
        flood = [
            asyncio.create_task(
                batcher.infer({"x": rows(4, 10 * i)}, 4, ((1,),), 5.0, client="flood")
            )
            for i in range(12)
        ]
        await asyncio.sleep(0.01)
        light = asyncio.create_task(
            batcher.infer({"x": rows(1, 999)}, 1, ((1,),), 5.0, client="light")
        )
        await asyncio.sleep(0.01)
        engine.gate.set()
        await asyncio.gather(first, light, *flood)

    engine = run(scenario, max_queue_delay_us=0)
    # 48 flood rows queued before it in batches of 8: in arrival order the light request
    # would ride in the 7th batch; in fair order it joins the first one formed.
    first_batch = engine.batches[1]
    assert 999.0 in first_batch[:, 0]
    assert batch_sizes(engine)[1:] == [5, 8, 8, 8, 8, 8, 4]


def test_one_client_keeps_arrival_order() -> None:
    async def scenario(batcher: Batcher, engine: FakeEngine) -> None:
        first = await occupy(batcher, engine)
        tasks = [
            asyncio.create_task(batcher.infer({"x": rows(3, 10 * i)}, 3, ((1,),), 5.0, client="a"))
            for i in range(4)
        ]
        await asyncio.sleep(0.02)
        engine.gate.set()
        await asyncio.gather(first, *tasks)

    engine = run(scenario, max_queue_delay_us=0)
    assert [b[0, 0] for b in engine.batches[1:]] == [0.0, 20.0]


def test_a_gathered_entry_counts_as_the_requests_it_stands_for() -> None:
    """One entry standing for 3 requests (a front end's gathering): the queue bound and the
    metrics count 3 requests, the batch its rows."""

    async def scenario(batcher: Batcher, engine: FakeEngine) -> None:
        first = await occupy(batcher, engine)
        gathered = asyncio.create_task(batcher.infer({"x": rows(3)}, 3, ((1,),), 5.0, requests=3))
        await asyncio.sleep(0.02)
        assert batcher.queued == 3
        with pytest.raises(QueueFull):  # max_queue_size 4: one more request fits, not two
            await batcher.infer({"x": rows(2)}, 2, ((1,),), 5.0, requests=2)
        engine.gate.set()
        np.testing.assert_array_equal((await gathered)["y"], rows(3) * 2)
        await first
        stats = batcher._metrics.statistics()["inference_stats"]
        assert isinstance(stats, dict)
        assert stats["queue"]["count"] == 4  # the blocker and the three
        assert stats["compute_infer"]["count"] == 4

    run(scenario, max_queue_delay_us=0, max_queue_size=4)


def test_an_entry_that_does_not_fit_waits_while_a_smaller_one_fills_the_batch() -> None:
    """Entries are not split: with 5, 5 and 3 rows queued and 8 to a batch, the first batch
    takes 5 + 3 and the second 5 (not 5, then 5, then 3)."""

    async def scenario(batcher: Batcher, engine: FakeEngine) -> None:
        first = await occupy(batcher, engine)
        tasks = [asyncio.create_task(infer(batcher, rows(n, 10 * n))) for n in (5, 5, 3)]
        await asyncio.sleep(0.02)
        engine.gate.set()
        for task, n in zip(tasks, (5, 5, 3), strict=True):
            np.testing.assert_array_equal(await task, rows(n, 10 * n) * 2)
        await first

    engine = run(scenario, max_queue_delay_us=0)
    assert batch_sizes(engine) == [1, 8, 5]


class BlockRunner(FakeRunner):
    """A runner that stages blocks itself (``engines.base.BlockRunner``): it records the
    blocks it was handed, then doubles them joined."""

    def run_blocks(self, blocks: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        self.engine.blocks.append([len(block["x"]) for block in blocks])
        return self.run({"x": np.concatenate([block["x"] for block in blocks])})


def test_a_runner_that_stages_blocks_gets_each_request_unjoined() -> None:
    """A gathered entry (two blocks) and a plain request in one batch reach a block runner as
    three blocks in queue order, never joined by the batcher; each caller gets its rows."""
    engine = FakeEngine()
    engine.new_runner = lambda: BlockRunner(engine)  # type: ignore[method-assign]

    async def main() -> None:
        pool = await RunnerPool.create(engine, 1, "test")
        metrics = ModelMetrics(f"fake{next(_models)}", "fp32")
        batcher = Batcher(pool, DynamicBatching(max_queue_delay_us=0), metrics, 8)
        batcher.start()
        try:
            first = await occupy(batcher, engine)
            gathered = asyncio.create_task(
                batcher.infer([{"x": rows(1)}, {"x": rows(2, 10)}], 3, ((1,),), 5.0, requests=2)
            )
            single = asyncio.create_task(infer(batcher, rows(3, 20)))
            await asyncio.sleep(0.02)
            engine.gate.set()
            await first
            joined = np.concatenate([rows(1), rows(2, 10)])
            np.testing.assert_array_equal((await gathered)["y"], joined * 2)
            np.testing.assert_array_equal(await single, rows(3, 20) * 2)
        finally:
            engine.gate.set()
            await batcher.close(drain_timeout_s=5)
            pool.close()

    asyncio.run(main())
    assert engine.blocks == [[1, 2, 3]]  # the lone blocker ran as one block, through run
    assert batch_sizes(engine) == [1, 6]


class PaddingRunner(FakeRunner):
    """A stand-in for a runner of CUDA graphs captured at powers of two: a batch costs its
    next power of two."""

    def rows_padded_to(self, rows: int) -> int:
        return 1 << (rows - 1).bit_length()


class PaddingEngine(FakeEngine):
    def new_runner(self) -> FakeRunner:
        return PaddingRunner(self)


@pytest.mark.parametrize("engine", [PaddingEngine(), FakeEngine()], ids=["graphs", "exact"])
def test_rows_a_runner_pads_a_batch_with_are_counted_beside_the_rows_inferred(
    engine: FakeEngine,
) -> None:
    model = f"fake{next(_models)}"

    async def main() -> None:
        pool = await RunnerPool.create(engine, 1, "test")
        batcher = Batcher(
            pool, DynamicBatching(max_queue_delay_us=0), ModelMetrics(model, "fp32"), 8
        )
        batcher.start()
        try:
            for n in (3, 5, 8, 1):  # one at a time: a batch each
                np.testing.assert_array_equal(await infer(batcher, rows(n)), rows(n) * 2)
        finally:
            await batcher.close(drain_timeout_s=5)
            pool.close()

    asyncio.run(main())
    labels = {"model": model, "version": "fp32"}
    padded = REGISTRY.get_sample_value("stoker_inference_padded_rows_total", labels)
    inferred = REGISTRY.get_sample_value("stoker_inference_count_total", labels)
    assert batch_sizes(engine) == [3, 5, 8, 1]
    assert inferred == 17
    assert padded == ((4 - 3) + (8 - 5) if isinstance(engine, PaddingEngine) else 0)
