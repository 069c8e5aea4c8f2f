"""The dynamic batcher of one model version, with Triton's semantics.

- Batch size counts rows (the first dimension), not requests; a batch never exceeds
  ``max_batch_size`` and only requests with the same non-batch shapes share one.
- A batch forms when a runner is free. It is sent at once when it is full, when the delay
  is 0, or when it reaches the largest preferred size; otherwise it waits for more requests
  until the oldest request in it has waited ``max_queue_delay_us``, and is then cut to the
  largest preferred size it can reach (or sent whole when it reaches none).
- The queue is bounded (429 when full); each request has a deadline (504, and a request
  that expires while queued never reaches a runner); a request whose caller went away is
  cancelled and dropped from the queue. Priority levels: 1 is served first.
- Waiting is event-driven: an ``asyncio.Event`` set on arrival, a timeout for the delay.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Hashable, Iterable, Mapping, Sequence

import numpy as np

from app import tracing
from app.engine.batch import Batch, Pending, Tensors, expire, run_batch
from app.engine.pool import RunnerPool
from app.engine.repository import DynamicBatching
from app.errors import BadRequest, EngineError, QueueFull, StokerError, Unavailable
from app.metrics import ModelMetrics
from engines.base import FatalEngineError, Runner, out_of_memory

log = logging.getLogger(__name__)


class Batcher:
    def __init__(
        self,
        pool: RunnerPool,
        policy: DynamicBatching,
        metrics: ModelMetrics,
        max_batch_size: int,
    ) -> None:
        self._pool = pool
        self._policy = policy
        self._metrics = metrics
        self._max_rows = max(1, max_batch_size)
        self._batched = max_batch_size > 0
        self._delay = policy.max_queue_delay_us / 1e6
        self._preferred = frozenset(policy.preferred_batch_size)
        self._levels: list[deque[Pending]] = [deque() for _ in range(policy.priority_levels)]
        self._queued = 0
        self._queued_rows = 0
        # Fair order between clients: each request's start tag is where its client's previous
        # one finishes (by rows) or the tag now being served, whichever is later; batches are
        # formed in tag order within a priority level. One client queues in arrival order.
        self._finish: dict[str, float] = {}
        self._waiting: dict[str, int] = {}
        self._virtual = 0.0
        self._max_queued_rows = policy.max_queue_rows
        # Input elements per second one runner clears, from the batches run so far.
        self._work_per_s: float | None = None
        self._queued_work = 0
        self._arrived = asyncio.Event()
        # Queued rows at which an arrival wakes the dispatcher while it waits out a batch's
        # delay: below it no batch can be full or reach the largest preferred size, so
        # re-selecting on every arrival (a scan of the queue each) would change nothing.
        self._wake_rows = 1
        self._full_rows = min(self._max_rows, max(self._preferred, default=self._max_rows))
        self._idle = asyncio.Event()
        self._idle.set()
        # Requests queued or executing: what close() waits for, and the pending gauge.
        self._in_flight = 0
        metrics.count_pending(self._pending_count)
        self._executions: set[asyncio.Task[None]] = set()
        self._dispatcher: asyncio.Task[None] | None = None
        self._closing = False
        self._closed_why = "server is shutting down"
        self.failed: BaseException | None = None

    def _pending_count(self) -> int:
        return self._in_flight

    @property
    def pending(self) -> int:
        """Requests queued or executing (what the pending gauge shows)."""
        return self._in_flight

    @property
    def queued(self) -> int:
        return self._queued

    def start(self) -> None:
        self._dispatcher = asyncio.create_task(self._dispatch_forever(), name="batcher")
        self._dispatcher.add_done_callback(self._dispatcher_ended)

    def _dispatcher_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.failed = task.exception()
            log.error("batcher of %s stopped: %r", self._metrics.model, self.failed)

    def level_of(self, priority: int) -> int:
        """Index into the queues for a request's priority (0 = the model's default)."""
        levels = self._policy.priority_levels
        if priority == 0:
            priority = self._policy.default_priority_level or levels
        return min(priority, levels) - 1

    def admit(self, requests: int = 1) -> None:
        """Raise now what ``infer`` would refuse ``requests`` with (503 failed or closing, 429
        full), so that a caller can refuse before spending CPU on decoding what it cannot
        queue."""
        if self.failed is not None:
            raise Unavailable(f"model {self._metrics.model!r} failed; retry on another replica")
        if self._closing:
            raise Unavailable(self._closed_why)
        if self._queued + requests > self._policy.max_queue_size:
            raise QueueFull(
                f"queue of model {self._metrics.model!r} is full "
                f"({self._policy.max_queue_size} requests); retry later"
            )

    async def infer(
        self,
        inputs: Mapping[str, np.ndarray] | Sequence[Mapping[str, np.ndarray]],
        rows: int,
        key: Hashable,
        timeout_s: float | None,
        priority: int = 0,
        client: str = "",
        requests: int = 1,
    ) -> Tensors:
        """Queue one request (or ``requests`` gathered into one entry: ``inputs`` then their
        blocks of rows, in order) and wait for its outputs, split to its own rows.
        ``client`` (an address) is whom it is fair to: a client with many requests waiting
        does not delay one with few by more than about one of its own requests per batch."""
        self.admit(requests)
        if self._batched and rows > self._max_rows:
            # No batch could ever take it: refused, never left queued until its deadline.
            raise BadRequest(f"batch of {rows} rows; the model takes 1 to {self._max_rows}")
        blocks = (inputs,) if isinstance(inputs, Mapping) else tuple(inputs)
        pending = Pending(
            blocks=blocks,
            rows=rows,
            key=key,
            level=self.level_of(priority),
            enqueued=time.monotonic(),
            future=asyncio.get_running_loop().create_future(),
            deadline=None if timeout_s is None else time.monotonic() + timeout_s,
            client=client,
            work=sum(int(np.size(value)) for block in blocks for value in block.values()),
            requests=requests,
        )
        if tracing.tracer is not None:
            pending.traced = tracing.FRAME.get()
        self._admit_rows(rows, client)
        pending.start = max(self._finish.get(client, 0.0), self._virtual)
        self._finish[client] = pending.start + rows
        self._waiting[client] = self._waiting.get(client, 0) + 1
        self._levels[pending.level].append(pending)
        self._queued += requests
        self._queued_rows += rows
        self._queued_work += pending.work
        self._in_flight += requests
        self._idle.clear()
        if self._queued_rows >= self._wake_rows:
            self._arrived.set()
        expiry = None
        if timeout_s is not None:
            # A timer on the request's own future, not a timeout scope around the wait: one
            # handle per request instead of a context manager and a task cancellation.
            expiry = asyncio.get_running_loop().call_later(timeout_s, expire, pending, timeout_s)
        try:
            return await pending.future
        finally:
            if expiry is not None:
                expiry.cancel()
            # A request that leaves early (deadline, caller gone) must not reach a runner.
            if not pending.dispatched:
                self._levels[pending.level].remove(pending)
                self._queued -= pending.requests
                self._queued_rows -= pending.rows
                self._queued_work -= pending.work
                self._left(pending)
            self._in_flight -= pending.requests
            if self._in_flight == 0:
                self._idle.set()

    async def _dispatch_forever(self) -> None:
        while True:
            runner = await self._pool.acquire()
            try:
                batch = await self._next_batch()
            except BaseException:
                self._pool.release(runner)
                raise
            now = time.monotonic()
            levels = set()
            for pending in batch.requests:
                pending.dispatched = True
                levels.add(pending.level)
                self._metrics.queued(now - pending.enqueued, pending.requests)
                self._virtual = max(self._virtual, pending.start)
                self._left(pending)
            for index in levels:  # one pass per level, not a search per request
                level = self._levels[index]
                kept = [p for p in level if not p.dispatched]
                level.clear()
                level.extend(kept)
            self._queued -= sum(p.requests for p in batch.requests)
            self._queued_rows -= batch.rows
            self._queued_work -= sum(p.work for p in batch.requests)
            task = asyncio.create_task(self._execute(runner, batch))
            self._executions.add(task)
            task.add_done_callback(self._executions.discard)

    def _admit_rows(self, rows: int, client: str) -> None:
        """429 when the rows already waiting pass ``max_queue_rows``, or when the work that
        would be served before this request (input elements, in fair order: a light client's
        request jumps most of a flood's) would take the runners longer than
        ``max_queue_work_s`` at the rate measured so far."""
        waiting = self._queued_rows
        if not waiting:
            return
        limit = self._max_queued_rows
        if limit and waiting + rows > limit:
            raise QueueFull(
                f"queue of model {self._metrics.model!r} is full ({waiting} rows "
                f"waiting, at most {limit}); retry later"
            )
        budget = self._policy.max_queue_work_s
        if budget and self._work_per_s:
            rate = self._work_per_s * self._pool.size
            seconds = self._queued_work / rate
            if seconds > budget:  # refined: what is served before this client
                start = max(self._finish.get(client, 0.0), self._virtual)
                ahead = sum(p.work for level in self._levels for p in level if p.start <= start)
                seconds = ahead / rate
            if seconds > budget:
                raise QueueFull(
                    f"queue of model {self._metrics.model!r} holds about {seconds:.1f} s of "
                    f"work ({waiting} rows; at most {budget:g} s); retry later"
                )

    def _left(self, pending: Pending) -> None:
        """A request left the queue (dispatched, expired or its caller gone)."""
        left = self._waiting[pending.client] - 1
        if left:
            self._waiting[pending.client] = left
        else:
            del self._waiting[pending.client]
            del self._finish[pending.client]

    def _in_order(self, level: deque[Pending]) -> Iterable[Pending]:
        """A level's requests in fair order: arrival order while one client waits."""
        if len(self._waiting) <= 1:
            return level
        return sorted(level, key=lambda p: p.start)

    def _select(self) -> tuple[Batch, bool]:
        """The oldest highest-priority request and those that can join it, in queue order;
        and whether the batch is full. A request past its deadline is passed over: its own
        timeout answers it 504 on the loop's next turn, and no runner spends time on it."""
        now = time.monotonic()
        ordered = [self._in_order(level) for level in self._levels]
        first = next((p for level in ordered for p in level if not p.expired(now)), None)
        batch = Batch()
        if first is None:
            return batch, False
        if not self._batched:
            batch.requests.append(first)
            return batch, True
        rows, overflow = 0, False
        for level in ordered:
            for pending in level:
                if pending.key != first.key or pending.expired(now):
                    continue
                if rows + pending.rows > self._max_rows:
                    # It waits for the next batch (where it is the oldest); a smaller entry
                    # behind it may still fill this one (gathered entries are not split).
                    overflow = True
                    continue
                batch.requests.append(pending)
                rows += pending.rows
                if rows == self._max_rows:
                    return batch, True
        return batch, overflow

    def _cut_to_preferred(self, batch: Batch) -> Batch:
        rows, cut = 0, 0
        for i, pending in enumerate(batch.requests, start=1):
            rows += pending.rows
            if rows in self._preferred:
                cut = i
        return Batch(batch.requests[:cut]) if cut else batch

    async def _next_batch(self) -> Batch:
        while True:
            batch, full = self._select()
            wait: float | None = None
            if batch.requests:
                if full or self._delay == 0:
                    return batch
                if self._preferred and batch.rows >= max(self._preferred):
                    return self._cut_to_preferred(batch)
                oldest = min(p.enqueued for p in batch.requests)
                wait = oldest + self._delay - time.monotonic()
                if wait <= 0:
                    return self._cut_to_preferred(batch)
            self._arrived.clear()
            self._wake_rows = self._full_rows if batch.requests else 1
            try:
                async with asyncio.timeout(wait):
                    await self._arrived.wait()
            except TimeoutError:
                pass
            finally:
                self._wake_rows = 1

    async def _execute(self, runner: Runner, batch: Batch) -> None:
        requests = batch.requests
        traced = None if tracing.tracer is None else tracing.tracer.batch(requests, batch.rows)
        try:
            outputs, times = await self._pool.call(
                lambda: run_batch(
                    runner, [p.blocks for p in requests], [p.rows for p in requests], self._batched
                )
            )
        except Exception as exc:
            if traced is not None:
                traced.failed(exc)
            log.error(
                "model %s: a batch of %d rows failed: %s: %s",
                self._metrics.model,
                batch.rows,
                type(exc).__name__,
                exc,
            )
            failure: StokerError = EngineError(f"inference failed: {type(exc).__name__}: {exc}")
            if out_of_memory(exc) and not isinstance(exc, FatalEngineError):
                # Out of memory is this batch's answer, not the runner's end: 503, so the
                # client retries (here, once memory is free, or on another replica).
                failure = Unavailable(
                    f"out of memory for a batch of {batch.rows} rows of model "
                    f"{self._metrics.model!r}; retry"
                )
            for pending in requests:
                if not pending.future.done():
                    pending.future.set_exception(failure)
            if isinstance(exc, FatalEngineError):
                self._fail(exc)
        else:
            times.requests = sum(p.requests for p in requests)
            self._metrics.batch_executed(times)
            if traced is not None:
                traced.ran(times)
            seconds = times.compute_input + times.compute_infer + times.compute_output
            work = sum(p.work for p in requests)
            if seconds > 0 and work > 0:
                rate = work / seconds
                known = self._work_per_s
                self._work_per_s = rate if known is None else 0.8 * known + 0.2 * rate
            for pending, result in zip(requests, outputs, strict=True):
                if not pending.future.done():
                    pending.future.set_result(result)
        finally:
            self._pool.release(runner)

    def _fail(self, fault: FatalEngineError) -> None:
        """Stop for good after an unrecoverable engine fault: refuse new requests, answer the
        queued ones with 503 (another replica can serve them) and stop dispatching."""
        log.critical(
            "model %s: unrecoverable engine fault, no longer serving: %s",
            self._metrics.model,
            fault,
        )
        self.failed = fault
        for level in self._levels:
            for pending in level:
                if not pending.future.done():
                    pending.future.set_exception(
                        Unavailable(
                            f"model {self._metrics.model!r} failed; retry on another replica"
                        )
                    )
        if self._dispatcher is not None:
            self._dispatcher.cancel()

    async def close(self, drain_timeout_s: float, why: str = "server is shutting down") -> None:
        """Refuse new requests, let queued and executing ones finish for up to the drain
        timeout, then fail what is left with 503 and stop. ``why``: what those 503s say (the
        server stops, the model is unloaded)."""
        if not self._closing:
            self._closed_why = why
        self._closing = True
        try:
            async with asyncio.timeout(drain_timeout_s):
                await self._idle.wait()
        except TimeoutError:
            log.warning(
                "model %s: drain timeout; failing %d queued requests",
                self._metrics.model,
                self._queued,
            )
        for level in self._levels:
            for pending in level:
                if not pending.future.done():
                    pending.future.set_exception(Unavailable(self._closed_why))
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            await asyncio.gather(self._dispatcher, return_exceptions=True)
        await asyncio.gather(*self._executions, return_exceptions=True)
        self._metrics.stop_counting(self._pending_count)
