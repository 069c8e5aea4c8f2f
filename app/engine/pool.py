"""The runners of one model version, each lent to one batch at a time.

A runner executes in one of the pool's own threads (one thread per runner), so the event
loop never waits on compute and a runner is never used by two threads at once. The threads
take calls from a plain queue and answer the loop's future with one ``call_soon_threadsafe``:
a ``ThreadPoolExecutor`` behind ``run_in_executor`` costs a ``concurrent.futures.Future``,
its chaining to the loop's and their locks, about 10 us of the loop's CPU per batch
(BENCHMARKS.md, "A request's budget").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import numpy as np

from engines.base import Engine, Runner
from engines.spec import ModelSpec

T = TypeVar("T")
log = logging.getLogger(__name__)


def warmup_inputs(spec: ModelSpec, rows: int) -> dict[str, np.ndarray]:
    """Zeros shaped like a real batch; dynamic dimensions take 1."""
    batch = (rows,) if spec.batched else ()
    inputs = {}
    for tensor in spec.inputs:
        shape = batch + tuple(1 if d == -1 else d for d in tensor.shape)
        if tensor.datatype == "BYTES":
            inputs[tensor.name] = np.full(shape, b"", dtype=object)
        else:
            inputs[tensor.name] = np.zeros(shape, dtype=tensor.dtype)
    return inputs


Call = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[[], Any]]
"""A call for the pool's threads: the loop to answer on, its future, the work."""


def _settle(future: asyncio.Future[T], result: T) -> None:
    if not future.done():  # its caller may have gone (cancelled) meanwhile
        future.set_result(result)


def _fail(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _answer(call: Call) -> None:
    """Run a call on this thread and answer its future on its loop."""
    loop, future, fn = call
    try:
        answer = partial(_settle, future, fn())
    except BaseException as error:  # the caller's to raise, as an executor's would be
        answer = partial(_fail, future, error)
    # A loop closed meanwhile has no one left to answer.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(answer)


class RunnerPool:
    def __init__(self, engine: Engine, runners: list[Runner], label: str) -> None:
        self.engine = engine
        self._runners = runners
        self._idle: asyncio.Queue[Runner] = asyncio.Queue()
        for runner in runners:
            self._idle.put_nowait(runner)
        self._calls: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{label}_{i}", daemon=True)
            for i in range(len(runners))
        ]
        for thread in self._threads:
            thread.start()

    @classmethod
    async def create(cls, engine: Engine, count: int, label: str) -> RunnerPool:
        """Make ``count`` runners off the event loop (sessions and contexts take a while).
        If one cannot be made, those made before it are closed (their pinned buffers and
        streams are not left behind) and the error is raised."""
        runners: list[Runner] = []
        try:
            for _ in range(count):
                runners.append(await asyncio.to_thread(engine.new_runner))
        except BaseException:
            for runner in runners:
                runner.close()
            raise
        return cls(engine, runners, label)

    @property
    def size(self) -> int:
        return len(self._runners)

    async def acquire(self) -> Runner:
        return await self._idle.get()

    def release(self, runner: Runner) -> None:
        self._idle.put_nowait(runner)

    async def call(self, fn: Callable[[], T]) -> T:
        """Run blocking work on the pool's threads (RuntimeError once the pool is closed)."""
        if self._closed:
            raise RuntimeError("the runner pool is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._calls.put((loop, future, fn))
        return await future

    def _work(self) -> None:
        while (call := self._calls.get()) is not None:
            _answer(call)
            del call  # its batch's tensors go with the answer, not with the next wait

    async def warm(self) -> None:
        """Run every runner once at batch 1 and at the max batch, so the first real request
        pays no lazy allocation, graph capture or kernel selection."""
        spec = self.engine.spec
        sizes = sorted({1, spec.max_batch_size}) if spec.batched else [1]
        runners = [await self.acquire() for _ in range(self.size)]
        try:
            for rows in sizes:
                inputs = warmup_inputs(spec, rows)
                await asyncio.gather(
                    *(self.call(partial(runner.run, inputs)) for runner in runners)
                )
        finally:
            for runner in runners:
                self.release(runner)

    def close(self) -> None:
        """Stop the threads (calls still queued are not run: their callers are cancelled),
        then free the runners and the engine."""
        self._closed = True
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                break
            if call is not None:
                with contextlib.suppress(RuntimeError):
                    call[0].call_soon_threadsafe(call[1].cancel)
        for _ in self._threads:
            self._calls.put(None)
        for thread in self._threads:
            thread.join()
        for runner in self._runners:
            runner.close()
        self.engine.close()
