"""The converted graph compiled by ``torch.compile``, its artefacts kept in the engine store.

Dynamo traces the module once per batch bucket (``dynamic=False``: each bucket's kernels are
generated and tuned for its shape), and Inductor fuses what the op-by-op conversion leaves as
separate kernels (bias, residual add and activation after each convolution) into Triton
kernels. The runner then captures the compiled call in its own CUDA graph, as it does the
plain module, so Inductor's own graphs are never used (``max-autotune`` is Inductor's
``max-autotune-no-cudagraphs``).

Compiling costs seconds per bucket (``default``) to minutes (``max-autotune`` times
Triton's templates against cuDNN). What it produced (Inductor's FX-graph, AOTAutograd and
autotuning caches and the Triton kernels: torch's "mega-cache") is saved as one file in the
engine store once the first runner has every bucket, keyed by the model, precision, GPU,
torch and Triton versions, buckets and mode; the next start loads it before compiling, so
Dynamo still traces (about a second per bucket) but nothing is generated or timed again.
"""

from __future__ import annotations

import importlib.metadata
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from engines.devices.options import CompileMode
from engines.store import EngineKey, EngineStore, sha256_file

log = logging.getLogger(__name__)

SUFFIX = ".inductor"

# The runner captures its own CUDA graphs, so Inductor must not capture its own inside them.
INDUCTOR_MODES: dict[str, str] = {
    "default": "default",
    "max-autotune": "max-autotune-no-cudagraphs",
}


def versions() -> str:
    """torch's and Triton's versions: what generated code depends on."""
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = "none"
    return f"torch {torch.__version__} triton {triton}"


def device_name(device: torch.device) -> str:
    """The GPU's name and compute capability (generated kernels are tuned for both)."""
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"


def artifact_key(
    source: Path,
    model: str,
    precision: str,
    mode: CompileMode,
    device: torch.device,
    buckets: Sequence[int],
    options: dict[str, Any],
) -> EngineKey:
    return EngineKey(
        model=model,
        model_hash=sha256_file(source),
        precision=precision,
        backend="torch",
        backend_version=versions(),
        device=device_name(device),
        profile=tuple(buckets),
        options={"mode": mode, **options},
        kind="inductor",
    )


def compile_module(module: torch.nn.Module, mode: CompileMode, buckets: int) -> Callable[..., Any]:
    """``module`` compiled whole (a graph break would be an error), one graph per shape."""
    # Each bucket is a recompilation of the same code, and every converted model (each
    # precision, each GPU's copy) runs the same ``OnnxModule.forward``: Dynamo counts them
    # all against one limit per code object (8 by default), past which it refuses to
    # compile. Each engine adds its buckets.
    config = torch._dynamo.config
    config.recompile_limit += buckets
    config.accumulated_recompile_limit = max(
        config.accumulated_recompile_limit, config.recompile_limit
    )
    compiled: Callable[..., Any] = torch.compile(
        module, mode=INDUCTOR_MODES[mode], fullgraph=True, dynamic=False
    )
    return compiled


def load_artifacts(store: EngineStore | None, key: EngineKey) -> bool:
    """Whether the store had this key's artefacts; they are then loaded into torch's caches
    so the compiles that follow find their kernels instead of generating them."""
    if store is None:
        return False
    found = store.load(key, SUFFIX)
    if found is None:
        return False
    started = time.perf_counter()
    try:
        torch.compiler.load_cache_artifacts(found.path.read_bytes())
    except Exception as error:  # compiling again costs minutes; refusing the model costs it
        log.warning("%s: the stored compiled kernels did not load (%s: %s); compiling",
                    key.model, type(error).__name__, error)  # fmt: skip
        return False
    log.info(
        "%s: compiled kernels loaded from the engine store (%.1f MB, %.1f s)",
        key.model,
        found.path.stat().st_size / 1e6,
        time.perf_counter() - started,
    )
    return True


def save_artifacts(store: EngineStore | None, key: EngineKey) -> bool:
    """Save what torch compiled in this process so far under ``key``; whether it did."""
    if store is None:
        return False
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return False
    # What torch compiled in this process so far: other models' kernels too, which then
    # load with this one's (harmless, a larger file).
    data, _ = saved

    def write(path: Path) -> dict[str, Any]:
        path.write_bytes(data)
        return {"artifact": "torch mega-cache", "bytes": len(data)}

    try:
        stored = store.get_or_build(key, write, SUFFIX)
    except OSError as error:  # a full disk costs the next start a compile, not this one
        log.warning("%s: the compiled kernels could not be stored: %s", key.model, error)
        return False
    log.info("%s: compiled kernels saved in the engine store: %s", key.model, stored.path)
    return True
