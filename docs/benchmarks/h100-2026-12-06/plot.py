"""32-row UINT8 requests on one H100 (2026-12-06): img/s and p99 against clients for a833e8c's
server, this tree's server and the in-process pool, from the JSON in hotpath/.

    python3 docs/benchmarks/h100-2026-12-06/plot.py
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

here = Path(__file__).parent
series = {
    "a833e8c (served default)": ("base_u8_rows32.json", "target"),
    "8a3b9b6 (served default)": ("this_u8_rows32.json", "target"),
    "in-process pool": ("pool_u8_rows32.json", "in-process"),
}
fig, (rate, tail) = plt.subplots(1, 2, figsize=(11, 4))
for label, (name, target) in series.items():
    doc = json.loads((here / "hotpath" / name).read_text())
    steps = next(t["steps"] for t in doc["targets"] if t["name"] == target)
    cs = [s["concurrency"] for s in steps]
    rate.plot(cs, [s["rows_per_s"] for s in steps], marker="o", label=label)
    tail.plot(cs, [s["latency_ms"]["p99"] for s in steps], marker="o", label=label)
for axis, what in ((rate, "images/s"), (tail, "p99 ms")):
    axis.set_xscale("log", base=2)
    axis.set_xlabel("clients (32 images a request)")
    axis.set_ylabel(what)
    axis.grid(alpha=0.3)
rate.legend()
fig.suptitle("ResNet-50 FP16 compiled, 4 runners, 4 front ends, one H100, one call")
fig.tight_layout()
fig.savefig(here / "rows32.png", dpi=110)
