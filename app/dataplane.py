"""The data plane: model lookup, readiness, request validation, batchers and metrics.

Routes call one method here and serialise what it returns. It is created in the lifespan
(never at import) and lives in ``app.state.plane``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

import zoo
from app import images
from app.batcher import Batcher, Tensors
from app.errors import (
    BadRequest,
    DeadlineExceeded,
    NotFound,
    StokerError,
    Unavailable,
    client_text,
)
from app.metrics import ModelMetrics, model_unavailable
from app.pool import RunnerPool
from app.protocol import InferRequest, RequestedOutput, classify, decode_request
from app.repository import ModelEntry, discover
from app.settings import Settings
from engines import backends
from engines.backends.onnxruntime import read_spec
from engines.base import EngineOptions, FatalEngineError, pixel_input
from engines.precision import accuracy
from engines.precision.build import (
    AccuracyBudgetExceeded,
    BuildCancelled,
    BuildPlan,
    ensure_variant,
)
from engines.preprocess import ImagePreprocess, normalize, preprocess
from engines.spec import ModelSpec, TensorSpec, v2_datatype
from engines.store import EngineStore

log = logging.getLogger(__name__)
T = TypeVar("T")
# Bodies above this are decoded on a worker thread so a large JSON tensor never stalls the loop.
THREADED_DECODE_BYTES = 256 * 1024
GPU_BACKENDS = ("torch", "tensorrt")


@dataclass
class ServedModel:
    """One model version (a precision) with everything that serves it."""

    entry: ModelEntry
    version: str
    spec: ModelSpec
    backend: str
    pool: RunnerPool
    batcher: Batcher
    metrics: ModelMetrics
    labels: list[str] | None
    pixels: PixelInput | None = None
    """The image input, when UINT8 pixels are accepted on it, and who normalises them."""
    decoder: images.DecodeQueue | None = None
    """Batched device decoding of JPEG uploads, when it is on for this model."""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def ready(self) -> bool:
        return self.batcher.failed is None

    async def close(self, drain_timeout_s: float = 0.0) -> None:
        """Stop its batcher, decoder, runners and engine, in that order."""
        await self.batcher.close(drain_timeout_s)
        if self.decoder is not None:
            await self.decoder.close()
        await asyncio.to_thread(self.pool.close)


class DataPlane:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._models: dict[str, dict[str, ServedModel]] = {}
        self._entries: list[ModelEntry] = []
        self.store = EngineStore(settings.store.path)
        # model -> version -> why it is not served (it missed its budget or failed to load).
        self._unavailable: dict[str, dict[str, str]] = {}
        self.ready = False
        self.failed: BaseException | None = None
        self.draining = False
        # Set with the drain: a build running in a worker thread stops at its next check
        # instead of holding the process up until it ends.
        self._stopping = threading.Event()
        self._drain_deadline = 0.0
        # Requests inside the data plane (decoding, queued, executing): what a drain waits for.
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Load every model, warm every runner, then report ready. A version that misses its
        accuracy budget or fails to load is not served and says why (unless
        ``models.exit_on_error``); the others serve."""
        repo = self.settings.models
        self._entries = discover(repo.repository, repo.models)
        for entry in self._entries:
            try:
                await self._load(entry)
            except BuildCancelled as stopped:
                log.info("loading stopped, the server is shutting down: %s", stopped)
                return
            except FatalEngineError:
                raise  # the device is broken for every model: liveness must go
            except Exception as error:
                # What every version needs (the ONNX file, its spec) is missing; _load
                # registers a model's versions only once all of them were tried.
                for precision in entry.config.precisions:
                    self._refuse(entry.config.name, precision, error)
        refused = [f"{n}[{v}]" for n, versions in self._unavailable.items() for v in versions]
        if not self.all_served():
            # Nothing to serve: stop (the orchestrator shows a crash loop) rather than stay
            # live and never ready.
            raise RuntimeError(f"no model version could be served: {', '.join(refused)}")
        self.ready = True
        log.info(
            "ready: %s%s",
            ", ".join(f"{n}{sorted(v)}" for n, v in self._models.items()) or "no model",
            f"; NOT served: {', '.join(refused)} (see above)" if refused else "",
        )

    def _refuse(self, model: str, version: str, error: Exception) -> None:
        """Record a version that will not be served, once, with the reason its 503s give;
        or re-raise where ``models.exit_on_error`` wants the server to stop."""
        if self.settings.models.exit_on_error:
            raise error
        accuracy_refusal = isinstance(error, AccuracyBudgetExceeded)
        reason = str(error) if accuracy_refusal else f"{type(error).__name__}: {error}"
        # Clients get a bounded reason (a backend's message can be long); the log, all of it.
        self._unavailable.setdefault(model, {})[version] = client_text(reason, 600)
        model_unavailable(model, version, "accuracy" if accuracy_refusal else "load")
        log.error(
            "model %s version %s is NOT served (%s): %s",
            model,
            version,
            "accuracy budget" if accuracy_refusal else "load failed",
            reason,
            # A missing file says it all; anything else may need its traceback.
            exc_info=None if isinstance(error, AccuracyBudgetExceeded | OSError) else error,
        )

    async def _load(self, entry: ModelEntry) -> None:
        config = entry.config
        path = entry.onnx_path
        if not path.exists():
            if config.generator is None or not self.settings.models.prepare_missing:
                raise FileNotFoundError(f"model {config.name!r}: {path} does not exist")
            log.info("model %s: generating %s with zoo.%s", config.name, path, config.generator)
            await asyncio.to_thread(prepare, entry)
        backend = backends.resolve(self.settings.models.backend or config.backend)
        spec = await asyncio.to_thread(model_spec, entry)
        plan = entry.build_plan(spec)
        versions: dict[str, ServedModel] = {}
        labels = entry.labels()
        try:
            for precision in config.precisions:
                try:
                    versions[precision] = await self._load_version(
                        entry, spec, plan, precision, backend, labels
                    )
                except (FatalEngineError, BuildCancelled):
                    raise
                except Exception as error:
                    self._refuse(config.name, precision, error)
        except BaseException:
            # Cancelled (shutdown mid-load), fatal, or exit_on_error: what loaded is closed.
            for served in versions.values():
                await served.close()
            raise
        self._models[config.name] = versions

    async def _load_version(
        self,
        entry: ModelEntry,
        spec: ModelSpec,
        plan: BuildPlan,
        precision: str,
        backend: str,
        labels: list[str] | None,
    ) -> ServedModel:
        config = entry.config
        started = time.perf_counter()
        variant, _ = await asyncio.to_thread(
            ensure_variant, self.store, plan, precision, backend, self._stopping.is_set
        )
        options = engine_options(entry, spec, self.store, plan.profile, precision)
        engine = await asyncio.to_thread(backends.loader(backend), variant, spec, options)
        pool: RunnerPool | None = None
        decoder: images.DecodeQueue | None = None
        try:
            pool = await RunnerPool.create(engine, config.runners, f"{config.name}-{precision}")
            await pool.warm()
            metrics = ModelMetrics(config.name, precision)
            decoder = self._decoder(entry, backend, metrics)
            native = pixel_input(engine)
            pixels = PixelInput.of(entry, spec, native is not None)
        except BaseException:
            if decoder is not None:
                await decoder.close()
            await asyncio.to_thread(pool.close if pool is not None else engine.close)
            raise
        batcher = Batcher(pool, config.dynamic_batching, metrics, config.max_batch_size)
        batcher.start()
        log.info(
            "model %s version %s: %s backend, %d runner(s)%s, pixels normalised on the %s, "
            "JPEG uploads decoded on the %s; loaded and warmed in %.1f s",
            config.name,
            precision,
            backend,
            config.runners,
            f" on GPUs {config.gpus}" if config.gpus else "",
            "device" if native else "CPU",
            "GPU" if decoder else "CPU",
            time.perf_counter() - started,
        )
        return ServedModel(
            entry,
            precision,
            spec,
            backend,
            pool,
            batcher,
            metrics,
            labels,
            pixels=pixels,
            decoder=decoder,
        )

    def _decoder(
        self, entry: ModelEntry, backend: str, metrics: ModelMetrics | None = None
    ) -> images.DecodeQueue | None:
        """A batched GPU decoder for the model's JPEG uploads, where ``image_decode`` and
        this machine allow one."""
        config, settings = entry.config, self.settings.models
        if config.preprocess is None or settings.image_decode == "cpu":
            return None
        available = backends.gpu_image_decode_available()
        if settings.image_decode == "auto" and not (backend in GPU_BACKENDS and available):
            return None
        if not available:
            raise RuntimeError("image_decode is gpu, but torchvision with CUDA is not available")
        from engines.backends.torch import images as torch_images

        device = f"cuda:{config.gpus[0] if config.gpus else 0}"
        decoder = torch_images.TorchImageDecoder(config.preprocess.to_spec("UINT8"), device)
        queue = images.DecodeQueue(
            decoder.decode,
            settings.decode_batch,
            f"{config.name}-jpeg",
            metrics.decode_batch if metrics else None,
        )
        queue.start()
        return queue

    def begin_drain(self) -> None:
        """From now on readiness is false and new inference requests get 503; the drain
        timeout starts. Sets plain attributes only, so a signal handler may call it."""
        if not self.draining:
            self.draining = True
            self._stopping.set()
            self._drain_deadline = time.monotonic() + self.settings.server.drain_timeout_s

    def drain_time_left(self) -> float:
        """Seconds left of the drain timeout (0 before a drain begins)."""
        return max(0.0, self._drain_deadline - time.monotonic())

    async def drain(self) -> None:
        """Begin draining, wait until every accepted request has its answer or the drain
        timeout passes, then fail what is still queued with 503 (a batch already running
        finishes: a runner's thread cannot be interrupted)."""
        self.begin_drain()
        try:
            async with asyncio.timeout(self.drain_time_left()):
                await self._idle.wait()
        except TimeoutError:
            log.warning("drain timeout: %d request(s) still in flight", self._active)
        await self._close_batchers()

    async def _close_batchers(self) -> None:
        timeout = self.drain_time_left()
        await asyncio.gather(*(m.batcher.close(timeout) for m in self.all_served()))

    async def stop(self) -> None:
        """Drain (if no drain ran yet), then free runners and engines in reverse order of
        loading."""
        self.ready = False
        self.begin_drain()
        await self._close_batchers()
        for model in reversed(self.all_served()):
            await model.close()  # its batcher is closed already: the rest goes
        self._models.clear()

    # -- lookup -------------------------------------------------------------------------

    @property
    def is_ready(self) -> bool:
        """Loading is over, some version serves, every served version is healthy and no
        drain has begun. A version refused at load does not hold readiness back: it answers
        503 with its reason instead."""
        served = self.all_served()
        return self.ready and not self.draining and bool(served) and all(m.ready for m in served)

    @property
    def alive(self) -> bool:
        """False once loading failed or a model stopped on an unrecoverable engine fault: the
        process cannot heal itself, so liveness fails and the orchestrator restarts it."""
        return self.failed is None and all(m.ready for m in self.all_served())

    def model_names(self) -> list[str]:
        return list(self._models)

    def entries(self) -> list[ModelEntry]:
        return list(self._entries)

    def _entry(self, name: str) -> ModelEntry | None:
        return next((e for e in self._entries if e.config.name == name), None)

    def get(self, name: str, version: str | None = None) -> ServedModel:
        entry = self._entry(name)
        if entry is None:
            raise NotFound(f"unknown model '{client_text(name)}'")
        version = version or entry.config.default_precision
        model = self._models.get(name, {}).get(version)
        if model is not None:
            return model
        reason = self._unavailable.get(name, {}).get(version)
        if reason is not None:
            raise Unavailable(f"model {name!r} version {version!r} is not served: {reason}")
        if not self.ready and version in entry.config.precisions:
            raise Unavailable(f"model {name!r} is loading")
        raise NotFound(
            f"model {name!r} has no version '{client_text(version)}'; versions: "
            f"{', '.join(entry.config.precisions)}"
        )

    def versions(self, name: str) -> list[str]:
        """The versions of a model that serve."""
        return list(self._models.get(name, {}))

    def unavailable(self, name: str) -> dict[str, str]:
        """The versions of a model that are configured but not served, with the reason."""
        return dict(self._unavailable.get(name, {}))

    def repository_index(self) -> list[dict[str, str]]:
        """Triton's repository index: every configured version with its state (READY,
        LOADING, UNAVAILABLE) and, where it is not served, the reason."""
        index = []
        for entry in self._entries:
            name = entry.config.name
            for version in entry.config.precisions:
                item = {"name": name, "version": version}
                reason = self._unavailable.get(name, {}).get(version)
                if reason is not None:
                    item |= {"state": "UNAVAILABLE", "reason": reason}
                elif version in self._models.get(name, {}):
                    item["state"] = "READY"
                else:
                    item["state"] = "LOADING"
                index.append(item)
        return index

    def default_model(self) -> ServedModel:
        name = self.settings.models.default_model
        if name is None:
            if not self._entries:
                raise Unavailable("no model is loaded yet")
            # The first model that serves; else the first, whose 503 then says why not.
            served = [e.config.name for e in self._entries if self._models.get(e.config.name)]
            name = served[0] if served else self._entries[0].config.name
        return self.get(name)

    def all_served(self) -> list[ServedModel]:
        return [m for versions in self._models.values() for m in versions.values()]

    # -- inference ----------------------------------------------------------------------

    async def _measured(self, model: ServedModel, work: Callable[[], Awaitable[T]]) -> T:
        """Run one request's work, counting its outcome and duration by reason; refuse it
        with 503 once the server drains, and track it until answered so a drain can wait."""
        started = time.perf_counter()
        self._active += 1
        self._idle.clear()
        try:
            if self.draining:
                raise Unavailable("server is shutting down; retry on another replica")
            result = await work()
        except StokerError as exc:
            model.metrics.request_failed(exc.reason, time.perf_counter() - started)
            raise
        except asyncio.CancelledError:
            model.metrics.request_failed("cancelled", time.perf_counter() - started)
            raise
        except Exception:
            model.metrics.request_failed("backend", time.perf_counter() - started)
            raise
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()
        model.metrics.request_succeeded(time.perf_counter() - started)
        return result

    async def infer(
        self, model: ServedModel, body: bytes | bytearray, header_length: int | None
    ) -> tuple[str | None, list[tuple[RequestedOutput, np.ndarray]]]:
        """Decode a V2 request, validate it against the model, batch it, shape the answer."""

        async def work() -> tuple[str | None, list[tuple[RequestedOutput, np.ndarray]]]:
            arrived = time.monotonic()
            # Under overload most requests are refused: refuse before decoding, not after.
            model.batcher.admit()
            depth = self.settings.limits.max_json_depth
            if len(body) > THREADED_DECODE_BYTES:
                request = await asyncio.to_thread(
                    decode_request, body, header_length, model.spec, depth
                )
            else:
                request = decode_request(body, header_length, model.spec, depth)
            pixels = model.pixels.name if model.pixels else None
            rows, _ = validate_inputs(model.spec, request.inputs, pixels)
            # The key of what the engine gets: normalised pixels batch with FP32 requests.
            inputs = pixels_for_engine(model.pixels, request.inputs)
            key = batch_key(model.spec, inputs)
            wanted = requested_outputs(model.spec, request)
            levels = model.entry.config.dynamic_batching.priority_levels
            if request.priority > levels:
                raise BadRequest(
                    f"priority {request.priority} exceeds the model's {levels} level(s)"
                )
            timeout = self._time_left(self._timeout_s(model, request.timeout_us), arrived)
            outputs = await model.batcher.infer(inputs, rows, key, timeout, request.priority)
            return request.id, [(out, self._shape_output(model, out, outputs)) for out in wanted]

        return await self._measured(model, work)

    def _shape_output(
        self, model: ServedModel, out: RequestedOutput, outputs: Tensors
    ) -> np.ndarray:
        value = outputs[out.name]
        if out.classification:
            return classify(value, out.classification, model.labels)
        return value

    @staticmethod
    def _time_left(timeout_s: float | None, arrived: float) -> float | None:
        """What is left of a request's deadline after decoding it; 504 if nothing is (it
        never reaches the queue, let alone a runner)."""
        if timeout_s is None:
            return None
        left = timeout_s - (time.monotonic() - arrived)
        if left <= 0:
            raise DeadlineExceeded(f"deadline of {timeout_s * 1000:g} ms passed while decoding")
        return left

    @staticmethod
    def _timeout_s(model: ServedModel, timeout_us: int | None) -> float | None:
        if timeout_us is None or timeout_us == 0:
            timeout_us = model.entry.config.dynamic_batching.default_timeout_us
        return timeout_us / 1e6 if timeout_us > 0 else None

    async def classify_images(
        self, model: ServedModel, uploads: Sequence[bytes], k: int
    ) -> list[list[dict[str, Any]]]:
        """Decode and preprocess images, batch them through the model, answer top-k labels."""
        config = model.entry.config
        if config.preprocess is None:
            raise BadRequest(f"model {model.name!r} does not take image uploads")
        if not uploads:
            raise BadRequest("no image in the request")
        limits = self.settings.limits
        if len(uploads) > limits.max_images_per_request:
            raise BadRequest(
                f"{len(uploads)} images in one request; "
                f"the limit is {limits.max_images_per_request}"
            )
        image_input = model.spec.inputs[0]
        prep = config.preprocess.to_spec("UINT8")
        if len(model.spec.inputs) != 1 or not image_input.matches(prep.row_shape()):
            raise BadRequest(
                f"model {model.name!r} input {image_input.name!r} expects rows of "
                f"{list(image_input.shape)}, preprocessing gives {list(prep.row_shape())}"
            )

        def on_cpu(data: bytes) -> np.ndarray:
            image = images.decode(data, limits.max_image_pixels, limits.max_image_aspect_ratio)
            return preprocess(image, prep)

        async def decode_all() -> np.ndarray:
            """UINT8 rows: JPEGs in batches on the GPU when a decoder is on, the rest (and
            what it gives back) on the CPU; headers are checked first either way."""
            headers = [
                images.inspect(data, limits.max_image_pixels, limits.max_image_aspect_ratio)
                for data in uploads
            ]
            rows: list[np.ndarray | None] = [None] * len(uploads)
            if model.decoder is not None:
                picked = [i for i, h in enumerate(headers) if h.device_decodable]
                decoded = await model.decoder.decode([uploads[i] for i in picked])
                for i, row in zip(picked, decoded, strict=True):
                    rows[i] = row
            left = [i for i, row in enumerate(rows) if row is None]
            model.metrics.images_decoded("gpu", len(rows) - len(left))
            if left:
                done = await asyncio.to_thread(lambda: [on_cpu(uploads[i]) for i in left])
                for i, row in zip(left, done, strict=True):
                    rows[i] = row
                model.metrics.images_decoded("cpu", len(left))
            return np.stack([row for row in rows if row is not None])

        async def work() -> list[list[dict[str, Any]]]:
            arrived = time.monotonic()
            model.batcher.admit()
            batch = await decode_all()
            on_device = model.pixels is not None and model.pixels.on_device
            if image_input.datatype != "UINT8" and not on_device:
                batch = normalize(batch, prep, image_input.dtype)
            timeout = self._time_left(self._timeout_s(model, None), arrived)
            step = model.spec.max_batch_size or 1
            chunks = [batch[i : i + step] for i in range(0, len(batch), step)]
            key = batch_key(model.spec, {image_input.name: batch})
            results = await asyncio.gather(
                *(model.batcher.infer({image_input.name: c}, len(c), key, timeout) for c in chunks)
            )
            scores = np.concatenate([r[model.spec.outputs[0].name] for r in results])
            if config.postprocess == "softmax":
                scores = accuracy.softmax(scores)
            return [top_k(row, k, model.labels) for row in scores.reshape(len(batch), -1)]

        return await self._measured(model, work)


