"""How a model uses its GPU, declared once: the model config's ``gpu:`` section, which the
service validates and the GPU backends take as it is."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

CompileMode = Literal["none", "default", "max-autotune"]

GPU_BACKENDS = ("torch", "tensorrt")
"""The backends whose runners run on a GPU."""
RUNNERS_PER_GPU = 4
"""Runners a GPU backend gets per GPU when the model config leaves ``runners`` unset: the
count that made the most images/s on the H200, measured with the torch backend compiled
(BENCHMARKS.md, "Runners per GPU")."""


class GpuOptions(BaseModel):
    """How a model is compiled for and fitted into its GPU."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid", frozen=True)

    compile: CompileMode = "default"
    """torch backend: ``default`` (the default) compiles the converted graph ahead of time
    with AOTInductor (Inductor's fused Triton kernels, cuDNN's convolutions) into one package
    for every batch size, tuned at the max batch; every runner captures its CUDA graphs of
    it. ``max-autotune`` also times Triton's convolution and matmul templates against cuDNN's
    and keeps the fastest (a much longer first build). The package is kept in the engine
    store, keyed by GPU, torch and Triton versions and max batch, so a restart loads it and
    compiles nothing: on an H200 the first start of ResNet-50 compiles for about 75 s, a
    restart loads in well under a second (BENCHMARKS.md, "Start in seconds"). ``none``
    captures the converted graph as it is: no compile, about half the images/s."""
    split_batches: bool = False
    """torch backend with CUDA graphs: run a batch as up to three graphs of its rows where
    that pads fewer rows than one graph of its bucket (``engines.base.split_rows``: 45 rows
    as graphs of 32 and 16, not one of 64), the rows after the first graph moved to the
    front of the input on the device. Batch 1 at c=256 on an H100 made 1.31-1.52x the
    unsplit default's requests/s with p99 under 50 ms (BENCHMARKS.md, "A batch as graphs of
    its rows ..."); off by default until its GPU test (row-by-row answers against ONNX
    Runtime) has run on a GPU. Off: every batch pads up to its bucket."""
    memory_fraction: float = Field(default=1.0, gt=0, le=1)
    """The share of each GPU's memory the engine process's allocator may hold (weights,
    every runner's buffers and CUDA graphs, its cache): torch caps it per process, so with
    several models in one engine process the smallest fraction any of them asks for holds,
    never below what is already in use. A max batch that does not fit is decided at load by
    ``on_out_of_memory``, not met by the first large batch. Lower it to share a GPU with
    other processes; 1: the whole GPU."""
    on_out_of_memory: Literal["refuse", "shrink"] = "refuse"
    """When the max batch does not fit ``memory_fraction`` at load: ``refuse`` fails the load
    naming the largest batch that fits; ``shrink`` serves with that batch as the max (larger
    requests are then refused with 400) and logs a warning."""
