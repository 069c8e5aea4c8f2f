"""How long a full collection stops a process like the engine, and after ``gc.freeze``:
with torch imported, then after compiling a small model for four batch sizes (Inductor on
the CPU, as the engine compiles on a GPU), then frozen (``engines.heap.freeze_heap``).

    python scripts/gc_pause.py          (the median of 5 collections each; prints a table)
"""

from __future__ import annotations

import gc
import statistics
import time


def collection_ms() -> float:
    times = []
    for _ in range(5):
        started = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def main() -> None:
    rows = [("nothing imported", len(gc.get_objects()), collection_ms())]
    import torch

    rows.append(("torch imported", len(gc.get_objects()), collection_ms()))
    layers = [torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU())]
    compiled = torch.compile(torch.nn.Sequential(*(layers * 20)))
    with torch.no_grad():
        for batch in (1, 2, 4, 8):
            compiled(torch.randn(batch, 8, 16, 16))
    rows.append(("a small model compiled, 4 batch sizes", len(gc.get_objects()), collection_ms()))
    gc.freeze()
    rows.append(("the same, frozen", len(gc.get_objects()), collection_ms()))
    print("| process | objects tracked | a full collection, ms |")
    print("| --- | ---: | ---: |")
    for what, objects, ms in rows:
        print(f"| {what} | {objects:,} | {ms:.1f} |")


if __name__ == "__main__":
    main()
