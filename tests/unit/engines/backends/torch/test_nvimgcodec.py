"""nvImageCodec as the JPEG decoder, through its CPU decoder (libjpeg-turbo) where no GPU is:
torchvision's signature and layout, Pillow's pixels, a broken image refused alone, and the
batched decoder's rows as with the Pillow stand-in."""

from __future__ import annotations

import io
from functools import partial
from typing import Any

import numpy as np
import pytest
from PIL import Image

from app.engine.decoders import jpeg_decode
from app.settings import Settings
from engines.preprocess import ImagePreprocess
from tests.conftest import sample_jpegs

torch = pytest.importorskip("torch", reason="the decoder hands torch tensors (the reference extra)")
pytest.importorskip("nvidia.nvimgcodec", reason="nvidia-nvimgcodec-cu13 has Linux wheels only")

from engines.backends.torch import nvimgcodec  # noqa: E402
from engines.backends.torch.images import TorchImageDecoder, pillow_decode_jpeg  # noqa: E402

BROKEN = b"\xff\xd8\xff\xe0 not a jpeg" * 8


def as_tensor(data: bytes) -> Any:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def test_a_batch_decodes_to_pillows_rgb_pixels_in_torchvisions_layout() -> None:
    photos = sample_jpegs()  # colour, greyscale and progressive
    decoded = nvimgcodec.decode_jpeg([as_tensor(p) for p in photos], device="cpu")
    assert len(decoded) == len(photos)
    for data, image in zip(photos, decoded, strict=True):
        pillow = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).transpose(2, 0, 1)
        assert image.dtype == torch.uint8 and tuple(image.shape) == pillow.shape
        difference = np.abs(image.numpy().astype(np.int16) - pillow)
        assert difference.mean() < 1.0  # both libjpeg-turbo; versions may round apart


def test_a_broken_image_is_none_in_its_batch_and_refused_alone() -> None:
    photo = sample_jpegs()[1]
    decoded = nvimgcodec.decode_jpeg([as_tensor(BROKEN), as_tensor(photo)], device="cpu")
    assert decoded[0] is None and decoded[1] is not None
    with pytest.raises(RuntimeError, match="could not decode"):
        nvimgcodec.decode_jpeg(as_tensor(BROKEN), device="cpu")
    single = nvimgcodec.decode_jpeg(as_tensor(photo), device="cpu")  # a tensor, not a list
    pillow = np.asarray(Image.open(io.BytesIO(photo)).convert("RGB")).transpose(2, 0, 1)
    assert tuple(single.shape) == pillow.shape


def test_the_batched_decoder_gives_the_rows_it_gives_with_pillow() -> None:
    spec = ImagePreprocess(datatype="UINT8")
    uploads: list[bytes | None] = [*sample_jpegs()[:3], BROKEN, None]
    rows, ok = TorchImageDecoder(spec, "cpu", nvimgcodec.decode_jpeg).decode(uploads)
    want, want_ok = TorchImageDecoder(spec, "cpu", pillow_decode_jpeg).decode(uploads)
    assert ok == want_ok == [True, True, True, False, False]
    got = np.asarray(rows).astype(np.int16)
    assert got.shape == np.asarray(want).shape
    assert np.abs(got - np.asarray(want)).max() <= 2
    assert not got[3:].any()  # left for the caller's CPU decode


def test_the_setting_names_the_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    def chosen(**uploads: object) -> object:
        return jpeg_decode(Settings(uploads=uploads))  # type: ignore[arg-type]

    assert chosen(jpeg_decoder="torchvision") is None  # torchvision's own, the default
    assert chosen() is None
    decode = chosen(jpeg_decoder="nvimgcodec", jpeg_hardware_share=0.25)
    assert isinstance(decode, partial) and decode.keywords == {"hardware_share": 0.25}
    photo = sample_jpegs()[1]
    image = decode(as_tensor(photo), device="cpu")
    assert tuple(image.shape) == (3, 400, 600)  # coffee: 600x400

    monkeypatch.setattr(nvimgcodec, "available", lambda: False)
    with pytest.raises(RuntimeError, match="nvidia-nvimgcodec is not installed"):
        chosen(jpeg_decoder="nvimgcodec")
