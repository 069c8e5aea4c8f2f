"""What the crossing to a decode process costs a batch, on the CPU (no GPU needed).

The same ``TorchImageDecoder`` (device "cpu") with a stand-in JPEG decoder that returns a
fixed 8x8 image at once (``instant_decode``) and rows of 8x8 (next to no pixel work, so what
is left is the crossing's own cost, not the CPU's resize), called in this process and
through a ``DecodeProcess`` (the JPEG bytes into its shared input slot, the message over the
pipe, the child's slot thread and ordered answer, the rows copied out of the shared buffer):
the difference per batch is the crossing, for batches of 1 to 256 uploads of ``--kb`` KB.

    .venv/bin/python scripts/decode_crossing_bench.py [--batches 1,32,128,256] [--kb 110]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engines.backends.torch.decode_process import DecodeProcess
from engines.backends.torch.images import TorchImageDecoder
from engines.preprocess import ImagePreprocess


def instant_decode(data: Any, device: Any = None) -> Any:
    """torchvision's ``decode_jpeg`` signature, an 8x8 grey image for each upload."""
    if isinstance(data, list):
        return [instant_decode(one) for one in data]
    return torch.full((3, 8, 8), 128, dtype=torch.uint8)


def per_batch(call: Any, batch: list[bytes | None], repeat: int) -> float:
    """Median seconds of ``call(batch)`` after three warm-up calls."""
    for _ in range(3):
        call(batch)
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        call(batch)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,32,128,256")
    parser.add_argument("--kb", type=int, default=110)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = ImagePreprocess(resize_shorter=8, crop=8, datatype="UINT8")
    sizes = [int(b) for b in args.batches.split(",")]
    local = TorchImageDecoder(spec, "cpu", instant_decode)
    child = DecodeProcess(spec, "cpu", max(sizes), instant_decode, label="crossing")
    payload = bytes(range(256)) * (args.kb * 4)
    print("| batch | in this process ms | through a decode process ms | the crossing ms |")
    print("| ---: | ---: | ---: | ---: |")
    try:
        for size in sizes:
            batch: list[bytes | None] = [payload] * size
            here = per_batch(local.decode, batch, args.repeat)
            there = per_batch(child, batch, args.repeat)
            print(f"| {size} | {here * 1e3:.2f} | {there * 1e3:.2f} | {(there - here) * 1e3:.2f} |")
    finally:
        child.close()


if __name__ == "__main__":
    main()
