"""The model-defined preprocessing that turns an RGB image into one input row.

Part of a model's definition (its config says how), shared by the service's uploads, the
calibration sets and the accuracy report, so all three feed the model the same pixels.
Pillow is imported where pixels are made, not here: a front end reads a model's
``ImagePreprocess`` from its contract without loading it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from PIL import Image


class ImagePreprocess(BaseModel):
    """Resize the shorter side, centre-crop, then ``(x - mean) / std`` per RGB channel.

    Also the model config's ``preprocess:`` section, declared once here. ``datatype`` is the
    input's V2 datatype (``UINT8`` skips normalisation, for models that normalise inside);
    the config leaves it out and it follows the model's input (``with_datatype``).
    """

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid", frozen=True)

    resize_shorter: int = Field(default=256, gt=0)
    """The shorter side is resized to this, keeping the aspect ratio."""
    crop: int = Field(default=224, gt=0)
    """Then the centre square of this side is kept."""
    mean: tuple[float, float, float] = (127.0, 127.0, 127.0)
    std: tuple[float, float, float] = (128.0, 128.0, 128.0)
    layout: Literal["NCHW", "NHWC"] = "NCHW"
    """Of one row: CHW or HWC."""
    datatype: str = "FP32"

    def with_datatype(self, datatype: str) -> ImagePreprocess:
        return self.model_copy(update={"datatype": datatype})

    def row_shape(self) -> tuple[int, ...]:
        if self.layout == "NCHW":
            return (3, self.crop, self.crop)
        return (self.crop, self.crop, 3)


def preprocess(image: Image.Image, spec: ImagePreprocess) -> np.ndarray:
    """One model input row from an RGB image."""
    from PIL import Image

    width, height, left, top = crop_box(*image.size, spec)
    resized = image.resize((width, height), Image.Resampling.BILINEAR)
    cropped = resized.crop((left, top, left + spec.crop, top + spec.crop))
    row = np.asarray(cropped, dtype=np.uint8)
    if spec.layout == "NCHW":
        row = np.transpose(row, (2, 0, 1))
    if spec.datatype != "UINT8":
        row = normalize(row, spec, np.dtype(np.float32))
    return np.ascontiguousarray(row)


def crop_box(width: int, height: int, spec: ImagePreprocess) -> tuple[int, int, int, int]:
    """(resized width, resized height, left, top): the resize that makes the shorter side
    ``resize_shorter`` and where the centre crop starts; every decoder uses these numbers."""
    scale = spec.resize_shorter / min(width, height)
    size = (max(spec.crop, round(width * scale)), max(spec.crop, round(height * scale)))
    return size[0], size[1], (size[0] - spec.crop) // 2, (size[1] - spec.crop) // 2


def normalize(pixels: np.ndarray, spec: ImagePreprocess, dtype: np.dtype[Any]) -> np.ndarray:
    """UINT8 pixels (rows in the spec's layout) as the model's input: ``(x - mean) / std``."""
    shape: tuple[int, ...] = (1, 3, 1, 1) if spec.layout == "NCHW" else (1, 1, 1, 3)
    if pixels.ndim == 3:
        shape = shape[1:]
    mean = np.asarray(spec.mean, dtype=np.float32).reshape(shape)
    std = np.asarray(spec.std, dtype=np.float32).reshape(shape)
    return ((pixels.astype(np.float32) - mean) / std).astype(dtype, copy=False)


def load_image(path: Path) -> Image.Image:
    """An RGB image from a trusted local file (calibration and evaluation sets)."""
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")
