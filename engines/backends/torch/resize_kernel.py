"""One kernel resizes and centre-crops a whole decode batch, every image at its own size.

The matrix form in ``images.py`` pads a group's images to its largest size, converts the
padded batch to float and multiplies it by weight matrices as wide as that padding, a few
launches a size group: on an H100 a batch of 55 photos spent 8.5 ms launching it and the
chain probe lost half its photos/s to it (BENCHMARKS.md, issue 43). Here one Triton
program computes a block of output pixels of one image, all three channels, straight from
the decoded UINT8 image wherever nvJPEG left it: a table of the images' device addresses
and their geometry goes to the device (two small copies), and one launch covers the batch.
No padding, no float copy of the images, no weight matrices.

The arithmetic is Pillow's BILINEAR resize (``ImagingResample``) followed by the crop, as
``bilinear_weights`` makes it: an output pixel ``x`` of the resized image has its centre at
``(x + 0.5) * scale`` in the source, its taps are the source pixels from
``int(centre - support + 0.5)`` to ``int(centre + support + 0.5)`` (``support`` is the scale
when shrinking, 1 when growing: the triangle widens, which is Pillow's antialiasing), each
weighted by the triangle at its distance and normalised to sum one. The horizontal pass is
rounded to a UINT8 level before the vertical one, as Pillow rounds between its passes; the
two passes are fused, so each output pixel recomputes the horizontal sums of its few rows.
Only the outputs the crop keeps are computed.

Triton's interpreter (``TRITON_INTERPRET=1``) runs the same kernel on the CPU with numpy,
which is how the tests check it against Pillow without a GPU; the kernel calls only Triton's
builtins (``tl.full``, not ``tl.zeros``, which is itself jitted when ``triton.language`` is
first imported and so cannot run in an interpreter turned on after that).
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch

from engines.preprocess import ImagePreprocess

# Output pixels a program computes (its three channels): 256 of a 224x224 crop is 196
# programs an image.
BLOCK = 256

_kernels: dict[bool, Any] = {}


def available() -> bool:
    """Whether Triton can be imported (it ships with CUDA builds of torch on Linux)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _kernel() -> Any:
    """The jitted kernel, made on first use: Triton reads ``TRITON_INTERPRET`` when a
    function is decorated, so a test that sets it gets an interpreted kernel."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if interpret in _kernels:
        return _kernels[interpret]
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def resize_crop(  # type: ignore[no-untyped-def]
        images,  # int64 (n, 6): address, height, width, taps y, taps x, output row
        geometry,  # float32 (n, 6): scale, support and first output of y, then of x
        out,  # UINT8 rows
        row_stride,
        channel_stride,
        pixel_stride,
        CROP: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        image = tl.program_id(0)
        offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < CROP * CROP
        # Output coordinates within the crop.
        y = (offsets // CROP).to(tl.float32)
        x = (offsets % CROP).to(tl.float32)
        facts = images + image * 6
        source = tl.load(facts).to(tl.pointer_type(tl.uint8))
        height = tl.load(facts + 1).to(tl.int32)
        width = tl.load(facts + 2).to(tl.int32)
        taps_y = tl.load(facts + 3).to(tl.int32)
        taps_x = tl.load(facts + 4).to(tl.int32)
        row = tl.load(facts + 5)
        g = geometry + image * 6
        scale_y = tl.load(g + 0)
        support_y = tl.load(g + 1)
        top = tl.load(g + 2)
        scale_x = tl.load(g + 3)
        support_x = tl.load(g + 4)
        left = tl.load(g + 5)
        # int64: a plane past 2**30 pixels would wrap int32 offsets (limits.max_image_pixels
        # is the server's bound, not this kernel's).
        plane = height.to(tl.int64) * width

        centre_y = (top + y + 0.5) * scale_y
        first_y = tl.maximum((centre_y - support_y + 0.5).to(tl.int32), 0)
        end_y = tl.minimum((centre_y + support_y + 0.5).to(tl.int32), height)
        centre_x = (left + x + 0.5) * scale_x
        first_x = tl.maximum((centre_x - support_x + 0.5).to(tl.int32), 0)
        end_x = tl.minimum((centre_x + support_x + 0.5).to(tl.int32), width)

        # Each axis's weights sum, to normalise them as Pillow does. (The loops are
        # ``while`` loops: their bounds are loaded, which the interpreter's ``range`` cannot
        # take.)
        total_y = tl.full([BLOCK], 0.0, tl.float32)
        j = 0
        while j < taps_y:
            tap = first_y + j
            weight = tl.maximum(
                1.0 - tl.abs((tap.to(tl.float32) - centre_y + 0.5) / support_y), 0.0
            )
            total_y += tl.where(tap < end_y, weight, 0.0)
            j += 1
        total_x = tl.full([BLOCK], 0.0, tl.float32)
        i = 0
        while i < taps_x:
            tap = first_x + i
            weight = tl.maximum(
                1.0 - tl.abs((tap.to(tl.float32) - centre_x + 0.5) / support_x), 0.0
            )
            total_x += tl.where(tap < end_x, weight, 0.0)
            i += 1
        total_x = tl.where(total_x == 0.0, 1.0, total_x)
        total_y = tl.where(total_y == 0.0, 1.0, total_y)

        red = tl.full([BLOCK], 0.0, tl.float32)
        green = tl.full([BLOCK], 0.0, tl.float32)
        blue = tl.full([BLOCK], 0.0, tl.float32)
        j = 0
        while j < taps_y:
            tap_y = first_y + j
            weight_y = tl.maximum(
                1.0 - tl.abs((tap_y.to(tl.float32) - centre_y + 0.5) / support_y), 0.0
            )
            row_ok = inside & (tap_y < end_y)
            across_r = tl.full([BLOCK], 0.0, tl.float32)
            across_g = tl.full([BLOCK], 0.0, tl.float32)
            across_b = tl.full([BLOCK], 0.0, tl.float32)
            i = 0
            while i < taps_x:
                tap_x = first_x + i
                weight_x = tl.maximum(
                    1.0 - tl.abs((tap_x.to(tl.float32) - centre_x + 0.5) / support_x), 0.0
                )
                ok = row_ok & (tap_x < end_x)
                at = source + tap_y.to(tl.int64) * width + tap_x
                across_r += weight_x * tl.load(at, mask=ok, other=0).to(tl.float32)
                across_g += weight_x * tl.load(at + plane, mask=ok, other=0).to(tl.float32)
                across_b += weight_x * tl.load(at + 2 * plane, mask=ok, other=0).to(tl.float32)
                i += 1
            # Rounded to a level between the passes (halves up), as Pillow's 8-bit passes.
            across_r = tl.minimum(tl.maximum(tl.floor(across_r / total_x + 0.5), 0.0), 255.0)
            across_g = tl.minimum(tl.maximum(tl.floor(across_g / total_x + 0.5), 0.0), 255.0)
            across_b = tl.minimum(tl.maximum(tl.floor(across_b / total_x + 0.5), 0.0), 255.0)
            weight_y = tl.where(row_ok, weight_y, 0.0)
            red += weight_y * across_r
            green += weight_y * across_g
            blue += weight_y * across_b
            j += 1

        red = tl.minimum(tl.maximum(tl.floor(red / total_y + 0.5), 0.0), 255.0)
        green = tl.minimum(tl.maximum(tl.floor(green / total_y + 0.5), 0.0), 255.0)
        blue = tl.minimum(tl.maximum(tl.floor(blue / total_y + 0.5), 0.0), 255.0)
        target = out + row * row_stride + offsets * pixel_stride
        tl.store(target, red.to(tl.uint8), mask=inside)
        tl.store(target + channel_stride, green.to(tl.uint8), mask=inside)
        tl.store(target + 2 * channel_stride, blue.to(tl.uint8), mask=inside)

    _kernels[interpret] = resize_crop
    return resize_crop


def tables(
    sizes: np.ndarray, addresses: np.ndarray, rows: np.ndarray, spec: ImagePreprocess
) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's two tables for images of ``sizes`` ((n, 2) heights and widths) at
    ``addresses`` going to ``rows``: int64 (address, height, width, taps y, taps x, row) and
    float32 (scale, support and first output of y, then of x). Every image's resize and crop
    follows ``engines.preprocess.crop_box``'s rule, computed for the whole batch in numpy
    (``np.rint`` rounds halves to even, as Python's ``round`` there does)."""
    heights = sizes[:, 0].astype(np.float64)
    widths = sizes[:, 1].astype(np.float64)
    scale = spec.resize_shorter / np.minimum(widths, heights)
    new_w = np.maximum(spec.crop, np.rint(widths * scale))
    new_h = np.maximum(spec.crop, np.rint(heights * scale))
    facts = np.empty((len(sizes), 6), dtype=np.int64)
    shapes = np.empty((len(sizes), 6), dtype=np.float64)
    facts[:, 0] = addresses
    facts[:, 1] = sizes[:, 0]
    facts[:, 2] = sizes[:, 1]
    facts[:, 5] = rows
    for k, size, resized in ((0, heights, new_h), (1, widths, new_w)):
        axis_scale = size / resized
        support = np.maximum(axis_scale, 1.0)
        shapes[:, 3 * k] = axis_scale
        shapes[:, 3 * k + 1] = support
        shapes[:, 3 * k + 2] = (resized - spec.crop) // 2
        # (int)(c + s + 0.5) - (int)(c - s + 0.5) is at most ceil(2 s) + 1.
        facts[:, 3 + k] = np.ceil(2 * support).astype(np.int64) + 1
    return facts, shapes.astype(np.float32)


