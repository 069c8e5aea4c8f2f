"""Which decoders a model's JPEG uploads get: processes of their own, threads of the engine,
or none (the CPU decodes them), and the queue that gathers uploads into their batches."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING

from app.engine import images
from app.engine.repository import ModelEntry
from app.metrics import ModelMetrics
from app.settings import Settings
from engines import backends
from engines.devices.options import GPU_BACKENDS
from engines.preprocess import ImagePreprocess

if TYPE_CHECKING:
    from engines.backends.torch.images import JpegDecode

log = logging.getLogger(__name__)


def gpu_decoders(entry: ModelEntry, backend: str, settings: Settings) -> list[images.BatchDecode]:
    """The batch decoders of the model's JPEG uploads where ``image_decode`` and this machine
    allow them (else none): ``decode_processes`` processes of their own, or ``decode_workers``
    decoders for the engine's threads. Blocks while processes start (seconds)."""
    config, wanted = entry.config, settings.uploads.image_decode
    if config.preprocess is None or wanted == "cpu":
        return []
    available = backends.gpu_image_decode_available()
    if wanted == "auto" and not (backend in GPU_BACKENDS and available):
        return []
    if not available:
        raise RuntimeError("image_decode is gpu, but torchvision with CUDA is not available")
    device = f"cuda:{config.gpus[0] if config.gpus else 0}"
    prep = config.preprocess.with_datatype("UINT8")
    decode_jpeg = jpeg_decode(settings)
    if settings.uploads.decode_processes:
        try:
            return decode_processes(prep, device, config.name, settings, decode_jpeg)
        except RuntimeError as error:
            # Spawning, CUDA IPC or /dev/shm refused here: the engine's threads still decode
            # on the GPU, as they did before decoders had processes.
            log.error("%s; JPEG uploads decoded in threads of the engine instead", error)
    from engines.backends.torch.images import TorchImageDecoder

    kernel = None if settings.uploads.resize_kernel else False
    return [
        TorchImageDecoder(prep, device, decode_jpeg, kernel).decode
        for _ in range(settings.uploads.decode_workers)
    ]


def jpeg_decode(settings: Settings) -> JpegDecode | None:
    """The ``decode_jpeg`` function ``jpeg_decoder`` names (None: torchvision's)."""
    if settings.uploads.jpeg_decoder == "torchvision":
        return None
    from engines.backends.torch import nvimgcodec

    if not nvimgcodec.available():
        raise RuntimeError("jpeg_decoder is nvimgcodec, but nvidia-nvimgcodec is not installed")
    return partial(nvimgcodec.decode_jpeg, hardware_share=settings.uploads.jpeg_hardware_share)


def decode_processes(
    prep: ImagePreprocess,
    device: str,
    name: str,
    settings: Settings,
    decode_jpeg: JpegDecode | None = None,
) -> list[images.BatchDecode]:
    """``decode_processes`` children started side by side (each child's import of torch and
    its CUDA context take seconds); if one fails, the others are closed and its error raised.
    Each is listed ``decode_in_flight`` times: the queue's threads call it that many at once."""
    from engines.backends.torch.decode_process import DecodeProcess

    uploads = settings.uploads

    def start(i: int) -> DecodeProcess:
        return DecodeProcess(
            prep,
            device,
            uploads.decode_batch_photos,
            decode_jpeg=decode_jpeg,
            label=f"{name}-{i}",
            slots=uploads.decode_in_flight,
            slot_bytes=uploads.decode_batch_bytes,
            kernel=None if uploads.resize_kernel else False,
        )

    count = settings.uploads.decode_processes
    with ThreadPoolExecutor(count, thread_name_prefix="decode-start") as pool:
        futures = [pool.submit(start, i) for i in range(count)]
    failed = [error for future in futures if (error := future.exception()) is not None]
    if failed:
        for future in futures:
            if future.exception() is None:
                future.result().close()
        raise failed[0]
    # interleaved (p0, p1, p0, p1): the queue's free decoders come first-in first-out, so a
    # batch goes to an idle process before a second one goes to a busy one
    processes = [future.result() for future in futures]
    return [process for _ in range(settings.uploads.decode_in_flight) for process in processes]


def describe_decoding(decoders: list[images.BatchDecode], settings: Settings) -> str:
    """Where JPEG uploads decode, and with what, for the load's log line."""
    if not decoders:
        return "CPU"
    library = {"torchvision": "torchvision", "nvimgcodec": "nvImageCodec"}
    return f"GPU by {library[settings.uploads.jpeg_decoder]} ({_where(decoders)})"


def _where(decoders: list[images.BatchDecode]) -> str:
    from engines.backends.torch.decode_process import DecodeProcess

    processes = {id(decoder): decoder for decoder in decoders if isinstance(decoder, DecodeProcess)}
    if processes:
        count = len(processes)
        slots = next(iter(processes.values())).slots
        each = f"{slots} batch{'es' if slots > 1 else ''} in flight each"
        return f"{count} decode process{'es' if count > 1 else ''}, {each}"
    threads = len(decoders)
    return f"{threads} decoder thread{'s' if threads > 1 else ''} in the engine"


def close_decoders(decoders: list[images.BatchDecode]) -> None:
    """End what the decoders hold: a ``DecodeProcess``'s child (a thread's decoder holds none)."""
    from engines.backends.torch.decode_process import DecodeProcess

    for decoder in {id(decoder): decoder for decoder in decoders}.values():
        if isinstance(decoder, DecodeProcess):
            decoder.close()


def decode_queue(
    name: str, decoders: list[images.BatchDecode], settings: Settings, metrics: ModelMetrics
) -> images.DecodeQueue | None:
    """The queue that gathers the model's JPEG uploads into batches for ``decoders`` (None
    without decoders: the CPU decodes them)."""
    if not decoders:
        return None
    queue = images.DecodeQueue(
        decoders,
        images.BatchBounds.of(settings.uploads),
        f"{name}-jpeg",
        metrics.decode_batch,
        lambda: close_decoders(decoders),
    )
    queue.start()
    return queue
