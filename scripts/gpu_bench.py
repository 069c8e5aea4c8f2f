"""The torch backend measured on one GPU: graph replay alone, the raw runner, latency, copies
and JPEG decode. ``scripts/h200.sh`` runs it; it prints a table last and writes JSON.

python scripts/gpu_bench.py --out results/ [--seconds 2]

- graph: CUDA-graph replays of one bucket back to back on the runner's stream, timed with CUDA
  events: the GPU alone, what the issue's ceilings measure.
- runner: ``TorchRunner.run`` with numpy batches as the pool calls it (staging copy into
  pinned memory, H2D, replay, D2H, blocking wait), from 1 or more threads, one runner each.
- The median of three timed windows after a warm-up; inputs are random pixels, rotated.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import zoo
from bench import accuracy_gpu, payloads
from engines.backends.onnxruntime import read_spec
from engines.backends.torch.engine import TorchEngine, TorchOptions
from engines.backends.torch.runner import TorchRunner
from engines.base import EngineOptions
from engines.devices import cuda
from engines.preprocess import ImagePreprocess

BATCHES = (1, 8, 32, 128, 256)
# The measured ceilings on this H200 (ResNet-50, 224², channels last, CUDA graph).
CEILINGS = {("resnet50", "fp16", 256): 17_100, ("resnet50", "fp16", 32): 13_500,
            ("resnet50", "bf16", 256): 15_900, ("resnet50", "tf32", 256): 9_400,
            ("resnet50", "fp32", 256): 3_800}  # fmt: skip


@dataclass
class Row:
    model: str
    precision: str
    what: str
    batch: int
    value: float
    unit: str
    note: str = ""


ROWS: list[Row] = []


def record(row: Row) -> None:
    ROWS.append(row)
    print(f"  {row.model:18} {row.precision:5} {row.what:34} b={row.batch:<4} "
          f"{row.value:12,.1f} {row.unit} {row.note}", flush=True)  # fmt: skip


def windows(fn: Callable[[float], float], seconds: float, count: int = 3) -> float:
    """Median of ``count`` windows of ``fn(seconds)`` after one warm-up window."""
    fn(min(0.5, seconds))
    return statistics.median(fn(seconds) for _ in range(count))


def pixels(rows: int, distinct: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng(rows)
    return [rng.integers(0, 256, (rows, 3, 224, 224), dtype=np.uint8) for _ in range(distinct)]


def as_float(batches: list[np.ndarray]) -> list[np.ndarray]:
    return [((b.astype(np.float32) - 127.0) / 128.0).astype(np.float32) for b in batches]


def make_engine(path: Path, precision: str, buckets: tuple[int, ...], **kw: Any) -> TorchEngine:
    """A torch engine, uncompiled unless ``gpu`` is given: the sections measure the
    conversion's own graphs unless they say they compile."""
    from engines.devices.options import GpuOptions

    kw.setdefault("gpu", GpuOptions(compile="none"))
    spec = read_spec(path, path.parent.name, max(buckets))
    options = TorchOptions(
        precision=precision, image=ImagePreprocess(), batch_buckets=buckets, **kw
    )
    return TorchEngine(path, spec, EngineOptions(), options)


def graph_rate(runner: TorchRunner, bucket: int, seconds: float) -> float:
    """Images/s of back-to-back replays of one graph (GPU only)."""
    graph = runner.graph(bucket, "UINT8")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def window(limit: float) -> float:
        with torch.cuda.stream(runner.stream):
            graph.replay()
            runner.stream.synchronize()
            reps, t0 = 0, time.perf_counter()
            start.record()
            while time.perf_counter() - t0 < limit:
                for _ in range(10):
                    graph.replay()
                reps += 10
                runner.stream.synchronize()
            end.record()
            end.synchronize()
        return reps * bucket / (start.elapsed_time(end) / 1000)

    return windows(window, seconds)