def top_k(scores: np.ndarray, k: int, labels: list[str] | None) -> list[dict[str, Any]]:
    k = min(k, scores.shape[-1])
    order = np.argsort(-scores, kind="stable")[:k]
    return [
        {
            "label": labels[i] if labels and i < len(labels) else str(i),
            "index": int(i),
            "probability": float(scores[i]),
        }
        for i in order
    ]


def validate_inputs(
    spec: ModelSpec, inputs: dict[str, np.ndarray], pixels: str | None = None
) -> tuple[int, tuple[Any, ...]]:
    """Check a request's tensors against the model; return its rows and its batch key
    (requests with different non-batch shapes or datatypes never share a batch). The
    ``pixels`` input also takes UINT8 pixels of its declared shape."""
    missing = [t.name for t in spec.inputs if t.name not in inputs]
    if missing:
        raise BadRequest(f"missing input(s): {', '.join(missing)}")
    unknown = [name for name in inputs if spec.input(name) is None]
    if unknown:
        expected = ", ".join(t.name for t in spec.inputs)
        raise BadRequest(f"unknown input(s): {', '.join(unknown[:8])}; the model takes {expected}")
    rows: int | None = None
    for tensor in spec.inputs:
        value = inputs[tensor.name]
        if not (tensor.name == pixels and value.dtype == np.uint8):
            check_datatype(tensor, value, pixels=tensor.name == pixels)
        shape = tuple(value.shape)
        row_shape = shape[1:] if spec.batched else shape
        if spec.batched:
            if not shape:
                raise BadRequest(f"input {tensor.name!r} needs a batch dimension")
            if rows is None:
                rows = shape[0]
            elif shape[0] != rows:
                raise BadRequest(f"inputs disagree on the batch size ({rows} vs {shape[0]})")
        if not tensor.matches(row_shape):
            raise BadRequest(
                f"input {tensor.name!r}: shape {list(shape)} does not match "
                f"{spec.full_shape(tensor)}"
            )
    rows = rows if rows is not None else 1
    if spec.batched and not 1 <= rows <= spec.max_batch_size:
        raise BadRequest(f"batch of {rows} rows; the model takes 1 to {spec.max_batch_size}")
    return rows, batch_key(spec, inputs)


