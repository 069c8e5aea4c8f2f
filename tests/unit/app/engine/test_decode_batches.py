"""GPU decode batches sized from the queue, on the CPU path (``TorchImageDecoder`` with
``device="cpu"`` and Pillow standing in for nvJPEG): under a queue one batch takes every
waiting upload up to its pixels, a second decoder does not cut the queue into small batches
while one decodes, and a lone photo goes at once. Every wait is on a state (a decoder that
started, uploads queued), never on a fixed sleep.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from app.engine.handlers import HandlerContext, ImageClassifier
from app.engine.images import BatchBounds, DecodeQueue
from app.image_header import read_header
from app.metrics import ModelMetrics
from app.settings import LimitSettings, UploadSettings
from engines.preprocess import ImagePreprocess
from engines.spec import ModelSpec, TensorSpec
from tests.conftest import sample_jpegs

pytest.importorskip("torch", reason="the batch decoder is torch's (the reference extra)")

PREP = ImagePreprocess(resize_shorter=40, crop=32, datatype="UINT8")
SPEC = ModelSpec(
    "m",
    (TensorSpec("input", "UINT8", (3, 32, 32)),),
    (TensorSpec("logits", "FP32", (4,)),),
    max_batch_size=256,
)
WAIT_S = 60.0  # generous: only a broken queue waits this long
_names = iter(range(10**6))


class Gated:
    """The CPU batch decoder, its first batch held until the test lets it go, so that
    uploads queue behind it as they do behind a busy GPU; records each batch's size."""

    def __init__(self, hold_first: bool = True) -> None:
        from engines.backends.torch.images import TorchImageDecoder, pillow_decode_jpeg

        self.decoder = TorchImageDecoder(PREP, "cpu", pillow_decode_jpeg)
        self.batches: list[int] = []
        self.started = threading.Event()
        self.release = threading.Event()
        if not hold_first:
            self.release.set()

    def __call__(self, jpegs: Sequence[bytes | None]) -> Any:
        self.batches.append(len(jpegs))
        self.started.set()
        assert self.release.wait(WAIT_S)
        return self.decoder.decode(jpegs)


def pixels(jpegs: Sequence[bytes]) -> list[int]:
    limits = LimitSettings()
    headers = [read_header(data, limits.max_image_pixels) for data in jpegs]
    return [h.width * h.height for h in headers]


async def until(condition: Any) -> None:
    """Turns of the loop until ``condition()`` holds (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not condition():
        assert loop.time() < deadline, "the state was never reached"
        await asyncio.sleep(0)


async def turns(count: int = 20) -> None:
    """Let the queue's task run what the last arrivals woke (it needs one turn)."""
    for _ in range(count):
        await asyncio.sleep(0)


def in_process(jpegs: Sequence[bytes]) -> np.ndarray:
    from engines.backends.torch.images import TorchImageDecoder, pillow_decode_jpeg

    rows, _ = TorchImageDecoder(PREP, "cpu", pillow_decode_jpeg).decode(list(jpegs))
    return np.asarray(rows)


def test_under_a_queue_one_batch_takes_every_photo_up_to_its_pixels() -> None:
    """While a batch decodes, 40 one-photo requests queue; the next batch takes them all, not
    a fixed count, and a bound of pixels (the photos' own, from their headers) cuts the
    batch where the pixels run out: here after 25 photos."""
    photos = sample_jpegs()
    order = [photos[i % len(photos)] for i in range(40)]
    areas = pixels(order)
    bound = sum(areas[:25])  # the first 25 queued fit, the 26th does not
    gated = Gated()
    seen: list[int] = []

    async def scenario() -> list[Any]:
        queue = DecodeQueue(
            gated,
            BatchBounds(pixels=bound, photos=256, bytes=1 << 30),
            on_batch=lambda images, waits, seconds: seen.append(images),
        )
        queue.start()
        try:
            first = asyncio.create_task(queue.decode([photos[0]], pixels([photos[0]])))
            await asyncio.to_thread(gated.started.wait, WAIT_S)
            tasks = [
                asyncio.create_task(queue.decode([data], [area]))
                for data, area in zip(order, areas, strict=True)
            ]
            await until(lambda: queue.queued == 40)
            gated.release.set()
            return [await first, *[await task for task in tasks]]
        finally:
            await queue.close()

    answers = asyncio.run(scenario())
    assert gated.batches == [1, 25, 15] and seen == gated.batches
    want = in_process(order)
    for i, answer in enumerate(answers[1:]):
        assert answer is not None and answer[1] == [True]
        np.testing.assert_array_equal(np.asarray(answer[0]), want[i : i + 1])


