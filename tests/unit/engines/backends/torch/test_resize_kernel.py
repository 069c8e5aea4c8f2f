"""The one-launch resize and crop (``resize_kernel``) on the CPU, through Triton's
interpreter: Pillow's pixels within one level for images of many sizes in one launch, each
row where it was asked, the rows of images not decoded left zero, and its geometry the
rule every decoder uses (``crop_box``)."""

from __future__ import annotations

import io
from typing import Literal

import numpy as np
import pytest
from PIL import Image

from engines.preprocess import ImagePreprocess, crop_box, preprocess
from tests.unit.engines.backends.torch.test_images import pillow_filter

# A small crop keeps the interpreter (numpy, a program at a time) to seconds: one program of
# 256 pixels an image.
SMALL = {"resize_shorter": 20, "crop": 16, "datatype": "UINT8"}
# Shrunk and grown, both orientations, a square, one far wider than tall, one whose resized
# side lands on a half.
SIZES = ((60, 45), (45, 60), (33, 100), (12, 9), (20, 20), (150, 40), (30, 25))


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's interpreter for this test: the kernel runs on the CPU with numpy."""
    pytest.importorskip("torch", reason="the kernel's host side needs torch (the reference extra)")
    pytest.importorskip(
        "triton", reason="Triton (the test extra, Linux x86_64 wheels) runs the kernel here"
    )
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def photo(size: tuple[int, int], seed: int) -> np.ndarray:
    """A photo-like (height, width, 3) UINT8 picture of ``size`` (width, height): gradients,
    an edge and noise, so a tap in the wrong place shows."""
    width, height = size
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), (x > y) * 200])
    noisy = pixels.transpose(1, 2, 0) + rng.integers(-30, 30, (height, width, 3))
    return noisy.clip(0, 255).astype(np.uint8)


def two_passes(picture: np.ndarray, spec: ImagePreprocess) -> np.ndarray:
    """Pillow's BILINEAR resize and crop written out in numpy from its coefficients
    (``pillow_filter``): the horizontal pass rounded to a level, then the vertical one, the
    order Pillow has always taken for photos (Pillow 13 takes the vertical pass first for
    some shapes, which moves a pixel by one level at most)."""
    height, width = picture.shape[:2]
    new_w, new_h, left, top = crop_box(width, height, spec)
    across = np.einsum("xw,hwc->hxc", pillow_filter(width, new_w, left, spec.crop), picture)
    across = np.clip(np.floor(across + 0.5), 0, 255)
    rows = np.einsum("yh,hxc->yxc", pillow_filter(height, new_h, top, spec.crop), across)
    rows = np.clip(np.floor(rows + 0.5), 0, 255).astype(np.uint8)
    return rows.transpose(2, 0, 1) if spec.layout == "NCHW" else rows


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_one_launch_gives_pillows_pixels_for_every_size_in_its_row(
    interpreted: None, layout: Literal["NCHW", "NHWC"]
) -> None:
    """Seven sizes in one launch, written to rows in another order than the images' (row 0
    and the last left alone): each row is Pillow's two passes (``two_passes``) but for a
    few pixels a level off (exact halves of small images, summed in float32 here and in
    float64 there), within one level of Pillow itself, and the rows not asked for are
    untouched."""
    import torch

    from engines.backends.torch import resize_kernel

    spec = ImagePreprocess(layout=layout, **SMALL)  # type: ignore[arg-type]
    pictures = [photo(size, seed) for seed, size in enumerate(SIZES)]
    images = [torch.from_numpy(p).permute(2, 0, 1).contiguous() for p in pictures]
    rows = [len(SIZES) - k for k in range(len(SIZES))]  # 7, 6, ..., 1
    out = torch.full((len(SIZES) + 2, *spec.row_shape()), 77, dtype=torch.uint8)
    resize_kernel.resize_crop(images, rows, out, spec)
    for picture, row in zip(pictures, rows, strict=True):
        got = out[row].numpy().astype(np.int16)
        off = np.abs(got - two_passes(picture.astype(np.float64), spec))
        assert off.max() <= 1 and off.mean() < 0.1, (picture.shape, off.max(), off.mean())
        pillow = preprocess(Image.fromarray(picture), spec)
        assert np.abs(got - pillow).max() <= 1, picture.shape
    assert (out[0] == 77).all() and (out[len(SIZES) + 1] == 77).all()


def test_the_decoder_with_the_kernel_gives_the_matrix_forms_rows(interpreted: None) -> None:
    """``TorchImageDecoder`` with the kernel and with the matrix products: the same rows
    within one level for a batch of JPEGs with a refused one and a None in it (their rows
    zero, reported not decoded), and rows written into a given tensor land there."""
    import torch

    from engines.backends.torch.images import TorchImageDecoder, pillow_decode_jpeg

    spec = ImagePreprocess(**SMALL)  # type: ignore[arg-type]
    jpegs: list[bytes | memoryview | None] = []
    for seed, size in enumerate(SIZES[:4]):
        buffer = io.BytesIO()
        Image.fromarray(photo(size, seed)).save(buffer, format="JPEG", quality=92)
        jpegs.append(buffer.getvalue())
    jpegs[1:1] = [b"\xff\xd8 not a JPEG", None]
    kernel = TorchImageDecoder(spec, "cpu", pillow_decode_jpeg, kernel=True)
    matrix = TorchImageDecoder(spec, "cpu", pillow_decode_jpeg, kernel=False)
    assert kernel.kernel and not matrix.kernel
    into = torch.full((len(jpegs) + 1, *spec.row_shape()), 5, dtype=torch.uint8)
    rows, ok = kernel.decode(jpegs, into=into[1:])
    want, want_ok = matrix.decode(jpegs)
    assert ok == want_ok == [True, False, False, True, True, True]
    assert rows.tensor.data_ptr() == into[1:].data_ptr()
    got = into[1:].numpy().astype(np.int16)
    assert np.abs(got - np.asarray(want)).max() <= 1
    assert not got[1].any() and not got[2].any()  # left for the CPU, which fills them
    assert (into[0] == 5).all()
    assert kernel.last.batches == 1 and kernel.last.images == len(jpegs)


