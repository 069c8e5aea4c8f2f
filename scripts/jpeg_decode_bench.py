"""Where a batch of JPEG uploads spends its time on the GPU: torchvision's batched nvJPEG
decode alone, then the whole ``TorchImageDecoder.decode`` (decode, batched resize and crop,
rows left on the device), at several batch sizes, on a folder of real photos; then torch's
profiler over one batch (CPU time per op: what the decoder thread pays in Python/launches);
then 1-4 decoders side by side in threads of this process, and in processes of their own;
for each decoder named (torchvision's, nvImageCodec's with a share to the hardware engines).
With ``--baseline`` (``git show REV:engines/backends/torch/images.py > FILE``), that version's
``TorchImageDecoder`` beside this one, on batches of sizes seen before (the same batch again)
and of sizes never seen (every photo cropped to a size of its own and encoded again), as
uploads from many sources are. With ``--chain STORE`` (an engine store the served default
filled: ``scripts/h200_jpeg.sh`` runs it after the service), the chain the service runs, in
one process on one stream: a batch decoded and resized by ``TorchImageDecoder``, its rows
left on the GPU, then the compiled ResNet-50 FP16 of the store through a runner at that
batch (its CUDA graph), photos/s per batch size, with the decoder's default resize (the
Triton kernel) and with the matrix form; with ``--json FILE`` the chain's figures.

    python3 scripts/jpeg_decode_bench.py PHOTOS [--batches 64,128,256] [--processes 1,2,3,4]
        [--decoders torchvision,nvimgcodec,nvimgcodec:0.5,nvimgcodec:0] [--threads 1,2,4]
        [--baseline FILE] [--chain STORE [--json FILE]]
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import statistics
import sys
import threading
import time
from functools import partial
from pathlib import Path

import torch
from torchvision.io import ImageReadMode, decode_jpeg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engines.backends.torch import nvimgcodec
from engines.backends.torch.decode_process import DecodeProcess
from engines.backends.torch.images import TorchImageDecoder
from engines.preprocess import ImagePreprocess


def timed(fn, repeat: int = 7) -> float:  # type: ignore[no-untyped-def]
    """Median seconds of ``fn`` (after two warm-up calls), the GPU synchronised."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def side_by_side(decoders: list, batch: list[bytes], seconds: float = 3.0) -> float:  # type: ignore[type-arg]
    """Images/s of ``decoders`` each called in a loop from a thread of its own."""
    for decode in decoders:
        decode(batch)
    done = [0] * len(decoders)
    stop = time.perf_counter() + seconds

    def loop(i: int) -> None:
        while time.perf_counter() < stop:
            decoders[i](batch)
            done[i] += len(batch)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(decoders))]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(done) / (time.perf_counter() - started)


def decoders_named(names: str) -> dict[str, object]:
    """``decode_jpeg`` functions by name: torchvision, nvimgcodec (all to the hardware JPEG
    engines it can take), nvimgcodec:SHARE (that share of a batch offered to them)."""
    chosen: dict[str, object] = {}
    for name in names.split(","):
        if name == "torchvision":
            chosen[name] = partial(decode_jpeg, mode=ImageReadMode.RGB)
        else:
            share = float(name.split(":")[1]) if ":" in name else 1.0
            chosen[name] = partial(nvimgcodec.decode_jpeg, hardware_share=share)
    return chosen


def cpu_per_image(fn, images: int) -> float:  # type: ignore[no-untyped-def]
    """Microseconds of this thread's CPU an image for ``fn`` (the GIL-holding share)."""
    fn()
    torch.cuda.synchronize()
    started = time.thread_time()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return (time.thread_time() - started) / (3 * images) * 1e6