def runner_rate(runners: list[TorchRunner], batches: list[np.ndarray], seconds: float) -> float:
    """Images/s of ``run`` from one thread per runner, each looping over the batches."""

    def window(limit: float) -> float:
        counts = [0] * len(runners)
        stop = threading.Event()

        def loop(i: int) -> None:
            runner, n = runners[i], 0
            while not stop.is_set():
                out = runner.run({"input": batches[n % len(batches)]})
                counts[i] += len(out["logits"])
                n += 1

        threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(runners))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        time.sleep(limit)
        stop.set()
        for t in threads:
            t.join()
        return sum(counts) / (time.perf_counter() - t0)

    return windows(window, seconds)


def latency_ms(runner: TorchRunner, batch: np.ndarray, count: int = 200) -> float:
    """The median ms of ``runner.run`` on a batch of one row."""
    return accuracy_gpu.latency_ms(runner, "input", batch[0], count)


def model_path(name: str, root: Path) -> Path:
    folder = root / name
    if not (folder / "model.onnx").exists():
        zoo.GENERATORS[name](folder)
    return folder / "model.onnx"


def bench_model(name: str, path: Path, seconds: float) -> None:
    print(f"== {name} fp16: graphs at {BATCHES}, two runners", flush=True)
    t0 = time.perf_counter()
    engine = make_engine(path, "fp16", BATCHES)
    runners = [engine.new_runner() for _ in range(2)]
    record(Row(name, "fp16", "startup: 2 runners, 10 graphs each", 0,
               time.perf_counter() - t0, "s"))  # fmt: skip
    for b in BATCHES:
        u8 = pixels(b)
        ceiling = CEILINGS.get((name, "fp16", b))
        gpu = graph_rate(runners[0], b, seconds)
        record(Row(name, "fp16", "graph replay (GPU only)", b, gpu, "img/s",
                   f"ceiling {ceiling:,} -> {gpu / ceiling:.2f}" if ceiling else ""))  # fmt: skip
        one = runner_rate(runners[:1], u8, seconds)
        record(Row(name, "fp16", "runner.run UINT8, 1 thread", b, one, "img/s",
                   f"/graph {one / gpu:.2f}"))  # fmt: skip
        two = runner_rate(runners, u8, seconds)
        versus = f", /ceiling {two / ceiling:.2f}" if ceiling else ""
        record(Row(name, "fp16", "runner.run UINT8, 2 runners", b, two, "img/s",
                   f"/graph {two / gpu:.2f}{versus}"))  # fmt: skip
        if b in (1, 32, 256):
            f32 = runner_rate(runners, as_float(u8), seconds)
            record(Row(name, "fp16", "runner.run FP32, 2 runners", b, f32, "img/s",
                       f"/graph {f32 / gpu:.2f}"))  # fmt: skip
    record(Row(name, "fp16", "latency runner.run UINT8 (graph)", 1,
               latency_ms(runners[0], pixels(1)[0]), "ms"))  # fmt: skip
    for r in runners:
        r.close()
    engine.close()
    eager = make_engine(path, "fp16", (1,), cuda_graphs=False).new_runner()
    record(Row(name, "fp16", "latency runner.run UINT8 (eager)", 1,
               latency_ms(eager, pixels(1)[0], 50), "ms"))  # fmt: skip
    eager.close()


def bench_as_served(name: str, path: Path, max_batch: int, rows: int, seconds: float) -> None:
    """The engine as ``stoker serve`` loads it (registry loader: the graph's own precision,
    FP32 input, default buckets, compiled as the default says, with no engine store), two
    runners at ``rows``."""
    from engines import backends

    print(f"== {name} as served (registry loader), batch {rows}", flush=True)
    spec = read_spec(path, name, max_batch)
    engine = backends.loader("torch")(path, spec, EngineOptions(runners=2))
    runners = [engine.new_runner() for _ in range(2)]
    rate = runner_rate(runners, as_float(pixels(rows)), seconds)  # type: ignore[arg-type]
    record(Row(name, "fp32", "as served: runner.run FP32, 2 runners", rows, rate, "img/s"))
    for r in runners:
        r.close()
    engine.close()


