"""Request bodies, built once before anything is timed.

Images come from a folder or are synthesised (seeded, so runs compare); V2 payloads carry
them preprocessed the way the model's config says, so the server does the work a real
client would make it do. A model whose input is not an image gets seeded random tensors.
"""

from __future__ import annotations

import io
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import orjson
from PIL import Image

from engines.preprocess import ImagePreprocess, preprocess
from engines.spec import TensorSpec, v2_datatype

if TYPE_CHECKING:
    from bench.answers import Expected

Kind = Literal["v2-json", "v2-binary", "jpeg"]
KINDS: tuple[Kind, ...] = ("v2-json", "v2-binary", "jpeg")
ProtocolName = Literal["http", "grpc", "grpc-stream"]
PROTOCOLS: tuple[ProtocolName, ...] = ("http", "grpc", "grpc-stream")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
# Distinct bodies cycle through the requests; fewer when bodies are large, so that all of
# them fit comfortably in every client process.
MAX_PAYLOAD_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class ModelInputs:
    """What a client needs to know of a model to build requests for it."""

    name: str
    inputs: tuple[TensorSpec, ...]
    batched: bool

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> ModelInputs:
        """From a V2 model metadata response (a leading -1 marks the batch dimension)."""
        entries = metadata["inputs"]
        batched = all(e["shape"][:1] == [-1] for e in entries)
        inputs = tuple(
            TensorSpec(e["name"], e["datatype"], tuple(e["shape"][1:] if batched else e["shape"]))
            for e in entries
        )
        return cls(metadata["name"], inputs, batched)


@dataclass(frozen=True)
class Payload:
    """One request ready to send: an HTTP body and headers, a serialized ModelInferRequest
    (gRPC), or the tensors for in-process."""

    rows: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    tensors: dict[str, np.ndarray] | None = None
    images: tuple[bytes, ...] = ()
    """For an upload: its images, which the in-process target decodes as the engine does."""
    expected: Expected | None = None
    """``--check-answers``: the answer this request got alone, which every answer to it under
    load is compared with (``bench.answers``)."""


def synthetic_images(count: int, width: int, height: int, seed: int = 0) -> list[bytes]:
    """JPEGs of smooth gradients with noise: they compress and decode like photos do."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    images = []
    for _ in range(count):
        base = rng.uniform(0, 255, 3)
        slope = rng.uniform(-0.3, 0.3, (2, 3))
        pixels = base + xs[..., None] * slope[0] + ys[..., None] * slope[1]
        pixels += rng.normal(0, 12, pixels.shape)
        buffer = io.BytesIO()
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(
            buffer, format="JPEG", quality=90
        )
        images.append(buffer.getvalue())
    return images


def folder_images(folder: Path, count: int) -> list[bytes]:
    paths = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not paths:
        raise ValueError(f"no {'/'.join(IMAGE_SUFFIXES)} files in {folder}")
    return [p.read_bytes() for p in paths[:count]]


def image_preprocess(tensor: TensorSpec, configured: ImagePreprocess | None) -> ImagePreprocess:
    """The model's own preprocessing where its config is at hand, else the defaults fitted to
    the input's shape (the numbers differ slightly, the work the server does does not)."""
    if configured is not None:
        return configured
    shape = tensor.shape
    if len(shape) == 3 and shape[0] == 3:
        return ImagePreprocess(crop=shape[1], layout="NCHW", datatype=tensor.datatype)
    if len(shape) == 3 and shape[2] == 3:
        return ImagePreprocess(crop=shape[0], layout="NHWC", datatype=tensor.datatype)
    raise ValueError(f"input {tensor.name!r} of shape {list(shape)} is not an image")


def is_image(tensor: TensorSpec) -> bool:
    shape = tensor.shape
    return len(shape) == 3 and (shape[0] == 3 or shape[2] == 3) and -1 not in shape


def random_rows(tensor: TensorSpec, rows: int, rng: np.random.Generator) -> np.ndarray:
    shape = (rows, *(1 if d == -1 else d for d in tensor.shape))
    dtype = tensor.dtype
    if tensor.datatype == "BYTES":
        raise ValueError(f"input {tensor.name!r} is BYTES; the bench sends numeric tensors only")
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(dtype)
    return rng.integers(0, 100, shape).astype(dtype)


