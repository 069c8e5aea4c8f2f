"""The ``direct`` target: ONNX Runtime called directly, the yardstick of the server's own cost.

The model is loaded by the model layer exactly as the server loads it (the same engine
store, backend and session options), and a runner of its own, made by the same engine, is
called in a thread with no batcher, no data plane and no HTTP. A closed-loop step of ``c``
clients is back-to-back runs of batches of ``c`` requests' rows: what a server could do for
``c`` clients if every request were batched with the others and nothing were spent around
the run. A server's throughput over this at the same ``c`` is the share of the CPU it leaves
to the model (1.0: it costs nothing); ``stoker bench --serve --direct`` prints it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from bench.payloads import Payload

if TYPE_CHECKING:
    from app.engine.models import LoadedModel
    from engines.base import Runner

Outcome = Callable[[str, int, float | None, bool], None]
"""Where a request's outcome goes: its status, rows, latency (None: outside the window)
and whether it completed inside the window."""


@dataclass(frozen=True)
class DirectTarget:
    """The model's runner, loaded in the worker process."""

    repository: Path
    model: str
    backend: str | None = None
    precision: str | None = None


class DirectClient:
    def __init__(
        self, model: LoadedModel, runner: Runner, tensors: dict[int, dict[str, np.ndarray]]
    ) -> None:
        """``tensors``: per payload (by id), its tensors as the engine takes them."""
        self._model = model
        self._runner = runner
        self._tensors = tensors
        self._lock = asyncio.Lock()

    @classmethod
    async def load(cls, target: DirectTarget, payloads: list[Payload]) -> DirectClient:
        from app.contract import validate_inputs
        from app.engine import models
        from app.engine.repository import discover
        from app.settings import Settings
        from engines import backends
        from engines.store import EngineStore

        entry = discover(target.repository, [target.model])[0]
        settings = Settings()
        source = await asyncio.to_thread(models.source, entry)
        backend = backends.resolve(target.backend or entry.config.backend)
        precision = target.precision or entry.config.default_precision
        store = EngineStore(settings.store.path)
        loaded = await models.load(source, precision, backend, store, settings)
        tensors = {}
        for payload in payloads:
            if payload.tensors is None:
                raise ValueError("the direct target takes tensor payloads (not uploads)")
            validate_inputs(source.spec, payload.tensors, loaded.inputs.pixels)
            # What the service does to UINT8 pixels before batching, done once up front.
            tensors[id(payload)] = loaded.inputs.for_engine(payload.tensors)
        # A runner of its own: the batcher's dispatcher holds an idle one of the pool's.
        runner = await asyncio.to_thread(loaded.pool.engine.new_runner)
        return cls(loaded, runner, tensors)

    def batch(self, chosen: list[Payload]) -> dict[str, np.ndarray]:
        """The chosen payloads' tensors joined into one batch."""
        blocks = [self._tensors[id(payload)] for payload in chosen]
        if len(blocks) == 1:
            return blocks[0]
        return {name: np.concatenate([b[name] for b in blocks]) for name in blocks[0]}

    async def _run(self, inputs: dict[str, np.ndarray]) -> None:
        async with self._lock:  # one runner: one run at a time, as a server's runner
            await asyncio.to_thread(self._runner.run, inputs)

    async def send(self, payload: Payload) -> int:
        """One payload alone (an open-loop arrival)."""
        await self._run(self._tensors[id(payload)])
        return 200

    async def closed_loop(
        self,
        payloads: list[Payload],
        clients: int,
        seed: int,
        t0: float,
        t1: float,
        outcome: Outcome,
    ) -> None:
        """Batches of ``clients`` payloads (cycled from ``seed``, joined before the step)
        back to back until ``t1``; each of their requests answered when its batch is."""
        if clients < 1:
            return
        chosen = [payloads[(seed + i) % len(payloads)] for i in range(clients)]
        inputs = self.batch(chosen)
        while time.perf_counter() < t1:
            start = time.perf_counter()
            await self._run(inputs)
            end = time.perf_counter()
            in_window = t0 <= end < t1
            for payload in chosen:
                outcome("200", payload.rows, end - start if in_window else None, in_window)

    async def metrics(self) -> str | None:
        return None

    async def close(self) -> None:
        self._runner.close()
        await self._model.close(5.0)
