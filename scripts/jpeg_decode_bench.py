"""Where a batch of JPEG uploads spends its time on the GPU: torchvision's batched nvJPEG
decode alone, then the whole ``TorchImageDecoder.decode`` (decode, batched resize and crop,
rows left on the device), at several batch sizes, on a folder of real photos; then torch's
profiler over one batch (CPU time per op: what the decoder thread pays in Python/launches);
then 1-4 decoders side by side in threads of this process, and in processes of their own.

    python3 scripts/jpeg_decode_bench.py PHOTOS [--batches 64,128,256] [--processes 1,2,3,4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from torchvision.io import ImageReadMode, decode_jpeg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("photos", type=Path)
    parser.add_argument("--batches", default="64,128,256")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--processes", default="1,2,3,4", help="decode processes side by side")
    args = parser.parse_args()
    datas = [p.read_bytes() for p in sorted(args.photos.glob("*.JPEG"))]
    decoder = TorchImageDecoder(ImagePreprocess(datatype="UINT8"), "cuda:0")
    rows = []
    for size in [int(b) for b in args.batches.split(",")]:
        batch = [datas[i % len(datas)] for i in range(size)]
        tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in batch]
        nvjpeg = timed(lambda: decode_jpeg(tensors, device="cuda:0", mode=ImageReadMode.RGB))
        whole = timed(lambda: decoder.decode(batch))
        rows.append((size, size / nvjpeg, size / whole, whole / size * 1e6))
    # Decoders side by side, each called from a thread of its own (the service's
    # ``models.decode_workers``, on a stream each, or ``models.decode_processes``): does the
    # CPU side of one batch overlap another's?
    batch64 = [datas[i % len(datas)] for i in range(64)]
    parallel = []
    for workers in (1, 2, 3, 4):
        decoders = [
            TorchImageDecoder(ImagePreprocess(datatype="UINT8"), "cuda:0") for _ in range(workers)
        ]
        parallel.append(("threads", workers, side_by_side([d.decode for d in decoders], batch64)))
    for count in [int(n) for n in args.processes.split(",") if n]:
        children = [
            DecodeProcess(ImagePreprocess(datatype="UINT8"), "cuda:0", 64, label=str(i))
            for i in range(count)
        ]
        try:
            parallel.append(("processes", count, side_by_side(children, batch64)))
        finally:
            for child in children:
                child.close()
    from torch.profiler import ProfilerActivity, profile

    batch = [datas[i % len(datas)] for i in range(64)]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        decoder.decode(batch)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "jpeg_decode_profile.txt").write_text(table)
    print(table)
    print(f"{len(datas)} photos, mean {sum(map(len, datas)) / len(datas) / 1000:.0f} KB")
    print("| batch | nvJPEG decode img/s | decode+resize+crop img/s | us per image |")
    print("| ---: | ---: | ---: | ---: |")
    for size, a, b, us in rows:
        print(f"| {size} | {a:,.0f} | {b:,.0f} | {us:.0f} |")
    print("| decoders | in | decode+resize+crop img/s, batches of 64 |")
    print("| ---: | --- | ---: |")
    for where, workers, rate in parallel:
        print(f"| {workers} | {where} | {rate:,.0f} |")


if __name__ == "__main__":
    main()
