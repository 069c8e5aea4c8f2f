"""The model layer: the one place where a model version is loaded, warmed, served and closed.

``source(entry)`` reads a model's contract (generating its ONNX with its zoo generator when
missing); ``load_engine`` builds or finds the precision variant in the engine store and
loads it on a backend; ``load`` adds the runner pool, warms it, and starts the batcher and the
handler of uploads: a ``LoadedModel``. ``Registry`` owns every loaded version of every
configured model, the versions refused and why, readiness and closing. The server, the CLI,
the accuracy report, the bench's in-process client and its naive baseline all load models
through here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import zoo
from app import images
from app.batcher import Batcher
from app.errors import NotFound, Unavailable, client_text
from app.handlers import Handler, HandlerContext, handler_for
from app.metrics import ModelMetrics, model_unavailable
from app.pool import RunnerPool
from app.repository import DynamicBatching, ModelEntry, discover
from app.settings import Settings
from engines import backends
from engines.backends.onnxruntime import read_spec
from engines.base import Engine, EngineOptions, FatalEngineError
from engines.precision.build import (
    AccuracyBudgetExceeded,
    BuildCancelled,
    BuildPlan,
    Cancelled,
    ensure_variant,
    never,
)
from engines.preprocess import ImagePreprocess, normalize
from engines.spec import ModelSpec
from engines.store import EngineStore

log = logging.getLogger(__name__)
GPU_BACKENDS = ("torch", "tensorrt")


# -- a model's contract -------------------------------------------------------------------


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


def model_spec(entry: ModelEntry) -> ModelSpec:
    """The tensor contract: the config's declaration where given, else the ONNX file's."""
    config = entry.config
    onnx_spec = read_spec(entry.onnx_path, config.name, config.max_batch_size)
    if config.inputs is None and config.outputs is None:
        return onnx_spec
    return ModelSpec(
        name=config.name,
        inputs=tuple(config.inputs) if config.inputs is not None else onnx_spec.inputs,
        outputs=tuple(config.outputs) if config.outputs is not None else onnx_spec.outputs,
        max_batch_size=config.max_batch_size,
    )


@dataclass(frozen=True)
class ModelSource:
    """A model's config, tensor contract and what the engine layer needs to build it."""

    entry: ModelEntry
    spec: ModelSpec
    plan: BuildPlan

    @property
    def name(self) -> str:
        return self.entry.config.name


def source(entry: ModelEntry, prepare_missing: bool = True) -> ModelSource:
    """The model's source, its ONNX generated first where it is missing and may be."""
    config = entry.config
    if not entry.onnx_path.exists():
        if config.generator is None or not prepare_missing:
            raise FileNotFoundError(f"model {config.name!r}: {entry.onnx_path} does not exist")
        log.info(
            "model %s: generating %s with zoo.%s", config.name, entry.onnx_path, config.generator
        )
        prepare(entry)
    spec = model_spec(entry)
    return ModelSource(entry, spec, entry.build_plan(spec))


# -- the input policy ---------------------------------------------------------------------


