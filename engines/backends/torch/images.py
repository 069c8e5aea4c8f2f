"""JPEG decode and preprocessing in batches with torch: nvJPEG on a GPU.

``torchvision.io.decode_jpeg`` decodes a list of JPEGs on the device in one call; each image
is then resized (``F.interpolate``, bilinear with antialiasing, as Pillow's downscale),
centre-cropped with the same numbers as the CPU path (``engines.preprocess.crop_box``) and
written into one UINT8 batch in the model's layout. Only that batch, 150 KB a 224² image,
comes back to the host. The resize and crop run on the CPU too (``device="cpu"`` with
another JPEG decoder), which is how they are tested without a GPU.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from engines.preprocess import ImagePreprocess, crop_box

log = logging.getLogger(__name__)
# Pixels resized in one call at most: 64 images of 640x480 (a 236 MB float copy).
GROUP_PIXELS = 64 * 640 * 480


JpegDecode = Callable[..., Any]


class TorchImageDecoder:
    """Decodes batches of JPEG bytes into UINT8 model rows; used by one thread at a time.

    ``decode_jpeg`` is torchvision's (``torchvision.io.decode_jpeg``: a tensor or a list of
    them, ``mode``, ``device``) unless another function of that signature is given; the
    resize and crop are plain torch, so they are the same on every device.
    """

    def __init__(
        self, spec: ImagePreprocess, device: str = "cuda:0", decode_jpeg: JpegDecode | None = None
    ) -> None:
        if decode_jpeg is None:
            from torchvision.io import ImageReadMode
            from torchvision.io import decode_jpeg as torchvision_decode

            decode_jpeg = partial(torchvision_decode, mode=ImageReadMode.RGB)
        self.spec = spec
        self.device = torch.device(device)
        self._decode_jpeg = decode_jpeg
        self._stream = (
            torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            if self.device.type == "cuda"
            else None
        )

    def decode(self, jpegs: Sequence[bytes]) -> list[np.ndarray | None]:
        """One UINT8 row per JPEG, in the spec's layout; None for an image the device decoder
        refused (the caller decodes that one on the CPU)."""
        if not jpegs:
            return []
        datas = [torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy()) for data in jpegs]
        crop = self.spec.crop
        with torch.no_grad(), self._on_stream():
            images = self._decode_all(datas)
            batch = torch.empty((len(datas), 3, crop, crop), dtype=torch.uint8, device=self.device)
            # Images of one size are resized together: a few kernels per group, not per
            # image (the thread competes for the GIL with the event loop; fewer calls, less
            # waiting).
            for (height, width), rows in self._groups(images):
                new_w, new_h, left, top = crop_box(width, height, self.spec)
                stacked = torch.stack([image for i in rows if (image := images[i]) is not None])
                cropped = resize(stacked, new_h, new_w)[..., top : top + crop, left : left + crop]
                index = torch.tensor(rows, device=self.device)
                batch.index_copy_(0, index, cropped)
            if self.spec.layout == "NHWC":
                batch = batch.permute(0, 2, 3, 1)
            host = batch.contiguous().cpu().numpy()  # waits for this stream's work
        return [host[i] if image is not None else None for i, image in enumerate(images)]

    @staticmethod
    def _groups(
        images: list[torch.Tensor | None],
    ) -> Iterator[tuple[tuple[int, int], list[int]]]:
        """Indices of the decoded images by (height, width), in slices of at most
        ``GROUP_PIXELS`` pixels (the float copy the resize makes stays bounded)."""
        sizes: dict[tuple[int, int], list[int]] = {}
        for i, image in enumerate(images):
            if image is not None:
                sizes.setdefault((int(image.shape[1]), int(image.shape[2])), []).append(i)
        for size, rows in sizes.items():
            step = max(1, GROUP_PIXELS // (size[0] * size[1]))
            for start in range(0, len(rows), step):
                yield size, rows[start : start + step]

    def _decode_all(self, datas: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """The batch in one call; if any image fails it, each image alone, so one bad image
        costs only itself."""
        try:
            decoded = self._decode_jpeg(datas, device=self.device)
            return list(decoded)
        except RuntimeError:
            pass
        images: list[torch.Tensor | None] = []
        for data in datas:
            try:
                images.append(self._decode_jpeg(data, device=self.device))
            except RuntimeError as exc:
                log.debug("device JPEG decode refused an image: %s", exc)
                images.append(None)
        return images

    def _on_stream(self) -> contextlib.AbstractContextManager[object]:
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)


def resize(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """NCHW UINT8 images resized bilinearly with antialiasing (what Pillow's BILINEAR does
    when it shrinks), rounded back to UINT8."""
    x = images.to(torch.float32)
    x = F.interpolate(x, size=(height, width), mode="bilinear", align_corners=False, antialias=True)
    return x.round_().clamp_(0, 255).to(torch.uint8)