def test_a_second_decoder_waits_for_a_share_of_a_batch_while_one_decodes() -> None:
    """Two decoders and ``spread_pixels`` of ten photos: a lone photo goes to the first at
    once; the five that queue while it decodes are not sent to the idle second one (five
    batches of one would each pay a batch's cost); once ten or more are queued the second
    decoder takes them all in one batch."""
    photo = sample_jpegs()[2]
    area = pixels([photo])[0]
    first, second = Gated(), Gated()

    async def scenario() -> list[Any]:
        queue = DecodeQueue(
            [first, second],
            BatchBounds(pixels=1000 * area, photos=256, bytes=1 << 30, spread_pixels=10 * area),
        )
        queue.start()
        try:
            lone = asyncio.create_task(queue.decode([photo], [area]))
            await asyncio.to_thread(first.started.wait, WAIT_S)  # not held for company
            early = [asyncio.create_task(queue.decode([photo], [area])) for _ in range(5)]
            await until(lambda: queue.queued == 5)
            await turns()
            assert queue.decoding == 1 and not second.started.is_set()
            late = [asyncio.create_task(queue.decode([photo], [area])) for _ in range(7)]
            await asyncio.to_thread(second.started.wait, WAIT_S)
            second.release.set()
            first.release.set()
            return [await task for task in [lone, *early, *late]]
        finally:
            await queue.close()

    answers = asyncio.run(scenario())
    assert first.batches == [1] and second.batches == [12]
    assert all(answer is not None and answer[1] == [True] for answer in answers)


def classifier(queue: DecodeQueue) -> ImageClassifier:
    """The image classifier of a model whose uploads decode through ``queue``."""
    return ImageClassifier(
        HandlerContext(
            name="m",
            spec=SPEC,
            preprocess=PREP,
            postprocess="softmax",
            labels=None,
            limits=LimitSettings(),
            metrics=ModelMetrics(f"decode-batches-{next(_names)}", "fp32"),
            normalised_by_engine=False,
            decoder=queue,
        )
    )


def test_a_lone_photo_is_decoded_at_once_through_the_classifier() -> None:
    """The served bounds (``UploadSettings``' defaults, a spread among them): a lone photo's
    batch starts as soon as it is handed over, with no company to wait for; its row is the
    in-process decoder's, and the handler counts it decoded on the device."""
    photo = sample_jpegs()[1]
    waits: list[float] = []

    async def scenario() -> dict[str, Any]:
        queue = DecodeQueue(
            Gated(hold_first=False),
            BatchBounds.of(UploadSettings()),
            on_batch=lambda images, waited, seconds: waits.extend(waited),
        )
        queue.start()
        handler = classifier(queue)
        try:
            return await handler.decode([photo])
        finally:
            await handler.close()

    inputs = asyncio.run(scenario())
    np.testing.assert_array_equal(np.asarray(inputs["input"]), in_process([photo]))
    assert len(waits) == 1 and waits[0] < 5.0  # no company waited for (generous: a loaded CI)


def test_under_load_batches_grow_and_the_answers_are_each_requests_own() -> None:
    """Many requests of several photos each through the classifier while the first batch
    decodes: the served bounds take them in one batch (48 photos, far under 48 M pixels),
    and every request gets its own rows, in order."""
    photos = sample_jpegs()[:3]
    gated = Gated()

    async def scenario() -> list[dict[str, Any]]:
        queue = DecodeQueue(gated, BatchBounds.of(UploadSettings()))
        queue.start()
        handler = classifier(queue)
        try:
            first = asyncio.create_task(handler.decode([photos[0]]))
            await asyncio.to_thread(gated.started.wait, WAIT_S)
            requests = [list(reversed(photos)) if i % 2 else photos for i in range(16)]
            tasks = [asyncio.create_task(handler.decode(r)) for r in requests]
            await until(lambda: queue.queued == 48)
            gated.release.set()
            await first
            return [await task for task in tasks]
        finally:
            await handler.close()

    answers = asyncio.run(scenario())
    assert gated.batches == [1, 48]
    want = in_process(photos)
    for i, inputs in enumerate(answers):
        got = np.asarray(inputs["input"])
        np.testing.assert_array_equal(got, want[::-1] if i % 2 else want)