def batch_key(spec: ModelSpec, inputs: Mapping[str, np.ndarray]) -> tuple[Any, ...]:
    """Requests share a batch only when every input has the same datatype and row shape."""
    return tuple(
        (value.dtype.str, *(value.shape[1:] if spec.batched else value.shape))
        for value in (inputs[tensor.name] for tensor in spec.inputs)
    )


def check_datatype(tensor: TensorSpec, value: np.ndarray, pixels: bool = False) -> None:
    got = v2_datatype(value.dtype)
    if got != tensor.datatype:
        also = " (or UINT8 pixels)" if pixels else ""
        raise BadRequest(
            f"input {tensor.name!r}: datatype {got}, the model takes {tensor.datatype}{also}"
        )


def requested_outputs(spec: ModelSpec, request: InferRequest) -> list[RequestedOutput]:
    if not request.outputs:
        return [RequestedOutput(t.name, request.binary_data_output, 0) for t in spec.outputs]
    unknown = [o.name for o in request.outputs if spec.output(o.name) is None]
    if unknown:
        raise BadRequest(f"unknown output(s): {', '.join(unknown[:8])}")
    return list(request.outputs)


@dataclass(frozen=True)
class PixelInput:
    """A model's image input that also takes UINT8 pixels (rows of the preprocessed shape),
    and who normalises them: the engine on its device (``on_device``) or the service."""

    name: str
    prep: ImagePreprocess
    dtype: np.dtype[Any]
    on_device: bool = False

    @classmethod
    def of(cls, entry: ModelEntry, spec: ModelSpec, on_device: bool = False) -> PixelInput | None:
        """The pixel input of a model with preprocessing whose only input is a floating-point
        image of the preprocessed shape; None for any other model."""
        prep = entry.config.preprocess
        if prep is None or len(spec.inputs) != 1:
            return None
        tensor = spec.inputs[0]
        pixels = prep.to_spec("UINT8")
        if tensor.datatype not in ("FP32", "FP16", "BF16", "FP64"):
            return None
        if tuple(tensor.shape) != pixels.row_shape():
            return None
        return cls(tensor.name, pixels, tensor.dtype, on_device)