def bench_precisions(path: Path, seconds: float) -> None:
    print("== resnet50 fp32 / tf32 / bf16 at batch 256", flush=True)
    for precision in ("fp32", "tf32", "bf16"):
        engine = make_engine(path, precision, (256,))
        runners = [engine.new_runner() for _ in range(2)]
        gpu = graph_rate(runners[0], 256, seconds)
        ceiling = CEILINGS[("resnet50", precision, 256)]
        record(Row("resnet50", precision, "graph replay (GPU only)", 256, gpu, "img/s",
                   f"ceiling {ceiling:,} -> {gpu / ceiling:.2f}"))  # fmt: skip
        two = runner_rate(runners, pixels(256), seconds)
        record(Row("resnet50", precision, "runner.run UINT8, 2 runners", 256, two, "img/s",
                   f"/ceiling {two / ceiling:.2f}"))  # fmt: skip
        for r in runners:
            r.close()
        engine.close()


def bench_streams(path: Path, seconds: float) -> None:
    print("== resnet50 fp16 at batch 8: runners (streams) in parallel", flush=True)
    engine = make_engine(path, "fp16", (8,))
    runners = [engine.new_runner() for _ in range(4)]
    base = 0.0
    for count in (1, 2, 4):
        rate = runner_rate(runners[:count], pixels(8), seconds)
        base = base or rate
        record(Row("resnet50", "fp16", f"runner.run UINT8, {count} runners", 8, rate, "img/s",
                   f"x{rate / base:.2f} of one"))  # fmt: skip
    for r in runners:
        r.close()
    engine.close()


def bench_scaling(path: Path, seconds: float) -> None:
    print("== resnet50 fp16: runners (threads) at batch 32 and 256", flush=True)
    engine = make_engine(path, "fp16", (32, 256))
    runners = [engine.new_runner() for _ in range(4)]
    for b in (32, 256):
        gpu = graph_rate(runners[0], b, seconds)
        for label, batches in (("UINT8", pixels(b)), ("FP32", as_float(pixels(b)))):
            for count in (1, 2, 3, 4):
                rate = runner_rate(runners[:count], batches, seconds)
                record(Row("resnet50", "fp16", f"runner.run {label}, {count} runners", b, rate,
                           "img/s", f"/graph {rate / gpu:.2f}"))  # fmt: skip
    for r in runners:
        r.close()
    engine.close()


def bench_gpus(path: Path, seconds: float) -> None:
    """Rows/s at batch 256 with the runners on one GPU, then spread over every GPU."""
    count = torch.cuda.device_count()
    print(f"== resnet50 fp16: runners on 1 and {count} GPU(s), batch 256", flush=True)
    if count < 2:
        record(Row("resnet50", "fp16", "runners over GPUs: skipped", 256, count, "GPUs",
                   "needs two GPUs"))  # fmt: skip
        return
    batches = pixels(256)
    rates = {}
    for devices in ((0,), tuple(range(count))):
        engine = make_engine(path, "fp16", (256,), devices=devices)
        runners = [engine.new_runner() for _ in range(2 * len(devices))]
        assert sorted({r.device for r in runners}) == list(devices)
        rates[len(devices)] = runner_rate(runners, batches, seconds)
        note = "" if len(devices) == 1 else f"x{rates[len(devices)] / rates[1]:.2f} of 1 GPU"
        record(Row("resnet50", "fp16", f"runner.run UINT8, {len(devices)} GPU(s), "
                   f"{len(runners)} runners", 256, rates[len(devices)], "img/s", note))  # fmt: skip
        for r in runners:
            r.close()
        engine.close()


def replay_rate(fn: Callable[[torch.Tensor], Any], x: torch.Tensor, seconds: float) -> float:
    """Images/s of ``fn(x)`` captured in one CUDA graph and replayed (GPU time only)."""
    stream = torch.cuda.Stream()
    with torch.no_grad(), torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph, stream=stream):
        fn(x)
    rows = x.shape[0]

    def window(limit: float) -> float:
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < limit:
            for _ in range(5):
                graph.replay()
            reps += 5
            torch.cuda.synchronize()
        return reps * rows / (time.perf_counter() - t0)

    return windows(window, seconds)


