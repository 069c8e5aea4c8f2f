"""A front end's ``RowMaker``: the threads it decodes in, the rows it makes of uploads (the
model's preprocessing worked out by hand here), and the refusals of what is no image or too
large."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
from PIL import Image

from app.errors import BadRequest, PayloadTooLarge
from app.frontend import upload_rows
from app.frontend.upload_rows import RowMaker
from app.settings import Settings
from engines.preprocess import ImagePreprocess

PREP = ImagePreprocess(datatype="UINT8")  # shorter side to 256, the centre 224


def encoded(array: np.ndarray, format: str) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format=format)
    return out.getvalue()


def maker(front_ends: int = 2, **limits: object) -> RowMaker:
    return RowMaker(Settings(server={"front_ends": front_ends}, limits=limits))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("cores", "front_ends", "threads"),
    [(16, 4, 4), (64, 2, 8), (2, 4, 1), (3, 2, 1)],
)
def test_the_usable_cores_are_shared_out_among_the_front_ends_within_bounds(
    monkeypatch: pytest.MonkeyPatch, cores: int, front_ends: int, threads: int
) -> None:
    monkeypatch.setattr(upload_rows, "usable_cores", lambda: cores)
    made = maker(front_ends)
    try:
        assert made.threads == threads
    finally:
        made.close()


def test_each_upload_becomes_the_row_pillow_makes_of_it() -> None:
    """A 300x200 PNG: its shorter side 200 becomes 256 (384x256, Pillow's bilinear), then
    the centre 224x224 from (80, 16); CHW, UINT8."""
    rng = np.random.default_rng(7)
    picture = rng.integers(0, 256, (200, 300, 3), dtype=np.uint8)
    grey = np.full((240, 240, 3), 90, np.uint8)
    made = maker()
    try:
        rows = asyncio.run(made.rows([encoded(picture, "PNG"), encoded(grey, "JPEG")], PREP))
    finally:
        made.close()
    assert [len(row) for row in rows] == [3 * 224 * 224] * 2
    resized = Image.fromarray(picture).resize((384, 256), Image.Resampling.BILINEAR)
    want = np.asarray(resized.crop((80, 16, 304, 240))).transpose(2, 0, 1)
    np.testing.assert_array_equal(np.frombuffer(rows[0], np.uint8).reshape(3, 224, 224), want)
    assert np.abs(np.frombuffer(rows[1], np.uint8).astype(int) - 90).max() <= 2  # JPEG's flat


def test_an_upload_that_is_no_image_or_too_large_refuses_the_request() -> None:
    picture = np.zeros((200, 300, 3), np.uint8)
    made = maker(max_image_pixels=50_000)
    try:
        with pytest.raises(BadRequest, match="cannot decode image"):
            asyncio.run(
                made.rows([encoded(picture[:100, :100], "PNG"), b"GIF89a" + bytes(8)], PREP)
            )
        with pytest.raises(PayloadTooLarge, match="300x200 = 60000 pixels"):
            asyncio.run(made.rows([encoded(picture, "PNG")], PREP))
    finally:
        made.close()
