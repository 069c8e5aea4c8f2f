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

from app.engine.images import BatchBounds, Decoded, DecodeQueue
from app.engine.repository import ModelConfig, ModelEntry
from app.errors import BadRequest, PayloadTooLarge
from app.image_header import UPLOAD_FORMATS, read_header
from engines.spec import ModelSpec, TensorSpec
from tests.conftest import jpeg_bytes

IMAGE = TensorSpec("input", "FP32", (3, 224, 224))


def photos(count: int) -> BatchBounds:
    """Batches bounded by their count alone (no spread: every free decoder takes a batch)."""
    return BatchBounds(pixels=1 << 40, photos=count, bytes=1 << 40)


SPEC = ModelSpec("m", (IMAGE,), (TensorSpec("logits", "FP32", (10,)),), max_batch_size=8)


def entry(**config: Any) -> ModelEntry:
    from pathlib import Path

    return ModelEntry(config=ModelConfig(name="m", max_batch_size=8, **config), folder=Path("."))


def test_headers_are_read_without_decoding_and_bombs_refused() -> None:
    photo = jpeg_bytes(np.zeros((30, 40, 3), np.uint8))
    header = read_header(photo, 10_000)
    assert (header.format, header.width, header.height, header.components) == ("JPEG", 40, 30, 3)
    assert header.device_decodable
    grey = io.BytesIO()
    Image.new("L", (8, 6)).save(grey, format="JPEG")
    assert read_header(grey.getvalue(), 10_000).device_decodable
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    assert not read_header(png.getvalue(), 10_000).device_decodable
    for mode in ("CMYK",):
        other = io.BytesIO()
        Image.new(mode, (8, 8)).save(other, format="JPEG")
        assert not read_header(other.getvalue(), 10_000).device_decodable  # left to Pillow
    with pytest.raises(PayloadTooLarge, match="1200 pixels; the limit is 1000"):
        read_header(photo, 1000)
    with pytest.raises(BadRequest, match="cannot decode image"):
        read_header(b"not an image", 1000)


@pytest.mark.parametrize(
    ("fmt", "mode"),
    [
        (fmt, mode)
        for fmt in UPLOAD_FORMATS
        for mode in ("RGB", "L", "RGBA", "P")
        if fmt != "JPEG" or mode in ("RGB", "L")  # JPEG has no alpha or palette
    ],
)
def test_every_upload_format_reads_the_size_pillow_reads(fmt: str, mode: str) -> None:
    """The plain-Python reader against Pillow's own header parse, format by format (lossy
    and lossless WEBP, grey, palette and alpha where the format has them)."""
    for size in ((1, 1), (37, 5), (300, 301)):
        for options in ({}, {"lossless": True}) if fmt == "WEBP" else ({},):
            buffer = io.BytesIO()
            Image.new(mode, size).save(buffer, format=fmt, **options)
            data = buffer.getvalue()
            header = read_header(data, 1 << 30)
            with Image.open(io.BytesIO(data)) as image:
                assert (header.format, header.width, header.height) == (image.format, *image.size)


def test_progressive_and_cut_short_jpegs() -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48)).save(buffer, format="JPEG", progressive=True)
    data = buffer.getvalue()
    header = read_header(data, 1 << 20)
    assert (header.width, header.height) == (64, 48) and header.device_decodable
    for cut in (3, 20, 100):
        with pytest.raises(BadRequest, match="cannot decode image"):
            read_header(data[:cut], 1 << 20)
    with pytest.raises(BadRequest, match="without a frame header"):
        read_header(b"\xff\xd8\xff\xd9", 1 << 20)


class ArrayRows:
    """Rows on the host standing in for a device batch (``DeviceRows``)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, rows: slice) -> ArrayRows:
        return ArrayRows(self.array[rows])

    def put(self, row: int, value: np.ndarray) -> None:
        self.array[row] = value


class RecordingDecoder:
    """Decodes to a row holding the upload's first byte; slow enough that uploads pile up."""

    def __init__(self, seconds: float = 0.02, refuse: bytes = b"", fail: bool = False) -> None:
        self.batches: list[int] = []
        self.threads: set[str] = set()
        self.seconds = seconds
        self.refuse = refuse
        self.fail = fail

    def __call__(self, uploads: list[bytes | None]) -> tuple[ArrayRows, list[bool]]:
        self.batches.append(len(uploads))
        self.threads.add(threading.current_thread().name)
        time.sleep(self.seconds)
        if self.fail:
            raise RuntimeError("device lost")
        ok = [u is not None and u != self.refuse for u in uploads]
        rows = np.array([[u[0] if u else 0] * 2 for u in uploads], np.uint8)
        return ArrayRows(rows), ok


