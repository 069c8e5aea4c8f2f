"""Images/s and p99 against clients, one line per target, from the tables ``stoker bench``
prints (the lines ``target  c=N  req/s  rows/s  p50  p90  p99 ...``), for a run whose JSON
did not come back from the GPU machine but whose printed tables did.

    python3 scripts/plot_bench_table.py TABLES.txt OUT.png --title "..." [--section NAME]

``--section``: only the table under the line ``-- NAME`` (default: the first).
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

ROW = re.compile(r"^\s*(\S+)\s+c=(\d+)\s+([\d,.]+)\s+([\d,.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)")


def rows(text: str, section: str | None) -> dict[str, list[tuple[int, float, float]]]:
    """Per target: (clients, rows/s, p99 ms) of each step, in the order printed."""
    found: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    inside = section is None
    for line in text.splitlines():
        if line.startswith("-- "):
            if found and inside:
                break
            inside = section is None or line[3:].startswith(section)
            continue
        match = ROW.match(line)
        if inside and match:
            name, clients, _, per_s, _, _, p99 = match.groups()
            found[name].append((int(clients), float(per_s.replace(",", "")), float(p99)))
    return dict(found)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("tables", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--title", default="")
    parser.add_argument("--section")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = rows(args.tables.read_text(), args.section)
    if not data:
        raise SystemExit(f"no bench table rows in {args.tables}")
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, steps in data.items():
        clients = [s[0] for s in steps]
        left.plot(clients, [s[1] for s in steps], marker="o", label=name)
        right.plot(clients, [s[2] for s in steps], marker="o", label=name)
    for axis, label in ((left, "images/s"), (right, "p99 latency, ms")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent clients")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
        axis.legend()
    left.set_ylim(bottom=0)
    figure.suptitle(args.title)
    figure.tight_layout()
    figure.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
