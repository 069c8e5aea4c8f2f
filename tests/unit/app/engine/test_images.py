"""Uploads: headers read without decoding (bombs refused), UINT8 pixels on the protocol,
and the queue that gathers JPEG uploads into batches for a device decoder.
"""

from __future__ import annotations

import asyncio
import io
import threading
import time
from typing import Any

import numpy as np
import pytest
from PIL import Image

from app.engine.images import DecodeQueue, inspect
from app.engine.repository import ModelConfig, ModelEntry
from app.errors import BadRequest, PayloadTooLarge
from engines.spec import ModelSpec, TensorSpec
from tests.conftest import jpeg_bytes

IMAGE = TensorSpec("input", "FP32", (3, 224, 224))


SPEC = ModelSpec("m", (IMAGE,), (TensorSpec("logits", "FP32", (10,)),), max_batch_size=8)


def entry(**config: Any) -> ModelEntry:
    from pathlib import Path

    return ModelEntry(config=ModelConfig(name="m", max_batch_size=8, **config), folder=Path("."))


def test_headers_are_read_without_decoding_and_bombs_refused() -> None:
    photo = jpeg_bytes(np.zeros((30, 40, 3), np.uint8))
    header = inspect(photo, 10_000)
    assert (header.format, header.mode, header.width, header.height) == ("JPEG", "RGB", 40, 30)
    assert header.device_decodable
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    assert not inspect(png.getvalue(), 10_000).device_decodable
    cmyk = io.BytesIO()
    Image.new("CMYK", (8, 8)).save(cmyk, format="JPEG")
    assert not inspect(cmyk.getvalue(), 10_000).device_decodable  # left to Pillow
    with pytest.raises(PayloadTooLarge, match="1200 pixels; the limit is 1000"):
        inspect(photo, 1000)
    with pytest.raises(BadRequest, match="cannot decode image"):
        inspect(b"not an image", 1000)


class RecordingDecoder:
    """Decodes to a row holding the upload's first byte; slow enough that uploads pile up."""

    def __init__(self, seconds: float = 0.02, refuse: bytes = b"", fail: bool = False) -> None:
        self.batches: list[int] = []
        self.threads: set[str] = set()
        self.seconds = seconds
        self.refuse = refuse
        self.fail = fail

    def __call__(self, uploads: list[bytes]) -> list[np.ndarray | None]:
        self.batches.append(len(uploads))
        self.threads.add(threading.current_thread().name)
        time.sleep(self.seconds)
        if self.fail:
            raise RuntimeError("device lost")
        return [None if u == self.refuse else np.full(2, u[0], np.uint8) for u in uploads]


def test_concurrent_uploads_are_decoded_together_up_to_the_batch_limit() -> None:
    decoder = RecordingDecoder(refuse=b"\x07")

    observed: list[int] = []

    async def scenario() -> list[list[np.ndarray | None]]:
        queue = DecodeQueue(decoder, max_batch=8, on_batch=observed.append)
        queue.start()
        try:
            requests = [[bytes([i]), bytes([i + 100])] for i in range(20)]
            return await asyncio.gather(*(queue.decode(r) for r in requests))
        finally:
            await queue.close()

    answers = asyncio.run(scenario())
    for i, answer in enumerate(answers):
        first, second = answer
        assert second is not None and second[0] == i + 100  # each upload gets its own row
        assert first is None if i == 7 else first is not None and first[0] == i
    assert sum(decoder.batches) == 40 and max(decoder.batches) == 8
    assert len(decoder.batches) < 40 / 2  # gathered, not one by one
    assert len(decoder.threads) == 1 and next(iter(decoder.threads)).startswith("decode")
    assert observed == decoder.batches  # what the batch-size histogram is fed


def test_a_failing_decoder_hands_every_upload_back_to_the_cpu() -> None:
    async def scenario() -> list[np.ndarray | None]:
        queue = DecodeQueue(RecordingDecoder(fail=True), max_batch=4)
        queue.start()
        try:
            return await queue.decode([b"a", b"b", b"c"])
        finally:
            await queue.close()

    assert asyncio.run(scenario()) == [None, None, None]


def test_a_cancelled_request_is_skipped_and_others_still_answer() -> None:
    decoder = RecordingDecoder(seconds=0.1)

    async def scenario() -> list[np.ndarray | None]:
        queue = DecodeQueue(decoder, max_batch=64)
        queue.start()
        try:
            first = asyncio.create_task(queue.decode([b"a"]))
            await asyncio.sleep(0.02)  # "a" is decoding; the next two wait
            gone = asyncio.create_task(queue.decode([b"b", b"c"]))
            kept = asyncio.create_task(queue.decode([b"d"]))
            await asyncio.sleep(0)
            gone.cancel()
            await first
            return await kept
        finally:
            await queue.close()

    answer = asyncio.run(scenario())
    assert answer[0] is not None and answer[0][0] == ord("d")
    assert decoder.batches == [1, 1]  # b and c never reached the decoder