def unseen_batches(datas: list[bytes], count: int, size: int) -> list[list[bytes]]:
    """``count`` batches of ``size`` JPEGs, each photo cropped by an amount of its own (so
    sizes hardly repeat) and encoded again."""
    from PIL import Image

    batches, k = [], 0
    for b in range(count):
        batch = []
        for i in range(size):
            image = Image.open(io.BytesIO(datas[(b * size + i) % len(datas)])).convert("RGB")
            k += 1
            width, height = image.size
            cropped = image.crop((0, 0, width - k % 97 - 1, height - k // 97 - 1))
            encoded = io.BytesIO()
            cropped.save(encoded, format="JPEG", quality=90)
            batch.append(encoded.getvalue())
        batches.append(batch)
    return batches


def against_baseline(path: Path, datas: list[bytes], prep: ImagePreprocess) -> list[tuple]:  # type: ignore[type-arg]
    """(version, sizes, img/s) of this TorchImageDecoder and the one in ``path``, batches of
    64: the same batch again (median of 7), and batches of sizes never seen (median of 7
    batches after 2, a fresh decoder each)."""
    spec = importlib.util.spec_from_file_location("baseline_images", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    unseen = unseen_batches(datas, 9, 64)
    seen = [datas[i % len(datas)] for i in range(64)]
    found = []
    for version, cls in (("this tree", TorchImageDecoder), (path.name, module.TorchImageDecoder)):
        decoder = cls(prep, "cuda:0")
        found.append((version, "seen", 64 / timed(lambda: decoder.decode(seen))))  # noqa: B023
        fresh = cls(prep, "cuda:0")
        times = []
        for batch in unseen:
            torch.cuda.synchronize()
            started = time.perf_counter()
            fresh.decode(batch)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        found.append((version, "never seen", 64 / statistics.median(times[2:])))
    return found


def chain(store_root: Path, datas: list[bytes], sizes: list[int]) -> list[dict[str, float]]:
    """Photos/s of decode, decode + resize + crop, and the whole chain (those, then the
    store's compiled ResNet-50 FP16 through a runner, the rows handed over on the GPU), per
    batch size: median of 7 batches after 2, one stream, one thread."""
    from engines.backends.onnxruntime import read_spec
    from engines.backends.torch.engine import TorchEngine, TorchOptions
    from engines.base import EngineOptions
    from engines.devices.options import GpuOptions
    from engines.store import EngineStore

    store = EngineStore(store_root)
    variant = next(p for p in store.root.rglob("*fp16*.onnx"))
    spec = read_spec(variant, "resnet50", max(sizes))
    prep = ImagePreprocess(datatype="UINT8")
    engine = TorchEngine(
        variant,
        spec,
        EngineOptions(store=store),
        TorchOptions(
            image=ImagePreprocess(),
            batch_buckets=tuple(sorted(set(sizes))),
            gpu=GpuOptions(compile="default"),
        ),
    )
    runner = engine.new_runner()
    # The decoder's default (the resize kernel where Triton imports) and the matrix form.
    decoders = {
        "": TorchImageDecoder(prep, "cuda:0"),
        "_matrix": TorchImageDecoder(prep, "cuda:0", kernel=False),
    }
    if not decoders[""].kernel:
        print("the resize kernel does not run here: both columns are the matrix form")
    name = spec.inputs[0].name
    found = []
    try:
        for size in sizes:
            batch = [datas[i % len(datas)] for i in range(size)]
            tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in batch]
            alone = timed(lambda: decode_jpeg(tensors, device="cuda:0", mode=ImageReadMode.RGB))  # noqa: B023
            figures: dict[str, float] = {"batch": size, "decode": size / alone}
            for suffix, decoder in decoders.items():
                resized = timed(lambda: decoder.decode(batch))  # noqa: B023

                def whole() -> None:
                    rows, _ = decoder.decode(batch)  # noqa: B023
                    runner.run({name: rows})  # type: ignore[dict-item]

                figures["decode_resize" + suffix] = size / resized
                figures["chain" + suffix] = size / timed(whole)
            found.append(figures)
    finally:
        runner.close()
        engine.close()
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("photos", type=Path)
    parser.add_argument("--batches", default="64,128,256")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--processes", default="1,2,3,4", help="decode processes side by side")
    parser.add_argument("--threads", default="1,2,3,4", help="decoder threads side by side")
    parser.add_argument(
        "--decoders", default="torchvision", help="torchvision, nvimgcodec, nvimgcodec:SHARE"
    )
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--baseline", type=Path, help="another images.py to measure beside")
    parser.add_argument("--chain", type=Path, help="an engine store: the chain to the model")
    parser.add_argument("--json", type=Path, help="the chain's figures as JSON")
    args = parser.parse_args()
    datas = [p.read_bytes() for p in sorted(args.photos.glob("*.JPEG"))]
    prep = ImagePreprocess(datatype="UINT8")
    rows = []
    parallel = []
    reference = [
        torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas[: min(64, len(datas))]
    ]
    expected = decode_jpeg(reference, device="cuda:0", mode=ImageReadMode.RGB)
    for name, fn in decoders_named(args.decoders).items():
        got = fn(reference, device="cuda:0")
        differences = [
            "shape" if a is None or a.shape != b.shape else (a.float() - b.float()).abs().mean()
            for a, b in zip(got, expected, strict=True)
        ]
        worst = max((d for d in differences if not isinstance(d, str)), default=0.0)
        print(
            f"{name}: {sum(isinstance(d, str) for d in differences)} of {len(reference)} "
            f"photos not decoded or of another shape than torchvision's; the largest mean "
            f"difference from torchvision's pixels {float(worst):.3f} levels"
        )
        decoder = TorchImageDecoder(prep, "cuda:0", fn)
        for size in [int(b) for b in args.batches.split(",")]:
            batch = [datas[i % len(datas)] for i in range(size)]
            tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in batch]
            alone = timed(lambda: fn(tensors, device="cuda:0"))  # noqa: B023
            whole = timed(lambda: decoder.decode(batch))  # noqa: B023
            cpu = cpu_per_image(lambda: decoder.decode(batch), size)  # noqa: B023
            rows.append((name, size, size / alone, size / whole, whole / size * 1e6, cpu))
        # Decoders side by side, each called from a thread of its own (the service's
        # ``uploads.decode_workers``, on a stream each, or ``uploads.decode_processes``): does
        # the CPU side of one batch overlap another's?
        batch64 = [datas[i % len(datas)] for i in range(64)]
        for workers in [int(n) for n in args.threads.split(",") if n]:
            threaded = [TorchImageDecoder(prep, "cuda:0", fn) for _ in range(workers)]
            rate = side_by_side([d.decode for d in threaded], batch64)
            parallel.append((name, "threads", workers, rate))
        for count in [int(n) for n in args.processes.split(",") if n]:
            children = [
                DecodeProcess(prep, "cuda:0", 64, decode_jpeg=fn, label=str(i))
                for i in range(count)
            ]
            try:
                parallel.append((name, "processes", count, side_by_side(children, batch64)))
            finally:
                for child in children:
                    child.close()
    if not args.no_profile:
        from torch.profiler import ProfilerActivity, profile

        decoder = TorchImageDecoder(prep, "cuda:0")
        batch = [datas[i % len(datas)] for i in range(64)]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            decoder.decode(batch)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "jpeg_decode_profile.txt").write_text(table)
        print(table)
    compared = [] if args.baseline is None else against_baseline(args.baseline, datas, prep)
    print(f"{len(datas)} photos, mean {sum(map(len, datas)) / len(datas) / 1000:.0f} KB")
    print(
        "| decoder | batch | decode alone img/s | decode+resize+crop img/s | us per image "
        "| CPU us per image (calling thread) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, size, a, b, us, cpu in rows:
        print(f"| {name} | {size} | {a:,.0f} | {b:,.0f} | {us:.0f} | {cpu:.0f} |")
    print("| decoder | decoders | in | decode+resize+crop img/s, batches of 64 |")
    print("| --- | ---: | --- | ---: |")
    for name, where, workers, rate in parallel:
        print(f"| {name} | {workers} | {where} | {rate:,.0f} |")
    if args.chain is not None:
        sizes = [int(b) for b in args.batches.split(",")]
        chained = chain(args.chain, datas, sizes)
        if args.json:
            args.json.write_text(json.dumps(chained))
        print(
            "| batch | decode img/s | decode+resize+crop img/s, kernel / matrices "
            "| chain to the model img/s, kernel / matrices |"
        )
        print("| ---: | ---: | ---: | ---: |")
        for row in chained:
            print(
                f"| {row['batch']} | {row['decode']:,.0f} | {row['decode_resize']:,.0f} / "
                f"{row['decode_resize_matrix']:,.0f} | {row['chain']:,.0f} / "
                f"{row['chain_matrix']:,.0f} |"
            )
    if compared:
        print("| TorchImageDecoder of | image sizes | decode+resize+crop img/s, batches of 64 |")
        print("| --- | --- | ---: |")
        for version, sizes, rate in compared:
            print(f"| {version} | {sizes} | {rate:,.0f} |")


if __name__ == "__main__":
    main()
