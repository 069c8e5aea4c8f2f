"""Which TensorRT this is, and the GPU it builds for.

The two TensorRTs with one API: TensorRT proper (10+, NVIDIA's container) and TensorRT for
RTX (1.x, from PyPI), which builds without a GPU, is always strongly typed and compiles its
plans just in time on the GPU at load: compute capability 8.0, 8.6, 8.9 and 12.x only.
``tensorrt_module`` picks the one installed; ``Target`` is what a plan is built for; the
logger, dims and parser errors are the small pieces every caller of TensorRT needs.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import tensorrt as trt


# The device of a TensorRT for RTX plan: specialised for the GPU only when it loads.
JIT_DEVICE = "any supported GPU (JIT at load)"


RTX_RUNS_ON = "compute capability 8.0, 8.6, 8.9 and 12.x"


Shape = tuple[int, ...]


class TensorRTUnavailable(RuntimeError):
    """TensorRT cannot be imported here (or what imports is not TensorRT 10 or later)."""


@dataclass(frozen=True)
class Target:
    """What a plan is built for and only valid on: a TensorRT version and a GPU."""

    tensorrt_version: str
    device_name: str
    compute_capability: tuple[int, int]

    @property
    def jit(self) -> bool:
        """A TensorRT for RTX plan: built for no GPU, specialised on the one it loads on, and
        with no tactic timings (nothing to time them on)."""
        return self.device_name == JIT_DEVICE

    def device_key(self, hardware_compatibility: str = "none") -> str:
        if self.jit:
            return JIT_DEVICE
        major, minor = self.compute_capability
        if hardware_compatibility == "ampere_plus":
            return "hardware-compatible:ampere_plus"
        if hardware_compatibility == "same_compute_capability":
            return f"hardware-compatible:sm_{major}{minor}"
        return f"{self.device_name} sm_{major}{minor}"


def current_target(device: int | None) -> Target:
    """The TensorRT in use and the GPU ``device``. TensorRT for RTX compiles its plans for
    the GPU when they load, so its plans are keyed by no GPU and can be built without one
    (``device`` None); on a GPU it does not run on it refuses, saying why."""
    if TYPE_CHECKING:  # the stubs' API, whichever TensorRT runs
        import tensorrt as trt
    else:
        trt = tensorrt_module()
    version = require_tensorrt()
    if flavour(trt) == TENSORRT_RTX:
        if device is not None:
            from engines.devices import cuda

            name, capability = cuda.device_properties(device)
            if not rtx_runs_on(capability):
                major, minor = capability
                raise TensorRTUnavailable(
                    f"TensorRT for RTX does not run on {name} (compute capability "
                    f"{major}.{minor}; it runs on {RTX_RUNS_ON}), and TensorRT proper is not "
                    "installed"
                )
        return Target(version, JIT_DEVICE, (0, 0))
    if device is None:
        raise TensorRTUnavailable("TensorRT proper builds for a GPU, and none was given")
    from engines.devices import cuda

    name, capability = cuda.device_properties(device)
    return Target(version, name, capability)


_LOG_LEVELS = {
    "INTERNAL_ERROR": logging.CRITICAL,
    "ERROR": logging.ERROR,
    "WARNING": logging.WARNING,
    # TensorRT's INFO is a running commentary of the build; keep it for debugging.
    "INFO": logging.DEBUG,
    "VERBOSE": logging.DEBUG,
}


_logger: trt.ILogger | None = None


_logger_lock = threading.Lock()


def tensorrt_logger() -> trt.ILogger:
    """One logger for every builder and runtime of the process, forwarding TensorRT's
    messages to Python logging (it must outlive them all, so it is never freed)."""
    global _logger
    if TYPE_CHECKING:  # the stubs' API, whichever TensorRT runs
        import tensorrt as trt
    else:
        trt = tensorrt_module()

    with _logger_lock:
        if _logger is None:

            class Logger(trt.ILogger):
                def __init__(self) -> None:
                    trt.ILogger.__init__(self)

                def log(self, severity: trt.ILogger.Severity, msg: str) -> None:
                    level = _LOG_LEVELS.get(severity.name, logging.WARNING)
                    if log.isEnabledFor(level):
                        log.log(level, "TensorRT: %s", msg)

            _logger = Logger()
        return _logger


# The two TensorRTs with one API: TensorRT proper (10+, NVIDIA's container) and TensorRT for
# RTX (1.x, from PyPI), which builds without a GPU, is always strongly typed and compiles its
# plans just in time on the GPU at load: compute capability 8.0, 8.6, 8.9 and 12.x only.
TENSORRT = "tensorrt"


TENSORRT_RTX = "tensorrt-rtx"


_MODULES = {TENSORRT: "tensorrt", TENSORRT_RTX: "tensorrt_rtx_bindings"}


_MINIMUM_MAJOR = {TENSORRT: 10, TENSORRT_RTX: 1}


RTX_COMPUTE_CAPABILITIES = ((8, 0), (8, 6), (8, 9))


def rtx_runs_on(capability: tuple[int, int]) -> bool:
    return capability in RTX_COMPUTE_CAPABILITIES or capability[0] == 12


def tensorrt_module() -> Any:
    """The TensorRT module this process uses: TensorRT proper where it imports, else
    TensorRT for RTX; ``TensorRTUnavailable`` saying how to get one if neither does."""
    import importlib

    problems = []
    for flavour, name in _MODULES.items():
        try:
            module = importlib.import_module(name)
        except Exception as error:  # ImportError, or OSError for a missing library
            problems.append(f"{name}: {error}")
            continue
        version = getattr(module, "__version__", None)
        if not isinstance(version, str) or not hasattr(module, "Builder"):
            problems.append(f"the `{name}` module here is not TensorRT (a stubs-only package?)")
            continue
        major = version.split(".", 1)[0]
        if not major.isdigit() or int(major) < _MINIMUM_MAJOR[flavour]:
            problems.append(f"{flavour} {version} is too old")
            continue
        return module
    raise TensorRTUnavailable(
        f"TensorRT is not installed ({'; '.join(problems)}); run in NVIDIA's TensorRT "
        "container (docker build --target gpu), `pip install 'stoker[tensorrt]'` on a machine "
        "that reaches NVIDIA's index, or `pip install 'stoker[tensorrt-rtx]'` (TensorRT for "
        f"RTX: builds anywhere, runs on {RTX_RUNS_ON}); or use backend: torch or onnxruntime"
    )


def flavour(module: Any) -> str:
    """``tensorrt`` or ``tensorrt-rtx``: which TensorRT ``module`` is."""
    return TENSORRT_RTX if module.__name__.startswith("tensorrt_rtx") else TENSORRT


def require_tensorrt() -> str:
    """``<flavour> <version>`` of the TensorRT in use (``tensorrt 10.13.0``, ``tensorrt-rtx
    1.7.1.116``); ``TensorRTUnavailable`` if there is none."""
    module = tensorrt_module()
    return f"{flavour(module)} {module.__version__}"


def importable() -> bool:
    """Whether a real TensorRT (10+, or TensorRT for RTX) imports here."""
    try:
        require_tensorrt()
    except TensorRTUnavailable:
        return False
    return True


def dims(value: Any) -> Shape:
    """A plain shape from TensorRT's ``Dims`` (or any sequence of ints)."""
    return tuple(int(value[i]) for i in range(len(value)))


def network_flags() -> int:
    """``create_network`` flags: strongly typed (required on 10.x, the only kind on 11 and on
    TensorRT for RTX, which still accept the flag)."""
    if TYPE_CHECKING:  # the stubs' API, whichever TensorRT runs
        import tensorrt as trt
    else:
        trt = tensorrt_module()

    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 0 if flag is None else 1 << int(flag)


def parser_errors(parser: trt.OnnxParser) -> list[str]:
    """Every error of the ONNX parser, with the node it concerns where there is one."""
    messages = []
    for index in range(parser.num_errors):
        error = parser.get_error(index)
        node = error.node()
        where = ""
        if node >= 0:
            where = f"node {node} ({error.node_operator()} {error.node_name()!r}): "
        messages.append(where + error.desc())
    return messages
