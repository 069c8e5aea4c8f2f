"""Decoding uploaded images, refusing what is not an image or is too big with the right status.

Every upload's header is read on the CPU first (format, size: a decompression bomb is
refused before any pixel is decoded). JPEGs can then be decoded in batches by a device
decoder (``DecodeQueue`` around ``engines.backends.torch.images``); the rest, and any JPEG the
device decoder gives back, are decoded here with Pillow. The model-defined preprocessing
lives in ``engines.preprocess``.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

from app.errors import BadRequest, PayloadTooLarge

log = logging.getLogger(__name__)
# Colour modes nvJPEG turns into RGB as Pillow does; CMYK and the like go to Pillow.
DEVICE_MODES = frozenset({"RGB", "L"})
# The formats an upload may be, and the only Pillow plugins ever tried on one: photos and
# screenshots. Pillow reads 40-odd more, some through external programs (EPS runs
# Ghostscript) or rarely exercised parsers; none of them is a photo a client sends.
UPLOAD_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF")


@dataclass(frozen=True)
class Header:
    format: str
    mode: str
    width: int
    height: int

    @property
    def device_decodable(self) -> bool:
        return self.format == "JPEG" and self.mode in DEVICE_MODES


def _open(data: bytes, max_pixels: int, max_aspect: float | None) -> Image.Image:
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        image = Image.open(io.BytesIO(data), formats=UPLOAD_FORMATS)
        width, height = image.size
        if width * height > max_pixels:
            raise PayloadTooLarge(
                f"image is {width}x{height} = {width * height} pixels; the limit is {max_pixels}"
            )
        if max_aspect is not None and max(width, height) > max_aspect * max(1, min(width, height)):
            # Its resize to the model's shorter side would scale the longer side past all
            # proportion before the crop: refused from the header, before any pixel.
            raise PayloadTooLarge(
                f"image is {width}x{height}, an aspect ratio over {max_aspect:g}:1 (the limit); "
                "crop it first"
            )
        return image


def _refusing(data: bytes, fn: Callable[[], Image.Image]) -> Image.Image:
    """Run ``fn`` on ``data`` turning every failure into 400, and a bomb into 413."""
    try:
        return fn()
    except PayloadTooLarge:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise PayloadTooLarge(f"image refused as a decompression bomb: {exc}") from exc
    except UnidentifiedImageError as exc:
        # Pillow's own message names its file object (<_io.BytesIO object at 0x...>).
        raise BadRequest(
            f"cannot decode image: {len(data)} bytes that are not an image format this server "
            f"reads ({', '.join(UPLOAD_FORMATS)})"
        ) from exc
    except Exception as exc:
        detail = f"{type(exc).__name__}: {exc}"[:200]
        raise BadRequest(f"cannot decode image: {detail}") from exc


def inspect(data: bytes, max_pixels: int, max_aspect: float | None = None) -> Header:
    """The upload's format and size from its header alone (no pixel is decoded); refuses
    images over ``max_pixels`` or, where given, longer than ``max_aspect`` times wide."""
    image = _refusing(data, lambda: _open(data, max_pixels, max_aspect))
    return Header(image.format or "", image.mode, *image.size)


def decode(data: bytes, max_pixels: int, max_aspect: float | None = None) -> Image.Image:
    """Decode JPEG/PNG/... bytes into RGB, refusing what ``inspect`` refuses before decoding."""
    return _refusing(data, lambda: _open(data, max_pixels, max_aspect).convert("RGB"))


BatchDecode = Callable[[list[bytes]], list[np.ndarray | None]]


class DecodeQueue:
    """Gathers the JPEG uploads of concurrent requests into batches for a batch decoder.

    There is no timer: while one batch decodes, the uploads that arrive wait and form the
    next one (up to ``max_batch``), as a zero-delay dynamic batcher does. ``decode`` answers
    one entry per upload: its UINT8 row, or None where the decoder gave up on that image
    (the caller decodes it on the CPU). A decoder that fails as a whole is logged and
    answers None for its batch, so a device fault degrades to CPU decoding, never to errors.
    """

    def __init__(
        self,
        decode: BatchDecode,
        max_batch: int,
        label: str = "decode",
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        self._decode = decode
        self._on_batch = on_batch
        self._max = max(1, max_batch)
        self._pending: deque[tuple[bytes, asyncio.Future[np.ndarray | None]]] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=label)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def decode(self, uploads: Sequence[bytes]) -> list[np.ndarray | None]:
        if self._task is None:
            raise RuntimeError("DecodeQueue.start() was not called")
        loop = asyncio.get_running_loop()
        futures = []
        for data in uploads:
            future: asyncio.Future[np.ndarray | None] = loop.create_future()
            self._pending.append((data, future))
            futures.append(future)
        self._wake.set()
        return list(await asyncio.gather(*futures))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                batch: list[tuple[bytes, asyncio.Future[np.ndarray | None]]] = []
                while self._pending and len(batch) < self._max:
                    data, future = self._pending.popleft()
                    if not future.done():  # the request went away: skip its upload
                        batch.append((data, future))
                if not batch:
                    continue
                try:
                    rows = await loop.run_in_executor(
                        self._executor, self._decode, [data for data, _ in batch]
                    )
                    if len(rows) != len(batch):
                        raise RuntimeError(f"{len(rows)} rows for {len(batch)} images")
                except Exception:
                    log.exception(
                        "device decode of %d image(s) failed; decoding on the CPU", len(batch)
                    )
                    rows = [None] * len(batch)
                if self._on_batch is not None:
                    self._on_batch(len(batch))
                for (_, future), row in zip(batch, rows, strict=True):
                    if not future.done():
                        future.set_result(row)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for _, future in self._pending:
            if not future.done():
                future.set_result(None)
        self._pending.clear()
        self._executor.shutdown(wait=True)
