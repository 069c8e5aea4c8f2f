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
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from app.settings import UploadSettings

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


@dataclass(frozen=True)
class BatchBounds:
    """What one decode batch may hold (``app.settings.UploadSettings``), and when a second
    batch may start beside one that decodes."""

    pixels: int
    """Decoded pixels (width x height from the headers)."""
    photos: int
    """Uploads, whatever their size (the rows a decoder's buffer holds)."""
    bytes: int
    """JPEG bytes (a decoder's shared input area)."""
    spread_pixels: int = 0
    """While a batch decodes, another starts only once this many pixels are queued, or a
    full batch (0: as soon as a decoder is free)."""

    @classmethod
    def of(cls, settings: UploadSettings) -> BatchBounds:
        return cls(
            settings.decode_batch_pixels,
            settings.decode_batch_photos,
            settings.decode_batch_bytes,
            settings.decode_spread_pixels,
        )


@dataclass(eq=False)
class Pending:
    """A request's uploads in the decode queue, their size, its answer, and when it came."""

    uploads: list[bytes | None]
    pixels: int
    size: int
    """The bytes of its uploads for this decoder."""
    future: asyncio.Future[Decoded | None]
    came: float
    """When (perf_counter)."""


class DecodeQueue:
    """Gathers the JPEG uploads of concurrent requests into batches for batch decoders: the
    one owner of a decode batch's bounds.

    There is no timer. When a decoder is free it takes every request queued, oldest first,
    up to the ``BatchBounds`` (decoded pixels, photos and bytes; a request larger than them
    alone), as a zero-delay dynamic batcher does: a lone photo goes at once, and under load
    the requests that arrive while batches decode form the next one. While a batch decodes,
    a second free decoder waits until the queue holds ``spread_pixels`` or a full batch,
    so that a queue is not cut into small batches across decoders, each paying its own
    fixed cost. Each decoder (one per device stream, or per slot of a decode process) runs in
    a thread of its own, one batch at a time, so the CPU side of one batch (JPEG parsing,
    kernel launches) overlaps another's. ``decode`` answers the request's rows (a view of
    the batch's, where the decoder put them) and, per upload, whether it was decoded (the
    caller decodes the rest on the CPU). A decoder that fails as a whole is logged and
    answers None, so a device fault degrades to CPU decoding, never to errors.
    """

    def __init__(
        self,
        decode: BatchDecode | Sequence[BatchDecode],
        bounds: BatchBounds,
        label: str = "decode",
        on_batch: Callable[[int, list[float], float], None] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self._decoders = [decode] if callable(decode) else list(decode)
        self._on_batch = on_batch
        self._on_close = on_close  # after the last batch: what the decoders hold (processes)
        self.bounds = bounds
        self._pending: deque[Pending] = deque()
        self._queued = [0, 0, 0]  # pixels, photos, bytes of ``_pending``
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._free: deque[int] = deque()  # first in, first out: an idle process first
        self._running: set[asyncio.Task[None]] = set()
        self._executor = ThreadPoolExecutor(
            max_workers=len(self._decoders), thread_name_prefix=label
        )

    @property
    def decoding(self) -> int:
        """Batches decoding now."""
        return len(self._decoders) - len(self._free)

    @property
    def queued(self) -> int:
        """Uploads waiting for a batch."""
        return self._queued[1]

    def start(self) -> None:
        self._free.extend(range(len(self._decoders)))
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def decode(
        self, uploads: Sequence[bytes | None], pixels: Sequence[int] | None = None
    ) -> Decoded | None:
        """The request's uploads decoded in a batch; ``pixels``: each one's decoded pixels
        (from its header; None: counted as one each)."""
        if self._task is None:
            raise RuntimeError("DecodeQueue.start() was not called")
        future: asyncio.Future[Decoded | None] = asyncio.get_running_loop().create_future()
        mine = [data for data in uploads if data is not None]
        size = sum(len(data) for data in mine)
        area = (
            len(mine)
            if pixels is None
            else sum(p for p, data in zip(pixels, uploads, strict=True) if data is not None)
        )
        self._pending.append(Pending(list(uploads), area, size, future, time.perf_counter()))
        self._count(self._pending[-1], 1)
        self._wake.set()
        return await future

    def _count(self, request: Pending, sign: int) -> None:
        self._queued[0] += sign * request.pixels
        self._queued[1] += sign * len(request.uploads)
        self._queued[2] += sign * request.size

    def _ready(self) -> bool:
        """Whether a free decoder takes a batch now: none decodes, or the queue holds enough
        to be worth a batch of its own beside those that do."""
        if not self.decoding:
            return True
        bounds = self.bounds
        pixels, photos, size = self._queued
        return (
            not bounds.spread_pixels
            or pixels >= min(bounds.spread_pixels, bounds.pixels)
            or photos >= bounds.photos
            or size >= bounds.bytes
        )

    def _take(self) -> list[Pending]:
        """The oldest queued requests up to the bounds (the first whatever its size)."""
        bounds = self.bounds
        batch: list[Pending] = []
        pixels = photos = size = 0
        while self._pending:
            request = self._pending[0]
            if batch and (
                pixels + request.pixels > bounds.pixels
                or photos + len(request.uploads) > bounds.photos
                or size + request.size > bounds.bytes
            ):
                break
            self._pending.popleft()
            self._count(request, -1)
            if request.future.done():  # the request went away: skip its uploads
                continue
            batch.append(request)
            pixels += request.pixels
            photos += len(request.uploads)
            size += request.size
        return batch

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            # Woken by an arrival and by each batch's end: what is queued goes when a
            # decoder is free and ``_ready`` says so, else it gathers on.
            while self._pending and self._free and self._ready():
                batch = self._take()
                if not batch:
                    continue
                index = self._free.popleft()
                task = asyncio.get_running_loop().create_task(self._decode_batch(index, batch))
                self._running.add(task)
                task.add_done_callback(self._running.discard)

    async def _decode_batch(self, index: int, batch: list[Pending]) -> None:
        joined = [data for request in batch for data in request.uploads]
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
            self._free.append(index)
            self._wake.set()
        seconds = time.perf_counter() - started
        at = 0
        for request in batch:
            end = at + len(request.uploads)
            if not request.future.done():
                rows, ok = decoded if decoded is not None else (None, None)
                request.future.set_result(
                    None if rows is None or ok is None else (rows[at:end], ok[at:end])
                )
            at = end
        if self._on_batch is not None:  # after the answers: a metric never holds them up
            self._on_batch(len(joined), [started - request.came for request in batch], seconds)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for task in list(self._running):
            with contextlib.suppress(Exception):
                await task
        for request in self._pending:
            if not request.future.done():
                request.future.set_result(None)
        self._pending.clear()
        self._executor.shutdown(wait=True)
        if self._on_close is not None:
            await asyncio.to_thread(self._on_close)
