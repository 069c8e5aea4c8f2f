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


# What one more graph a batch costs, in rows: a replay's launches and the smaller batch's
# lower occupancy, taken as this many rows of work (a guess made in the open: measured on
# the GPU only through the service's rate, BENCHMARKS.md "Batch 1 as graphs of its rows").
PIECE_ROWS = 8
MAX_PIECES = 3


def split_rows(rows: int, buckets: Sequence[int], max_pieces: int = MAX_PIECES) -> list[int]:
    """The row counts of the graphs a batch of ``rows`` runs as, in order, where each graph
    pads its rows up to the smallest bucket that holds them: the plan of at most
    ``max_pieces`` graphs that costs the fewest rows, counting ``PIECE_ROWS`` a graph; every
    piece but the last is a whole bucket (so the rows after it can be moved to the front of
    the input in one copy that does not overlap). 45 rows with power-of-two buckets: 32 and
    13 (48 rows, not 64); 60 rows: one graph of 64."""
    sizes = sorted(buckets)
    if not sizes or rows > sizes[-1]:
        raise ValueError(f"batch of {rows} rows exceeds the buckets {sizes}")

    def padded(n: int) -> int:
        return next(size for size in sizes if size >= n)

    def best(n: int, left: int, cap: int) -> tuple[int, list[int]] | None:
        # No piece after the first larger than it: the rows moved never overlap their place.
        plan = (padded(n) + PIECE_ROWS, [n]) if n <= cap else None
        if left > 1:
            for first in (size for size in sizes if 0 < size < n and size <= cap):
                rest = best(n - first, left - 1, first)
                if rest is not None and (plan is None or first + PIECE_ROWS + rest[0] < plan[0]):
                    plan = (first + PIECE_ROWS + rest[0], [first, *rest[1]])
        return plan

    found = best(rows, max_pieces, rows) if rows > 0 else None
    return found[1] if found is not None else [rows]


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
