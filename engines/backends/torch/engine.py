"""torch on CUDA: the GPU backend for machines without TensorRT.

The model is the ONNX file itself, converted op by op into a ``torch.nn.Module``
(``engines.backends.torch.convert``), in one of the precisions of
``engines.backends.torch.precision``: fp32, tf32, fp16 or bf16, or the ONNX ``fp16`` variant
as it is. The engine holds one copy of the weights per GPU; a runner
(``engines.backends.torch.runner``) is one execution lane with a CUDA graph per batch bucket.

With ``gpu.compile`` the module is compiled ahead of time by AOTInductor into one package
for every bucket, shared by every runner and kept in the engine store
(``engines.backends.torch.compiled``); the runners capture its call. The engine's GPU
memory is capped at ``gpu.memory_fraction`` of each GPU (``engines.backends.torch.memory``):
a runner whose graphs do not fit is retried with smaller max batches, and the model is refused
naming the largest that fits, or served with it (``gpu.on_out_of_memory``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engines.backends.torch import compiled
from engines.backends.torch.convert import OnnxModule, UnsupportedModel, convert
from engines.backends.torch.memory import limit_memory, reserved
from engines.backends.torch.precision import PRECISIONS, compute_dtype, graph_precision
from engines.backends.torch.runner import TORCH_DTYPES, TorchRunner
from engines.base import EngineOptions, ModelDoesNotFit
from engines.devices.options import GpuOptions
from engines.preprocess import ImagePreprocess
from engines.spec import ModelSpec

BACKEND = "torch"


log = logging.getLogger(__name__)


def buckets(max_batch_size: int, preferred: Sequence[int] = ()) -> list[int]:
    """Batch sizes that get a CUDA graph: powers of two, the preferred sizes, the max."""
    sizes = {max_batch_size, *(p for p in preferred if 0 < p <= max_batch_size)}
    power = 1
    while power < max_batch_size:
        sizes.add(power)
        power *= 2
    return sorted(sizes)


@dataclass(frozen=True)
class TorchOptions:
    """What the torch backend takes beyond ``EngineOptions``.

    ``precision`` is one of ``PRECISIONS`` or None (the graph's own: fp32, or the fp16
    variant as converted). ``devices``: the GPUs runners are placed on, round-robin (one
    copy of the weights per GPU). ``image``: the model's preprocessing, which lets the image
    input take UINT8 pixels normalised on the GPU. ``batch_buckets`` replaces the default
    buckets (``buckets()``). ``cuda_graphs`` off runs eagerly, to measure what graphs save.
    ``gpu``: compiling and the memory the engine may take (the model config's ``gpu:``).
    """

    precision: str | None = None
    devices: tuple[int, ...] = (0,)
    image: ImagePreprocess | None = None
    preferred_batch_sizes: tuple[int, ...] = ()
    batch_buckets: tuple[int, ...] = ()
    cuda_graphs: bool = True
    channels_last: bool = True
    gpu: GpuOptions = field(default_factory=GpuOptions)


class TorchEngine:
    backend = BACKEND

    def __init__(
        self, path: Path, spec: ModelSpec, options: EngineOptions, torch_options: TorchOptions
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("the torch backend needs CUDA; use backend: onnxruntime")
        dynamic = [t.name for t in (*spec.inputs, *spec.outputs) if not t.is_static]
        if dynamic:
            raise UnsupportedModel(
                f"{spec.name}: {', '.join(dynamic)} have dynamic dimensions besides the batch; "
                "the torch backend's static buffers and CUDA graphs need fixed row shapes"
            )
        precision = torch_options.precision or graph_precision(path)
        if precision not in (*PRECISIONS, "fp16-variant"):
            raise ValueError(f"unknown precision {precision!r}; one of {', '.join(PRECISIONS)}")
        self.spec = spec
        self.precision = precision
        self.options = torch_options
        # The image input takes UINT8 pixels too, normalised inside the CUDA graph.
        self.pixel_input = spec.inputs[0].name if torch_options.image is not None else None
        self.devices = torch_options.devices or (0,)
        self.cuda_graphs = torch_options.cuda_graphs
        self.split_batches = torch_options.gpu.split_batches and self.cuda_graphs
        if not spec.batched:
            self.buckets = [0]
        elif torch_options.batch_buckets:
            self.buckets = sorted(torch_options.batch_buckets)
            if self.buckets[-1] < spec.max_batch_size:
                raise ValueError(f"batch buckets {self.buckets} do not reach the max batch")
        else:
            self.buckets = buckets(spec.max_batch_size, torch_options.preferred_batch_sizes)
        # cuDNN times its algorithms once per shape; the graphs then replay the winner.
        torch.backends.cudnn.benchmark = True
        dtype = compute_dtype(precision)
        gpu = torch_options.gpu
        self._store = options.store
        self._modules: dict[int, OnnxModule] = {}
        self._calls: dict[int, Any] = {}
        self.weight_bytes: dict[int, int] = {}
        """Per GPU, the bytes of the engine's copy of the weights (parameters and buffers)."""
        self.runner_bytes: list[int] = []
        """Per runner, in order made, what its buffers and graphs took of the allocator."""
        for device in self.devices:
            self.memory_fraction = limit_memory(device, gpu.memory_fraction)
            module = convert(path).to(device=torch.device("cuda", device), dtype=dtype)
            if torch_options.channels_last:
                for attr, buffer in list(module.named_buffers()):
                    if buffer.dim() == 4:
                        setattr(module, attr, buffer.contiguous(memory_format=torch.channels_last))
            self._modules[device] = module
            self.weight_bytes[device] = sum(
                t.numel() * t.element_size()
                for t in itertools.chain(module.parameters(), module.buffers())
            )
            self._calls[device] = module
            if gpu.compile != "none":
                self._calls[device] = self._compiled(path, device, module, dtype)
        self._next = 0
        self._lock = threading.Lock()
        self._capture = ThreadPoolExecutor(1, thread_name_prefix=f"{spec.name}-capture")

    def _compiled(
        self, path: Path, device: int, module: OnnxModule, dtype: torch.dtype | None
    ) -> Any:
        """The module's package for every bucket (``compiled``), from the store or compiled;
        the module itself where compiling fails (slower: the warning says so)."""
        torch_device = torch.device("cuda", device)
        gpu = self.options.gpu
        key = compiled.package_key(
            path,
            self.spec.name,
            self.precision,
            gpu.compile,
            torch_device,
            self.buckets[-1],
            {"channels_last": self.options.channels_last},
        )
        try:
            # Outside a CUDA graph its calls are one at a time (the runners' capture lock);
            # eager runners run side by side, so they need its own synchronisation.
            return compiled.load_or_compile(
                self._store,
                key,
                module,
                lambda: self.example_inputs(torch_device, dtype),
                torch_device,
                single_threaded=self.cuda_graphs,
            )
        except Exception as error:
            self._compile_failed(device, error)
            return module

    def example_inputs(
        self, device: torch.device, dtype: torch.dtype | None
    ) -> tuple[torch.Tensor, ...]:
        """Inputs shaped, typed and laid out as a runner hands them to the module at the max
        batch (``TorchRunner._prepare``): what the package is traced and tuned with."""
        rows = self.buckets[-1]
        generator = torch.Generator().manual_seed(0)
        values = []
        for tensor in self.spec.inputs:
            row = tuple(1 if d == -1 else d for d in tensor.shape)
            shape = (rows, *row) if self.spec.batched else row
            want = TORCH_DTYPES[tensor.datatype]
            if want.is_floating_point:
                x = torch.randn(shape, generator=generator).to(device, dtype or want)
            else:
                x = torch.zeros(shape, dtype=want, device=device)
            if self.options.channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            values.append(x)
        return tuple(values)

    def _compile_failed(self, device: int, error: Exception) -> None:
        # A graph the converter runs but Inductor cannot compile still serves, uncompiled,
        # rather than not at all.
        log.warning(
            "%s: compiling failed on GPU %d (%s: %s); serving the converted graph uncompiled",
            self.spec.name,
            device,
            type(error).__name__,
            str(error).splitlines()[0][:300] if str(error) else "",
        )

    def module(self, device: int) -> OnnxModule:
        return self._modules[device]

    def call(self, device: int) -> Any:
        """What a runner on ``device`` runs: the module, or the module compiled."""
        return self._calls[device]

    def new_runner(self) -> TorchRunner:
        """A runner with a CUDA graph per bucket, made on the engine's one capture thread
        whichever thread asks: cuDNN's timed choice of algorithms (``cudnn.benchmark``) is
        kept per thread, so runners made in other threads would each time every convolution
        of every bucket again (seconds a runner at ResNet-50's 9 buckets)."""
        return self._capture.submit(self._new_runner).result()

    def _new_runner(self) -> TorchRunner:
        with self._lock:
            device = self.devices[self._next % len(self.devices)]
            self._next += 1
        before = reserved(device)
        fell_back = False
        try:
            runner = self._runner_or_none(device)
        except Exception as error:
            if not self._compiles(device):
                raise
            self._compile_failed(device, error)  # the package loaded but its calls fail
            self._calls[device] = self._modules[device]
            fell_back = True
        if fell_back:  # made again here, once the failed one's memory went with the error
            runner = self._runner_or_none(device)
        if runner is None:
            runner = self._fit(device)
        self.runner_bytes.append(reserved(device) - before)
        return runner

    def _compiles(self, device: int) -> bool:
        return self._calls[device] is not self._modules[device]

    def _runner_or_none(self, device: int) -> TorchRunner | None:
        """A runner with every bucket; None where it does not fit the memory left."""
        try:
            return TorchRunner(self, device, self.buckets)
        except torch.OutOfMemoryError:
            return None  # the caller retries smaller, once this runner's memory is released

    def _fit(self, device: int) -> TorchRunner:
        """A runner with the largest max batch that fits the memory left, tried from the
        next smaller bucket down; kept as the new max (``shrink``) or refused."""
        wanted = self.buckets[-1]
        runner, largest = None, 0
        for size in reversed(self.buckets[:-1]):
            torch.cuda.empty_cache()
            try:
                runner = TorchRunner(self, device, [b for b in self.buckets if b <= size])
            except torch.OutOfMemoryError:
                continue
            largest = size
            break
        gib = torch.cuda.get_device_properties(device).total_memory * self.memory_fraction / 2**30
        where = (
            f"{self.spec.name}: a batch of {wanted} does not fit "
            f"{self.memory_fraction:.0%} of GPU {device} ({gib:.1f} GiB) with "
            f"{len(self.runner_bytes)} runner(s) already made"
        )
        if runner is not None and self.options.gpu.on_out_of_memory == "shrink":
            log.warning("%s; serving with a max batch of %d (gpu.on_out_of_memory: shrink)",
                        where, largest)  # fmt: skip
            self.buckets = [b for b in self.buckets if b <= largest]
            self.spec = dataclasses.replace(self.spec, max_batch_size=largest)
            return runner
        if runner is not None:
            runner.close()
        fits = f"the largest that fits is {largest}" if largest else "not even a batch of 1 fits"
        raise ModelDoesNotFit(
            f"{where}; {fits}: lower max_batch_size or runners, raise gpu.memory_fraction "
            "or set gpu.on_out_of_memory: shrink"
        )

    def close(self) -> None:
        self._capture.shutdown(wait=True)
        self._calls.clear()
        self._modules.clear()
        torch.cuda.empty_cache()


def load(path: Path, spec: ModelSpec, options: EngineOptions) -> TorchEngine:
    """The registry's loader: the graph's own precision; the GPUs, batch buckets and image
    preprocessing the service passes (UINT8 pixels are then normalised on the GPU)."""
    image = options.image
    first = spec.inputs[0] if spec.inputs else None
    takes_pixels = (
        image is not None
        and first is not None
        and first.datatype in ("FP32", "FP16", "BF16")
        and tuple(first.shape) == image.row_shape()
    )
    return TorchEngine(
        path,
        spec,
        options,
        TorchOptions(
            devices=options.devices or (0,),
            image=image if takes_pixels else None,
            preferred_batch_sizes=options.preferred_batch_sizes,
            gpu=options.gpu,
        ),
    )
