"""Uploaded images to pixels with Pillow, refusing what is not an image or is too big with
the right status: what the engine does with an upload no device decoder takes, and what a
front end does with its uploads when the engine decodes on the CPU (``uploads.
decode_in_front_ends``). The header was screened before (``app.image_header``);
Pillow checks its limits again as it opens the image. Imported only where images are
decoded: a front end that hands the engine files never loads Pillow.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable

import numpy as np
from PIL import Image, UnidentifiedImageError

from app.errors import BadRequest, PayloadTooLarge
from app.image_header import UPLOAD_FORMATS
from engines.preprocess import ImagePreprocess, preprocess


def _open(data: bytes, max_pixels: int, max_aspect: float | None) -> Image.Image:
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        image = Image.open(io.BytesIO(data), formats=UPLOAD_FORMATS)
        width, height = image.size
        if width * height > max_pixels:
            raise PayloadTooLarge(
                f"image is {width}x{height} = {width * height} pixels; the limit is {max_pixels}"
            )
        if max_aspect is not None and max(width, height) > max_aspect * max(1, min(width, height)):
            # Its resize to the model's shorter side would scale the longer side past all
            # proportion before the crop: refused from the header, before any pixel.
            raise PayloadTooLarge(
                f"image is {width}x{height}, an aspect ratio over {max_aspect:g}:1 (the limit); "
                "crop it first"
            )
        return image


def _refusing(data: bytes, fn: Callable[[], Image.Image]) -> Image.Image:
    """Run ``fn`` on ``data`` turning every failure into 400, and a bomb into 413."""
    try:
        return fn()
    except PayloadTooLarge:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise PayloadTooLarge(f"image refused as a decompression bomb: {exc}") from exc
    except UnidentifiedImageError as exc:
        # Pillow's own message names its file object (<_io.BytesIO object at 0x...>).
        raise BadRequest(
            f"cannot decode image: {len(data)} bytes that are not an image format this server "
            f"reads ({', '.join(UPLOAD_FORMATS)})"
        ) from exc
    except Exception as exc:
        detail = f"{type(exc).__name__}: {exc}"[:200]
        raise BadRequest(f"cannot decode image: {detail}") from exc


def decode(data: bytes, max_pixels: int, max_aspect: float | None = None) -> Image.Image:
    """Decode JPEG/PNG/... bytes into RGB, refusing what ``inspect`` refuses before decoding."""
    return _refusing(data, lambda: _open(data, max_pixels, max_aspect).convert("RGB"))


def upload_row(
    data: bytes | memoryview, spec: ImagePreprocess, max_pixels: int, max_aspect: float | None
) -> np.ndarray:
    """One model input row (in ``spec``'s layout and datatype) from an upload's bytes."""
    return preprocess(decode(bytes(data), max_pixels, max_aspect), spec)
