"""JPEG decoding with NVIDIA's nvImageCodec, in torchvision's ``decode_jpeg`` signature.

torchvision's batched ``decode_jpeg`` spends about 86 us of the calling thread's CPU an
image parsing (an H200's host, BENCHMARKS.md, run 26) and takes one lock a process.
nvImageCodec parses and decodes a batch in C++ with the GIL released, and on a GPU with
hardware JPEG engines (A100, H100, H200) hands the baseline JPEGs to them, leaving the SMs to
the model. On the H200 it made fewer photos/s than torchvision in every form, alone and in
the service (runs 45-46): ``uploads.jpeg_decoder`` offers it, torchvision stays the default.

``hardware_share`` is nvImageCodec's load hint: the share of every batch offered to the
hardware engines, the rest (and whatever they cannot take: progressive, unusual subsampling)
going to nvJPEG's CUDA decoder, then its hybrid one.
An image none of them decodes comes back as None in a batch (the caller decodes it on the
CPU), as RuntimeError alone, as torchvision refuses.

On the CPU (``device`` cpu) the same function decodes with libjpeg-turbo on nvImageCodec's
own threads, rows on the host: how it is tested without a GPU.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
from torch.utils.dlpack import from_dlpack

_local = threading.local()  # a decoder per thread: one batch at a time on each


def available() -> bool:
    """Whether nvImageCodec's Python package imports here."""
    try:
        from nvidia import nvimgcodec  # noqa: F401
    except ImportError:
        return False
    return True


def decode_jpeg(
    data: torch.Tensor | list[torch.Tensor], device: Any = None, hardware_share: float = 1.0
) -> Any:
    """RGB UINT8 (3, height, width) tensors on ``device`` (torchvision's layout), one for a
    tensor of JPEG bytes or a list of them (None where an image could not be decoded); the
    rows are ready in order with the current CUDA stream."""
    target = torch.device("cpu" if device is None else device)
    single = isinstance(data, torch.Tensor)
    datas = [data] if isinstance(data, torch.Tensor) else data
    decoder, params = _decoder(target, hardware_share)
    stream = torch.cuda.current_stream(target).cuda_stream if target.type == "cuda" else 0
    decoded = decoder.decode([d.numpy() for d in datas], params=params, cuda_stream=stream)
    tensors = [None if image is None else _tensor(image, target) for image in decoded]
    if single:
        if tensors[0] is None:
            raise RuntimeError("nvImageCodec could not decode the image")
        return tensors[0]
    return tensors


def _tensor(image: Any, device: torch.device) -> torch.Tensor:
    """The decoded image as a torch tensor sharing its memory (the image lives as long)."""
    if device.type == "cuda":
        return from_dlpack(image)
    # a host image's DLPack export asks for CUDA; its array interface does not
    return torch.from_numpy(np.asarray(image))


def _decoder(device: torch.device, hardware_share: float) -> tuple[Any, Any]:
    """This thread's decoder for ``device`` and ``hardware_share``, made on first use."""
    key = (str(device), hardware_share)
    cached: dict[tuple[str, float], tuple[Any, Any]] = _local.__dict__.setdefault("decoders", {})
    if key not in cached:
        cached[key] = _make(device, hardware_share)
    return cached[key]


def _make(device: torch.device, hardware_share: float) -> tuple[Any, Any]:
    from nvidia import nvimgcodec as codec

    if device.type == "cuda":
        backends = [
            codec.Backend(codec.BackendKind.GPU_ONLY),
            codec.Backend(codec.BackendKind.HYBRID_CPU_GPU),
        ]
        if hardware_share > 0:
            backends.insert(0, codec.Backend(codec.BackendKind.HW_GPU_ONLY, hardware_share))
        index = device.index if device.index is not None else torch.cuda.current_device()
        decoder = codec.Decoder(device_id=index, backends=backends)
    else:
        decoder = codec.Decoder(
            device_id=codec.NVIMGCODEC_DEVICE_CPU_ONLY,
            backends=[codec.Backend(codec.BackendKind.CPU_ONLY)],
        )
    # torchvision's and Pillow's output: RGB, planar, the EXIF orientation left as stored.
    params = codec.DecodeParams(apply_exif_orientation=False, sample_format=codec.P_RGB)
    return decoder, params
