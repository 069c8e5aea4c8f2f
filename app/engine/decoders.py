"""Which decoders a model's JPEG uploads get: processes of their own, threads of the engine,
or none (the CPU decodes them), and the queue that gathers uploads into their batches."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from app.engine import images
from app.engine.repository import ModelEntry
from app.metrics import ModelMetrics
from app.settings import Settings
from engines import backends
from engines.devices.options import GPU_BACKENDS


def gpu_decoders(entry: ModelEntry, backend: str, settings: Settings) -> list[images.BatchDecode]:
    """The batch decoders of the model's JPEG uploads where ``image_decode`` and this machine
    allow them (else none): ``decode_processes`` processes of their own, or ``decode_workers``
    decoders for the engine's threads. Blocks while processes start (seconds)."""
    config, wanted = entry.config, settings.models.image_decode
    if config.preprocess is None or wanted == "cpu":
        return []
    available = backends.gpu_image_decode_available()
    if wanted == "auto" and not (backend in GPU_BACKENDS and available):
        return []
    if not available:
        raise RuntimeError("image_decode is gpu, but torchvision with CUDA is not available")
    device = f"cuda:{config.gpus[0] if config.gpus else 0}"
    prep = config.preprocess.with_datatype("UINT8")
    if not settings.models.decode_processes:
        from engines.backends.torch.images import TorchImageDecoder

        return [
            TorchImageDecoder(prep, device).decode for _ in range(settings.models.decode_workers)
        ]
    from engines.backends.torch.decode_process import DecodeProcess

    def start(i: int) -> DecodeProcess:
        rows = settings.models.decode_batch
        return DecodeProcess(prep, device, rows, label=f"{config.name}-{i}")

    # Side by side: each child's import of torch and its CUDA context take seconds.
    count = settings.models.decode_processes
    with ThreadPoolExecutor(count, thread_name_prefix="decode-start") as pool:
        futures = [pool.submit(start, i) for i in range(count)]
    failed = [error for future in futures if (error := future.exception()) is not None]
    if failed:
        for future in futures:
            if future.exception() is None:
                future.result().close()
        raise failed[0]
    return [future.result() for future in futures]


def describe_decoding(settings: Settings, on_gpu: bool) -> str:
    """Where JPEG uploads decode, for the load's log line."""
    if not on_gpu:
        return "CPU"
    processes = settings.models.decode_processes
    if processes:
        return f"GPU ({processes} decode process{'es' if processes > 1 else ''})"
    workers = settings.models.decode_workers
    return f"GPU ({workers} decoder thread{'s' if workers > 1 else ''} in the engine)"


def close_decoders(decoders: list[images.BatchDecode]) -> None:
    """End what the decoders hold: a ``DecodeProcess``'s child (a thread's decoder holds none)."""
    for decoder in decoders:
        closing = getattr(decoder, "close", None)
        if closing is not None:
            closing()


def decode_queue(
    name: str, decoders: list[images.BatchDecode], settings: Settings, metrics: ModelMetrics
) -> images.DecodeQueue | None:
    """The queue that gathers the model's JPEG uploads into batches for ``decoders`` (None
    without decoders: the CPU decodes them)."""
    if not decoders:
        return None
    queue = images.DecodeQueue(
        decoders,
        settings.models.decode_batch,
        f"{name}-jpeg",
        metrics.decode_batch,
        lambda: close_decoders(decoders),
    )
    queue.start()
    return queue
