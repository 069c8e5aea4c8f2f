"""Image uploads through a model's handler and batcher (``run_uploads``, which
``LocalEngine.classify`` calls: the engine client's name for it, kept for the wire).

The upload path beside the V2 one: each request's images are checked against the limits,
decoded by the model's handler (the device decoder's queue, which alone bounds a decode
batch, joins them with the uploads of other calls; rows a front end made of its uploads are
only stacked), run through the batcher in as few entries as the max batch allows, and
encoded by the handler in one call for all of them (top-k labels for the image classifier:
a handler may answer anything). An upload that is not an image
fails its own request alone, counted as it fails.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import numpy as np

from app import tracing
from app.contract import Classified, Uploads, batch_key
from app.engine.batch import Tensors, time_left
from app.engine.handlers import check_uploads
from app.engine.models import LoadedModel
from app.errors import BadRequest, Reloaded, StokerError
from app.settings import LimitSettings


class Measured(Protocol):
    """``LocalEngine._measured``: runs the work of requests, counting each one's outcome
    (``requests``: how many, once the work ends) and tracking it for the drain."""

    def __call__(
        self,
        model: LoadedModel,
        work: Callable[[], Awaitable[None]],
        requests: int | Callable[[], int] = 1,
        timed: bool = True,
    ) -> Awaitable[None]: ...


async def run_uploads(
    model: LoadedModel, uploads: Uploads, limits: LimitSettings, measured: Measured
) -> Classified:
    """Per request of ``uploads``, one answer per image, or the error that request alone
    gets. The requests the data plane gathered (``uploads.counts``) are decoded together
    and go through the batcher as one entry; ``measured`` counts each request's outcome."""
    handler = model.handler
    if handler is None:
        raise BadRequest(f"model {model.name!r} does not take image uploads")
    made = uploads.row_preprocess
    if made is not None and made != model.row_preprocess:
        # Made for a contract a reload replaced: nothing ran, the front end makes them again.
        raise Reloaded(f"model {model.name!r} was reloaded; its uploads are decoded again")
    top = uploads.k if uploads.k is not None else limits.default_top_k
    if top < 1:
        raise BadRequest("k must be at least 1")
    started = time.perf_counter()
    requests = [[bytes(image) for image in part] for part in uploads.requests()]
    answers: list[list[Any] | StokerError] = [[] for _ in requests]
    live: list[int] = []  # the requests still running, counted by ``measured``

    def failed(i: int, error: StokerError) -> None:
        model.metrics.request_failed(error.reason, time.perf_counter() - started)
        error.counted = True
        answers[i] = error
        if i in live:
            live.remove(i)  # counted here: not again by ``measured``

    for i, images in enumerate(requests):
        try:
            check_uploads(images, limits)
        except StokerError as error:
            failed(i, error)

    async def decode(images: list[bytes]) -> dict[str, Any]:
        if made is None:
            return await handler.decode(images)
        taking = model.rows_handler
        assert taking is not None  # ``row_preprocess`` equal to the model's: it has one
        return await asyncio.to_thread(taking.rows, images)  # megabytes joined, normalised

    async def work() -> None:
        arrived = time.monotonic()
        model.batcher.admit(len(live))
        decoding = list(live)
        decoded = await asyncio.gather(
            *(
                decode(requests[i])
                if tracing.tracer is None
                else tracing.spanned(i, "decode", decode(requests[i]))
                for i in decoding
            ),
            return_exceptions=True,
        )
        blocks: list[tuple[int, dict[str, Any]]] = []
        for i, inputs in zip(decoding, decoded, strict=True):
            if isinstance(inputs, StokerError):
                failed(i, inputs)
            elif isinstance(inputs, BaseException):
                raise inputs
            else:
                blocks.append((i, inputs))
        if not blocks:
            return
        timeout = time_left(model.timeout_s(None), arrived)
        outputs, counts = await through_batcher(
            model, [b for _, b in blocks], timeout, uploads.client, [i for i, _ in blocks]
        )
        encoded = handler.encode(outputs, top)  # every request's rows in one call
        at = 0
        for (i, _), rows in zip(blocks, counts, strict=True):
            answers[i] = encoded[at : at + rows]
            at += rows

    live += [i for i, answer in enumerate(answers) if not isinstance(answer, StokerError)]
    if live:
        # Rows a front end made: it times the request from before it made them.
        await measured(model, work, requests=lambda: len(live), timed=made is None)
    return Classified(model.name, model.version, answers)


async def through_batcher(
    model: LoadedModel,
    blocks: list[dict[str, Any]],
    timeout_s: float | None,
    client: str,
    of: list[int] | None = None,
) -> tuple[Tensors, list[int]]:
    """Each request's rows through the batcher, as few entries as the max batch allows
    (consecutive requests of one batch key together; one larger than it in slices); the
    outputs of all of them, in order, and each request's count of rows. ``of``: each
    block's request in the frame, whose trace its entry's wait joins (``app.tracing``)."""
    model = model.current()  # a reload may have switched while the images decoded
    step = model.spec.max_batch_size or 1
    counts = [len(next(iter(block.values()))) for block in blocks]
    entries: list[tuple[list[dict[str, Any]], int, Any]] = []  # blocks, rows, key
    owners: list[list[int]] = []  # each entry's requests (``of``)
    for block, rows, owner in zip(blocks, counts, of or range(len(blocks)), strict=True):
        key = batch_key(model.spec, block)
        if rows > step:
            for i in range(0, rows, step):
                piece = {n: value[i : i + step] for n, value in block.items()}
                entries.append(([piece], min(step, rows - i), key))
                owners.append([owner])
        elif entries and entries[-1][2] == key and entries[-1][1] + rows <= step:
            entries[-1][0].append(block)
            entries[-1] = (entries[-1][0], entries[-1][1] + rows, key)
            owners[-1].append(owner)
        else:
            entries.append(([block], rows, key))
            owners.append([owner])
    queued = [
        model.batcher.infer(entry, rows, key, timeout_s, 0, client, len(entry))
        for entry, rows, key in entries
    ]
    if tracing.tracer is not None and tracing.REQUESTS.get():
        queued = [tracing.framed(o, q) for o, q in zip(owners, queued, strict=True)]
    results = await asyncio.gather(*queued)
    names = [t.name for t in model.spec.outputs]
    return {n: np.concatenate([r[n] for r in results]) for n in names}, counts
