"""The model-defined preprocessing: the crop stays inside the resized image, normalisation
follows the layout.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from engines.preprocess import ImagePreprocess, crop_box, normalize, preprocess


def test_nhwc_rows_normalise_along_the_last_axis() -> None:
    photo = Image.fromarray(np.random.default_rng(3).integers(0, 256, (300, 400, 3), np.uint8))
    nhwc = ImagePreprocess(layout="NHWC", datatype="UINT8", mean=(1.0, 2.0, 3.0))
    row = preprocess(photo, nhwc)
    want = (row.astype(np.float64) - np.array([1.0, 2.0, 3.0])) / 128.0
    np.testing.assert_allclose(normalize(row, nhwc, np.dtype(np.float32)), want, atol=1e-5)


def test_crop_box_keeps_the_crop_inside_the_resized_image() -> None:
    spec = ImagePreprocess()
    for width, height in [(640, 480), (480, 640), (224, 224), (300, 10), (1, 1000)]:
        new_w, new_h, left, top = crop_box(width, height, spec)
        assert min(new_w, new_h) >= spec.crop
        assert left >= 0 and left + spec.crop <= new_w
        assert top >= 0 and top + spec.crop <= new_h
