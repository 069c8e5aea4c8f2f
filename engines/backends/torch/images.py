"""JPEG decode and preprocessing in batches with torch: nvJPEG on a GPU, the rows left there.

``torchvision.io.decode_jpeg`` decodes a list of JPEGs on the device in one call. The resize
(Pillow's BILINEAR, antialiased as it shrinks) and the centre crop (``engines.preprocess.
crop_box``) of images of different sizes then take one of two forms:

- On a GPU where Triton imports: one kernel for the whole batch (``resize_kernel``), each
  image read where nvJPEG left it, its row written where the caller wants it.
- Elsewhere (the CPU, and how the decoder is tested without a GPU): two batched matrix
  products. Pillow's resize is separable, one fixed weight matrix per axis and image size,
  so the rows the crop keeps are ``Wy @ image @ Wx.T`` with the crop folded into the
  matrices. Images of every size go through those two products together: padded with zeros
  to the group's largest height and width, image and weights alike (the weights of every
  image made in one batched computation from its size and crop, the columns past its size
  zero); an image that would pad the others more than ``PAD_RATIO`` times their area starts
  a group of its own, and a group holds at most ``GROUP_PIXELS``.

The UINT8 batch stays on the device (``DeviceRows``) and the runner copies it into its input
buffer there: nothing but the JPEG bytes crosses PCIe.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from functools import partial
from typing import Any

import numpy as np
import torch

from engines.backends.torch import resize_kernel
from engines.preprocess import ImagePreprocess, crop_box

log = logging.getLogger(__name__)
# Padded pixels of one group at most: 64 images of 640x480 (a 236 MB float copy).
GROUP_PIXELS = 64 * 640 * 480
# A group's padded size is its largest height and width rounded up to a multiple of this.
BUCKET = 32
# An image joins a group only if the group's padded area is at most this many times its own
# (photos of one camera or data set, both orientations, pad to well under 2x).
PAD_RATIO = 4.0


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


@dataclass
class DecodeTimes:
    """Where decode batches spent their time (seconds): one batch's
    (``TorchImageDecoder.last``) or a decode process's, summed (``DecodeProcess.times``,
    logged when it stops). ``decode`` in the JPEG decoder's call (nvJPEG waits for its own
    stream), ``resize`` launching the resize and crop, ``wait`` for them on the device;
    the rows are written where the caller wants them (a decode process's shared buffer)."""

    batches: int = 0
    images: int = 0
    decode: float = 0.0
    resize: float = 0.0
    wait: float = 0.0

    def add(self, other: DecodeTimes) -> None:
        for name in (field.name for field in fields(self)):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def describe(self) -> str:
        if not self.batches:
            return "no batch"
        each = {
            name: 1000 * getattr(self, name) / self.batches for name in ("decode", "resize", "wait")
        }
        return (
            f"{self.batches} batches of {self.images / self.batches:.1f} images; a batch: "
            f"decode {each['decode']:.2f} ms, resize launched {each['resize']:.2f} ms, "
            f"waited for {each['wait']:.2f} ms"
        )


class TorchImageDecoder:
    """Decodes batches of JPEG bytes into UINT8 model rows; used by one thread at a time.

    ``decode_jpeg`` is torchvision's (``torchvision.io.decode_jpeg``: a tensor or a list of
    them, ``mode``, ``device``) unless another function of that signature is given; the
    resize and crop are plain torch, so they are the same on every device.
    """

    def __init__(
        self,
        spec: ImagePreprocess,
        device: str = "cuda:0",
        decode_jpeg: JpegDecode | None = None,
        kernel: bool | None = None,
    ) -> None:
        if decode_jpeg is None:
            from torchvision.io import ImageReadMode
            from torchvision.io import decode_jpeg as torchvision_decode

            decode_jpeg = partial(torchvision_decode, mode=ImageReadMode.RGB)
        self.spec = spec
        self.device = torch.device(device)
        self._decode_jpeg = decode_jpeg
        # The resize and crop: one Triton kernel for the batch (``resize_kernel``) on a GPU
        # where Triton imports, else the batched matrix products below (the CPU's way).
        self.kernel = (
            self.device.type == "cuda" and resize_kernel.available() if kernel is None else kernel
        )
        self._stream = (
            torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            if self.device.type == "cuda"
            else None
        )
        self._lock = threading.Lock()
        self.last = DecodeTimes()  # the last batch's
        if self.kernel and self.device.type == "cuda":
            self.kernel = warmed(kernel, self._warm)

    def _warm(self) -> None:
        """Compile the resize kernel now (a second or two the first time in a machine,
        Triton's cache after), not on the first upload."""
        with torch.no_grad(), self._on_stream():
            image = torch.zeros((3, 64, 48), dtype=torch.uint8, device=self.device)
            self._resize_kernel([image], None)
        if self._stream is not None:
            self._stream.synchronize()

    def decode(
        self, jpegs: Sequence[bytes | memoryview | None], into: torch.Tensor | None = None
    ) -> tuple[DeviceRows, list[bool]]:
        """The batch's rows on the device, in the spec's layout, and for each whether it was
        decoded: False for None (not for this decoder) and for an image the device decoder
        refused, whose row is zeros for the caller to fill (``DeviceRows.put``). ``into``:
        where the rows go (``len(jpegs)`` rows on the device, e.g. a decode process's shared
        buffer), else a new tensor."""
        with self._lock, torch.no_grad(), self._on_stream():
            started = time.perf_counter()
            images = self._decode_all(jpegs)
            decoded = time.perf_counter()
            if self.kernel:
                batch = self._resize_kernel(images, into)
            else:
                batch = self._resize_groups(images)
                if into is not None:
                    batch = into.copy_(batch)
            launched = time.perf_counter()
            if self._stream is not None:
                # Before the rows are handed out: the runner's stream reads them next.
                self._stream.synchronize()
            self.last = DecodeTimes(
                1,
                len(jpegs),
                decoded - started,
                launched - decoded,
                time.perf_counter() - launched,
            )
        return DeviceRows(batch), [image is not None for image in images]

    def _resize_kernel(
        self, images: list[torch.Tensor | None], into: torch.Tensor | None
    ) -> torch.Tensor:
        """Every decoded image resized and cropped into its row in one launch; the rows of
        the others zeroed."""
        shape = (len(images), *self.spec.row_shape())
        if into is not None and tuple(into.shape) != shape:
            raise ValueError(f"rows {tuple(into.shape)} given for a batch of {shape}")
        batch = torch.empty(shape, dtype=torch.uint8, device=self.device) if into is None else into
        decoded = [i for i, image in enumerate(images) if image is not None]
        if len(decoded) < len(images):
            missing = [i for i, image in enumerate(images) if image is None]
            batch[self._to_device(np.asarray(missing))] = 0
        resize_kernel.resize_crop(
            [images[i].contiguous() for i in decoded],  # type: ignore[union-attr]
            decoded,
            batch,
            self.spec,
        )
        return batch

    def _resize_groups(self, images: list[torch.Tensor | None]) -> torch.Tensor:
        """Every decoded image resized and cropped by the matrix products, a launch or a few
        a group of sizes; the rows of the others zeros."""
        crop = self.spec.crop
        batch = torch.zeros((len(images), 3, crop, crop), dtype=torch.uint8, device=self.device)
        groups = self._groups(images)
        order = [i for group in groups for i in group]
        # Each group's rows go to a slice of ``grouped`` in turn; one scatter then puts them
        # in the batch's order (one index to the device a batch, not one a group).
        in_order = order == list(range(len(images)))
        grouped = batch if in_order else torch.empty_like(batch[: len(order)])
        at = 0
        for group in groups:
            self._resize_group(grouped[at : at + len(group)], images, group)
            at += len(group)
        if not in_order and order:
            batch.index_copy_(0, self._to_device(np.asarray(order)), grouped)
        if self.spec.layout == "NHWC":
            batch = batch.permute(0, 2, 3, 1).contiguous()
        return batch

    def _resize_group(
        self, out: torch.Tensor, images: list[torch.Tensor | None], group: list[int]
    ) -> None:
        """Resize and crop the images of one group into ``out`` (a row each): in one
        float tensor, then ``Wy @ x @ Wx.T`` as two batched products (rounded between them,
        as Pillow rounds between its two passes). Images of one size share their weights
        (broadcast); images of several sizes are padded with zeros to the group's size
        (``bucket`` of its largest height and width) in one call (``padded``), and their
        weights are made that wide (``bilinear_weights``): zero rows and columns add nothing
        to a product."""
        crop = self.spec.crop
        chosen: list[torch.Tensor] = [images[i] for i in group]  # type: ignore[misc]
        sizes = [(int(image.shape[1]), int(image.shape[2])) for image in chosen]
        if len(set(sizes)) == 1:
            height, width = sizes[0]
            x = torch.stack(chosen).to(torch.float32)
            sizes = sizes[:1]  # their weights broadcast
        else:
            height, width = bucket(max(h for h, _ in sizes), max(w for _, w in sizes))
            x = padded(chosen, height, width).to(torch.float32)
        axes = []
        for h, w in sizes:
            new_w, new_h, left, top = crop_box(w, h, self.spec)
            axes.append((h, new_h, top, w, new_w, left))
        on_device = self._to_device(np.asarray(axes, dtype=np.float64))
        wy = bilinear_weights(on_device[:, :3], crop, height)[:, None]  # (n, 1, crop, height)
        wx = bilinear_weights(on_device[:, 3:], crop, width).transpose(1, 2)[:, None]
        # Halves round up, as Pillow's fixed point does (an upscale makes many exact halves).
        across = torch.matmul(x, wx).add_(0.5).floor_().clamp_(0, 255)  # (n, 3, height, crop)
        rows = torch.matmul(wy, across).add_(0.5).floor_().clamp_(0, 255)  # (n, 3, crop, crop)
        out.copy_(rows)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """``array`` on the device without waiting for the stream: a copy from pageable
        memory would wait for every kernel queued before it; from pinned memory it is
        queued like a kernel."""
        host = torch.from_numpy(array)
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    @staticmethod
    def _groups(images: list[torch.Tensor | None]) -> list[list[int]]:
        """Indices of the decoded images in groups, largest first: each image joins the
        group before it unless the group's padded size would be more than ``PAD_RATIO``
        times its own area or the group more than ``GROUP_PIXELS`` padded pixels."""
        decoded = [i for i, image in enumerate(images) if image is not None]
        shapes = {i: (int(images[i].shape[1]), int(images[i].shape[2])) for i in decoded}  # type: ignore[union-attr]
        decoded.sort(key=lambda i: -shapes[i][0] * shapes[i][1])
        groups: list[list[int]] = []
        height = width = 0
        for i in decoded:
            h, w = shapes[i]
            if groups:
                tall, wide = bucket(max(height, h), max(width, w))
                if tall * wide <= PAD_RATIO * h * w and (
                    (len(groups[-1]) + 1) * tall * wide <= GROUP_PIXELS
                ):
                    groups[-1].append(i)
                    height, width = max(height, h), max(width, w)
                    continue
            groups.append([i])
            height, width = h, w
        return groups

    def _decode_all(self, jpegs: Sequence[bytes | memoryview | None]) -> list[torch.Tensor | None]:
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


def warmed(asked: bool | None, warm: Callable[[], None]) -> bool:
    """Whether the resize kernel is used, once ``warm`` has compiled and run it: where it
    fails (no C compiler for Triton's launcher, no ptxas for this GPU), the matrix products
    are, with a warning, unless the kernel was asked for by name (``asked`` True), whose
    failure stands."""
    try:
        warm()
    except Exception as error:
        if asked:
            raise
        log.warning("the resize kernel does not run here (%s); matrix products instead", error)
        return False
    return True


def pillow_decode_jpeg(data: torch.Tensor | list[torch.Tensor], device: Any = None) -> Any:
    """torchvision's ``decode_jpeg`` signature on the CPU with Pillow (RGB, one tensor or a
    list): the stand-in for nvJPEG with which the tests run the decoders without a GPU or
    torchvision (a module-level function, so a decode process can import it). An image
    Pillow cannot read raises RuntimeError, as nvJPEG's refusals do."""
    import io

    from PIL import Image

    if isinstance(data, list):
        return [pillow_decode_jpeg(one, device) for one in data]
    try:
        image = Image.open(io.BytesIO(data.numpy().tobytes())).convert("RGB")
    except Exception as exc:
        raise RuntimeError(f"cannot decode image: {exc}") from exc
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).contiguous()