def bench_reference(seconds: float) -> None:
    """torchvision's ResNet-50 the same way (fp16, channels last, one CUDA graph): whether
    the issue's ceilings reproduce on this machine today, independent of our conversion."""
    import torchvision

    print("== torchvision resnet50 fp16 channels-last, CUDA graph", flush=True)
    model = torchvision.models.resnet50().eval().half().cuda()
    model = model.to(memory_format=torch.channels_last)
    torch.backends.cudnn.benchmark = True
    for b in (32, 256):
        x = torch.randn(b, 3, 224, 224, device="cuda").half()
        x = x.contiguous(memory_format=torch.channels_last)
        ceiling = CEILINGS[("resnet50", "fp16", b)]
        rate = replay_rate(model, x, seconds)
        record(Row("torchvision-rn50", "fp16", "graph replay (GPU only)", b, rate, "img/s",
                   f"ceiling {ceiling:,} -> {rate / ceiling:.2f}"))  # fmt: skip


def bench_graphs(paths: dict[str, Path], seconds: float) -> None:
    """Graph replay alone, fp16, at batch 32 and 256: the converted model's GPU speed."""
    for name, path in paths.items():
        print(f"== {name} fp16 graph replay", flush=True)
        engine = make_engine(path, "fp16", (32, 256))
        runner = engine.new_runner()
        for b in (32, 256):
            gpu = graph_rate(runner, b, seconds)
            ceiling = CEILINGS.get((name, "fp16", b))
            note = f"ceiling {ceiling:,} -> {gpu / ceiling:.2f}" if ceiling else ""
            record(Row(name, "fp16", "graph replay (GPU only)", b, gpu, "img/s", note))
        runner.close()
        engine.close()


def bench_compiled(paths: dict[str, Path], seconds: float, modes: list[str]) -> None:
    """#13's first candidate: the converted graph (fp16, channels last) through
    ``torch.compile`` (Inductor's fused kernels, one graph: the converter test checks there
    is no break) in each mode, then one CUDA graph per batch, beside the same without
    compiling and torchvision's ResNet-50 compiled the same way, in one run. The note gives
    the compile time (first call at that batch) and the largest difference of the logits
    from the uncompiled graph's on the same input."""
    import torchvision

    for name, path in paths.items():
        print(f"== {name} fp16: compiled ({', '.join(modes)}) vs graph-only", flush=True)
        engine = make_engine(path, "fp16", (32, 256))
        ours = engine.module(0)
        candidates: dict[str, Callable[[torch.Tensor], Any]] = {"stoker-convert": ours}
        for mode in modes:
            candidates[f"convert+{mode}"] = torch.compile(
                ours, mode=mode, fullgraph=True, dynamic=False
            )
        if name == "resnet50":
            reference = torchvision.models.resnet50().eval().half().cuda()
            reference = reference.to(memory_format=torch.channels_last)
            candidates["torchvision"] = reference
            for mode in modes:
                candidates[f"torchvision+{mode}"] = torch.compile(
                    reference, mode=mode, dynamic=False
                )
        for b in (32, 256):
            x = torch.randn(b, 3, 224, 224, device="cuda").half()
            x = x.contiguous(memory_format=torch.channels_last)
            with torch.no_grad():
                eager = ours(x)[0].float()
            for label, fn in candidates.items():
                started = time.perf_counter()
                with torch.no_grad():
                    first = fn(x)
                torch.cuda.synchronize()
                compiled_s = time.perf_counter() - started
                note = f"first call {compiled_s:.1f} s"
                if label.startswith("convert"):
                    diff = (first[0].float() - eager).abs().max().item()
                    note += f", max |logit diff| {diff:.3g}"
                rate = replay_rate(fn, x, seconds)
                record(Row(label[:18], "fp16", "graph replay (GPU only)", b, rate, "img/s", note))
        engine.close()


def pool_rate(runners: list[TorchRunner], rows: int, clients: int, seconds: float) -> float:
    """Images/s through Stoker's batcher and runner pool (no HTTP, no codec): ``clients``
    coroutines each sending requests of ``rows`` UINT8 images, batches up to the largest
    bucket, with the runners given."""
    return pool_latencies(runners, rows, clients, seconds)[0]


