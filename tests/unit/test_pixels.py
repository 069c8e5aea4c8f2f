"""UINT8 pixels on a model's image input, GPU placement in the config, and batched image
decoding (the queue, and the torch resize and crop checked against Pillow on the CPU)."""

from __future__ import annotations

import asyncio
import io
import threading
import time
from typing import Any, Literal

import numpy as np
import pytest
from PIL import Image

from app.dataplane import batch_key, validate_inputs
from app.errors import BadRequest, PayloadTooLarge
from app.images import DecodeQueue, inspect
from app.repository import ConfigError, ModelConfig, ModelEntry
from engines.preprocess import ImagePreprocess, crop_box, normalize, preprocess
from engines.spec import ModelSpec, TensorSpec
from tests.conftest import jpeg_bytes, sample_jpegs

IMAGE = TensorSpec("input", "FP32", (3, 224, 224))
SPEC = ModelSpec("m", (IMAGE,), (TensorSpec("logits", "FP32", (10,)),), max_batch_size=8)


def entry(**config: Any) -> ModelEntry:
    from pathlib import Path

    return ModelEntry(config=ModelConfig(name="m", max_batch_size=8, **config), folder=Path("."))


# -- pixels on the protocol -------------------------------------------------------------


def test_uint8_pixels_are_validated_on_the_pixel_input_only() -> None:
    pixels = np.zeros((2, 3, 224, 224), np.uint8)
    floats = np.zeros((2, 3, 224, 224), np.float32)
    assert validate_inputs(SPEC, {"input": pixels}, "input") == 2
    assert validate_inputs(SPEC, {"input": floats}, "input") == 2
    # Pixels and floats never share a batch.
    assert batch_key(SPEC, {"input": pixels}) != batch_key(SPEC, {"input": floats})
    with pytest.raises(BadRequest, match=r"datatype UINT8, the model takes FP32$"):
        validate_inputs(SPEC, {"input": pixels})
    with pytest.raises(BadRequest, match=r"datatype INT32, the model takes FP32 \(or UINT8"):
        validate_inputs(SPEC, {"input": pixels.astype(np.int32)}, "input")
    with pytest.raises(BadRequest, match="does not match"):
        validate_inputs(SPEC, {"input": np.zeros((1, 224, 224, 3), np.uint8)}, "input")


def test_nhwc_rows_normalise_along_the_last_axis() -> None:
    photo = Image.fromarray(np.random.default_rng(3).integers(0, 256, (300, 400, 3), np.uint8))
    nhwc = ImagePreprocess(layout="NHWC", datatype="UINT8", mean=(1.0, 2.0, 3.0))
    row = preprocess(photo, nhwc)
    want = (row.astype(np.float64) - np.array([1.0, 2.0, 3.0])) / 128.0
    np.testing.assert_allclose(normalize(row, nhwc, np.dtype(np.float32)), want, atol=1e-5)


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        ({"gpus": [0, 0], "runners": 2}, "lists a GPU twice"),
        ({"gpus": [0, 1], "runners": 1}, "give at least one runner per GPU"),
        ({"gpus": [-1]}, "greater than or equal to 0"),
    ],
)
def test_gpu_placement_is_checked_when_the_config_loads(
    tmp_path: object, config: dict[str, object], problem: str
) -> None:
    from pathlib import Path

    import yaml

    from app.repository import load_config

    folder = Path(str(tmp_path)) / "m"
    folder.mkdir()
    (folder / "config.yaml").write_text(yaml.safe_dump({"max_batch_size": 8, **config}))
    with pytest.raises(ConfigError, match=problem):
        load_config(folder)


# -- headers ----------------------------------------------------------------------------


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


# -- the decode queue -------------------------------------------------------------------


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


# -- the torch decoder's resize and crop, on the CPU -----------------------------------


def pil_decode(data: object, device: object) -> object:
    """A stand-in for nvJPEG with torchvision's signature: Pillow on the CPU."""
    import torch

    if isinstance(data, list):
        return [pil_decode(d, device) for d in data]
    assert isinstance(data, torch.Tensor)
    raw = data.numpy().tobytes()
    if raw.startswith(b"\xff\xd8bad"):
        raise RuntimeError("nvjpeg: bad bitstream")
    image = Image.open(io.BytesIO(raw)).convert("RGB")
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).contiguous()


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_torch_resize_and_crop_match_pillow_within_one_level(
    layout: Literal["NCHW", "NHWC"],
) -> None:
    pytest.importorskip("torch", reason="the torch decoder needs torch (the reference extra)")
    from engines.backends.torch.images import TorchImageDecoder

    spec = ImagePreprocess(layout=layout, datatype="UINT8")
    uploads = sample_jpegs()
    rows = TorchImageDecoder(spec, "cpu", pil_decode).decode(uploads)
    for data, row in zip(uploads, rows, strict=True):
        want = preprocess(Image.open(io.BytesIO(data)).convert("RGB"), spec)
        assert row is not None and row.shape == want.shape and row.dtype == np.uint8
        diff = np.abs(row.astype(np.int16) - want)
        assert diff.max() <= 1 and diff.mean() < 0.3


def test_one_image_the_device_refuses_costs_only_itself() -> None:
    pytest.importorskip("torch", reason="the torch decoder needs torch (the reference extra)")
    from engines.backends.torch.images import TorchImageDecoder

    good = sample_jpegs()[:2]
    rows = TorchImageDecoder(ImagePreprocess(datatype="UINT8"), "cpu", pil_decode).decode(
        [good[0], b"\xff\xd8bad", good[1]]
    )
    assert rows[0] is not None and rows[2] is not None and rows[1] is None


def test_images_of_one_size_resized_together_give_what_each_alone_gives() -> None:
    pytest.importorskip("torch", reason="the torch decoder needs torch (the reference extra)")
    from engines.backends.torch import images as torch_images

    a, b, c = sample_jpegs()[:3]
    decoder = torch_images.TorchImageDecoder(ImagePreprocess(datatype="UINT8"), "cpu", pil_decode)
    alone = {data: decoder.decode([data])[0] for data in (a, b, c)}
    mixed = [a, b, a, c, a, b]
    for limit in (torch_images.GROUP_PIXELS, 512 * 512 * 2):  # whole groups, then slices of 2
        torch_images.GROUP_PIXELS, saved = limit, torch_images.GROUP_PIXELS
        try:
            rows = decoder.decode(mixed)
        finally:
            torch_images.GROUP_PIXELS = saved
        for data, row in zip(mixed, rows, strict=True):
            np.testing.assert_array_equal(row, alone[data])


def test_crop_box_keeps_the_crop_inside_the_resized_image() -> None:
    spec = ImagePreprocess()
    for width, height in [(640, 480), (480, 640), (224, 224), (300, 10), (1, 1000)]:
        new_w, new_h, left, top = crop_box(width, height, spec)
        assert min(new_w, new_h) >= spec.crop
        assert left >= 0 and left + spec.crop <= new_w
        assert top >= 0 and top + spec.crop <= new_h
