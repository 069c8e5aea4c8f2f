"""``stoker accuracy --gpu``: each precision on GPU 0 through the torch backend.

Per precision (fp32 and fp16: the variants the server builds; bf16: torch's cast of the FP32
graph, as ``TorchOptions(precision="bf16")`` gives it, not a precision the server serves),
one runner with FP32 input and the report's batch sizes as its buckets, compiled as the
model's ``gpu:`` section says, afresh (no engine store): agreement with ONNX Runtime's FP32
on the same photos, top-1/top-5 where the file names carry labels, img/s of the runner at
each batch size, the median batch-1 latency, and the GPU memory of the weights and of the
runner (its buffers and CUDA graphs).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from engines.backends.onnxruntime import read_spec
from engines.base import EngineOptions
from engines.devices.options import GpuOptions
from engines.precision import accuracy


def rows_on_gpu(
    variants: dict[str, Path],
    data: np.ndarray,
    input_name: str,
    reference: np.ndarray,
    labels: np.ndarray,
    batches: list[int],
    gpu: GpuOptions,
) -> list[dict[str, Any]]:
    """One row per precision: ``variants`` maps fp32 (required) and fp16 to their ONNX
    files; bf16 is cast from fp32 by torch."""
    import torch

    from engines.backends.torch.engine import TorchEngine, TorchOptions

    largest = max(batches)
    buckets = tuple(sorted(set(batches)))
    plan: list[tuple[str, Path, str | None]] = [("fp32", variants["fp32"], None)]
    if "fp16" in variants:
        plan.append(("fp16", variants["fp16"], None))
    plan.append(("bf16", variants["fp32"], "bf16"))
    results = []
    for name, path, cast in plan:
        print(f"GPU {name}: loading (gpu.compile {gpu.compile}, buckets {list(buckets)})")
        started = time.perf_counter()
        spec = read_spec(path, path.parent.name, largest)
        options = TorchOptions(precision=cast, batch_buckets=buckets, gpu=gpu)
        engine = TorchEngine(path, spec, EngineOptions(), options)
        runner = engine.new_runner()
        output = spec.outputs[0].name
        try:
            print(f"GPU {name}: ready in {time.perf_counter() - started:.1f} s; running photos")
            logits = np.concatenate(
                [
                    runner.run({input_name: data[i : i + largest]})[output].astype(np.float32)
                    for i in range(0, len(data), largest)
                ]
            )
            result: dict[str, Any] = {
                "precision": name,
                **accuracy.scores(reference, logits, labels),
            }
            for batch in batches:
                result[f"img/s@{batch}"] = rate(runner, input_name, data[0], batch)
            result["ms@1 (median)"] = latency_ms(runner, input_name, data[0])
            result["GPU MiB weights"] = sum(engine.weight_bytes.values()) / 2**20
            result["GPU MiB/runner"] = engine.runner_bytes[0] / 2**20
            results.append(result)
        finally:
            runner.close()
            engine.close()
            torch.cuda.empty_cache()
    return results


def rate(runner: Any, input_name: str, row: np.ndarray, batch: int, rounds: int = 5) -> float:
    """Images/s of ``runner.run`` at ``batch`` rows (staging, copies, replay, wait): the
    median of ``rounds`` windows of at least half a second."""
    inputs = {input_name: np.repeat(row[None], batch, axis=0)}
    runner.run(inputs)
    samples = []
    for _ in range(rounds):
        runs, started = 0, time.perf_counter()
        while runs < 3 or time.perf_counter() - started < 0.5:
            runner.run(inputs)
            runs += 1
        samples.append(batch * runs / (time.perf_counter() - started))
    return statistics.median(samples)


def latency_ms(runner: Any, input_name: str, row: np.ndarray, count: int = 200) -> float:
    """The median time of one batch-1 ``run``, in ms."""
    inputs = {input_name: row[None]}
    for _ in range(10):
        runner.run(inputs)
    times = []
    for _ in range(count):
        started = time.perf_counter()
        runner.run(inputs)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def describe(gpu: GpuOptions) -> str:
    """The GPU the rows ran on, and how: its name, torch's version, the compile mode."""
    import torch

    return (
        f"GPU 0 ({torch.cuda.get_device_name(0)}), torch {torch.__version__}, torch backend, "
        f"gpu.compile {gpu.compile}"
    )
