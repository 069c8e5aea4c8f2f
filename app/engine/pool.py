"""The runners of one model version, each lent to one batch at a time.

A runner executes in a thread of the pool's own executor (one thread per runner), so the
event loop never waits on compute and a runner is never used by two threads at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TypeVar

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


class RunnerPool:
    def __init__(self, engine: Engine, runners: list[Runner], label: str) -> None:
        self.engine = engine
        self._runners = runners
        self._idle: asyncio.Queue[Runner] = asyncio.Queue()
        for runner in runners:
            self._idle.put_nowait(runner)
        self._executor = ThreadPoolExecutor(max_workers=len(runners), thread_name_prefix=label)

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
        """Run blocking work on the pool's threads."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

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
        self._executor.shutdown(wait=True, cancel_futures=True)
        for runner in self._runners:
            runner.close()
        self.engine.close()
