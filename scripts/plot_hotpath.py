"""Charts of one ``h200_hotpath.sh`` call's JSON: img/s and p99 against clients at 32 rows a
request for each tree (and the in-process pool), and batch-1 req/s at c=256 for each tree
(and the naive server).

    python3 scripts/plot_hotpath.py docs/benchmarks/h100-2026-12-06-crossing/call6 \\
        docs/benchmarks/h100-2026-12-06-crossing/call6.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def steps(path: Path, target: str) -> list[tuple[int, float, float]]:
    """(clients, rows/s, p99 ms) of ``target``'s steps in a bench JSON."""
    found = []
    for entry in json.loads(path.read_text())["targets"]:
        if entry["name"] == target:
            for step in entry["steps"]:
                found.append((step["concurrency"], step["rows_per_s"], step["latency_ms"]["p99"]))
    return sorted(found)


def main(folder: Path, target: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trees = sorted(p.name.removesuffix("_u8_rows32.json") for p in folder.glob("*_u8_rows32.json"))
    figure, (rate, p99, one) = plt.subplots(1, 3, figsize=(15, 4.5))
    for tree in trees:
        name = "in-process" if tree == "pool" else "target"
        got = steps(folder / f"{tree}_u8_rows32.json", name)
        clients = [c for c, _, _ in got]
        rate.plot(clients, [r for _, r, _ in got], marker="o", label=tree)
        p99.plot(clients, [p for _, _, p in got], marker="o", label=tree)
    for axis, title in ((rate, "img/s, 32 rows a request"), (p99, "p99 ms, 32 rows a request")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent clients")
        axis.set_title(title)
        axis.legend()
        axis.grid(alpha=0.3)
    bars = []
    for tree in [t for t in trees if t != "pool"]:
        for name in ("target", "naive"):
            for _, r, p in steps(folder / f"{tree}_u8_rows1.json", name):
                bars.append((f"{tree}" if name == "target" else "naive", r, p))
    one.bar([b[0] for b in bars], [b[1] for b in bars], color="tab:blue")
    for i, (_, r, p) in enumerate(bars):
        one.text(i, r, f"{r:,.0f}\np99 {p:.0f} ms", ha="center", va="bottom", fontsize=8)
    one.set_title("batch 1 at c=256, req/s")
    figure.tight_layout()
    figure.savefig(target, dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
