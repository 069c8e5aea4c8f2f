"""JPEG decode and preprocessing in batches with torch: nvJPEG on a GPU, the rows left there.

``torchvision.io.decode_jpeg`` decodes a list of JPEGs on the device in one call. The resize
(Pillow's BILINEAR, antialiased as it shrinks) and the centre crop (``engines.preprocess.
crop_box``) of images of different sizes are then two batched matrix products: Pillow's
resize is separable, one fixed weight matrix per axis and image size, so the rows the crop
keeps are ``Wy @ image @ Wx.T`` with the crop folded into the matrices. Images of one size
share their weights; the sizes left alone are padded into groups of similar sizes (zeros in
the image and the weights); a group costs a few kernels, and the weights of each size are
made once and cached on the device. The UINT8 batch stays on the device (``DeviceRows``) and
the runner copies it into its input buffer there: nothing but the JPEG bytes crosses PCIe.
The same code runs on the CPU (``device="cpu"`` with another JPEG decoder), which is how it
is tested without a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from functools import lru_cache, partial
from typing import Any

import numpy as np
import torch

from engines.preprocess import ImagePreprocess, crop_box

log = logging.getLogger(__name__)
# Padded pixels of one group at most: 64 images of 640x480 (a 236 MB float copy).
GROUP_PIXELS = 64 * 640 * 480
# A group's padded area is at most this much more than the pixels its images have.
GROUP_WASTE = 1.5
# Weight matrices kept on the device, by (size, resized size, crop start, crop).
CACHED_WEIGHTS = 512


JpegDecode = Callable[..., Any]


class DeviceRows:
    """UINT8 rows of a batch where they were decoded (a torch tensor, usually on the GPU).

    Array-like as far as the batcher needs (``shape``, ``dtype``, ``size``, ``len`` and
    slicing by rows), so the rows of one request travel as a view of the decoder's batch;
    the torch runner copies them into its input buffer on the device, and ``np.asarray``
    brings them to the host for any other engine.
    """

    __slots__ = ("tensor",)
    dtype = np.dtype(np.uint8)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def ndim(self) -> int:
        return self.tensor.dim()

    @property
    def size(self) -> int:
        return self.tensor.numel()

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def __len__(self) -> int:
        return int(self.tensor.shape[0])

    def __getitem__(self, rows: slice) -> DeviceRows:
        if not isinstance(rows, slice):
            raise TypeError("DeviceRows are sliced by rows only")
        return DeviceRows(self.tensor[rows])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        host = self.tensor.cpu().numpy()
        return host if dtype is None else host.astype(dtype)

    def put(self, row: int, value: np.ndarray) -> None:
        """Write one row decoded elsewhere (an image the device decoder refused)."""
        self.tensor[row].copy_(torch.from_numpy(np.ascontiguousarray(value)))


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
        self._lock = threading.Lock()
        self._weights = lru_cache(maxsize=CACHED_WEIGHTS)(self._weights_on_device)

    def decode(self, jpegs: Sequence[bytes | None]) -> tuple[DeviceRows, list[bool]]:
        """The batch's rows on the device, in the spec's layout, and for each whether it was
        decoded: False for None (not for this decoder) and for an image the device decoder
        refused, whose row is left for the caller to fill (``DeviceRows.put``)."""
        crop = self.spec.crop
        with self._lock, torch.no_grad(), self._on_stream():
            batch = torch.zeros((len(jpegs), 3, crop, crop), dtype=torch.uint8, device=self.device)
            images = self._decode_all(jpegs)
            for group in self._groups(images):
                self._resize_group(batch, images, group)
            if self.spec.layout == "NHWC":
                batch = batch.permute(0, 2, 3, 1).contiguous()
            if self._stream is not None:
                # Before the rows are handed out: the runner's stream reads them next.
                self._stream.synchronize()
        return DeviceRows(batch), [image is not None for image in images]

    def _resize_group(
        self, batch: torch.Tensor, images: list[torch.Tensor | None], group: list[int]
    ) -> None:
        """Resize and crop the images of one group into their rows of ``batch``: in one
        float tensor, then ``Wy @ x @ Wx.T`` as two batched products (rounded between them,
        as Pillow rounds between its two passes). Images of one size share their weights
        (broadcast, nothing copied per image); others are padded with zeros, image and
        weights alike."""
        crop = self.spec.crop
        sizes = [tuple(images[i].shape[1:]) for i in group]  # type: ignore[union-attr]
        if len(set(sizes)) == 1:
            h, w = sizes[0]
            new_w, new_h, left, top = crop_box(w, h, self.spec)
            x = torch.stack([images[i] for i in group]).to(torch.float32)  # type: ignore[misc]
            wy = self._weights(h, new_h, top, crop)[None, None]
            wx = self._weights(w, new_w, left, crop).T[None, None]
        else:
            height = max(h for h, _ in sizes)
            width = max(w for _, w in sizes)
            n = len(group)
            x = torch.zeros((n, 3, height, width), dtype=torch.float32, device=self.device)
            wy = torch.zeros((n, 1, crop, height), dtype=torch.float32, device=self.device)
            wx = torch.zeros((n, 1, width, crop), dtype=torch.float32, device=self.device)
            for slot, (i, (h, w)) in enumerate(zip(group, sizes, strict=True)):
                new_w, new_h, left, top = crop_box(w, h, self.spec)
                x[slot, :, :h, :w].copy_(images[i])  # type: ignore[arg-type]
                wy[slot, 0, :, :h].copy_(self._weights(h, new_h, top, crop))
                wx[slot, 0, :w, :].copy_(self._weights(w, new_w, left, crop).T)
        # Halves round up, as Pillow's fixed point does (an upscale makes many exact halves).
        across = torch.matmul(x, wx).add_(0.5).floor_().clamp_(0, 255)  # (n, 3, height, crop)
        rows = torch.matmul(wy, across).add_(0.5).floor_().clamp_(0, 255)  # (n, 3, crop, crop)
        if group == list(range(group[0], group[0] + len(group))):
            batch[group[0] : group[0] + len(group)].copy_(rows)
        else:
            index = torch.tensor(group, device=self.device)
            batch.index_copy_(0, index, rows.to(torch.uint8))

    def _weights_on_device(self, size: int, resized: int, start: int, count: int) -> torch.Tensor:
        return torch.from_numpy(bilinear_weights(size, resized, start, count)).to(self.device)

    @staticmethod
    def _groups(images: list[torch.Tensor | None]) -> list[list[int]]:
        """Indices of the decoded images in groups: those of one size together (in slices
        of ``GROUP_PIXELS``); the sizes left alone then sorted and padded together, a group
        ending where padding it to the next image would pass ``GROUP_PIXELS`` or waste more
        than ``GROUP_WASTE`` times its pixels."""
        by_size: dict[tuple[int, int], list[int]] = {}
        for i, image in enumerate(images):
            if image is not None:
                by_size.setdefault((int(image.shape[1]), int(image.shape[2])), []).append(i)
        groups: list[list[int]] = []
        alone: list[tuple[int, int, int]] = []
        for (h, w), same in by_size.items():
            if len(same) == 1:
                alone.append((h, w, same[0]))
                continue
            step = max(1, GROUP_PIXELS // (h * w))
            groups += [same[start : start + step] for start in range(0, len(same), step)]
        alone.sort()
        group: list[int] = []
        height = width = pixels = 0
        for h, w, i in alone:
            grown_h, grown_w = max(height, h), max(width, w)
            padded = (len(group) + 1) * grown_h * grown_w
            if group and (padded > GROUP_PIXELS or padded > GROUP_WASTE * (pixels + h * w)):
                groups.append(group)
                group, height, width, pixels = [], 0, 0, 0
                grown_h, grown_w = h, w
            group.append(i)
            height, width, pixels = grown_h, grown_w, pixels + h * w
        if group:
            groups.append(group)
        return groups

    def _decode_all(self, jpegs: Sequence[bytes | None]) -> list[torch.Tensor | None]:
        """The batch in one call; if any image fails it, each image alone, so one bad image
        costs only itself."""
        picked = [i for i, data in enumerate(jpegs) if data is not None]
        datas = [torch.frombuffer(bytearray(jpegs[i]), dtype=torch.uint8) for i in picked]  # type: ignore[arg-type]
        images: list[torch.Tensor | None] = [None] * len(jpegs)
        if not datas:
            return images
        try:
            for i, image in zip(picked, self._decode_jpeg(datas, device=self.device), strict=True):
                images[i] = image
            return images
        except RuntimeError:
            pass
        for i, data in zip(picked, datas, strict=True):
            try:
                images[i] = self._decode_jpeg(data, device=self.device)
            except RuntimeError as exc:
                log.debug("device JPEG decode refused an image: %s", exc)
        return images

    def _on_stream(self) -> contextlib.AbstractContextManager[object]:
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)


def bilinear_weights(size: int, resized: int, start: int, count: int) -> np.ndarray:
    """Pillow's BILINEAR resampling of one axis from ``size`` to ``resized`` pixels as a
    (``count`` x ``size``) matrix, the output pixels ``start`` to ``start + count`` of it
    (the crop). The triangle filter widens by the scale as it shrinks (antialiasing), and
    each output pixel's taps are normalised to sum to one, as ``ImagingResample`` does."""
    scale = size / resized
    filter_scale = max(scale, 1.0)
    support = filter_scale  # the triangle's support of 1, widened
    weights = np.zeros((count, size), dtype=np.float64)
    for row, out in enumerate(range(start, start + count)):
        center = (out + 0.5) * scale
        low = max(int(center - support + 0.5), 0)
        high = min(int(center + support + 0.5), size)
        taps = np.arange(low, high)
        w = np.maximum(0.0, 1.0 - np.abs((taps - center + 0.5) / filter_scale))
        total = w.sum()
        if total != 0:
            w /= total
        weights[row, low:high] = w
    return weights.astype(np.float32)
