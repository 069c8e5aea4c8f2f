"""What a batcher queues and runs: a queued entry (one request, or several a front end
gathered) with its deadline, a batch of entries, and one batch's run on a runner's thread
(join, run, check the outputs' rows, split back per entry, timed by phase).

The scheduling (which entries form a batch, when, in what order) is ``app.engine.batcher``'s.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from app.errors import DeadlineExceeded
from app.metrics import BatchTimes
from engines.base import BlockRunner, PaddingRunner, Runner

Tensors = dict[str, np.ndarray]


@dataclass(eq=False)
class Pending:
    blocks: tuple[Mapping[str, np.ndarray], ...]
    """Its tensors, as one block of rows or several (the requests a front end gathered):
    joined only by the runner's staging copy."""
    rows: int
    key: Hashable
    level: int
    enqueued: float
    future: asyncio.Future[Tensors]
    deadline: float | None = None
    """``time.monotonic()`` past which it is answered 504 and must not reach a runner."""
    dispatched: bool = False
    client: str = ""
    work: int = 0
    """Its input elements: what the work bound counts (rows of one model can differ in
    cost when a dimension is dynamic)."""
    start: float = 0.0
    """Its start tag in the fair order (start-time fair queuing by rows, per client)."""
    requests: int = 1
    """Client requests it stands for (a front end gathers several into one entry): what the
    queue bound, the pending gauge and the per-request metrics count."""
    traced: tuple[Any, ...] = ()
    """The ``engine`` spans of its traced requests (``app.tracing``)."""

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline


@dataclass
class Batch:
    requests: list[Pending] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.requests)


def expire(pending: Pending, timeout_s: float) -> None:
    """A request's deadline passed: it is answered 504 now, queued or executing."""
    if not pending.future.done():
        where = "executing" if pending.dispatched else "queued"
        pending.future.set_exception(
            DeadlineExceeded(f"deadline of {timeout_s:.3f} s exceeded while {where}")
        )


def time_left(timeout_s: float | None, arrived: float) -> float | None:
    """What is left of a request's deadline after decoding it; 504 if nothing is (it never
    reaches the queue, let alone a runner)."""
    if timeout_s is None:
        return None
    left = timeout_s - (time.monotonic() - arrived)
    if left <= 0:
        raise DeadlineExceeded(f"deadline of {timeout_s * 1000:g} ms passed while decoding")
    return left


class OutputMismatch(Exception):
    """An engine returned an output whose first dimension is not the batch's row count."""


@functools.cache
def abilities(kind: type) -> tuple[bool, bool]:
    """Whether runners of a class take a batch as blocks (``BlockRunner``) and may pad it
    (``PaddingRunner``): asked once a class, since a runtime protocol's check walks its
    members every time (3.6% of a lone request's loop samples on the CPU when asked a
    batch)."""
    return issubclass(kind, BlockRunner), issubclass(kind, PaddingRunner)


def run_batch(
    runner: Runner,
    requests: list[tuple[Mapping[str, np.ndarray], ...]],
    rows: list[int],
    batched: bool,
) -> tuple[list[Tensors], BatchTimes]:
    """Join (or hand the blocks to a runner that stages them itself), run, check and split
    one batch; runs on a runner's thread."""
    start = time.perf_counter()
    total = sum(rows)
    blocks = [block for request in requests for block in request]
    takes_blocks, pads = abilities(type(runner))
    if batched and len(blocks) > 1 and takes_blocks:
        ran = time.perf_counter()
        outputs = cast(BlockRunner, runner).run_blocks(blocks)
    else:
        inputs = blocks[0]
        if batched and len(blocks) > 1:
            inputs = {name: np.concatenate([b[name] for b in blocks]) for name in blocks[0]}
        ran = time.perf_counter()
        outputs = runner.run(inputs)
    done = time.perf_counter()
    if batched:
        for name, value in outputs.items():
            if value.ndim == 0 or value.shape[0] != total:
                got = value.shape[0] if value.ndim else "no"
                raise OutputMismatch(f"output {name!r} has {got} rows for a batch of {total}")
        if len(rows) == 1:  # a lone entry takes the outputs whole
            split = [outputs]
        else:
            bounds = np.cumsum([0, *rows])
            split = [
                {name: value[bounds[i] : bounds[i + 1]] for name, value in outputs.items()}
                for i in range(len(rows))
            ]
    else:
        split = [outputs]
    finished = time.perf_counter()
    padded = 0
    if batched and pads:
        padded = cast(PaddingRunner, runner).rows_padded_to(total) - total
    return split, BatchTimes(
        rows=total,
        requests=len(rows),  # entries; ``_execute`` counts the requests they stand for
        compute_input=ran - start,
        compute_infer=done - ran,
        compute_output=finished - done,
        padded=padded,
    )
