"""Images/s against runners per GPU, from ``gpu_bench.py --only counts``'s JSON: runners from
threads at batch 32 and 256, and the batcher + pool at its two loads, one panel per model,
with each pool point's p99 latency written beside it.

    python3 scripts/plot_runners.py docs/benchmarks/h200-run19/gpu_bench.json \
        docs/benchmarks/h200-runners.png
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

COUNT = re.compile(r"(\d) runner\(s\)")
P99 = re.compile(r"p99 ([\d.]+) ms")


def series(path: Path) -> dict[str, dict[str, list[tuple[int, float, str]]]]:
    """model -> curve label -> [(runners, img/s, p99 label)]."""
    curves: dict[str, dict[str, list[tuple[int, float, str]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for row in json.loads(path.read_text())["rows"]:
        count = COUNT.search(row["what"])
        if count is None or row["unit"] != "img/s":
            continue
        if row["what"].startswith("runner.run"):
            label = f"runners from threads, batch {row['batch']}"
        else:
            label = row["what"].split(",")[0]  # "pool 32 rows x c=32"
        p99 = P99.search(row["note"])
        curves[row["model"]][label].append(
            (int(count.group(1)), row["value"], f"{p99.group(1)} ms" if p99 else "")
        )
    return curves


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    source, target = Path(sys.argv[1]), Path(sys.argv[2])
    curves = series(source)
    figure, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4.5), squeeze=False)
    for axis, (model, lines) in zip(axes[0], curves.items(), strict=True):
        for i, (label, points) in enumerate(lines.items()):
            xs, ys, notes = zip(*sorted(points), strict=True)
            style = "--" if label.startswith("runners") else "-"
            axis.plot(xs, ys, style, marker="o", label=label)
            for x, y, note in zip(xs, ys, notes, strict=True):
                if note:
                    axis.annotate(f"p99 {note}", (x, y), textcoords="offset points",
                                  xytext=(4, -10 + 9 * (i % 2)), fontsize=7)  # fmt: skip
        axis.set_title(f"{model} FP16, compiled, one H200")
        axis.set_xlabel("runners on the GPU")
        axis.set_ylabel("images/s")
        axis.set_xticks([1, 2, 3, 4])
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    figure.savefig(target, dpi=120)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
