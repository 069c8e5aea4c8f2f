"""The bench's outputs: a table on the terminal as steps finish, JSON, and PNG plots."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import orjson

from bench.loadgen import StepResult

COLUMNS = (
    ("target", 19),
    ("load", 9),
    ("req/s", 9),
    ("rows/s", 9),
    ("p50", 8),
    ("p90", 8),
    ("p99", 8),
    ("p99.9", 8),
    ("max", 8),
    ("errors", 7),
    ("batch", 6),
    ("queue", 7),
    ("infer", 7),
    ("cpu", 5),
)
PACKAGES = (
    "stoker",
    "numpy",
    "onnxruntime",
    "aiohttp",
    "fastapi",
    "uvicorn",
    "prometheus-client",
    "grpcio",
    "protobuf",
)


@dataclass
class TargetResult:
    name: str
    description: str
    steps: list[StepResult] = field(default_factory=list)
    found_rate: StepResult | None = None
    p99_target_ms: float | None = None

    def closed(self) -> dict[int, StepResult]:
        return {s.step.concurrency: s for s in self.steps if s.step.mode == "closed"}

    def closed_rounds(self) -> dict[int, list[StepResult]]:
        """Each closed-loop concurrency's steps, one a round (``--rounds``), in order."""
        rounds: dict[int, list[StepResult]] = {}
        for step in self.steps:
            if step.step.mode == "closed":
                rounds.setdefault(step.step.concurrency, []).append(step)
        return rounds

    def as_json(self) -> dict[str, Any]:
        found = None
        if self.p99_target_ms is not None:
            found = {
                "p99_target_ms": self.p99_target_ms,
                "rate": self.found_rate.step.rate if self.found_rate else None,
                "step": self.found_rate.as_json() if self.found_rate else None,
            }
        return {
            "name": self.name,
            "description": self.description,
            "steps": [s.as_json() for s in self.steps],
            "find_rate": found,
        }


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def header() -> str:
    titles = " ".join(f"{name:>{width}}" for name, width in COLUMNS)
    units = "latency in ms; batch: server's mean realised batch size; queue, infer: server's "
    units += "mean ms per request; cpu: client cores"
    return f"{titles}\n{units}"


def row(target: str, result: StepResult) -> str:
    step = result.step
    load = f"c={step.concurrency}" if step.mode == "closed" else f"{step.rate:.0f}/s"
    lat = result.latency_ms
    server = result.server
    cells = (
        target[:19],
        load,
        _number(result.throughput),
        _number(result.rows_per_s),
        _ms(lat["p50"]),
        _ms(lat["p90"]),
        _ms(lat["p99"]),
        _ms(lat["p99.9"]),
        _ms(lat["max"]),
        str(result.errors),
        _number(server.mean_batch_size, 2),
        _ms(server.queue_ms),
        _ms(server.compute_infer_ms),
        f"{result.client_cpu:.2f}",
    )
    return " ".join(f"{cell:>{width}}" for cell, (_, width) in zip(cells, COLUMNS, strict=True))


def error_lines(target: str, result: StepResult) -> list[str]:
    bad = {s: n for s, n in result.statuses.items() if not s.startswith("2")}
    return [f"  {target}: errors by status {bad}"] if bad else []


def _ratios(mine: list[StepResult], theirs: list[StepResult]) -> list[float]:
    """Throughput ratios of the same rounds (round i with round i)."""
    return [
        m.throughput / t.throughput if t.throughput else float("inf")
        for m, t in zip(mine, theirs, strict=False)
    ]