def bench_runner(name: str, path: Path, seconds: float, mode: str) -> None:
    """One engine as a GPU config serves it (fp16, UINT8 pixels normalised on the GPU),
    compiled in ``mode`` or not: startup, GPU memory of the weights and of each runner, graph
    replay, runners from threads, the batcher and pool over the same runners (rows of 32 and
    of 256 per request), and batch-1 latency."""
    from engines.devices.options import GpuOptions

    print(f"== {name} fp16, compile {mode}: runner, pool, latency, memory", flush=True)
    t0 = time.perf_counter()
    compile_options = GpuOptions(compile=mode)  # type: ignore[arg-type]
    engine = make_engine(path, "fp16", (1, 32, 128, 256), gpu=compile_options)
    runners = [engine.new_runner() for _ in range(2)]
    what = f"compile {mode}"
    record(Row(name, "fp16", f"startup, 2 runners ({what})", 0, time.perf_counter() - t0, "s"))
    record(Row(name, "fp16", "GPU memory: weights", 0, engine.weight_bytes[0] / 2**20, "MiB"))
    for i, used in enumerate(engine.runner_bytes):
        record(Row(name, "fp16", f"GPU memory: runner {i + 1} (4 buckets x 2)", 0,
                   used / 2**20, "MiB"))  # fmt: skip
    for b in (32, 128, 256):
        gpu = graph_rate(runners[0], b, seconds)
        record(Row(name, "fp16", f"graph replay ({what})", b, gpu, "img/s"))
        two = runner_rate(runners, pixels(b), seconds)
        record(Row(name, "fp16", f"runner.run UINT8, 2 runners ({what})", b, two, "img/s",
                   f"/graph {two / gpu:.2f}"))  # fmt: skip
        loads = {128: ((128, 4),), 256: ((32, 16), (32, 32), (256, 4))}.get(b, ())
        for rows, clients in loads:
            rate = pool_rate(runners, rows, clients, seconds)
            record(Row(name, "fp16", f"pool: {rows} rows/request, c={clients} ({what})",
                       b, rate, "img/s", f"/runners {rate / two:.2f}"))  # fmt: skip
    record(Row(name, "fp16", f"latency runner.run UINT8 ({what})", 1,
               latency_ms(runners[0], pixels(1)[0]), "ms"))  # fmt: skip
    for r in runners:
        r.close()
    engine.close()


def pool_latencies(
    runners: list[TorchRunner], rows: int, clients: int, seconds: float
) -> tuple[float, float, float]:
    """Images/s through the batcher and pool as ``pool_rate`` measures it, with the median
    and p99 of the requests' own latency (ms) in the median window."""
    from app.engine.batcher import Batcher
    from app.metrics import ModelMetrics
    from app.engine.pool import RunnerPool
    from app.engine.repository import DynamicBatching

    engine = runners[0].engine
    batches = pixels(rows)

    async def window(limit: float) -> tuple[float, float, float]:
        pool = RunnerPool(engine, list(runners), "bench")
        largest = engine.buckets[-1]
        policy = DynamicBatching(max_queue_delay_us=2000, preferred_batch_size=[largest])
        batcher = Batcher(pool, policy, ModelMetrics("bench", engine.precision), largest)
        batcher.start()
        done, took, stop = [0], [], time.perf_counter() + limit

        async def client(i: int) -> None:
            n = i
            while time.perf_counter() < stop:
                t = time.perf_counter()
                out = await batcher.infer({"input": batches[n % len(batches)]}, rows, "k", 30.0)
                took.append(time.perf_counter() - t)
                done[0] += len(out["logits"])
                n += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(clients)))
        elapsed = time.perf_counter() - t0
        await batcher.close(10.0)
        ms = np.array(took) * 1000
        return done[0] / elapsed, float(np.median(ms)), float(np.percentile(ms, 99))

    asyncio.run(window(min(0.5, seconds)))
    results = sorted((asyncio.run(window(seconds)) for _ in range(3)), key=lambda r: r[0])
    return results[1]


