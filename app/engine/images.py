"""Batches of uploaded JPEGs for the engine's device decoders.

Every upload's header is read first (``app.image_header``: format, size; a decompression
bomb is refused before any pixel is decoded). JPEGs can then be decoded in batches by a
device decoder (``DecodeQueue`` around ``engines.backends.torch.images``), their rows left on
the device; the rest, and any JPEG the device decoder gives back, are decoded with Pillow
(``app.image_pixels``), which checks the header's limits again. The model-defined
preprocessing lives in ``engines.preprocess``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np

log = logging.getLogger(__name__)


class Rows(Protocol):
    """A decoded batch's rows where the decoder left them (``engines.backends.torch.images.
    DeviceRows``): sliced by request, and filled where the device refused an image."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def __len__(self) -> int: ...

    def __getitem__(self, rows: slice) -> Rows: ...

    def put(self, row: int, value: np.ndarray) -> None: ...


BatchDecode = Callable[[list[bytes | None]], tuple[Rows, list[bool]]]
"""Decodes a batch (None: an upload not for this decoder) into its rows and, for each,
whether it was decoded."""
Decoded = tuple[Rows, list[bool]]
Pending = tuple[list[bytes | None], "asyncio.Future[Decoded | None]", float]
"""A request's uploads in the decode queue, its answer, and when it came (perf_counter)."""


class DecodeQueue:
    """Gathers the JPEG uploads of concurrent requests into batches for batch decoders.

    There is no timer: while every decoder is busy, the requests that arrive wait and form
    the next batch (up to ``max_batch`` images; a larger request alone), as a zero-delay
    dynamic batcher does. Each decoder (one per device stream) runs in a thread of its own,
    one batch at a time, so the CPU side of one batch (JPEG parsing, kernel launches)
    overlaps another's. ``decode`` answers the request's rows (a view of the batch's, where
    the decoder put them) and, per upload, whether it was decoded (the caller decodes the
    rest on the CPU). A decoder that fails as a whole is logged and answers None, so a
    device fault degrades to CPU decoding, never to errors.
    """

    def __init__(
        self,
        decode: BatchDecode | Sequence[BatchDecode],
        max_batch: int,
        label: str = "decode",
        on_batch: Callable[[int, list[float], float], None] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self._decoders = [decode] if callable(decode) else list(decode)
        self._on_batch = on_batch
        self._on_close = on_close  # after the last batch: what the decoders hold (processes)
        self._max = max(1, max_batch)
        # each request's uploads, its answer, and when it came (perf_counter)
        self._pending: deque[Pending] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._free: asyncio.Queue[int] = asyncio.Queue()
        self._running: set[asyncio.Task[None]] = set()
        self._executor = ThreadPoolExecutor(
            max_workers=len(self._decoders), thread_name_prefix=label
        )

    def start(self) -> None:
        for index in range(len(self._decoders)):
            self._free.put_nowait(index)
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def decode(self, uploads: Sequence[bytes | None]) -> Decoded | None:
        if self._task is None:
            raise RuntimeError("DecodeQueue.start() was not called")
        future: asyncio.Future[Decoded | None] = asyncio.get_running_loop().create_future()
        self._pending.append((list(uploads), future, time.perf_counter()))
        self._wake.set()
        return await future

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                index = await self._free.get()  # meanwhile arrivals join the next batch
                batch: list[Pending] = []
                images = 0
                while self._pending and (
                    not batch or images + len(self._pending[0][0]) <= self._max
                ):
                    request = self._pending.popleft()
                    if not request[1].done():  # the request went away: skip its uploads
                        batch.append(request)
                        images += len(request[0])
                if not batch:
                    self._free.put_nowait(index)
                    continue
                task = asyncio.get_running_loop().create_task(self._decode_batch(index, batch))
                self._running.add(task)
                task.add_done_callback(self._running.discard)

    async def _decode_batch(self, index: int, batch: list[Pending]) -> None:
        joined = [data for uploads, _, _ in batch for data in uploads]
        decoded: Decoded | None
        started = time.perf_counter()
        try:
            decoded = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._decoders[index], joined
            )
            if len(decoded[1]) != len(joined) or len(decoded[0]) != len(joined):
                raise RuntimeError(f"{len(decoded[1])} rows for {len(joined)} images")
        except Exception:
            log.exception("device decode of %d image(s) failed; decoding on the CPU", len(joined))
            decoded = None
        finally:
            self._free.put_nowait(index)
        seconds = time.perf_counter() - started
        at = 0
        for uploads, future, _ in batch:
            end = at + len(uploads)
            if not future.done():
                rows, ok = decoded if decoded is not None else (None, None)
                future.set_result(
                    None if rows is None or ok is None else (rows[at:end], ok[at:end])
                )
            at = end
        if self._on_batch is not None:  # after the answers: a metric never holds them up
            self._on_batch(len(joined), [started - came for _, _, came in batch], seconds)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for task in list(self._running):
            with contextlib.suppress(Exception):
                await task
        for _, future, _ in self._pending:
            if not future.done():
                future.set_result(None)
        self._pending.clear()
        self._executor.shutdown(wait=True)
        if self._on_close is not None:
            await asyncio.to_thread(self._on_close)
