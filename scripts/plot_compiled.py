"""Images/s of the torch runner compiled and not, from ``gpu_bench.py --only runner``'s log:
graph replay, two runners from threads, and the batcher + pool over those runners, at batch
32, 128 and 256, one panel per model.

    python3 scripts/plot_compiled.py docs/benchmarks/h200-run16/gpu_bench.log \
        docs/benchmarks/h200-compiled.png
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROW = re.compile(r"^  (\S+)\s+fp16\s+(.+?)\s+b=(\d+)\s+([\d,.]+) img/s")
MODE = re.compile(r"\(compile (\w+)\)")
KINDS = {"graph replay": "graph", "runner.run UINT8, 2": "runners", "pool: ": "pool"}


def read(log: Path) -> dict[tuple[str, str, str, int], float]:
    """(model, what, mode, batch) -> img/s; ``what``: graph, runners or pool (the pool's
    32-rows-per-request load at batch 256, its whole-batch load at 128)."""
    values = {}
    for line in log.read_text().splitlines():
        match = ROW.match(line)
        mode = MODE.search(line)
        if match is None or mode is None:
            continue
        model, what, batch, value = match.groups()
        for start, name in KINDS.items():
            if what.startswith(start):
                if name == "pool" and not ("32 rows/request, c=32" in what or int(batch) == 128):
                    continue
                values[(model, name, mode.group(1), int(batch))] = float(value.replace(",", ""))
    return values


def main(log: Path, target: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = read(log)
    models = sorted({key[0] for key in values})
    figure, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.8), squeeze=False)
    series = [(what, mode) for mode in ("none", "default") for what in ("graph", "runners", "pool")]
    batches = (32, 128, 256)
    width = 0.8 / len(series)
    for axis, model in zip(axes[0], models, strict=True):
        for i, (what, mode) in enumerate(series):
            heights = [values.get((model, what, mode, b), 0.0) for b in batches]
            at = [j + (i - len(series) / 2 + 0.5) * width for j in range(len(batches))]
            label = f"{what}, {'compiled' if mode == 'default' else 'not compiled'}"
            axis.bar(at, heights, width, label=label, hatch="" if mode == "default" else "//")
        axis.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
        axis.set_title(f"{model} FP16, one H200")
        axis.set_ylabel("images/s")
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(target, dpi=110)
    print(f"wrote {target}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
