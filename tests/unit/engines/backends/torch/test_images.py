"""The torch decoder's resize and crop, on the CPU (a Pillow stand-in for nvJPEG): the same
pixels as the CPU path within one level, one bad image costs only itself.
"""

from __future__ import annotations

import io
from typing import Literal

import numpy as np
import pytest
from PIL import Image

from engines.preprocess import ImagePreprocess, preprocess
from tests.conftest import sample_jpegs


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_batched_resize_and_crop_match_pillow_within_one_level(
    layout: Literal["NCHW", "NHWC"],
) -> None:
    """Images of many sizes (shrunk and enlarged, both orientations) in one batch: the
    weight matrices give Pillow's BILINEAR resize and crop within one level, nearly every
    pixel equal."""
    pytest.importorskip("torch", reason="the torch decoder needs torch (the reference extra)")
    from engines.backends.torch.images import TorchImageDecoder, pillow_decode_jpeg

    spec = ImagePreprocess(layout=layout, datatype="UINT8")
    uploads = sample_jpegs() + [
        jpeg_of(size) for size in ((160, 128), (97, 300), (1000, 240), (256, 256), (225, 224))
    ]
    rows, ok = TorchImageDecoder(spec, "cpu", pillow_decode_jpeg).decode(uploads)
    assert ok == [True] * len(uploads) and rows.shape == (len(uploads), *spec.row_shape())
    for data, row in zip(uploads, np.asarray(rows), strict=True):
        want = preprocess(Image.open(io.BytesIO(data)).convert("RGB"), spec)
        assert row.shape == want.shape and row.dtype == np.uint8
        diff = np.abs(row.astype(np.int16) - want)
        assert diff.max() <= 1 and diff.mean() < 0.02, (
            Image.open(io.BytesIO(data)).size,
            diff.mean(),
        )


def jpeg_of(size: tuple[int, int]) -> bytes:
    """A photo-like JPEG (gradients and noise) of ``size``."""
    width, height = size
    rng = np.random.default_rng(width * 7919 + height)
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), (x + y) % 256])
    noisy = pixels.transpose(1, 2, 0) + rng.integers(-20, 20, (height, width, 3))
    buffer = io.BytesIO()
    Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def test_one_image_the_device_refuses_costs_only_itself() -> None:
    pytest.importorskip("torch", reason="the torch decoder needs torch (the reference extra)")
    from engines.backends.torch.images import TorchImageDecoder, pillow_decode_jpeg

    good = sample_jpegs()[:2]
    decoder = TorchImageDecoder(ImagePreprocess(datatype="UINT8"), "cpu", pillow_decode_jpeg)
    rows, ok = decoder.decode([good[0], b"\xff\xd8bad", None, good[1]])
    assert ok == [True, False, False, True]
    alone = [np.asarray(decoder.decode([data])[0])[0] for data in good]
    host = np.asarray(rows)
    assert within_a_level(host[0], alone[0]) and within_a_level(host[3], alone[1])
    assert not host[1].any() and not host[2].any()  # left for the CPU, which fills them
    rows.put(1, alone[1])
    np.testing.assert_array_equal(np.asarray(rows)[1], alone[1])


def test_images_grouped_together_give_what_each_alone_gives() -> None:
    """However the sizes fall into padded groups (one group for photos of many sizes, a
    small image apart from a large one, a group in slices), each image's row is what it
    gets alone (``within_a_level``): the padding never leaks into a row."""
    pytest.importorskip("torch", reason="the torch decoder needs torch (the reference extra)")
    from engines.backends.torch import images as torch_images

    a, b, c = sample_jpegs()[:3]  # 512x512, 600x400, 451x300
    d, e = jpeg_of((300, 200)), jpeg_of((290, 199))
    tiny = jpeg_of((64, 48))
    photos = [jpeg_of(size) for size in ((500, 375), (375, 500), (500, 333), (333, 500))]
    decoder = torch_images.TorchImageDecoder(
        ImagePreprocess(datatype="UINT8"), "cpu", torch_images.pillow_decode_jpeg
    )
    everyone = (a, b, c, d, e, tiny, *photos)
    alone = {data: np.asarray(decoder.decode([data])[0])[0] for data in everyone}
    for mixed, limit, groups_wanted in (
        (photos + photos[:2], torch_images.GROUP_PIXELS, 1),  # both orientations: one group
        ([a, b, d, a, c, a, b, d], torch_images.GROUP_PIXELS, 2),  # d would pad over 4x
        ([d, c, e], torch_images.GROUP_PIXELS, 1),  # three sizes padded to 320 x 480
        ([a, tiny, b], torch_images.GROUP_PIXELS, 2),  # the tiny one apart
        ([a, a, a, c], 512 * 512 * 2, 2),  # at most two of 512 x 512 a group
    ):
        saved = torch_images.GROUP_PIXELS
        torch_images.GROUP_PIXELS = limit
        try:
            groups = decoder._groups(decoder._decode_all(mixed))
            rows, _ = decoder.decode(mixed)
        finally:
            torch_images.GROUP_PIXELS = saved
        assert sorted(i for g in groups for i in g) == list(range(len(mixed)))
        assert len(groups) == groups_wanted, groups
        for data, row in zip(mixed, np.asarray(rows), strict=True):
            assert within_a_level(row, alone[data])


