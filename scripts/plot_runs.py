"""Bar charts of a CSV of recorded H200 runs (``docs/benchmarks/h200-runs9-13.csv``): batch-1
requests/s against the naive server, and JPEG images/s, one bar group per step.

    python3 scripts/plot_runs.py docs/benchmarks/h200-runs9-13.csv \
        docs/benchmarks/h200-engine-per-frame.png
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path


def main(source: Path, target: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(source.open()))
    labels = [row["step"] for row in rows]
    at = range(len(rows))
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.4
    left.bar([i - width / 2 for i in at], [float(r["batch1_req_s"]) for r in rows], width,
             label="Stoker")  # fmt: skip
    left.bar([i + width / 2 for i in at], [float(r["naive_req_s"]) for r in rows], width,
             label="naive server")  # fmt: skip
    for i, row in enumerate(rows):
        ratio = float(row["batch1_req_s"]) / float(row["naive_req_s"])
        left.text(i - width / 2, float(row["batch1_req_s"]), f"{ratio:.1f}x", ha="center",
                  va="bottom", fontsize=8)  # fmt: skip
    left.set_title("UINT8 batch-1 at c=256 (ResNet-50 FP16, H200), req/s")
    right.bar([i - width / 2 for i in at], [float(r["jpeg_c64_img_s"]) for r in rows], width,
              label="c=64")  # fmt: skip
    right.bar([i + width / 2 for i in at], [float(r["jpeg_c256_img_s"]) for r in rows], width,
              label="c=256")  # fmt: skip
    right.set_title("JPEG uploads, 1 image/request, img/s")
    for axis in (left, right):
        axis.set_xticks(list(at), labels, rotation=30, ha="right", fontsize=8)
        axis.legend(fontsize=8)
        axis.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(target, dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