def pixels_for_engine(
    pixels: PixelInput | None, inputs: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """A request's inputs as the engine takes them: UINT8 pixels on the image input are
    normalised here with the model's preprocessing, unless the engine does it."""
    if pixels is None or pixels.on_device or inputs[pixels.name].dtype != np.uint8:
        return inputs
    return {**inputs, pixels.name: normalize(inputs[pixels.name], pixels.prep, pixels.dtype)}


def engine_options(
    entry: ModelEntry,
    spec: ModelSpec,
    store: EngineStore | None = None,
    profile: tuple[int, ...] = (),
    precision: str = "",
) -> EngineOptions:
    """What the backend is told about a model: runners, GPUs, batch sizes, preprocessing."""
    config = entry.config
    prep = config.preprocess
    image = prep.to_spec(spec.inputs[0].datatype) if prep and PixelInput.of(entry, spec) else None
    return EngineOptions(
        runners=config.runners,
        store=store,
        profile=profile,
        precision=precision,
        devices=tuple(config.gpus),
        preferred_batch_sizes=tuple(config.dynamic_batching.preferred_batch_size),
        image=image,
    )


def model_spec(entry: ModelEntry) -> ModelSpec:
    """The tensor contract: the config's declaration where given, else the ONNX file's."""
    config = entry.config
    onnx_spec = read_spec(entry.onnx_path, config.name, config.max_batch_size)
    if config.inputs is None and config.outputs is None:
        return onnx_spec

    def declared(
        tensors: Sequence[Any] | None, fallback: tuple[TensorSpec, ...]
    ) -> tuple[TensorSpec, ...]:
        if tensors is None:
            return fallback
        return tuple(TensorSpec(t.name, t.datatype, tuple(t.shape)) for t in tensors)

    return ModelSpec(
        name=config.name,
        inputs=declared(config.inputs, onnx_spec.inputs),
        outputs=declared(config.outputs, onnx_spec.outputs),
        max_batch_size=config.max_batch_size,
    )


def prepare(entry: ModelEntry) -> None:
    """Write a model's ONNX (and labels) with its zoo generator.

    The generator writes into a scratch folder and each file is renamed into place, so a
    killed or concurrent preparation never leaves a half-written model behind.
    """
    name = entry.config.generator
    if name is None or name not in zoo.GENERATORS:
        raise ValueError(f"model {entry.config.name!r}: unknown generator {name!r}")
    entry.folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=entry.folder, prefix=".prepare-") as scratch:
        zoo.GENERATORS[name](Path(scratch))
        for produced in Path(scratch).iterdir():
            os.replace(produced, entry.folder / produced.name)
