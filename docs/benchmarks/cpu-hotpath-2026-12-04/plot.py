"""The bar chart of BENCHMARKS.md's "The hot path on this CPU" (issue 42): server CPU a
32-row UINT8 request (4.8 MB binary V2, the `pix` model, 2 front ends), medians of 7
alternating rounds, from the tables there.

    python docs/benchmarks/cpu-hotpath-2026-12-04/plot.py
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).parent
# Each comparison's own run: (older tree, main) server CPU a request in us, at c=8 and c=32
# (request_budget.py --against, 7 alternating rounds).
RUNS = {
    "against a833e8c": ("a833e8c", {8: (4172, 3147), 32: (5159, 3043)}),
    "against f99d1ba (session start)": ("f99d1ba", {8: (5772, 2754), 32: (6151, 3202)}),
}

figure, panels = plt.subplots(1, 2, figsize=(9, 4), sharey=True)
width = 0.38
for axes, (title, (older, steps)) in zip(panels, RUNS.items()):
    for i, (c, (before, after)) in enumerate(steps.items()):
        axes.bar(i - width / 2, before / 1000, width, color="#bbbbbb",
                 label=older if i == 0 else None)  # fmt: skip
        axes.bar(i + width / 2, after / 1000, width, color="#4477aa",
                 label="main" if i == 0 else None)  # fmt: skip
        axes.text(i + width / 2, after / 1000, f"{after / before:.2f}x", ha="center", va="bottom")
    axes.set_xticks(range(len(steps)), [f"c={c}" for c in steps])
    axes.set_title(title)
    axes.legend()
panels[0].set_ylabel("server CPU a request (ms)")
figure.suptitle("32 UINT8 images a request (4.8 MB), 2 front ends, 2-core EPYC: lower is better")
figure.tight_layout()
figure.savefig(HERE / "server-cpu-per-request.png", dpi=120)