def test_concurrent_uploads_are_decoded_together_up_to_the_batch_limit() -> None:
    decoder = RecordingDecoder(refuse=b"\x07")

    observed: list[int] = []
    waits: list[float] = []
    durations: list[float] = []

    def on_batch(images: int, waited: list[float], seconds: float) -> None:
        observed.append(images)
        waits.extend(waited)
        durations.append(seconds)

    async def scenario() -> list[Decoded | None]:
        queue = DecodeQueue(decoder, photos(8), on_batch=on_batch)
        queue.start()
        try:
            requests: list[list[bytes | None]] = [[bytes([i]), bytes([i + 100])] for i in range(20)]
            requests[3][0] = None  # not for this decoder: decoded elsewhere
            return await asyncio.gather(*(queue.decode(r) for r in requests))
        finally:
            await queue.close()

    answers = asyncio.run(scenario())
    for i, answer in enumerate(answers):
        assert answer is not None
        rows, ok = answer
        assert isinstance(rows, ArrayRows) and rows.array[1, 0] == i + 100  # its own rows
        assert ok == [i not in (3, 7), True]
        assert not ok[0] or rows.array[0, 0] == i
    assert sum(decoder.batches) == 40 and max(decoder.batches) == 8
    assert len(decoder.batches) < 40 / 2  # gathered, not one by one
    assert len(decoder.threads) == 1 and next(iter(decoder.threads)).startswith("decode")
    assert observed == decoder.batches  # what the batch-size histogram is fed
    assert len(waits) == 20  # a wait per request
    # each batch takes the decoder's sleep at least, and later requests waited for earlier
    # batches: at least one decoder's whole batch
    assert min(durations) >= decoder.seconds and max(waits) >= decoder.seconds


def test_a_request_larger_than_the_batch_limit_is_decoded_alone() -> None:
    decoder = RecordingDecoder(seconds=0.0)

    async def scenario() -> Decoded | None:
        queue = DecodeQueue(decoder, photos(4))
        queue.start()
        try:
            return await queue.decode([bytes([i]) for i in range(10)])
        finally:
            await queue.close()

    answer = asyncio.run(scenario())
    assert answer is not None and answer[1] == [True] * 10 and decoder.batches == [10]


def test_a_failing_decoder_hands_every_upload_back_to_the_cpu() -> None:
    async def scenario() -> Decoded | None:
        queue = DecodeQueue(RecordingDecoder(fail=True), photos(4))
        queue.start()
        try:
            return await queue.decode([b"a", b"b", b"c"])
        finally:
            await queue.close()

    assert asyncio.run(scenario()) is None


def test_a_cancelled_request_is_skipped_and_others_still_answer() -> None:
    decoder = RecordingDecoder(seconds=0.1)

    async def scenario() -> Decoded | None:
        queue = DecodeQueue(decoder, photos(64))
        queue.start()
        try:
            first = asyncio.create_task(queue.decode([b"a"]))
            for _ in range(10_000):  # until "a" is decoding; the next two wait
                if decoder.batches:
                    break
                await asyncio.sleep(0.001)
            gone = asyncio.create_task(queue.decode([b"b", b"c"]))
            kept = asyncio.create_task(queue.decode([b"d"]))
            await asyncio.sleep(0)
            gone.cancel()
            await first
            return await kept
        finally:
            await queue.close()

    answer = asyncio.run(scenario())
    assert answer is not None and answer[1] == [True]
    assert isinstance(answer[0], ArrayRows) and answer[0].array[0, 0] == ord("d")
    assert decoder.batches == [1, 1]  # b and c never reached the decoder


def test_two_decoders_decode_two_batches_at_once() -> None:
    """The second batch goes to the second decoder while the first still decodes: the first
    decoder waits (bounded) for the second to start, which a queue that ran one batch at a
    time could never let happen."""
    second_started = threading.Event()
    overlapped: list[bool] = []

    def first(uploads: list[bytes | None]) -> tuple[ArrayRows, list[bool]]:
        overlapped.append(second_started.wait(timeout=30))
        return ArrayRows(np.ones((len(uploads), 2), np.uint8)), [True] * len(uploads)

    def second(uploads: list[bytes | None]) -> tuple[ArrayRows, list[bool]]:
        second_started.set()
        return ArrayRows(np.full((len(uploads), 2), 2, np.uint8)), [True] * len(uploads)

    async def scenario() -> list[Decoded | None]:
        queue = DecodeQueue([first, second], photos(1))
        queue.start()
        try:
            return list(await asyncio.gather(queue.decode([b"a"]), queue.decode([b"b"])))
        finally:
            await queue.close()

    answers = asyncio.run(scenario())
    assert overlapped == [True]
    values = sorted(int(a[0].array[0, 0]) for a in answers if a is not None)  # type: ignore[attr-defined]
    assert values == [1, 2]  # one batch each
