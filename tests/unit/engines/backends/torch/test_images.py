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