def bench_runner_counts(name: str, path: Path, seconds: float, mode: str) -> None:
    """#13's last figure: how many runners one GPU wants. One engine as a GPU config serves
    it (fp16, UINT8 pixels, buckets 1/32/128/256, compiled in ``mode``) with 1 to 4 runners:
    runners from threads at batch 32 and 256, then the batcher and pool over the same
    runners at two loads (32 rows x 32 clients, the service's binary run; 256 rows x 8
    clients), with each request's median and p99 latency, and each runner's GPU memory."""
    from engines.devices.options import GpuOptions

    print(f"== {name} fp16, compile {mode}: 1-4 runners per GPU", flush=True)
    t0 = time.perf_counter()
    engine = make_engine(path, "fp16", (1, 32, 128, 256), gpu=GpuOptions(compile=mode))  # type: ignore[arg-type]
    runners = [engine.new_runner() for _ in range(4)]
    record(Row(name, "fp16", f"startup, 4 runners (compile {mode})", 0,
               time.perf_counter() - t0, "s"))  # fmt: skip
    for i, used in enumerate(engine.runner_bytes):
        record(Row(name, "fp16", f"GPU memory: runner {i + 1}", 0, used / 2**20, "MiB"))
    for b in (32, 256):
        gpu = graph_rate(runners[0], b, seconds)
        record(Row(name, "fp16", "graph replay", b, gpu, "img/s"))
        for count in (1, 2, 3, 4):
            rate = runner_rate(runners[:count], pixels(b), seconds)
            record(Row(name, "fp16", f"runner.run UINT8, {count} runner(s)", b, rate, "img/s",
                       f"/graph {rate / gpu:.2f}"))  # fmt: skip
    for rows, clients in ((32, 32), (256, 8)):
        for count in (1, 2, 3, 4):
            rate, p50, p99 = pool_latencies(runners[:count], rows, clients, seconds)
            record(Row(name, "fp16", f"pool {rows} rows x c={clients}, {count} runner(s)", 256,
                       rate, "img/s", f"p50 {p50:.1f} ms, p99 {p99:.1f} ms"))  # fmt: skip
    for r in runners:
        r.close()
    engine.close()


def bench_copies() -> None:
    print("== host to device copies, 256 MiB", flush=True)
    nbytes = 256 << 20
    stream, done = cuda.Stream(0), cuda.Event(0)
    pinned, device = cuda.HostBuffer(nbytes), cuda.DeviceBuffer(0, nbytes)
    pageable = np.ones(nbytes, dtype=np.uint8)
    for label, src in (("pinned", pinned.ptr), ("pageable", pageable.ctypes.data)):
        times = []
        for _ in range(6):
            t0 = time.perf_counter()
            cuda.copy_to_device(device.ptr, src, nbytes, stream)
            done.record(stream)
            done.synchronize()
            times.append(time.perf_counter() - t0)
        record(Row("-", "-", f"H2D copy, {label} (engines.devices.cuda)", 0,
                   nbytes / statistics.median(times[1:]) / 1e9, "GB/s"))  # fmt: skip
    for resource in (pinned, device, done, stream):
        resource.close()


