"""A model's own pre- and post-processing around the engine: what ``POST /infer`` does.

The V2 tensor routes need none of it: tensors in, tensors out. An upload route needs to know
how bytes become the engine's input rows and how its outputs become an answer, which is
the model's business, not the server's. A ``Handler`` says both, the way LitServe's
``decode_request`` / ``encode_response`` do; the engine (``app.engine.uploads``) batches what
``decode`` gives through the model's batcher and hands the outputs to ``encode``.

A model picks its handler with ``handler:`` in its config: ``image-classifier`` (the default
when the config has ``preprocess``: images decoded, resized and cropped, softmax, top-k
labels), ``none`` (tensors only), or ``package.module:Class`` for a class of your own,
constructed with the ``HandlerContext`` and implementing ``Handler``, which the operator
lists in ``models.handlers``: a handler is code the server imports, and a config may come
with a load request.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from app.engine import images
from app.engine.repository import IMAGE_CLASSIFIER, NO_HANDLER
from app.errors import BadRequest, client_text
from app.image_header import read_header
from app.image_pixels import upload_row
from app.metrics import ModelMetrics
from app.settings import LimitSettings
from engines.precision import accuracy
from engines.preprocess import ImagePreprocess, normalize
from engines.spec import ModelSpec


class Handler(Protocol):
    """Uploads to engine rows, engine outputs to one answer per upload."""

    async def decode(self, uploads: Sequence[bytes]) -> dict[str, Any]:
        """Every model input, one row per upload (an array, or rows left on the device by
        its decoder); raise ``BadRequest`` for bad uploads."""
        ...

    def encode(self, outputs: Mapping[str, np.ndarray], k: int) -> list[Any]:
        """One JSON-serialisable answer per row of ``outputs`` (``k``: how many labels)."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class RowsHandler(Handler, Protocol):
    """A handler that also takes rows a front end made of its uploads with its preprocessing
    (where the engine would decode them on the CPU): the image classifier, and any handler
    of the user's that offers the two."""

    @property
    def row_preprocess(self) -> ImagePreprocess:
        """What makes an upload's row (UINT8): how a front end makes them."""
        ...

    def rows(self, uploads: Sequence[bytes | memoryview]) -> dict[str, Any]:
        """Every model input from those rows, as ``decode`` gives them for the uploads; called
        in a worker thread."""
        ...


@dataclass(frozen=True)
class HandlerContext:
    """What a handler is made with: the model's contract and the server's limits."""

    name: str
    spec: ModelSpec
    preprocess: ImagePreprocess | None
    """The config's preprocessing, in UINT8 (pixels before normalisation)."""
    postprocess: str
    labels: list[str] | None
    limits: LimitSettings
    metrics: ModelMetrics
    normalised_by_engine: bool
    """The engine normalises UINT8 pixels itself (on its device): pass them as they are."""
    decoder: images.DecodeQueue | None = None
    """Batched device decoding of JPEG uploads, when it is on for this model."""


def top_k(scores: np.ndarray, k: int, labels: list[str] | None) -> list[dict[str, Any]]:
    k = min(k, scores.shape[-1])
    if k < scores.shape[-1]:
        # The k best without sorting every class, ties in index order as a stable sort
        # gives them: all better than the k-th score, then the first of those equal to it.
        negated = -scores
        kth = np.partition(negated, k - 1)[k - 1]
        above = np.flatnonzero(negated < kth)
        best = np.concatenate([above, np.flatnonzero(negated == kth)[: k - len(above)]])
        order = best[np.lexsort((best, negated[best]))]
    if k == scores.shape[-1] or len(order) < k:  # all of them, or NaN among the scores
        order = np.argsort(-scores, kind="stable")[:k]
    return [
        {
            "label": labels[i] if labels and i < len(labels) else str(i),
            "index": int(i),
            "probability": float(scores[i]),
        }
        for i in order
    ]


def top_k_rows(scores: np.ndarray, k: int, labels: list[str] | None) -> list[list[dict[str, Any]]]:
    """``top_k`` of each row of ``scores`` (rows x classes), the k best of every row found in
    one partition and ordered in one sort; a row whose k-th score is tied with one left out,
    or that holds a NaN, goes through ``top_k`` (whose order among ties is a stable sort's)."""
    rows, classes = scores.shape
    k = min(k, classes)
    if rows <= 1:  # one row: the whole-matrix steps cost more than they save
        return [top_k(row, k, labels) for row in scores]
    negated = -scores
    if k == classes:
        best = np.broadcast_to(np.arange(classes), (rows, classes))
    else:
        best = np.argpartition(negated, k - 1, axis=1)[:, :k]
    values = np.take_along_axis(negated, best, axis=1)
    kth = values.max(axis=1, keepdims=True)
    clear = (
        np.count_nonzero(negated == kth, axis=1) == np.count_nonzero(values == kth, axis=1)
    ) & (~np.isnan(scores).any(axis=1))
    order = np.take_along_axis(best, np.lexsort((best, values), axis=1), axis=1)
    chosen = np.take_along_axis(scores, order, axis=1).tolist()
    answers = []
    for row in range(rows):
        if not clear[row]:
            answers.append(top_k(scores[row], k, labels))
            continue
        answers.append(
            [
                {
                    "label": labels[i] if labels and i < len(labels) else str(i),
                    "index": i,
                    "probability": p,
                }
                for i, p in zip(order[row].tolist(), chosen[row], strict=True)
            ]
        )
    return answers


