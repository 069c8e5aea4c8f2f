"""Uploads made model input rows in a front end, where the engine would decode them on the CPU.

An engine with no device decoder for a model publishes the model's preprocessing in its
contract (``Contract.row_preprocess``). A front end then decodes, resizes and crops its own
uploads with Pillow (``app.image_pixels``, the engine's own CPU path: the same rows) in
threads of its own (``RowMaker``), which Pillow leaves as it decodes and resizes, and hands
the engine UINT8 rows that it only stacks, batches and runs: N front ends decode in N
processes at once, beside the engine's inference, not in its process. ``uploads.
decode_in_front_ends`` turns it off. Pillow is loaded at the first upload, not with
the front end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from app.settings import Settings, usable_cores
from engines.preprocess import ImagePreprocess

# Threads a front end decodes in at most: each holds one decoded image (and Pillow's RGB
# copy of it) until its row is cut, up to 2 x 3 x ``limits.max_image_pixels`` bytes.
MAX_THREADS = 8


class RowMaker:
    """Makes the rows of a front end's uploads, at most ``threads`` images at once: the
    usable cores shared out among the front ends, one at least and ``MAX_THREADS`` at most,
    which bounds the decoded images a front end holds (``MAX_THREADS``). Uploads past them
    wait as the bytes they came as."""

    def __init__(self, settings: Settings) -> None:
        limits = settings.limits
        self._max_pixels = limits.max_image_pixels
        self._max_aspect = limits.max_image_aspect_ratio
        shared = usable_cores() // settings.server.front_ends
        self.threads = min(MAX_THREADS, max(1, shared))
        self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="upload-rows")

    async def rows(self, uploads: Sequence[bytes], spec: ImagePreprocess) -> list[bytes]:
        """Each upload's row (UINT8, ``spec``'s layout), or the refusal of the first upload
        that is not an image or too large (``BadRequest``, ``PayloadTooLarge``)."""
        loop = asyncio.get_running_loop()
        made = await asyncio.gather(
            *(loop.run_in_executor(self._executor, self._row, data, spec) for data in uploads),
            return_exceptions=True,
        )
        rows: list[bytes] = []
        for row in made:
            if isinstance(row, BaseException):
                raise row
            rows.append(row)
        return rows

    def _row(self, data: bytes, spec: ImagePreprocess) -> bytes:
        from app.image_pixels import upload_row

        return upload_row(data, spec, self._max_pixels, self._max_aspect).tobytes()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