def test_padding_in_one_call_or_image_by_image_gives_the_same_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The nested tensor's padding and the copy per image (where a device lacks it)."""
    import torch

    from engines.backends.torch import images as torch_images

    rng = np.random.default_rng(4)
    pictures = [
        torch.from_numpy(rng.integers(0, 256, (3, h, w), dtype=np.uint8))
        for h, w in ((5, 7), (8, 3))
    ]
    one_call = torch_images.padded(pictures, 8, 8)
    by_image = torch.zeros((2, 3, 8, 8), dtype=torch.uint8)
    for i, picture in enumerate(pictures):
        by_image[i, :, : picture.shape[1], : picture.shape[2]] = picture
    assert torch.equal(one_call, by_image)

    def refused(tensors: object) -> object:
        raise NotImplementedError("no nested tensors on this device")

    monkeypatch.setattr(torch.nested, "nested_tensor", refused)
    assert torch.equal(torch_images.padded(pictures, 8, 8), by_image)


def within_a_level(row: np.ndarray, alone: np.ndarray) -> bool:
    """The same row but for a few pixels one level off: padding adds only zeros, but a
    longer product sums in another order, which can move a value across a rounding edge
    (a leak of the padding would be far off)."""
    diff = np.abs(row.astype(np.int16) - alone)
    return bool(diff.max() <= 1 and diff.mean() < 0.005)


def pillow_filter(size: int, resized: int, start: int, count: int) -> np.ndarray:
    """Pillow's BILINEAR coefficients of one axis, written out from ``ImagingResample``'s
    ``precompute_coeffs`` loop by loop (a (count x size) matrix): the reference for the
    batched weights."""
    scale = size / resized
    filterscale = max(scale, 1.0)
    support = 1.0 * filterscale
    matrix = np.zeros((count, size))
    for row, out in enumerate(range(start, start + count)):
        center = (out + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), size)
        taps = [max(0.0, 1.0 - abs((x - center + 0.5) / filterscale)) for x in range(xmin, xmax)]
        total = sum(taps)
        for x, weight in zip(range(xmin, xmax), taps, strict=True):
            matrix[row, x] = weight / total if total else weight
    return matrix


def test_bilinear_weights_are_pillows_filter_for_every_image_of_a_batch() -> None:
    """Images of several sizes (shrunk, grown, cropped) in one call: each image's matrix is
    Pillow's coefficients for its own axis, zero past its size; taps sum to one and
    shrinking widens the triangle (antialiasing)."""
    import torch

    from engines.backends.torch.images import bilinear_weights

    axes = [(500, 250, 0), (100, 300, 0), (500, 250, 13), (37, 256, 16)]
    weights = bilinear_weights(torch.tensor(axes, dtype=torch.float64), 224, 512).numpy()
    assert weights.shape == (4, 224, 512) and weights.dtype == np.float32
    for matrix, (size, resized, start) in zip(weights, axes, strict=True):
        np.testing.assert_allclose(
            matrix[:, :size], pillow_filter(size, resized, start, 224), rtol=1e-6, atol=1e-7
        )
        assert not matrix[:, size:].any()
        np.testing.assert_allclose(matrix.sum(axis=1), 1.0, rtol=1e-5)
    assert (weights[0][100] > 0).sum() == 4 and (weights[1][150] > 0).sum() == 2