def test_the_kernels_geometry_is_crop_box_for_every_size() -> None:
    """The batch's resize and crop computed in numpy are ``crop_box``'s, image by image, for
    sizes whose resized side lands on a half (rounded to even, as ``round``) and for sizes
    the crop enlarges; the tap bound covers every output's taps."""
    pytest.importorskip("torch", reason="the kernel's host side needs torch (the reference extra)")
    from engines.backends.torch.resize_kernel import tables

    spec = ImagePreprocess()
    rng = np.random.default_rng(7)
    sizes = [(h, w) for h, w in rng.integers(1, 5000, (600, 2))]
    sizes += [(512, 640), (512, 384), (1024, 1280), (100, 100), (224, 225), (7, 4000)]
    facts, shapes = tables(
        np.asarray(sizes), np.arange(len(sizes)), np.arange(len(sizes)) + 9, spec
    )
    for (h, w), fact, shape in zip(sizes, facts, shapes, strict=True):
        new_w, new_h, left, top = crop_box(int(w), int(h), spec)
        assert tuple(fact[1:3]) == (h, w) and fact[5] == fact[0] + 9
        assert shape[2] == top and shape[5] == left
        np.testing.assert_allclose(shape[[0, 3]], (h / new_h, w / new_w), rtol=1e-6)
        for k, (size, resized) in enumerate(((h, new_h), (w, new_w))):
            scale = size / resized
            support = max(scale, 1.0)
            # The most taps any output of this axis has, from Pillow's loop.
            most = max(
                min(int((x + 0.5) * scale + support + 0.5), size)
                - max(int((x + 0.5) * scale - support + 0.5), 0)
                for x in range(resized)
            )
            assert most <= fact[3 + k], (size, resized)


@pytest.mark.parametrize("capability", [80, 90])
def test_the_kernel_compiles_for_the_gpus_it_serves(capability: int) -> None:
    """What the interpreter does not check (types of the loops' carried values, the pointer
    cast, register use): Triton compiles the kernel to a cubin for an A100 (8.0) and a
    Hopper (9.0) with its own ptxas, no GPU needed, as the decoder's first call does."""
    pytest.importorskip("torch", reason="the kernel's host side needs torch (the reference extra)")
    pytest.importorskip("triton", reason="Triton (the test extra) compiles the kernel")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engines.backends.torch import resize_kernel

    signature = {
        "images": "*i64",
        "geometry": "*fp32",
        "out": "*u8",
        "row_stride": "i32",
        "channel_stride": "i32",
        "pixel_stride": "i32",
        "CROP": "constexpr",
        "BLOCK": "constexpr",
    }
    source = ASTSource(
        fn=resize_kernel._kernel(),
        signature=signature,
        constexprs={"CROP": 224, "BLOCK": resize_kernel.BLOCK},
    )
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32))
    except RuntimeError as exc:
        if "ptxas" in str(exc).lower():
            pytest.skip(f"Triton's ptxas does not run here: {exc}")
        raise
    assert compiled.asm["cubin"] and "ld.global" in compiled.asm["ptx"]


def test_the_kernel_refuses_rows_it_would_write_outside(interpreted: None) -> None:
    """Rows out of the output's range, an output of another row shape or type, or an image
    not (3, height, width) UINT8 are refused before anything is launched: the kernel writes
    by address and would not fail by itself."""
    import torch

    from engines.backends.torch import resize_kernel

    spec = ImagePreprocess(**SMALL)  # type: ignore[arg-type]
    image = torch.full((3, 30, 20), 100, dtype=torch.uint8)
    out = torch.zeros((2, *spec.row_shape()), dtype=torch.uint8)
    for images, rows, target in (
        ([image], [2], out),  # past the last row
        ([image], [-1], out),
        ([image, image], [0], out),  # a row for each image
        ([image], [0], torch.zeros((2, 3, 8, 8), dtype=torch.uint8)),  # another row shape
        ([image], [0], out.float()),
        ([image.float()], [0], out),
        ([image[:, :, ::2]], [0], out),  # not contiguous
    ):
        with pytest.raises(ValueError):
            resize_kernel.resize_crop(images, rows, target, spec)
    assert not out.any()  # nothing was written by the refused calls
    resize_kernel.resize_crop([image], [1], out, spec)
    assert (out[1] == 100).all() and not out[0].any()  # a flat image stays flat


def test_a_kernel_that_cannot_run_here_leaves_the_matrix_form_unless_asked_for(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The decoder's warm-up compiles and runs the kernel at start: where that fails (no C
    compiler for Triton's launcher, no ptxas for the GPU) the decoder keeps the matrix
    products and says why, so the model still loads; asked for by name, the failure
    stands."""
    pytest.importorskip("torch", reason="the decoder needs torch (the reference extra)")
    from engines.backends.torch.images import warmed

    def fails() -> None:
        raise RuntimeError("Failed to find C compiler")

    calls: list[int] = []
    with caplog.at_level("WARNING", logger="engines.backends.torch.images"):
        assert warmed(None, fails) is False
    assert "does not run here (Failed to find C compiler); matrix products" in caplog.text
    with pytest.raises(RuntimeError, match="C compiler"):
        warmed(True, fails)
    assert warmed(None, lambda: calls.append(1)) is True and calls == [1]
