"""The model layer: the one place where a model version is loaded, warmed, served and closed.

``source(entry)`` reads a model's contract (generating its ONNX with its zoo generator when
missing); ``load_engine`` builds or finds the precision variant in the engine store and
loads it on a backend; ``load`` adds the runner pool, warms it, and starts the batcher and the
handler of uploads: a ``LoadedModel``. ``app.engine.registry.Registry`` owns every loaded
version of every configured model, the versions refused and why, readiness and closing.
The server, the CLI, the accuracy report, the bench's in-process client and its naive baseline
all load models through here.

Kept in one module (~520 lines): a version's whole life (source, engine, pool, warm-up,
batcher, close) is what "the one place" means; each step's work lives in ``engines`` and the
batcher, and what stays here is their order and what each leaves for the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import functools
import gc
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import zoo
from app.contract import Contract, Part, serial_of, validate_inputs
from app.engine import images
from app.engine.batcher import Batcher
from app.engine.decoders import decode_queue, describe_decoding
from app.engine.folders import triton_layout, version_folders
from app.engine.handlers import Handler, HandlerContext, RowsHandler, handler_for
from app.engine.pool import RunnerPool
from app.engine.repository import DynamicBatching, ModelEntry
from app.engine.startup import describe_phases, start_decoders, start_phases, stop_decoders
from app.errors import BadRequest, Reloaded, client_text
from app.metrics import ModelMetrics
from app.settings import Settings
from engines import backends
from engines.backends.onnxruntime import read_spec
from engines.base import Engine, EngineOptions
from engines.heap import freeze_heap
from engines.precision.build import (
    BuildPlan,
    Cancelled,
    ensure_variant,
    never,
)
from engines.preprocess import ImagePreprocess, normalize
from engines.spec import ModelSpec
from engines.store import EngineStore

log = logging.getLogger(__name__)


# -- a model's contract -------------------------------------------------------------------


def prepare(entry: ModelEntry) -> None:
    """Write a model's ONNX (and labels) with its zoo generator.

    The generator writes into a scratch folder and each file is linked into place, so a
    killed or concurrent preparation never leaves a half-written model behind; a file the
    folder already has is never replaced (a load's config naming a generator cannot
    overwrite the operator's files).
    """
    name = entry.config.generator
    if name is None or name not in zoo.GENERATORS:
        raise ValueError(f"model {entry.config.name!r}: unknown generator {name!r}")
    entry.folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=entry.folder, prefix=".prepare-") as scratch:
        zoo.GENERATORS[name](Path(scratch))
        for produced in Path(scratch).iterdir():
            with contextlib.suppress(FileExistsError):  # linking never replaces a file
                os.link(produced, entry.folder / produced.name)


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
            found = version_folders(entry.folder)
            if found:
                raise FileNotFoundError(triton_layout(config.name, found, config.onnx))
            raise FileNotFoundError(
                f"model {config.name!r}: {config.onnx} does not exist in its folder"
            )
        log.info(
            "model %s: generating %s with zoo.%s", config.name, entry.onnx_path, config.generator
        )
        prepare(entry)
    if not entry.onnx_path.is_file():  # a FIFO or a device would hold the loading thread
        raise FileNotFoundError(f"model {config.name!r}: {config.onnx} is not a regular file")
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
    text: tuple[str, ...] = ()
    """BYTES inputs the engine takes as UTF-8 text (``Engine.text_inputs``: ONNX Runtime's
    Python API turns bytes into their repr): decoded here, per request, so an element that is
    not UTF-8 is that request's 400, not its batch's 500."""

    @classmethod
    def decide(
        cls, entry: ModelEntry, spec: ModelSpec, engine: Engine | None = None
    ) -> InputPolicy:
        """The policy of ``entry`` served by ``engine`` (None: before an engine exists, as
        the engine's options are decided)."""
        text: tuple[str, ...] = ()
        if engine is not None and getattr(engine, "text_inputs", False):
            text = tuple(t.name for t in spec.inputs if t.datatype == "BYTES")
        prep = entry.config.preprocess
        if prep is None or len(spec.inputs) != 1:
            return cls(text=text)
        tensor = spec.inputs[0]
        pixels = prep.with_datatype("UINT8")
        if tensor.datatype not in ("FP32", "FP16", "BF16", "FP64"):
            return cls(text=text)
        if tuple(tensor.shape) != pixels.row_shape():
            return cls(text=text)
        on_device = engine is not None and engine.pixel_input == tensor.name
        return cls(tensor.name, pixels, tensor.dtype, on_device, text)

    def for_engine(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The inputs as the engine takes them: UINT8 pixels on the image input are
        normalised here with the model's preprocessing, unless the engine does it; BYTES the
        engine takes as text are decoded from UTF-8."""
        if self.text:
            inputs = {**inputs, **{n: as_text(n, inputs[n]) for n in self.text if n in inputs}}
        name = self.pixels
        if name is None or self.on_device or inputs[name].dtype != np.uint8:
            return inputs
        assert self.prep is not None and self.dtype is not None
        return {**inputs, name: normalize(inputs[name], self.prep, self.dtype)}


def as_text(name: str, array: np.ndarray) -> np.ndarray:
    """A BYTES input as an object array of ``str`` (UTF-8), for an engine that takes text."""
    flat = array.reshape(-1)
    try:
        text = [e.decode("utf-8") if isinstance(e, bytes) else e for e in flat.tolist()]
    except UnicodeDecodeError:
        raise BadRequest(
            f"input {client_text(name)!r}: this model's engine takes BYTES as UTF-8 text; an "
            "element is not UTF-8"
        ) from None
    result = np.empty(len(text), dtype=np.object_)
    result[:] = text
    return result.reshape(array.shape)


def engine_options(
    entry: ModelEntry,
    spec: ModelSpec,
    backend: str,
    store: EngineStore | None = None,
    profile: tuple[int, ...] = (),
    precision: str = "",
) -> EngineOptions:
    """What ``backend`` (a resolved name) is told about a model: runners, GPUs, batch sizes,
    preprocessing."""
    config = entry.config
    policy = InputPolicy.decide(entry, spec)
    image = policy.prep.with_datatype(spec.inputs[0].datatype) if policy.prep else None
    return EngineOptions(
        runners=config.runner_count(backend),
        store=store,
        profile=profile,
        precision=precision,
        devices=tuple(config.gpus),
        preferred_batch_sizes=tuple(config.dynamic_batching.preferred_batch_size),
        image=image,
        gpu=config.gpu,
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
    options = engine_options(
        model.entry, model.spec, backends.resolve(backend), store, model.plan.profile, precision
    )
    return variant, report, options


def prebuild_tensorrt(model: ModelSource, precision: str, variant: Path, store: EngineStore) -> str:
    """Build the TensorRT plan of a variant ahead of serving where this machine can (TensorRT
    for RTX: anywhere; TensorRT proper: on its GPU), and say what was built or why not."""
    from engines.backends.tensorrt.build import TensorRTOptions, describe_network, prebuild_plan
    from engines.backends.tensorrt.runtime import RTX_RUNS_ON, TensorRTUnavailable
    from engines.devices import cuda

    name = model.name
    options = engine_options(
        model.entry, model.spec, "tensorrt", store, model.plan.profile, precision
    )
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
        options = dataclasses.replace(options, runners=runners)
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
    rows_handler: RowsHandler | None = None
    """The handler, where a front end may make this model's input rows of its uploads
    itself: one that takes rows (``RowsHandler``), the engine decoding on the CPU (no device
    decoder). None: uploads cross as files."""
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    """What its load spent per phase, in seconds (``start_phases``)."""
    replaced_by: LoadedModel | None = None
    """The version that serves in its place since a reload switched to it."""

    @property
    def row_preprocess(self) -> ImagePreprocess | None:
        """How a front end makes this model's rows of its uploads (None: it sends files)."""
        return None if self.rows_handler is None else self.rows_handler.row_preprocess

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def ready(self) -> bool:
        return self.batcher.failed is None

    @functools.cached_property
    def serial(self) -> int:
        """Names what a request decoded for it relies on (``app.contract.serial_of``): its
        tensors, max batch, pixel input and priority levels."""
        levels = self.entry.config.dynamic_batching.priority_levels
        return serial_of(self.spec, self.inputs.pixels, levels)

    @functools.cached_property
    def contract(self) -> Contract:
        """What a request for it is decoded and checked against, made once: its terms
        never change while it is loaded."""
        levels = self.entry.config.dynamic_batching.priority_levels
        pixels, preprocess = self.inputs.pixels, self.row_preprocess
        return Contract(self.name, self.version, self.spec, pixels, levels, self.serial, preprocess)

    def fits(self, parts: Sequence[Part]) -> bool:
        """Whether requests decoded against another contract (of a version a reload
        replaced) are requests this version takes as they are."""
        try:
            for part in parts:
                validate_inputs(self.spec, part.inputs, self.inputs.pixels)
                if any(self.spec.output(out.name) is None for out in part.wanted):
                    return False
        except BadRequest:
            return False
        return not self.spec.batched or sum(p.rows for p in parts) <= self.spec.max_batch_size

    def current(self) -> LoadedModel:
        """The version serving in its place now: itself, or the one a reload switched to
        while a request for it was being decoded (``Reloaded`` when that one's contract is
        another: the request is decoded again)."""
        model = self
        while model.replaced_by is not None:
            model = model.replaced_by
        if model.serial != self.serial:
            raise Reloaded(f"model {self.name!r} version {self.version!r} was reloaded; retry")
        return model

    def timeout_s(self, timeout_us: int | None) -> float | None:
        """A request's deadline in seconds (see ``deadline_s``)."""
        return deadline_s(self.entry.config.dynamic_batching, timeout_us)

    async def close(
        self, drain_timeout_s: float = 0.0, why: str = "server is shutting down"
    ) -> None:
        """Stop its batcher (what it queued runs to its answer within ``drain_timeout_s``; the
        rest is answered 503 with ``why``), handler, runners and engine, in that order."""
        await self.batcher.close(drain_timeout_s, why)
        if self.handler is not None:
            await self.handler.close()
        await asyncio.to_thread(self.pool.close)


def release_memory() -> None:
    """Give what closed versions held back to the system once nothing refers to them: collect
    the cycles that keep an engine alive (frozen ones too: ``freeze_heap``), return the GPU
    memory torch keeps cached, and ask glibc to return its free heap pages (without it RSS
    can stay at its peak after an unload, although the memory is free for the next load)."""
    gc.unfreeze()
    freeze_heap()  # collects everything, then freezes what is left
    backends.release_device_memory()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def handler_context(
    model: ModelSource,
    labels: list[str] | None,
    settings: Settings,
    metrics: ModelMetrics,
    policy: InputPolicy,
    decoder: images.DecodeQueue | None = None,
) -> HandlerContext:
    """What a model's upload handler is made with."""
    config = model.entry.config
    prep = config.preprocess
    return HandlerContext(
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


async def load(
    model: ModelSource,
    precision: str,
    backend: str,
    store: EngineStore,
    settings: Settings,
    cancelled: Cancelled = never,
    metrics: ModelMetrics | None = None,
) -> LoadedModel:
    """One version loaded, its runners warmed, its batcher and upload handler started.
    ``metrics``: those of the version it replaces (a reload), whose totals it continues."""
    entry, config = model.entry, model.entry.config
    started = time.perf_counter()
    in_store = store.phases.of(config.name)
    # The decode processes start beside the engine (each imports torch and makes a CUDA
    # context: seconds), not after it.
    decoding = asyncio.ensure_future(asyncio.to_thread(start_decoders, entry, backend, settings))
    try:
        engine, policy = await asyncio.to_thread(
            load_engine, model, precision, backend, store, cancelled
        )
    except BaseException:
        await stop_decoders(decoding)
        raise
    phases = start_phases(in_store, store.phases.of(config.name), time.perf_counter() - started)
    pool: RunnerPool | None = None
    handler: Handler | None = None
    decoder: images.DecodeQueue | None = None
    if metrics is None:
        metrics = ModelMetrics(config.name, precision, settings.uploads.jpeg_decoder)
    try:
        labels = await asyncio.to_thread(entry.labels)
        runners = config.runner_count(backends.resolve(backend))
        step = time.perf_counter()
        pool = await RunnerPool.create(engine, runners, f"{config.name}-{precision}")
        phases["capture"] = time.perf_counter() - step
        step = time.perf_counter()
        await pool.warm()
        phases["warm-up"] = time.perf_counter() - step
        decoders, decoding_s = await decoding
        if decoders:
            phases["decode processes"] = decoding_s
        decoder = decode_queue(config.name, decoders, settings, metrics)
        context = handler_context(model, labels, settings, metrics, policy, decoder)
        handler = handler_for(config.handler, context, settings.models.handlers)
    except BaseException:
        if decoder is not None:
            await decoder.close()
        else:
            await stop_decoders(decoding)
        await asyncio.to_thread(pool.close if pool is not None else engine.close)
        raise
    # The engine's spec, not the config's: a GPU engine told to shrink serves a smaller max
    # batch when the configured one does not fit its memory.
    spec = engine.spec
    batcher = Batcher(pool, config.dynamic_batching, metrics, spec.max_batch_size)
    batcher.start()
    # Pixels and JPEG uploads are said only of a model that takes them (it has preprocessing).
    log.info(
        "model %s version %s: %s backend, %d runner(s)%s%s%s; loaded and warmed in %.1f s (%s)",
        config.name,
        precision,
        backend,
        pool.size,
        f" on GPUs {config.gpus}" if config.gpus else "",
        f", pixels normalised on the {'device' if policy.on_device else 'CPU'}"
        if policy.pixels is not None
        else "",
        f", JPEG uploads decoded on the {describe_decoding(decoders, settings)}"
        if config.preprocess is not None
        else ", no preprocessing",
        time.perf_counter() - started,
        describe_phases(phases),
    )
    rows_handler = handler if isinstance(handler, RowsHandler) and decoder is None else None
    return LoadedModel(
        entry,
        precision,
        spec,
        backend,
        pool,
        batcher,
        metrics,
        labels,
        policy,
        handler,
        rows_handler,
        phases,
    )
