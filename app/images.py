"""Decoding uploaded images, refusing what is not an image or is too big with the right status.

The model-defined preprocessing that follows lives in ``engines.preprocess``."""

from __future__ import annotations

import io
import warnings

from PIL import Image

from app.errors import BadRequest, PayloadTooLarge


def decode(data: bytes, max_pixels: int) -> Image.Image:
    """Decode JPEG/PNG/... bytes into RGB, refusing decompression bombs before decoding."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise PayloadTooLarge(
                    f"image is {width}x{height} = {width * height} pixels; "
                    f"the limit is {max_pixels}"
                )
            return image.convert("RGB")
    except PayloadTooLarge:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise PayloadTooLarge(f"image refused as a decompression bomb: {exc}") from exc
    except Exception as exc:
        raise BadRequest(f"cannot decode image: {type(exc).__name__}: {exc}") from exc