@dataclass(frozen=True)
class InputPolicy:
    """How a request's tensors become the engine's, decided once per loaded version.

    A model with preprocessing whose only input is a floating-point image of the
    preprocessed shape also takes UINT8 pixels on it (``pixels``: that input's name): the
    engine normalises them on its device when it declares so (``Engine.pixel_input``), else
    the service does, on the CPU, before batching.
    """

    pixels: str | None = None
    prep: ImagePreprocess | None = None
    """The preprocessing in UINT8 (what pixels are before normalisation)."""
    dtype: np.dtype[Any] | None = None
    """The image input's own datatype, which the service normalises pixels to."""
    on_device: bool = False

    @classmethod
    def decide(
        cls, entry: ModelEntry, spec: ModelSpec, engine: Engine | None = None
    ) -> InputPolicy:
        """The policy of ``entry`` served by ``engine`` (None: before an engine exists, as
        the engine's options are decided)."""
        prep = entry.config.preprocess
        if prep is None or len(spec.inputs) != 1:
            return cls()
        tensor = spec.inputs[0]
        pixels = prep.with_datatype("UINT8")
        if tensor.datatype not in ("FP32", "FP16", "BF16", "FP64"):
            return cls()
        if tuple(tensor.shape) != pixels.row_shape():
            return cls()
        on_device = engine is not None and engine.pixel_input == tensor.name
        return cls(tensor.name, pixels, tensor.dtype, on_device)

    def for_engine(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The inputs as the engine takes them: UINT8 pixels on the image input are
        normalised here with the model's preprocessing, unless the engine does it."""
        name = self.pixels
        if name is None or self.on_device or inputs[name].dtype != np.uint8:
            return inputs
        assert self.prep is not None and self.dtype is not None
        return {**inputs, name: normalize(inputs[name], self.prep, self.dtype)}


def engine_options(
    entry: ModelEntry,
    spec: ModelSpec,
    store: EngineStore | None = None,
    profile: tuple[int, ...] = (),
    precision: str = "",
) -> EngineOptions:
    """What the backend is told about a model: runners, GPUs, batch sizes, preprocessing."""
    config = entry.config
    policy = InputPolicy.decide(entry, spec)
    image = policy.prep.with_datatype(spec.inputs[0].datatype) if policy.prep else None
    return EngineOptions(
        runners=config.runners,
        store=store,
        profile=profile,
        precision=precision,
        devices=tuple(config.gpus),
        preferred_batch_sizes=tuple(config.dynamic_batching.preferred_batch_size),
        image=image,
    )


# -- loading ------------------------------------------------------------------------------


def build(
    model: ModelSource,
    precision: str,
    backend: str,
    store: EngineStore,
    cancelled: Cancelled = never,
) -> tuple[Path, dict[str, float], EngineOptions]:
    """The precision variant built (or found) in the store, its accuracy report, and the
    options its engine is loaded with."""
    variant, report = ensure_variant(store, model.plan, precision, backend, cancelled)
    options = engine_options(model.entry, model.spec, store, model.plan.profile, precision)
    return variant, report, options


def prebuild_tensorrt(model: ModelSource, precision: str, variant: Path, store: EngineStore) -> str:
    """Build the TensorRT plan of a variant ahead of serving where this machine can (TensorRT
    for RTX: anywhere; TensorRT proper: on its GPU), and say what was built or why not."""
    from engines.backends.tensorrt.build import TensorRTOptions, describe_network, prebuild_plan
    from engines.backends.tensorrt.runtime import RTX_RUNS_ON, TensorRTUnavailable
    from engines.devices import cuda

    name = model.name
    options = engine_options(model.entry, model.spec, store, model.plan.profile, precision)
    try:
        target = prebuild_plan(variant, model.spec, options, TensorRTOptions())
    except (TensorRTUnavailable, cuda.CudaUnavailable, cuda.CudaError) as why:
        return (
            f"{name} {precision}: no TensorRT plan built here ({why}); the server builds it "
            "at its first start on the GPU"
        )
    jit = (
        f"; it is specialised for the GPU when it loads (TensorRT for RTX runs on {RTX_RUNS_ON})"
        if target.jit
        else ""
    )
    return (
        f"{name} {precision}: {target.tensorrt_version} plan for {target.device_key()}{jit}\n"
        f"  network: {describe_network(variant).describe()}"
    )


def load_engine(
    model: ModelSource,
    precision: str,
    backend: str,
    store: EngineStore,
    cancelled: Cancelled = never,
    runners: int | None = None,
) -> tuple[Engine, InputPolicy]:
    """The variant built or found, loaded on ``backend``, with its input policy. ``runners``
    overrides the config's (the naive baseline runs one)."""
    variant, _, options = build(model, precision, backend, store, cancelled)
    if runners is not None:
        options = EngineOptions(**{**options.__dict__, "runners": runners})
    engine = backends.loader(backend)(variant, model.spec, options)
    return engine, InputPolicy.decide(model.entry, model.spec, engine)


def deadline_s(batching: DynamicBatching, timeout_us: int | None) -> float | None:
    """A request's deadline in seconds: its own, else the config's default; None: none."""
    if timeout_us is None or timeout_us == 0:
        timeout_us = batching.default_timeout_us
    return timeout_us / 1e6 if timeout_us > 0 else None


@dataclass
class LoadedModel:
    """One model version (a precision) with everything that serves it."""

    entry: ModelEntry
    version: str
    spec: ModelSpec
    backend: str
    pool: RunnerPool
    batcher: Batcher
    metrics: ModelMetrics
    labels: list[str] | None
    inputs: InputPolicy
    handler: Handler | None = None
    """What ``POST /infer`` does with uploads; None: the model takes V2 tensors only."""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def ready(self) -> bool:
        return self.batcher.failed is None

    def timeout_s(self, timeout_us: int | None) -> float | None:
        """A request's deadline in seconds (see ``deadline_s``)."""
        return deadline_s(self.entry.config.dynamic_batching, timeout_us)

    async def close(self, drain_timeout_s: float = 0.0) -> None:
        """Stop its batcher, handler, runners and engine, in that order."""
        await self.batcher.close(drain_timeout_s)
        if self.handler is not None:
            await self.handler.close()
        await asyncio.to_thread(self.pool.close)


def gpu_decoder(
    entry: ModelEntry, backend: str, settings: Settings, metrics: ModelMetrics | None = None
) -> images.DecodeQueue | None:
    """A batched GPU decoder for the model's JPEG uploads, where ``image_decode`` and this
    machine allow one."""
    config, wanted = entry.config, settings.models.image_decode
    if config.preprocess is None or wanted == "cpu":
        return None
    available = backends.gpu_image_decode_available()
    if wanted == "auto" and not (backend in GPU_BACKENDS and available):
        return None
    if not available:
        raise RuntimeError("image_decode is gpu, but torchvision with CUDA is not available")
    from engines.backends.torch import images as torch_images

    device = f"cuda:{config.gpus[0] if config.gpus else 0}"
    decoder = torch_images.TorchImageDecoder(config.preprocess.with_datatype("UINT8"), device)
    queue = images.DecodeQueue(
        decoder.decode,
        settings.models.decode_batch,
        f"{config.name}-jpeg",
        metrics.decode_batch if metrics else None,
    )
    queue.start()
    return queue


async def load(
    model: ModelSource,
    precision: str,
    backend: str,
    store: EngineStore,
    settings: Settings,
    cancelled: Cancelled = never,
) -> LoadedModel:
    """One version loaded, its runners warmed, its batcher and upload handler started."""
    entry, config = model.entry, model.entry.config
    started = time.perf_counter()
    engine, policy = await asyncio.to_thread(
        load_engine, model, precision, backend, store, cancelled
    )
    pool: RunnerPool | None = None
    handler: Handler | None = None
    decoder: images.DecodeQueue | None = None
    metrics = ModelMetrics(config.name, precision)
    labels = entry.labels()
    try:
        pool = await RunnerPool.create(engine, config.runners, f"{config.name}-{precision}")
        await pool.warm()
        decoder = gpu_decoder(entry, backend, settings, metrics)
        prep = config.preprocess
        context = HandlerContext(
            name=config.name,
            spec=model.spec,
            preprocess=prep.with_datatype("UINT8") if prep else None,
            postprocess=config.postprocess,
            labels=labels,
            limits=settings.limits,
            metrics=metrics,
            normalised_by_engine=policy.on_device,
            decoder=decoder,
        )
        handler = handler_for(config.handler, context)
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
        "device" if policy.on_device else "CPU",
        "GPU" if decoder else "CPU",
        time.perf_counter() - started,
    )
    return LoadedModel(
        entry, precision, model.spec, backend, pool, batcher, metrics, labels, policy, handler
    )