def model_tensors(
    model: ModelInputs,
    images: list[bytes],
    rows: int,
    count: int,
    configured: ImagePreprocess | None = None,
) -> list[dict[str, np.ndarray]]:
    """``count`` input sets of ``rows`` rows each: preprocessed images for a single image
    input, seeded random data otherwise."""
    if not model.batched and rows != 1:
        raise ValueError(f"model {model.name!r} has no batch dimension: use --rows 1")
    rng = np.random.default_rng(0)
    if len(model.inputs) == 1 and is_image(model.inputs[0]) and images:
        tensor = model.inputs[0]
        prep = image_preprocess(tensor, configured)
        decoded = [preprocess(Image.open(io.BytesIO(data)).convert("RGB"), prep) for data in images]
        sets = []
        for i in range(count):
            at = [i * rows + r for r in range(rows)]
            batch = np.stack(
                [variant(decoded[k % len(decoded)], k // len(decoded), prep.layout) for k in at]
            )
            sets.append({tensor.name: batch if model.batched else batch[0]})
        return sets
    sets = []
    for _ in range(count):
        arrays = {t.name: random_rows(t, rows, rng) for t in model.inputs}
        sets.append(arrays if model.batched else {k: v[0] for k, v in arrays.items()})
    return sets


CHANNEL_ORDERS = ((0, 1, 2), (1, 2, 0), (2, 0, 1), (0, 2, 1), (2, 1, 0), (1, 0, 2))


def variant(image: np.ndarray, cycle: int, layout: str) -> np.ndarray:
    """The ``cycle``-th of 24 views of a preprocessed image (0: itself; then its channels in
    another order, flipped left-right, upside down): the rows of the requests that cycle
    through fewer images than they have rows differ all the same (``--check-answers`` can
    tell a row answered in another's place only if their inputs differ)."""
    k = cycle % 24
    if not k:
        return image
    channel, height, width = (0, 1, 2) if layout == "NCHW" else (2, 0, 1)
    view = np.take(image, CHANNEL_ORDERS[k % 6], axis=channel)
    if (k // 6) % 2:
        view = np.flip(view, axis=width)
    if (k // 12) % 2:
        view = np.flip(view, axis=height)
    return view


def v2_json(tensors: dict[str, np.ndarray], rows: int) -> Payload:
    document = {
        "inputs": [
            {
                "name": name,
                "shape": list(array.shape),
                "datatype": v2_datatype(array.dtype),
                "data": array.ravel(),
            }
            for name, array in tensors.items()
        ]
    }
    body = orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)
    return Payload(rows, body, {"Content-Type": "application/json"})


def v2_binary(tensors: dict[str, np.ndarray], rows: int) -> Payload:
    """Triton's binary tensor extension: a JSON header, then each input's raw bytes; every
    output asked for as binary, as perf_analyzer does."""
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": name,
                    "shape": list(array.shape),
                    "datatype": v2_datatype(array.dtype),
                    "parameters": {"binary_data_size": array.nbytes},
                }
                for name, array in tensors.items()
            ],
            "parameters": {"binary_data_output": True},
        }
    )
    body = b"".join([header, *(np.ascontiguousarray(a).tobytes() for a in tensors.values())])
    headers = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(header)),
    }
    return Payload(rows, body, headers)


def grpc_request(
    tensors: dict[str, np.ndarray], rows: int, model: str, version: str | None, typed: bool
) -> Payload:
    """A serialized ModelInferRequest: each input's bytes in ``raw_input_contents`` (what
    tritonclient.grpc sends, gRPC's binary form), or with ``typed`` in its typed
    ``contents`` (gRPC's non-binary form, as v2-json is HTTP's); every output answered, as
    raw bytes."""
    from app.frontend.grpc.codec import TYPED_CONTENTS
    from app.frontend.grpc.generated import grpc_service_pb2 as pb

    request = pb.ModelInferRequest(model_name=model, model_version=version or "")
    for name, array in tensors.items():
        datatype = v2_datatype(array.dtype)
        tensor = request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        if not typed:
            request.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
        elif datatype in TYPED_CONTENTS:
            getattr(tensor.contents, TYPED_CONTENTS[datatype][0]).extend(array.ravel().tolist())
        else:
            raise ValueError(f"{datatype} has no typed gRPC contents: use --payload v2-binary")
    return Payload(rows, request.SerializeToString())


def jpeg_upload(images: list[bytes]) -> Payload:
    """One image as a raw ``image/jpeg`` body; several as a multipart form (``curl -F``)."""
    if len(images) == 1:
        return Payload(1, images[0], {"Content-Type": "image/jpeg"}, images=tuple(images))
    boundary = uuid.uuid4().hex
    parts = []
    for i, data in enumerate(images):
        parts.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="image"; '
            f'filename="{i}.jpg"\r\nContent-Type: image/jpeg\r\n\r\n'.encode()
        )
        parts.append(data)
        parts.append(b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return Payload(
        len(images),
        b"".join(parts),
        {"Content-Type": f"multipart/form-data; boundary={boundary}"},
        images=tuple(images),
    )


def build(
    kind: Kind | Literal["tensors"],
    images: list[bytes],
    rows: int,
    count: int,
    model: ModelInputs | None = None,
    configured: ImagePreprocess | None = None,
    protocol: ProtocolName = "http",
    version: str | None = None,
) -> list[Payload]:
    """``count`` distinct payloads (fewer if they would not fit in memory), as HTTP bodies or
    as gRPC ModelInferRequests of ``version`` (default: the model's)."""
    if kind == "jpeg":
        if protocol != "http":  # a gRPC stream's messages are ModelInferRequests too
            raise ValueError("gRPC has no image upload: use --payload v2-binary or v2-json")
        if not images:
            raise ValueError("JPEG uploads need images")
        return [
            jpeg_upload([images[(i * rows + r) % len(images)] for r in range(rows)])
            for i in range(count)
        ]
    if model is None:
        raise ValueError(f"{kind} payloads need the model's inputs")
    first = model_tensors(model, images, rows, 1, configured)[0]
    encoders: dict[str, Callable[[dict[str, np.ndarray], int], Payload]]
    if protocol != "http":  # a gRPC stream's messages are ModelInferRequests too
        encoders = {
            "v2-json": partial(grpc_request, model=model.name, version=version, typed=True),
            "v2-binary": partial(grpc_request, model=model.name, version=version, typed=False),
        }
    else:
        encoders = {"v2-json": v2_json, "v2-binary": v2_binary}
    encode = encoders.get(kind)
    size = len(encode(first, rows).body) if encode else sum(a.nbytes for a in first.values())
    count = max(1, min(count, MAX_PAYLOAD_BYTES // max(1, size)))
    sets = model_tensors(model, images, rows, count, configured)
    if encode is None:
        return [Payload(rows, tensors=tensors) for tensors in sets]
    return [encode(tensors, rows) for tensors in sets]