def comparison(targets: Sequence[TargetResult]) -> list[str]:
    """Closed-loop throughput of the first target over each other one, step by step (same
    run, same payloads, same machine); over several rounds, the median of the rounds'
    ratios and each of them."""
    if len(targets) < 2:
        return []
    first = targets[0]
    lines = []
    for other in targets[1:]:
        mine_all, theirs_all = first.closed_rounds(), other.closed_rounds()
        shared = sorted(set(mine_all) & set(theirs_all))
        if not shared:
            continue
        lines.append(f"{first.name} / {other.name} (closed loop):")
        for c in shared:
            mine, theirs = mine_all[c][-1], theirs_all[c][-1]
            ratios = _ratios(mine_all[c], theirs_all[c])
            if len(ratios) == 1:
                lines.append(
                    f"  c={c:<4} {mine.throughput:10,.1f} / {theirs.throughput:10,.1f} req/s "
                    f"= {ratios[0]:5.2f}x   p99 {_ms(mine.latency_ms['p99'])} vs "
                    f"{_ms(theirs.latency_ms['p99'])} ms"
                )
                continue
            each = ", ".join(f"{r:.2f}" for r in ratios)
            lines.append(
                f"  c={c:<4} median {statistics.median(ratios):5.2f}x of {len(ratios)} rounds "
                f"({each}); req/s medians {_median_rate(mine_all[c]):,.1f} / "
                f"{_median_rate(theirs_all[c]):,.1f}"
            )
    return lines


def _median_rate(steps: list[StepResult]) -> float:
    return statistics.median(s.throughput for s in steps)


def ratios_json(targets: Sequence[TargetResult]) -> list[dict[str, Any]]:
    if len(targets) < 2:
        return []
    first = targets[0]
    result = []
    for other in targets[1:]:
        mine_all, theirs_all = first.closed_rounds(), other.closed_rounds()
        for c in sorted(set(mine_all) & set(theirs_all)):
            ratios = _ratios(mine_all[c], theirs_all[c])
            result.append(
                {
                    "numerator": first.name,
                    "denominator": other.name,
                    "concurrency": c,
                    "throughput_ratio": statistics.median(ratios) if ratios else None,
                    "rounds": ratios,
                }
            )
    return result


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    versions: dict[str, str | None] = {}
    for package in PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "packages": versions,
        # Other work on the machine skews every number; the bench's own processes count too.
        "load_average": list(os.getloadavg()),
    }


def write_json(
    path: Path, targets: Sequence[TargetResult], settings: dict[str, Any], command: list[str]
) -> None:
    document = {
        "command": command,
        "machine": machine(),
        "settings": settings,
        "targets": [t.as_json() for t in targets],
        "ratios": ratios_json(targets),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))


def write_plots(folder: Path, targets: Sequence[TargetResult], title: str) -> list[Path]:
    """``throughput.png`` (req/s against concurrency) and ``latency.png`` (p50/p90/p99
    against achieved req/s, closed and open loop)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    folder.mkdir(parents=True, exist_ok=True)
    written = []

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for target in targets:
        closed = sorted(target.closed().items())
        if closed:
            axes.plot(
                [c for c, _ in closed], [s.throughput for _, s in closed], "o-", label=target.name
            )
    axes.set_xscale("log", base=2)
    axes.set_xlabel("concurrent clients")
    axes.set_ylabel("requests/s")
    axes.set_title(f"Throughput: {title}")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path = folder / "throughput.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    written.append(path)

    figure, axes = plt.subplots(figsize=(7, 4.5))
    styles = {"p50": "o-", "p90": "s--", "p99": "^:"}
    for index, target in enumerate(targets):
        # A line follows the load as it rises: the closed loop by concurrency, the open loop
        # (fixed rates and the rate search) by offered rate, as points of their own.
        sweep = sorted(
            (s for s in target.steps if s.step.mode == "closed"), key=lambda s: s.step.concurrency
        )
        rates = sorted(
            (s for s in target.steps if s.step.mode == "open"), key=lambda s: s.step.rate
        )
        for steps, suffix, line in ((sweep, "", True), (rates, " open loop", False)):
            for name, style in styles.items():
                points = [(s.throughput, s.latency_ms[name]) for s in steps]
                shown = [(x, y) for x, y in points if y is not None]
                if shown:
                    axes.plot(
                        [x for x, _ in shown],
                        [y for _, y in shown],
                        style if line else style[0],
                        color=f"C{index}",
                        alpha=1.0 if line else 0.5,
                        label=f"{target.name} {name}{suffix}",
                    )
    axes.set_yscale("log")
    axes.yaxis.set_major_formatter(ScalarFormatter())
    axes.set_xlabel("requests/s achieved")
    axes.set_ylabel("latency (ms)")
    axes.set_title(f"Latency against throughput: {title}")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    path = folder / "latency.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    written.append(path)
    return written


def say(line: str, out: TextIO = sys.stdout) -> None:
    print(line, file=out, flush=True)