def resize_crop(
    images: list[torch.Tensor],
    rows: list[int],
    out: torch.Tensor,
    spec: ImagePreprocess,
    block: int = BLOCK,
) -> None:
    """Resize and crop each of ``images`` (UINT8 (3, height, width), contiguous, on
    ``out``'s device) into row ``rows[k]`` of ``out`` (UINT8 rows in ``spec``'s layout), in
    one launch on the current stream. The images must stay alive until the stream has run
    it. ``block``: output pixels a program (a power of two; the interpreter is quicker with
    larger ones)."""
    if not images:
        return
    for image in images:
        if image.dtype != torch.uint8 or image.dim() != 3 or image.shape[0] != 3:
            raise ValueError(f"not a UINT8 (3, height, width) image: {tuple(image.shape)}")
        if not image.is_contiguous() or image.device != out.device:
            raise ValueError("the images must be contiguous and on the rows' device")
    shape = (*spec.row_shape(),)
    if out.dtype != torch.uint8 or tuple(out.shape[1:]) != shape or not out.is_contiguous():
        raise ValueError(f"the rows must be contiguous UINT8 (n, {shape}), not {tuple(out.shape)}")
    if len(rows) != len(images) or min(rows) < 0 or max(rows) >= len(out):
        raise ValueError(f"rows {min(rows)}..{max(rows)} for {len(images)} images, {len(out)} rows")
    sizes = np.asarray([image.shape[1:] for image in images], dtype=np.int64)
    addresses = np.fromiter((image.data_ptr() for image in images), np.int64, len(images))
    facts, shapes = tables(sizes, addresses, np.asarray(rows, dtype=np.int64), spec)
    crop = spec.crop
    if spec.layout == "NCHW":
        channel_stride, pixel_stride = crop * crop, 1
    else:
        channel_stride, pixel_stride = 1, 3
    _kernel()[(len(images), math.ceil(crop * crop / block))](
        _on(out.device, facts),
        _on(out.device, shapes),
        out,
        out.stride(0),
        channel_stride,
        pixel_stride,
        CROP=crop,
        BLOCK=block,
    )


def _on(device: torch.device, array: np.ndarray) -> torch.Tensor:
    """``array`` on ``device``, queued on the current stream (pinned, so not waiting for
    the kernels before it)."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