# -- the registry -------------------------------------------------------------------------


class Registry:
    """Every configured model, its loaded versions, and the versions refused with why.

    Readiness, per level: a version is ready while its batcher runs (``LoadedModel.ready``);
    the registry is ready once loading is over, something serves and every loaded version is
    ready (``ready``); a refused version does not hold it back, it answers 503 with its
    reason.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store = EngineStore(settings.store.path)
        self._entries: list[ModelEntry] = []
        self._loaded: dict[str, dict[str, LoadedModel]] = {}
        # model -> version -> why it is not served (it missed its budget or failed to load).
        self._unavailable: dict[str, dict[str, str]] = {}
        self.loading_done = False
        # Set when the server stops: a build running in a worker thread stops at its next
        # check instead of holding the process up until it ends.
        self.stopping = threading.Event()

    # -- loading and closing

    async def load_all(self) -> None:
        """Load every model, warm every runner. A version that misses its accuracy budget
        or fails to load is not served and says why (unless ``models.exit_on_error``); the
        others serve. Nothing at all to serve is an error."""
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
        if not self.loaded():
            # Nothing to serve: stop (the orchestrator shows a crash loop) rather than stay
            # live and never ready.
            raise RuntimeError(f"no model version could be served: {', '.join(refused)}")
        self.loading_done = True
        log.info(
            "ready: %s%s",
            ", ".join(f"{n}{sorted(v)}" for n, v in self._loaded.items()) or "no model",
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
        settings = self.settings.models
        backend = backends.resolve(settings.backend or config.backend)
        model = await asyncio.to_thread(source, entry, settings.prepare_missing)
        versions: dict[str, LoadedModel] = {}
        try:
            for precision in config.precisions:
                try:
                    versions[precision] = await load(
                        model, precision, backend, self.store, self.settings, self.stopping.is_set
                    )
                except (FatalEngineError, BuildCancelled):
                    raise
                except Exception as error:
                    self._refuse(config.name, precision, error)
        except BaseException:
            # Cancelled (shutdown mid-load), fatal, or exit_on_error: what loaded is closed.
            for loaded in versions.values():
                await loaded.close()
            raise
        self._loaded[config.name] = versions

    async def close_batchers(self, timeout_s: float) -> None:
        """Fail what is still queued after ``timeout_s`` (a running batch finishes)."""
        await asyncio.gather(*(m.batcher.close(timeout_s) for m in self.loaded()))

    async def close(self) -> None:
        """Free every version in reverse order of loading."""
        self.stopping.set()
        for model in reversed(self.loaded()):
            await model.close()
        self._loaded.clear()

    # -- state

    @property
    def ready(self) -> bool:
        served = self.loaded()
        return self.loading_done and bool(served) and all(m.ready for m in served)

    @property
    def healthy(self) -> bool:
        """False once a version stopped on an unrecoverable engine fault."""
        return all(m.ready for m in self.loaded())

    def loaded(self) -> list[LoadedModel]:
        return [m for versions in self._loaded.values() for m in versions.values()]

    def entries(self) -> list[ModelEntry]:
        return list(self._entries)

    def entry(self, name: str) -> ModelEntry | None:
        return next((e for e in self._entries if e.config.name == name), None)

    def get(self, name: str, version: str | None = None) -> LoadedModel:
        """The loaded version; 404 for an unknown model or version, 503 with the reason for
        one that is refused or still loading."""
        entry = self.entry(name)
        if entry is None:
            raise NotFound(f"unknown model '{client_text(name)}'")
        version = version or entry.config.default_precision
        model = self._loaded.get(name, {}).get(version)
        if model is not None:
            return model
        reason = self._unavailable.get(name, {}).get(version)
        if reason is not None:
            raise Unavailable(f"model {name!r} version {version!r} is not served: {reason}")
        if not self.loading_done and version in entry.config.precisions:
            raise Unavailable(f"model {name!r} is loading")
        raise NotFound(
            f"model {name!r} has no version '{client_text(version)}'; versions: "
            f"{', '.join(entry.config.precisions)}"
        )

    def versions(self, name: str) -> list[str]:
        """The versions of a model that serve."""
        return list(self._loaded.get(name, {}))

    def unavailable(self, name: str) -> dict[str, str]:
        """The versions of a model that are configured but not served, with the reason."""
        return dict(self._unavailable.get(name, {}))

    def index(self) -> list[dict[str, str]]:
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
                elif version in self._loaded.get(name, {}):
                    item["state"] = "READY"
                else:
                    item["state"] = "LOADING"
                index.append(item)
        return index

    def default(self, name: str | None) -> LoadedModel:
        """The model of the plain ``POST /infer``: ``name``, else the first model that
        serves; else the first, whose 503 then says why not."""
        if name is None:
            if not self._entries:
                raise Unavailable("no model is loaded yet")
            served = [e.config.name for e in self._entries if self._loaded.get(e.config.name)]
            name = served[0] if served else self._entries[0].config.name
        return self.get(name)
