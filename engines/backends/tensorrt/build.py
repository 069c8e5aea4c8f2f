"""Building a TensorRT plan from a precision variant's ONNX, kept in the engine store.

A precision is a property of the ONNX graph (``engines.precision.build``), so the network is
created strongly typed: TensorRT runs every tensor in the type the graph gives it (FP16 where
the variant casts to FP16, INT8 between its symmetric Q/DQ pairs) and needs none of the
precision flags and INT8 calibrators that TensorRT 10.12 deprecated and 11 removed. The
strongly typed flag is required on 10.x; 11 makes every network strongly typed and still
accepts the flag, which is passed whenever the installed TensorRT has it.

One optimization profile covers the inputs: the batch dimension from the batching config
(min 1, opt the largest preferred size, max the max batch size), every other dimension fixed
at the ONNX file's value or, where the file leaves it dynamic, the model config's. The plan
is kept in the engine store under everything it is valid for: TensorRT's version, the GPU's
name and compute capability (or the hardware-compatibility level), the variant's content,
the profile and the build options. The builder's timing cache is kept there too, per
TensorRT version and GPU, so a later build (another precision or model, a changed profile)
reuses the tactic timings already measured.

``tensorrt`` is imported inside the functions that call it: profile derivation, store keys
and error formatting are plain Python, unit-tested on machines without TensorRT.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engines.backends.tensorrt.profile import (
    ProfileShapes,
    batch_profile,
    profile_shapes,
    read_onnx,
)
from engines.backends.tensorrt.runtime import (
    TENSORRT_RTX,
    Shape,
    Target,
    current_target,
    dims,
    flavour,
    network_flags,
    parser_errors,
    require_tensorrt,
    tensorrt_logger,
    tensorrt_module,
)
from engines.base import EngineOptions
from engines.spec import ModelSpec
from engines.store import EngineKey, EngineStore, sha256_file

if TYPE_CHECKING:
    import tensorrt as trt


log = logging.getLogger(__name__)


BACKEND = "tensorrt"


HARDWARE_COMPATIBILITY = ("none", "ampere_plus", "same_compute_capability")


PLAN_SUFFIX = ".plan"


"""What TensorRT for RTX runs plans on (A100, RTX 30/40/50, RTX PRO; not the H200's 9.0)."""


TIMING_CACHE_SUFFIX = ".cache"


class BuildError(RuntimeError):
    """TensorRT could not parse or build the model; the message says where and why."""


@dataclass(frozen=True)
class TensorRTOptions:
    """What the TensorRT backend takes beyond ``EngineOptions``; every field that changes the
    plan is part of its store key.

    ``workspace_bytes`` caps the builder's scratch memory (the WORKSPACE pool): tactics that
    need more are not considered, and the plan may use up to this much at run time.
    ``optimization_level`` is the builder's 0-5 (TensorRT's default 3): higher builds longer
    and may find faster kernels. ``version_compatible`` embeds the lean runtime so later
    TensorRT releases of the same major version load the plan, at some cost in tactics.
    ``hardware_compatibility`` is ``none`` (this GPU's architecture), ``ampere_plus`` or
    ``same_compute_capability``; such a plan is keyed by that level instead of the GPU's
    name, so nodes with different GPUs sharing a store build it once. ``timing_cache`` loads
    and saves the builder's timing cache in the store. ``cuda_graphs`` captures each batch
    size's enqueue into a CUDA graph on first use and replays it (fewer launches for small
    batches). ``device`` is the GPU that builds and runs the plan.
    """

    workspace_bytes: int = 4 << 30
    optimization_level: int = 3
    version_compatible: bool = False
    hardware_compatibility: str = "none"
    timing_cache: bool = True
    cuda_graphs: bool = False
    device: int = 0

    def __post_init__(self) -> None:
        if self.workspace_bytes <= 0:
            raise ValueError("workspace_bytes must be positive")
        if not 0 <= self.optimization_level <= 5:
            raise ValueError("optimization_level must be between 0 and 5")
        if self.hardware_compatibility not in HARDWARE_COMPATIBILITY:
            raise ValueError(
                f"hardware_compatibility {self.hardware_compatibility!r}: one of "
                f"{', '.join(HARDWARE_COMPATIBILITY)}"
            )

    def build_options(self) -> dict[str, Any]:
        """The options that change the plan, as they go into its store key."""
        return {
            "strongly_typed": True,
            "workspace_bytes": self.workspace_bytes,
            "optimization_level": self.optimization_level,
            "version_compatible": self.version_compatible,
            "hardware_compatibility": self.hardware_compatibility,
        }


def plan_key(
    spec: ModelSpec,
    model_hash: str,
    precision: str,
    target: Target,
    rows: tuple[int, int, int],
    shapes: ProfileShapes,
    options: TensorRTOptions,
) -> EngineKey:
    """Everything a plan is valid for; a plan under any other key is never loaded."""
    return EngineKey(
        model=spec.name,
        model_hash=model_hash,
        precision=precision,
        backend=BACKEND,
        backend_version=target.tensorrt_version,
        device=target.device_key(options.hardware_compatibility),
        profile=rows,
        options={
            "shapes": {name: [list(s) for s in triple] for name, triple in sorted(shapes.items())},
            **options.build_options(),
        },
    )


def timing_cache_key(target: Target, generation: int) -> EngineKey:
    """One generation of the timing cache of a TensorRT version on a GPU. Tactic timings
    are measured on the GPU itself, so the key is the GPU even for hardware-compatible
    plans."""
    return EngineKey(
        model="tensorrt-timing-cache",
        model_hash="",
        precision="any",
        backend=BACKEND,
        backend_version=target.tensorrt_version,
        device=target.device_key(),
        options={"generation": generation},
        kind="timing-cache",
    )


def load_timing_cache(store: EngineStore, target: Target) -> tuple[int, bytes]:
    """The newest timing cache in the store: (its generation, its bytes), (0, b"") if none.

    Store entries are immutable, so a cache that a build extended is stored as the next
    generation; one that does not verify (a write in progress, a corrupt file) is passed over
    for the one before it.
    """
    generation = 0
    while store.path_for(timing_cache_key(target, generation + 1), TIMING_CACHE_SUFFIX).exists():
        generation += 1
    while generation > 0:
        try:
            stored = store.load(timing_cache_key(target, generation), TIMING_CACHE_SUFFIX)
            if stored is not None:
                return generation, stored.path.read_bytes()
        except OSError:
            pass
        generation -= 1
    return 0, b""


def save_timing_cache(store: EngineStore, target: Target, generation: int, data: bytes) -> None:
    """Store ``data`` as ``generation``; if another build stored that generation first, its
    cache stands and these timings are measured again by a later build."""

    def write(path: Path) -> dict[str, int]:
        path.write_bytes(data)
        return {"bytes": len(data)}

    store.get_or_build(timing_cache_key(target, generation), write, TIMING_CACHE_SUFFIX)


"""And every 12.x: what TensorRT for RTX runs on (the H200's 9.0 is not among them)."""


def progress_monitor(label: str, every_s: float = 10.0) -> trt.IProgressMonitor:
    """Build progress in the log: each top-level phase as it starts and ends, and its steps at
    most every ``every_s`` seconds. It never cancels the build."""
    if TYPE_CHECKING:  # the stubs' API, whichever TensorRT runs
        import tensorrt as trt
    else:
        trt = tensorrt_module()

    class Progress(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self._lock = threading.Lock()
            self._phases: dict[str, tuple[int, float, float, bool]] = {}

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            now = time.monotonic()
            top = parent_phase is None
            with self._lock:
                self._phases[phase_name] = (num_steps, now, now, top)
            if top:
                log.info("%s: %s (%d steps)", label, phase_name, num_steps)

        def step_complete(self, phase_name: str, step: int) -> bool:
            now = time.monotonic()
            with self._lock:
                entry = self._phases.get(phase_name)
                if entry is None:
                    return True
                steps, started, reported, top = entry
                due = now - reported >= every_s
                if due:
                    self._phases[phase_name] = (steps, started, now, top)
            if due:
                log.info("%s: %s %d/%d", label, phase_name, step + 1, steps)
            return True

        def phase_finish(self, phase_name: str) -> None:
            with self._lock:
                entry = self._phases.pop(phase_name, None)
            if entry is not None and entry[3]:
                log.info("%s: %s done in %.1f s", label, phase_name, time.monotonic() - entry[1])

    return Progress()


def _use_timing_cache(config: trt.IBuilderConfig, data: bytes, label: str) -> None:
    try:
        cache = config.create_timing_cache(data)
        accepted = cache is not None and config.set_timing_cache(cache, ignore_mismatch=False)
    except Exception as error:  # a corrupt blob: TensorRT may raise rather than refuse
        log.debug("%s: timing cache refused: %s", label, error)
        accepted = False
    if not accepted:
        if data:
            log.warning("%s: the stored timing cache does not fit; starting a new one", label)
        config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)


def parse_network(
    onnx_path: Path, context: str = ""
) -> tuple[trt.Builder, trt.INetworkDefinition, trt.OnnxParser]:
    """(builder, network, parser) of ``onnx_path`` parsed strongly typed; the network lives
    as long as the three do. ``BuildError`` naming each node the parser refused."""
    if TYPE_CHECKING:  # the stubs' API, whichever TensorRT runs
        import tensorrt as trt
    else:
        trt = tensorrt_module()

    logger = tensorrt_logger()
    builder = trt.Builder(logger)
    network = builder.create_network(network_flags())
    parser = trt.OnnxParser(network, logger)
    # From the file, not from bytes: weights stored beside the model (external data) load too.
    if not parser.parse_from_file(str(onnx_path)):
        errors = parser_errors(parser) or ["no error reported"]
        raise BuildError(
            f"{context}TensorRT's ONNX parser refused {onnx_path.name}: {'; '.join(errors)}"
        )
    return builder, network, parser


def build_plan(
    onnx_path: Path,
    spec: ModelSpec,
    shapes: ProfileShapes,
    options: TensorRTOptions,
    timing_cache: bytes | None,
    label: str,
) -> tuple[bytes, bytes]:
    """Parse the ONNX file into a strongly typed network and build it: (serialized plan,
    serialized timing cache, empty when ``timing_cache`` is None: no cache is used).
    ``BuildError`` with the parser's errors, or pointing at TensorRT's logged messages, if it
    cannot."""
    if TYPE_CHECKING:  # the stubs' API, whichever TensorRT runs
        import tensorrt as trt
    else:
        trt = tensorrt_module()

    builder, network, _parser = parse_network(onnx_path, f"{label}: ")
    outputs = {network.get_output(i).name for i in range(network.num_outputs)}
    missing = [t.name for t in spec.outputs if t.name not in outputs]
    if missing:
        raise BuildError(f"{label}: outputs {missing} are not outputs of the parsed network")
    dynamic = {
        tensor.name
        for tensor in (network.get_input(i) for i in range(network.num_inputs))
        if -1 in dims(tensor.shape)
    }
    if dynamic - set(shapes):
        raise BuildError(f"{label}: inputs {sorted(dynamic - set(shapes))} have no profile")

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_bytes)
    config.builder_optimization_level = options.optimization_level
    if options.version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    if options.hardware_compatibility != "none":
        config.hardware_compatibility_level = getattr(
            trt.HardwareCompatibilityLevel, options.hardware_compatibility.upper()
        )
    if shapes:
        profile = builder.create_optimization_profile()
        for name, (low, opt, high) in shapes.items():
            profile.set_shape(name, trt.Dims(list(low)), trt.Dims(list(opt)), trt.Dims(list(high)))
        if config.add_optimization_profile(profile) < 0:
            raise BuildError(f"{label}: TensorRT refused the optimization profile {shapes}")
    if timing_cache is not None:
        _use_timing_cache(config, timing_cache, label)
    # TensorRT calls the monitor until the build returns; the local keeps it alive that long.
    monitor = progress_monitor(label)
    config.progress_monitor = monitor

    started = time.perf_counter()
    log.info("%s: building a %s plan", label, require_tensorrt())
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise BuildError(
            f"{label}: TensorRT could not build the plan; its errors are logged above "
            f"(logger {__name__})"
        )
    log.info("%s: built in %.1f s", label, time.perf_counter() - started)
    if timing_cache is None:
        return bytes(plan), b""
    return bytes(plan), bytes(config.get_timing_cache().serialize())


