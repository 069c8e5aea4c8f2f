"""The two nouns of the engine layer.

An ``Engine`` holds a model's loaded weights and is shared; a ``Runner`` is one execution
lane (a session, or a context + stream + buffers) owned by one thread at a time. Backends
are plain modules exposing ``load(path, spec, options) -> Engine``; choosing one is a dict
lookup in ``engines.backends``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from engines.devices.options import GpuOptions
from engines.preprocess import ImagePreprocess
from engines.spec import ModelSpec
from engines.store import EngineStore


class Runner(Protocol):
    """One execution lane. ``run`` is called from one thread at a time, never concurrently."""

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch: every model input in, every model output out, same first dim."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class BlockRunner(Runner, Protocol):
    """A runner that takes a batch as blocks of rows (the requests it is made of, in order)
    and copies each block straight into its own staging memory: the batch is never joined
    into one array first, which for large batches is a full extra copy on the runner's
    thread. Runners without it get the blocks joined by the caller."""

    def run_blocks(self, blocks: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """``run`` of the blocks joined along the first axis."""
        ...


@runtime_checkable
class PaddingRunner(Runner, Protocol):
    """A runner that may run a batch as a larger one: a CUDA graph captured for a bucket of
    rows runs a batch's rows padded up to that bucket."""

    def rows_padded_to(self, rows: int) -> int:
        """The rows a batch of ``rows`` costs the device (``rows`` where none is padded)."""
        ...


class Engine(Protocol):
    """Loaded weights for one model and precision; makes runners that share them."""

    spec: ModelSpec
    backend: str
    pixel_input: str | None
    """The input that takes UINT8 pixels, normalised by the engine itself on its device
    (given ``EngineOptions.image``), or None: the service then normalises pixels on the CPU
    before they reach the engine."""

    def new_runner(self) -> Runner: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class EngineOptions:
    """What a backend needs beyond the model file and its tensor contract.

    ``runners`` is how many lanes will run at once, so a CPU backend can divide the cores
    between them instead of oversubscribing. Backends that compile the model (TensorRT) keep
    what they build in ``store`` (None: built in memory at every load), optimise for the
    batch sizes of ``profile`` (min, opt, max rows, from the batching config; empty: 1 to the
    max batch size) and label the artefact with ``precision``. GPU backends place runners on
    ``devices`` round-robin (one copy of the weights per GPU; empty: GPU 0) and may size
    their batch buckets by ``preferred_batch_sizes``. ``image`` is the model's preprocessing:
    a backend that can normalise on the device accepts UINT8 pixels on the first input and
    says so in its engine's ``pixel_input``. ``gpu``: how the model is compiled for and
    fitted into its GPU (the model config's ``gpu:`` section).
    """

    runners: int = 1
    cpu_threads: int = 0
    store: EngineStore | None = None
    profile: tuple[int, ...] = ()
    precision: str = ""
    devices: tuple[int, ...] = ()
    preferred_batch_sizes: tuple[int, ...] = ()
    image: ImagePreprocess | None = None
    gpu: GpuOptions = field(default_factory=GpuOptions)


class ModelDoesNotFit(Exception):
    """A model whose max batch does not fit the device memory it may use, found at load
    (the message names the largest batch that fits); it is not served."""


class FatalEngineError(Exception):
    """A fault the process cannot recover from (a broken CUDA context, a lost device).

    A runner raises it instead of an ordinary exception when no later batch can succeed
    either; the service then fails the batch, stops the model and turns readiness and
    liveness off so the orchestrator replaces the process. It is never retried in-process.
    """


def out_of_memory(error: BaseException) -> bool:
    """Whether a runner's error is an allocation that failed (torch's ``OutOfMemoryError``,
    CUDA's ``cudaErrorMemoryAllocation``, ONNX Runtime's failed allocation, ``MemoryError``):
    this batch did not fit the memory left, which says nothing of the next one."""
    if isinstance(error, MemoryError):
        return True
    text = f"{type(error).__name__} {error}".lower()
    return any(
        mark in text
        for mark in (
            "outofmemoryerror",
            "out of memory",
            "cudaerrormemoryallocation",
            "failed to allocate memory",
        )
    )


class Loader(Protocol):
    def __call__(self, path: Path, spec: ModelSpec, options: EngineOptions) -> Engine: ...
