"""The converted graph compiled ahead of time by AOTInductor: one package for every batch
bucket and every runner, kept in the engine store.

``torch.export`` traces the module once with the batch dimension symbolic (1 to the max
batch), and AOTInductor compiles that one graph into a package (``.pt2``: a shared library of
Inductor's fused Triton kernels and cuDNN/cuBLAS calls, with its own copy of the weights),
tuned at the max batch. The package is written to the engine store under a key of model,
precision, GPU, torch and Triton versions, max batch and mode. Every runner on every GPU of
that name loads the same package, and a start that finds it loads it and compiles nothing:
no tracing, no code generation, no autotuning. The runner captures the package's call in its
own CUDA graph per bucket; for that the package is loaded single-threaded (without the
stream synchronisation of its own that a capture forbids), its calls outside a graph made one
at a time (the runners' capture lock). Eager runners (``cuda_graphs`` off), which call it side
by side, get it with that synchronisation.

A package that verifies (manifest, checksum) but does not load is refused: discarded and
compiled again, once.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engines.devices.options import CompileMode
from engines.store import EngineKey, EngineStore, StoredEngine, sha256_file

log = logging.getLogger(__name__)

SUFFIX = ".pt2"

# Inductor's options per mode (its own CUDA graphs are never made: the runner captures the
# package's call in graphs of its own). ``cpp.vec_isa_ok`` takes the CPU's vector
# instruction set from its flags rather than by compiling test programs for each (about a
# minute on a fresh machine), and the host code that launches the kernels is compiled
# unoptimised (``O0``: seconds less): the runners replay CUDA graphs of it, so its own speed
# never counts.
_HOST = {"cpp.vec_isa_ok": True, "aot_inductor.compile_wrapper_opt_level": "O0"}
INDUCTOR_CONFIGS: dict[str, dict[str, Any]] = {
    "default": _HOST,
    "max-autotune": {**_HOST, "max_autotune": True},
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


def package_key(
    source: Path,
    model: str,
    precision: str,
    mode: CompileMode,
    device: torch.device,
    max_batch: int,
    options: dict[str, Any],
) -> EngineKey:
    """The store key of a model's package: one for all of its buckets (the batch is
    symbolic up to ``max_batch``; 0: an unbatched model)."""
    return EngineKey(
        model=model,
        model_hash=sha256_file(source),
        precision=precision,
        backend="torch",
        backend_version=versions(),
        device=device_name(device),
        profile=(max_batch,),
        options={"mode": mode, **options},
        kind="aoti",
    )


def compile_package(
    module: torch.nn.Module,
    example: Callable[[], tuple[torch.Tensor, ...]],
    mode: CompileMode,
    path: Path,
    max_batch: int,
) -> None:
    """``module`` exported with the first dimension of ``example()``'s inputs (``max_batch``
    rows) symbolic from 1 to ``max_batch``, and compiled into a package written to ``path``.
    A max batch of 1, or 0 (an unbatched model), keeps every dimension static."""
    with torch.no_grad():
        inputs = example()
        dynamic = None
        if max_batch > 1:
            batch = torch.export.Dim("batch", min=1, max=max_batch)
            dynamic = (tuple({0: batch} for _ in inputs),)
        program = torch.export.export(module, inputs, dynamic_shapes=dynamic, strict=False)
        # AOTInductor names its packages ``*.pt2``; the store's temporary file is not.
        with tempfile.TemporaryDirectory(dir=path.parent) as folder:
            package = Path(folder) / "model.pt2"
            torch._inductor.aoti_compile_and_package(
                program, package_path=str(package), inductor_configs=INDUCTOR_CONFIGS[mode]
            )
            os.replace(package, path)


class Package:
    """A loaded package, called as the module is (its tensors in, a tuple of tensors out)."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self._loader.boxed_run(list(inputs)))


def load_package(path: Path, device: torch.device, single_threaded: bool) -> Package:
    """The package at ``path`` loaded onto ``device``, ready to call.

    AOTInductor's own loader (``aoti_load_package``) first compares the machine with the one
    that compiled it, and that comparison picks the CPU's vector instruction set by compiling
    test programs into Inductor's cache: 67-70 s a start on a fresh H200 machine
    (BENCHMARKS.md, "Start in seconds"); its Python wrapper also imports ``torch.export``'s
    archive code (seconds more). The store's key already holds the GPU and the versions, and
    the module's inputs and outputs are flat tuples of tensors, so the C++ loader underneath
    is called directly."""
    index = device.index if device.type == "cuda" and device.index is not None else -1
    return Package(
        torch._C._aoti.AOTIModelPackageLoader(str(path), "model", single_threaded, 1, index)
    )


def load_or_compile(
    store: EngineStore | None,
    key: EngineKey,
    module: torch.nn.Module,
    example: Callable[[], tuple[torch.Tensor, ...]],
    device: torch.device,
    single_threaded: bool = True,
) -> Package:
    """The package of ``key`` from the store, compiled (once, for every process sharing the
    store) where it is missing, foreign or corrupt; refused and compiled again where it
    verifies but does not load. Without a store it is compiled in a temporary folder.
    ``example`` makes the inputs it is traced and tuned with, only where it is compiled."""
    mode: CompileMode = key.options["mode"]

    def build(path: Path) -> dict[str, Any]:
        started = time.perf_counter()
        log.info("%s: compiling for batches of 1 to %d (AOTInductor, %s); once per GPU model",
                 key.model, key.profile[0], mode)  # fmt: skip
        compile_package(module, example, mode, path, key.profile[0])
        log.info("%s: compiled in %.1f s (%.1f MB)", key.model, time.perf_counter() - started,
                 path.stat().st_size / 1e6)  # fmt: skip
        return {"artifact": "AOTInductor package", "torch": versions()}

    if store is None:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "model.pt2"
            build(path)
            return load_package(path, device, single_threaded)
    try:
        return _loaded(store, key, store.get_or_build(key, build, SUFFIX), device, single_threaded)
    except Exception as error:  # refused (discarded): compiled again, once
        log.warning("%s: %s; compiling it again", key.model, error)
    return _loaded(store, key, store.get_or_build(key, build, SUFFIX), device, single_threaded)


def _loaded(
    store: EngineStore, key: EngineKey, stored: StoredEngine, device: torch.device, single: bool
) -> Package:
    """The stored package loaded; discarded from the store where it does not load."""
    started = time.perf_counter()
    try:
        loaded = load_package(stored.path, device, single)
    except Exception as error:
        why = f"the compiled package did not load ({type(error).__name__}: {error})"
        store.discard(key, SUFFIX, why)
        raise RuntimeError(why) from error
    seconds = time.perf_counter() - started
    store.phases.add(key.model, "load", seconds)
    log.info("%s: compiled package loaded from the engine store (%.1f MB, %.1f s)",
             key.model, stored.path.stat().st_size / 1e6, seconds)  # fmt: skip
    return loaded