def ensure_plan(
    variant: Path,
    spec: ModelSpec,
    engine_options: EngineOptions,
    options: TensorRTOptions,
    target: Target,
) -> bytes:
    """The serialized plan of ``variant`` for ``target``: from the store, else built (once
    across processes sharing the store) and stored. Without a store it is built in memory."""
    network_inputs, graph_precision = read_onnx(variant)
    precision = engine_options.precision or graph_precision
    label = f"{spec.name} {precision}"
    rows = batch_profile(spec, engine_options.profile)
    shapes = profile_shapes(spec, rows, network_inputs)
    store = engine_options.store
    if store is None:
        log.info("%s: no engine store, so the plan is built in memory and not kept", label)
        fresh_cache = None if target.jit else b""
        plan, _ = build_plan(variant, spec, shapes, options, fresh_cache, label)
        return plan
    key = plan_key(spec, sha256_file(variant), precision, target, rows, shapes, options)

    # Tactics are timed on the GPU; a TensorRT for RTX plan built without one times nothing.
    timed = options.timing_cache and not target.jit

    def build(path: Path) -> dict[str, Any]:
        generation, cache = (0, b"")
        if timed:
            generation, cache = load_timing_cache(store, target)
        plan, new_cache = build_plan(
            variant, spec, shapes, options, cache if timed else None, label
        )
        path.write_bytes(plan)
        if timed and new_cache != cache:
            generation += 1
            save_timing_cache(store, target, generation, new_cache)
        return {
            "tensorrt": target.tensorrt_version,
            "device": target.device_name,
            "compute_capability": list(target.compute_capability),
            "timing_cache_generation": generation,
        }

    return store.get_or_build(key, build, PLAN_SUFFIX).path.read_bytes()