def bucket(height: int, width: int) -> tuple[int, int]:
    """The padded size of a group whose largest height and width are these."""
    return -(-height // BUCKET) * BUCKET, -(-width // BUCKET) * BUCKET


def padded(images: list[torch.Tensor], height: int, width: int) -> torch.Tensor:
    """(n, 3, height, width) UINT8, each image in its top-left corner, zeros around: one call
    through a nested tensor where the device has it, else a copy per image."""
    shape = (len(images), 3, height, width)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # nested tensors: "prototype stage"
            nested = torch.nested.nested_tensor(images)
            return nested.to_padded_tensor(0, shape)
    except (RuntimeError, NotImplementedError):
        out = images[0].new_zeros(shape)
        for slot, image in enumerate(images):
            out[slot, :, : image.shape[1], : image.shape[2]].copy_(image)
        return out


def bilinear_weights(axes: torch.Tensor, count: int, columns: int) -> torch.Tensor:
    """Pillow's BILINEAR resampling of one axis of each image as a (``count`` x ``columns``)
    matrix: ``axes`` holds a row (size, resized size, start) an image (float64, on the
    device the weights are made on), and its matrix resamples ``size`` pixels to ``resized``
    and keeps outputs ``start`` to ``start + count`` (the crop), the columns past ``size``
    zero (padding). The triangle filter widens by the scale as it shrinks (antialiasing),
    and each output pixel's taps are normalised to sum to one, as ``ImagingResample`` does.
    Every image of a batch in the same few kernels, computed in float64 as Pillow computes
    its coefficients in double, then float32."""
    size, resized, start = (axes[:, k, None, None] for k in range(3))  # (n, 1, 1) each
    scale = size / resized
    filter_scale = scale.clamp(min=1.0)  # also the triangle's support of 1, widened
    outputs = torch.arange(count, dtype=torch.float64, device=axes.device)[None, :, None]
    center = (start + outputs + 0.5) * scale  # (n, count, 1)
    low = (center - filter_scale + 0.5).trunc().clamp(min=0)  # C's (int): toward zero
    high = torch.minimum((center + filter_scale + 0.5).trunc(), size)
    taps = torch.arange(columns, dtype=torch.float64, device=axes.device)[None, None, :]
    weights = (1.0 - ((taps - center + 0.5) / filter_scale).abs()).clamp(min=0.0)
    weights = weights * ((taps >= low) & (taps < high))
    totals = weights.sum(dim=2, keepdim=True)
    weights = torch.where(totals != 0, weights / totals, weights)
    return weights.to(torch.float32)