class ImageClassifier:
    """Images decoded (JPEGs in batches on the GPU when a decoder is on, the rest on the CPU),
    resized and centre-cropped by the model's preprocessing, normalised unless the engine
    does it; the first output through softmax (``postprocess: softmax``) and top-k labels."""

    def __init__(self, context: HandlerContext) -> None:
        spec, prep = context.spec, context.preprocess
        if prep is None:
            raise ValueError(f"model {context.name!r}: the image classifier needs `preprocess`")
        tensor = spec.inputs[0]
        if len(spec.inputs) != 1 or not tensor.matches(prep.row_shape()):
            raise ValueError(
                f"model {context.name!r}: input {tensor.name!r} takes rows of "
                f"{list(tensor.shape)}, its preprocessing makes {list(prep.row_shape())}"
            )
        self._context = context
        self._prep = prep
        self._input = tensor
        self._output = spec.outputs[0].name

    @property
    def row_preprocess(self) -> ImagePreprocess:
        """What makes a row of an upload (UINT8): how a front end makes them (``rows``)."""
        return self._prep

    def _on_cpu(self, data: bytes) -> np.ndarray:
        limits = self._context.limits
        return upload_row(data, self._prep, limits.max_image_pixels, limits.max_image_aspect_ratio)

    def rows(self, uploads: Sequence[bytes | memoryview]) -> dict[str, Any]:
        """Every model input from rows a front end made of its uploads with ``row_preprocess``
        (UINT8, each of the row's size): what ``decode`` gives for those uploads, on the
        CPU. A row of another size is the front end's fault: 500, not the client's."""
        shape = self._prep.row_shape()
        size = int(np.prod(shape))
        if any(len(row) != size for row in uploads):
            raise RuntimeError(f"rows of {size} bytes expected, got {[len(r) for r in uploads]}")
        batch = np.frombuffer(b"".join(uploads), dtype=np.uint8).reshape(len(uploads), *shape)
        self._context.metrics.images_decoded("front_ends", len(uploads))
        return {self._input.name: self._normalised(batch)}

    async def decode(self, uploads: Sequence[bytes]) -> dict[str, Any]:
        context, limits = self._context, self._context.limits
        # Headers first, whoever decodes: a bomb or an unread format is refused before any
        # pixel is decoded (in plain Python: microseconds an image).
        headers = [
            read_header(data, limits.max_image_pixels, limits.max_image_aspect_ratio)
            for data in uploads
        ]
        decoded = None
        if context.decoder is not None:
            picked = [
                data if h.device_decodable else None
                for data, h in zip(uploads, headers, strict=True)
            ]
            pixels = [h.width * h.height for h in headers]  # the queue's bound of a batch
            decoded = await context.decoder.decode(picked, pixels)
        if decoded is None:  # no device decoder, or it failed: every image on the CPU
            done = await asyncio.to_thread(lambda: [self._on_cpu(data) for data in uploads])
            context.metrics.images_decoded("cpu", len(uploads))
            return {self._input.name: self._normalised(np.stack(done))}
        rows, ok = decoded
        left = [i for i, good in enumerate(ok) if not good]
        context.metrics.images_decoded("gpu", len(uploads) - len(left))
        if left:
            # The device decoder refused these (a PNG, CMYK, a JPEG it cannot read): Pillow
            # decodes each into its row of the device's batch, costing only itself.
            def fill() -> None:
                for i in left:
                    rows.put(i, self._on_cpu(uploads[i]))

            await asyncio.to_thread(fill)
            context.metrics.images_decoded("cpu", len(left))
        if self._input.datatype != "UINT8" and not context.normalised_by_engine:
            return {self._input.name: self._normalised(np.asarray(rows))}
        return {self._input.name: rows}

    def _normalised(self, batch: np.ndarray) -> np.ndarray:
        if self._input.datatype != "UINT8" and not self._context.normalised_by_engine:
            return normalize(batch, self._prep, self._input.dtype)
        return batch

    def encode(self, outputs: Mapping[str, np.ndarray], k: int) -> list[Any]:
        scores = outputs[self._output]
        if self._context.postprocess == "softmax":
            scores = accuracy.softmax(scores)
        return top_k_rows(scores.reshape(len(scores), -1), k, self._context.labels)

    async def close(self) -> None:
        if self._context.decoder is not None:
            await self._context.decoder.close()


def handler_for(
    choice: str | None, context: HandlerContext, allowed: Collection[str] = ()
) -> Handler | None:
    """The model's handler: the named one, a ``module:Class`` of the user's that ``allowed``
    (``models.handlers``) lists, or by default the image classifier for a model with
    preprocessing and none for the rest. Nothing is imported that ``allowed`` does not list."""
    if choice is None:
        choice = IMAGE_CLASSIFIER if context.preprocess is not None else NO_HANDLER
    if choice == NO_HANDLER:
        return None
    if choice == IMAGE_CLASSIFIER:
        return ImageClassifier(context)
    module_name, _, class_name = choice.partition(":")
    if choice not in allowed or not class_name:
        raise ValueError(
            f"handler '{client_text(choice)}': give {IMAGE_CLASSIFIER}, {NO_HANDLER} or a "
            "package.module:Class that models.handlers lists"
        )
    made: Handler = getattr(importlib.import_module(module_name), class_name)(context)
    return made


def check_uploads(uploads: Sequence[bytes], limits: LimitSettings) -> None:
    if not uploads:
        raise BadRequest("no image in the request")
    if len(uploads) > limits.max_images_per_request:
        raise BadRequest(
            f"{len(uploads)} images in one request; the limit is {limits.max_images_per_request}"
        )
