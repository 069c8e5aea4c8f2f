"""The model repository: ``<repository>/<model>/config.yaml``, validated by pydantic.

A config error names the model, the file and the field, never a server path. Inputs and
outputs are read from the ONNX file where the config omits them.

A config is data about its model's folder, whoever wrote it (the operator's config.yaml or
a load request's ``parameters.config``): every path in it resolves inside the folder (no
absolute path, no ``..`` or symlink out of it), a model folder is inside the repository,
its handler is a built-in one or one ``models.handlers`` allows, and its numbers stay within
``models.bounds``.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from app.engine.folders import (
    MAX_LABELS_BYTES,
    ConfigError,
    check_folder,
    inside,
    model_folder,
    read_regular,
)
from app.errors import client_text
from app.settings import ConfigBounds, ModelRepositorySettings
from engines.devices.options import GPU_BACKENDS, RUNNERS_PER_GPU, GpuOptions
from engines.precision.build import BuildPlan
from engines.precision.options import BUILTIN_CALIBRATION, Budget, Fp16Options, Int8Options
from engines.preprocess import ImagePreprocess
from engines.spec import ModelSpec, TensorSpec

PRECISIONS = ("fp32", "fp16", "int8")
IMAGE_CLASSIFIER = "image-classifier"
NO_HANDLER = "none"

log = logging.getLogger(__name__)


class DynamicBatching(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    preferred_batch_size: list[Annotated[int, Field(gt=0)]] = Field(default_factory=list)
    """Batch sizes the engine runs best at. A batch is sent as soon as the largest can be
    formed, and on delay expiry it is cut to the largest preferred size reachable."""
    max_queue_delay_us: int = Field(default=2000, ge=0)
    """How long the oldest waiting request may wait for a fuller batch; 0 never waits.
    Higher means bigger batches and more throughput, at the price of latency at low load."""
    max_queue_size: int = Field(default=1024, gt=0)
    """Requests waiting beyond this are refused with 429 instead of queueing without bound."""
    max_queue_rows: int = Field(default=0, ge=0)
    """Rows waiting beyond this are refused with 429 (a request of 32 rows costs 32 of 1);
    0: no bound by rows, only by work (``max_queue_work_s``)."""
    max_queue_work_s: float = Field(default=5.0, ge=0)
    """A request is refused with 429 at once when the work already waiting ahead of it would
    keep the runners busy longer than this (input elements, at the rate of the batches run
    so far), instead of queueing for half a minute; 0: no bound by work. Clients with a
    deadline shorter than this get 504 rather than 429 when the queue is that deep."""
    default_timeout_us: int = Field(default=30_000_000, ge=0)
    """Deadline of a request that does not set ``timeout``; 0 means no deadline."""
    priority_levels: int = Field(default=1, ge=1)
    """Number of priority levels (1 is the highest); requests pick one with ``priority``."""
    default_priority_level: int = Field(default=0, ge=0)
    """Level of a request that sets no priority; 0 means the lowest level."""


def _default_budgets() -> dict[str, Budget]:
    return {
        "fp16": Budget(min_top1_agreement=0.99),
        "int8": Budget(min_top1_agreement=0.98),
    }


class AccuracyConfig(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    budgets: dict[str, Budget] = Field(default_factory=_default_budgets)
    """Per precision, the least a variant must agree with FP32 on held-out rows; a variant
    that misses its budget is refused at build time with a message saying by how much."""
    evaluation_samples: int = Field(default=200, gt=0)
    """Held-out rows each variant is measured on (never used for calibration)."""
    override: bool = False
    """Serve a variant that misses its budget anyway (logged as a warning)."""


class ModelConfig(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    name: str = ""
    """Served name; defaults to the folder name."""
    onnx: str = "model.onnx"
    """The FP32 ONNX source, relative to the model folder (and inside it: no absolute path,
    ``..`` or symlink out of it)."""
    autoload: bool = True
    """Load when the server is not told which models to serve. Off for benchmark-only
    models, which are loaded by naming them."""
    generator: str | None = None
    """A ``zoo`` generator that writes the ONNX (and labels) when the file is missing."""
    backend: str = "auto"
    """``auto``, ``onnxruntime``, ``torch`` or ``tensorrt``."""
    max_batch_size: int = Field(default=0, ge=0)
    """Most rows in one batch; 0 means the model has no batch dimension."""
    runners: int | None = Field(default=None, ge=1)
    """Execution lanes (Triton's ``instance_group.count``). Unset: one on ONNX Runtime (one
    runner with every core beats two that split them), ``RUNNERS_PER_GPU`` per GPU on the GPU
    backends, so that one runner's copies overlap another's compute (both measured:
    BENCHMARKS.md). ``runner_count`` says what a backend gets."""
    gpus: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    """GPUs the runners are placed on, round-robin, with one copy of the weights per GPU and
    one batcher for them all (Triton's ``instance_group.gpus``); empty: GPU 0. GPU backends
    only; give at least as many runners as GPUs."""
    precisions: list[str] = Field(default_factory=lambda: ["fp32"])
    """Precisions to serve, each a version: ``/v2/models/<name>/versions/<precision>``."""
    default_precision: str = "fp32"
    """Precision served by the unversioned path."""
    dynamic_batching: DynamicBatching = Field(default_factory=DynamicBatching)
    fp16: Fp16Options = Field(default_factory=Fp16Options)
    """How the fp16 variant is made."""
    int8: Int8Options = Field(default_factory=Int8Options)
    """How the int8 variant is calibrated and quantized."""
    accuracy: AccuracyConfig = Field(default_factory=AccuracyConfig)
    """What each variant may cost in accuracy."""
    gpu: GpuOptions = Field(default_factory=GpuOptions)
    """GPU backends: compiling the model (torch backend), the share of GPU memory it may take
    and what happens when its max batch does not fit."""
    inputs: list[TensorSpec] | None = None
    """Overrides the inputs read from the ONNX file: name, datatype and the shape of one row
    (without the batch dimension; -1 for a dynamic dimension)."""
    outputs: list[TensorSpec] | None = None
    """Overrides the outputs read from the ONNX file."""
    labels: str | None = None
    """A text file with one class label per line, relative to the model folder (and inside
    it)."""
    preprocess: ImagePreprocess | None = None
    """How ``/infer`` turns an uploaded image into one input row; None: no image uploads.
    Also what INT8 calibration runs its images through."""
    postprocess: Literal["softmax", "none"] = "softmax"
    """How the image classifier turns the first output into probabilities."""
    handler: str | None = None
    """What ``POST /infer`` does with uploads (``app.engine.handlers``): ``image-classifier``,
    ``none`` (V2 tensors only) or a ``package.module:Class`` that ``models.handlers`` lists;
    unset: the image classifier when ``preprocess`` is given, else none."""

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        unknown = [p for p in self.precisions if p not in PRECISIONS]
        if unknown:
            raise ValueError(
                f"precisions {unknown} are not available; this build serves {list(PRECISIONS)}"
            )
        if self.default_precision not in self.precisions:
            raise ValueError(
                f"default_precision {self.default_precision!r} is not among {self.precisions}"
            )
        if len(set(self.gpus)) != len(self.gpus):
            raise ValueError(f"gpus {self.gpus} lists a GPU twice")
        if self.runners is not None and self.runners < len(self.gpus):
            raise ValueError(
                f"{self.runners} runner(s) cannot cover gpus {self.gpus}: "
                "give at least one runner per GPU"
            )
        levels = self.dynamic_batching.priority_levels
        if self.dynamic_batching.default_priority_level > levels:
            raise ValueError("dynamic_batching.default_priority_level exceeds priority_levels")
        too_big = [s for s in self.dynamic_batching.preferred_batch_size if s > self.max_batch_size]
        if too_big:
            raise ValueError(f"preferred_batch_size {too_big} exceeds max_batch_size")
        return self

    def runner_count(self, backend: str) -> int:
        """The runners ``backend`` (a resolved name, not ``auto``) runs this model with."""
        if backend == "auto":
            raise ValueError("runner_count takes a resolved backend, not 'auto'")
        if self.runners is not None:
            return self.runners
        if backend == "torch":  # its runners go round-robin over the model's GPUs
            return RUNNERS_PER_GPU * max(1, len(self.gpus))
        if backend in GPU_BACKENDS:  # TensorRT: every context on one GPU
            return RUNNERS_PER_GPU
        return 1


class ModelEntry(BaseModel):
    """A parsed config with the folder it came from."""

    folder: Path
    config: ModelConfig

    @property
    def onnx_path(self) -> Path:
        return self.folder / self.config.onnx

    def build_plan(self, spec: ModelSpec) -> BuildPlan:
        """What the engine layer needs to build this model's precision variants."""
        config = self.config
        preferred = config.dynamic_batching.preferred_batch_size
        max_batch = max(1, config.max_batch_size)
        image_input = spec.inputs[0]
        return BuildPlan(
            model=config.name,
            source=self.onnx_path,
            folder=self.folder,
            input_name=image_input.name,
            preprocess=(
                config.preprocess.with_datatype(image_input.datatype) if config.preprocess else None
            ),
            profile=(1, max(preferred, default=max_batch), max_batch),
            fp16=config.fp16,
            int8=config.int8,
            budgets=dict(config.accuracy.budgets),
            evaluation_samples=config.accuracy.evaluation_samples,
            override_accuracy=config.accuracy.override,
        )

    def labels(self) -> list[str] | None:
        """The labels file's lines; None where the config names none or it does not exist.
        Only a regular file of at most ``MAX_LABELS_BYTES`` is read, opened without blocking
        (a FIFO would hold the reading thread until someone writes to it). Blocking: call it
        off the event loop."""
        if self.config.labels is None:
            return None
        path = inside(self.folder, self.config.labels, "labels")
        try:
            data = read_regular(path, MAX_LABELS_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as error:
            raise ConfigError(f"labels: cannot be read ({error.strerror or error})") from None
        if len(data) > MAX_LABELS_BYTES:
            raise ConfigError(f"labels: larger than a labels file's {MAX_LABELS_BYTES} bytes")
        try:
            return data.decode("utf-8").splitlines()
        except UnicodeDecodeError:
            raise ConfigError("labels: not UTF-8 text") from None


class _NoAliases(yaml.SafeLoader):  # type: ignore[misc]
    """YAML without anchors' aliases: a few kilobytes of nested aliases expand to billions of
    values for whatever walks them (pydantic does), and no model config needs one."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not accepted", self.peek_event().start_mark
            )
        return super().compose_node(parent, index)


def load_config(folder: Path, rules: ModelRepositorySettings | None = None) -> ModelEntry:
    """The config.yaml of the model in ``folder``, read within ``rules`` (the repository's
    settings; their defaults where None). Blocking: call it off the event loop."""
    rules = rules or ModelRepositorySettings()
    where = f"model '{client_text(folder.name)}': config.yaml"
    try:
        path = inside(folder, "config.yaml", "config.yaml")
        data = read_regular(path, rules.max_config_bytes + 1)
    except OSError as exc:
        log.warning("%s: cannot read %s: %s", where, folder / "config.yaml", exc)
        why = exc.strerror or type(exc).__name__
        raise ConfigError(f"{where}: cannot read it ({why})") from None
    except ConfigError as exc:
        raise ConfigError(f"model '{client_text(folder.name)}': {exc}") from None
    if len(data) > rules.max_config_bytes:
        raise ConfigError(
            f"{where}: larger than {rules.max_config_bytes} bytes (models.max_config_bytes)"
        )
    try:
        loader = _NoAliases(data.decode("utf-8"))  # a SafeLoader: no tags, no aliases
        try:
            raw = loader.get_single_data() or {}
        finally:
            loader.dispose()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply") from None
    return parse_config(folder, raw, where, rules)


def parse_config(
    folder: Path, raw: object, where: str, rules: ModelRepositorySettings | None = None
) -> ModelEntry:
    """A config (as config.yaml or a load request's override holds it) for the model in
    ``folder``, checked against ``rules`` (their defaults where None): its paths inside the
    folder, its handler allowed, its numbers within bounds; ``where`` names it in errors."""
    rules = rules or ModelRepositorySettings()
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping at the top level")
    try:
        config = ModelConfig.model_validate(raw)
    except ValidationError as exc:
        found = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigError(f"{where}: {client_text(found, 600)}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply") from None
    problems = out_of_bounds(config, rules.bounds)
    if config.handler is not None and config.handler not in (
        IMAGE_CLASSIFIER,
        NO_HANDLER,
        *rules.handlers,
    ):
        problems.append(
            f"handler: '{client_text(config.handler)}' is not allowed: give {IMAGE_CLASSIFIER} "
            f"or {NO_HANDLER}, or a package.module:Class that models.handlers lists"
        )
    try:
        inside(folder, config.onnx, "onnx")
        if config.labels is not None:
            inside(folder, config.labels, "labels")
        if config.int8.calibration != BUILTIN_CALIBRATION:
            inside(folder, config.int8.calibration, "int8.calibration")
    except ConfigError as exc:
        problems.append(str(exc))
    if problems:
        raise ConfigError(f"{where}: {'; '.join(problems)}")
    if not config.name:
        config = config.model_copy(update={"name": folder.name})
    return ModelEntry(folder=folder, config=config)


def out_of_bounds(config: ModelConfig, bounds: ConfigBounds) -> list[str]:
    """What ``config`` asks for past ``bounds``, each naming the field and its setting."""
    devices = max(1, len(config.gpus))
    batching = config.dynamic_batching
    asked = [
        ("max_batch_size", config.max_batch_size, bounds.max_batch_size, "max_batch_size"),
        (
            "runners",
            config.runners or 0,
            bounds.max_runners_per_device * devices,
            "max_runners_per_device",
        ),
        (
            "dynamic_batching.max_queue_size",
            batching.max_queue_size,
            bounds.max_queue_size,
            "max_queue_size",
        ),
        (
            "dynamic_batching.priority_levels",
            batching.priority_levels,
            bounds.max_priority_levels,
            "max_priority_levels",
        ),
        (
            "int8.samples + accuracy.evaluation_samples",
            config.int8.samples + config.accuracy.evaluation_samples,
            bounds.max_samples,
            "max_samples",
        ),
    ]
    asked.append(("gpus: GPUs listed", len(config.gpus), bounds.max_gpus, "max_gpus"))
    rows = max(1, config.max_batch_size)
    declared = [*(config.inputs or ()), *(config.outputs or ())]
    if declared:  # each runner holds a max batch of every tensor: their sum is what it costs
        asked.append(
            (
                "inputs and outputs: bytes of a max batch of them all",
                rows
                * sum(
                    math.prod(max(1, d) for d in tensor.shape) * tensor.dtype.itemsize
                    for tensor in declared
                ),
                bounds.max_batch_bytes,
                "max_batch_bytes",
            )
        )
    if config.preprocess is not None:
        prep, side = config.preprocess, bounds.max_image_side
        asked.append(("preprocess.resize_shorter", prep.resize_shorter, side, "max_image_side"))
        asked.append(("preprocess.crop", prep.crop, side, "max_image_side"))
        row = math.prod(prep.row_shape()) * 4
        asked.append(
            (
                "preprocess: bytes of a max batch",
                rows * row,
                bounds.max_batch_bytes,
                "max_batch_bytes",
            )
        )
    return [
        f"{field}: {value} is more than {limit} (models.bounds.{setting})"
        for field, value, limit, setting in asked
        if value > limit
    ]


def discover(
    repository: Path, names: list[str], rules: ModelRepositorySettings | None = None
) -> list[ModelEntry]:
    """The models to serve: the named folders, or every folder whose config autoloads."""
    if not repository.is_dir():
        raise ConfigError(f"model repository {repository} does not exist")
    if names:
        folders = []
        for name in names:
            folder = model_folder(repository, name)
            if folder is None:
                raise ConfigError(f"model {name!r}: no {repository}/{name}/config.yaml")
            folders.append(folder)
    else:
        folders = sorted(p.parent for p in repository.glob("*/config.yaml"))
    for folder in folders:
        check_folder(repository, folder)
    entries = [load_config(folder, rules) for folder in folders]
    if not names:
        entries = [e for e in entries if e.config.autoload]
    if not entries:
        raise ConfigError(f"model repository {repository} has no <model>/config.yaml to load")
    return entries