def bench_jpeg(seconds: float) -> None:
    import torchvision
    from PIL import Image
    from torchvision.io import decode_jpeg
    from torchvision.transforms.v2 import functional as tvf

    print("== JPEG decode + resize 256 + crop 224, 640x480 photos", flush=True)
    # The bench's synthetic photos, so these numbers and the service's JPEG runs decode alike.
    jpegs = [
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        for data in payloads.synthetic_images(16, 640, 480)
    ]
    batch = [jpegs[i % len(jpegs)] for i in range(128)]

    def gpu_window(limit: float) -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < limit:
            images = decode_jpeg(batch, device="cuda")
            resized = [tvf.center_crop(tvf.resize(i, [256], antialias=True), [224]) for i in images]
            torch.stack(resized).cpu()
            n += len(batch)
        return n / (time.perf_counter() - t0)

    rate = windows(gpu_window, seconds)
    record(Row("-", "-", f"GPU decode_jpeg (tv {torchvision.__version__})", 128, rate, "img/s"))

    def cpu_window(limit: float) -> float:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < limit:
            img = Image.open(io.BytesIO(batch[n % len(batch)].numpy().tobytes())).convert("RGB")
            img.resize((341, 256), Image.Resampling.BILINEAR).crop((58, 16, 282, 240))
            n += 1
        return n / (time.perf_counter() - t0)

    record(Row("-", "-", "CPU PIL decode, one core", 1, windows(cpu_window, seconds), "img/s"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--models", type=Path, default=Path("/tmp/stoker-models"))
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument(
        "--only", default="models,precisions,served,streams,scaling,reference,copies,jpeg"
    )
    parser.add_argument("--compile-modes", default="default,max-autotune-no-cudagraphs")
    parser.add_argument("--compile-models", default="efficientnet_lite0")
    parser.add_argument("--runner-modes", default="none,default")
    parser.add_argument("--runner-models", default="resnet50,efficientnet_lite0")
    parser.add_argument("--counts-mode", default="default")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    env = {"torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version(), "gpu": props.name,
           "sms": props.multi_processor_count, "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    print("env:", env, flush=True)
    resnet = model_path("resnet50", args.models)
    steps: list[tuple[str, Callable[[], None]]] = [
        ("models", lambda: bench_model("resnet50", resnet, args.seconds)),
        (
            "models",
            lambda: bench_model(
                "efficientnet_lite0", model_path("efficientnet_lite0", args.models), args.seconds
            ),
        ),
        ("precisions", lambda: bench_precisions(resnet, args.seconds)),
        ("served", lambda: bench_as_served("resnet50", resnet, 64, 32, args.seconds)),
        (
            "served",
            lambda: bench_as_served(
                "efficientnet_lite0",
                model_path("efficientnet_lite0", args.models),
                32,
                32,
                args.seconds,
            ),
        ),
        ("streams", lambda: bench_streams(resnet, args.seconds)),
        ("scaling", lambda: bench_scaling(resnet, args.seconds)),
        ("gpus", lambda: bench_gpus(resnet, args.seconds)),
        ("reference", lambda: bench_reference(args.seconds)),
        ("copies", bench_copies),
        (
            "compiled",
            lambda: bench_compiled(
                {"resnet50": resnet}
                | {
                    m: model_path(m, args.models)
                    for m in args.compile_models.split(",")
                    if m not in ("", "none")
                },
                args.seconds,
                args.compile_modes.split(","),
            ),
        ),
        (
            "graphs",
            lambda: bench_graphs(
                {
                    "resnet50": resnet,
                    "efficientnet_lite0": model_path("efficientnet_lite0", args.models),
                },
                args.seconds,
            ),
        ),
        ("jpeg", lambda: bench_jpeg(args.seconds)),
    ]
    for mode in args.runner_modes.split(","):
        for name in args.runner_models.split(","):
            steps.append(
                (
                    "runner",
                    lambda name=name, mode=mode: bench_runner(  # type: ignore[misc]
                        name, model_path(name, args.models), args.seconds, mode
                    ),
                )
            )
    for name in args.runner_models.split(","):
        steps.append(
            (
                "counts",
                lambda name=name: bench_runner_counts(  # type: ignore[misc]
                    name, model_path(name, args.models), args.seconds, args.counts_mode
                ),
            )
        )
    for key in args.only.split(","):
        for name, step in steps:
            if name != key:
                continue
            try:
                step()
            except Exception as exc:  # one failed section must not lose the others' numbers
                print(f"!! {key}: {type(exc).__name__}: {exc}", flush=True)
                note = str(exc)[:80]
                record(Row("-", "-", f"FAILED {key}: {type(exc).__name__}", 0, 0, "", note))
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_bench.json").write_text(
        json.dumps({"env": env, "rows": [r.__dict__ for r in ROWS]}, indent=1)
    )
    print("\n| model | precision | what | batch | value | note |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in ROWS:
        value = f"{r.value:,.1f} {r.unit}"
        print(f"| {r.model} | {r.precision} | {r.what} | {r.batch} | {value} | {r.note} |")


if __name__ == "__main__":
    main()