def prebuild_plan(
    variant: Path, spec: ModelSpec, engine_options: EngineOptions, options: TensorRTOptions
) -> Target:
    """Build (or find) the plan of ``variant`` in the store ahead of serving, as ``stoker
    build`` does in an image or an init container: for the GPU ``options.device`` with
    TensorRT proper; with TensorRT for RTX for no GPU at all (none is needed: the plan is
    specialised for the GPU when it loads). Returns what the plan was built for."""
    rtx = flavour(tensorrt_module()) == TENSORRT_RTX
    target = current_target(None if rtx else options.device)
    ensure_plan(variant, spec, engine_options, options, target)
    return target


@dataclass(frozen=True)
class NetworkSummary:
    """What TensorRT's parser made of a variant: the network a plan is built from."""

    inputs: tuple[tuple[str, str, Shape], ...]
    """(name, TensorRT dtype, shape) of each input, -1 for a dynamic dimension."""
    outputs: tuple[tuple[str, str, Shape], ...]
    layers: Mapping[str, int]
    """Layers by type (``CONVOLUTION``, ``QUANTIZE``, ``DEQUANTIZE``...)."""
    tensor_types: Mapping[str, int]
    """Layer outputs by dtype (``FLOAT``, ``HALF``, ``INT8``...): the precision it runs in."""

    def describe(self) -> str:
        kinds = ", ".join(f"{n} {t.lower()}" for t, n in sorted(self.layers.items()) if n > 4)
        types = ", ".join(f"{t} {n}" for t, n in sorted(self.tensor_types.items()))
        return f"{sum(self.layers.values())} layers ({kinds}); tensors by type: {types}"


def describe_network(onnx_path: Path) -> NetworkSummary:
    """Parse ``onnx_path`` strongly typed, as ``build_plan`` does, and summarise the network;
    ``BuildError`` naming the nodes the parser refused."""
    from collections import Counter

    _builder, network, _parser = parse_network(onnx_path)

    def io(tensors: Any) -> tuple[tuple[str, str, Shape], ...]:
        return tuple((t.name, t.dtype.name, dims(t.shape)) for t in tensors)

    layers = [network.get_layer(i) for i in range(network.num_layers)]
    return NetworkSummary(
        inputs=io(network.get_input(i) for i in range(network.num_inputs)),
        outputs=io(network.get_output(i) for i in range(network.num_outputs)),
        layers=dict(Counter(layer.type.name for layer in layers)),
        tensor_types=dict(
            Counter(
                layer.get_output(j).dtype.name for layer in layers for j in range(layer.num_outputs)
            )
        ),
    )
