"""``stoker accuracy``: what each precision of a model costs, on labelled photos.

Per precision: top-1 agreement with FP32, mean KL divergence of the softmax, top-1/top-5
against the labels that ImageNet file names carry, and img/s on this machine at several batch
sizes. Writes Markdown and a PNG (accuracy against speed; skipped, saying so, where matplotlib
is not installed). ``python -m bench accuracy`` is the same command from a source checkout.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from app.engine import models
from app.engine.repository import discover
from app.settings import Settings
from bench import accuracy_gpu
from engines import backends
from engines.precision import accuracy
from engines.precision.build import BuildPlan, budget_problems
from engines.precision.options import int8_recipe
from engines.preprocess import ImagePreprocess, load_image, preprocess
from engines.store import EngineStore

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp"}


# --int8-weights: Int8Options' reduce_range and keep_first_and_last per recipe (auto: the CPU).
RECIPES: dict[str, bool | None] = {"auto": None, "8": False, "7": True}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model to measure")
    parser.add_argument("--images", type=Path, required=True, help="folder of evaluation photos")
    parser.add_argument("--repository", type=Path, help="model repository folder")
    parser.add_argument("--limit", type=int, default=0, help="use at most N photos (0: all)")
    parser.add_argument(
        "--calibrate-on",
        type=int,
        default=0,
        metavar="N",
        help="calibrate INT8 on N of the photos (shuffled, seed 0) and evaluate on the rest, "
        "instead of the model's configured calibration set",
    )
    parser.add_argument(
        "--precisions", help="comma-separated precisions to measure (default: the model's)"
    )
    parser.add_argument(
        "--calibrators",
        help="comma-separated INT8 calibrators to compare, one row each "
        "(default: the model's configured one)",
    )
    parser.add_argument(
        "--int8-weights",
        default="auto",
        help="comma-separated INT8 weight recipes to compare, one row each: auto (what this "
        "CPU gets), 8 (8-bit weights everywhere), 7 (7-bit weights, first and last layers "
        "in float)",
    )
    parser.add_argument("--batches", default="1,8,32", help="batch sizes for img/s")
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="also measure, on GPU 0 with the torch backend (compiled as the model's gpu: "
        "section says; one runner, FP32 input, the --batches as its buckets), the fp32 and "
        "fp16 variants and torch's bf16 cast of fp32 (not a served precision): agreement "
        "with ONNX Runtime's FP32, img/s, batch-1 latency, GPU memory of the weights and of "
        "one runner",
    )
    parser.add_argument("--out", type=Path, default=Path("accuracy-report"), help="output folder")


def photos(folder: Path, limit: int) -> list[Path]:
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    return files[:limit] if limit else files


def rows_of(files: list[Path], prep: ImagePreprocess) -> np.ndarray:
    started = time.perf_counter()
    rows = []
    for i, path in enumerate(files, start=1):
        rows.append(preprocess(load_image(path), prep))
        if i % 100 == 0 or i == len(files):
            print(f"  preprocessed {i}/{len(files)} photos ({time.perf_counter() - started:.1f} s)")
    return np.stack(rows)


RESIDENT_PROBE = """
import os, sys
import numpy as np
import onnxruntime as ort
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
batch = np.load(sys.argv[3])
options = ort.SessionOptions()
options.intra_op_num_threads = int(sys.argv[2])
before = resident()
session = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
session.run(None, {sys.argv[4]: batch})
print(resident() - before)
"""


def resident_cost(path: Path, input_name: str, batch: np.ndarray) -> int | None:
    """Resident memory a fresh process grows by when it loads ``path`` in ONNX Runtime and
    runs ``batch`` once (weights, arena, buffers): measured in a process of its own, because
    in this one the sessions before it leave freed memory that the next one reuses. None
    where ``/proc`` does not exist."""
    if not Path("/proc/self/statm").exists():
        return None
    with tempfile.TemporaryDirectory() as scratch:
        saved = Path(scratch) / "batch.npy"
        np.save(saved, batch)
        threads = str(os.cpu_count() or 1)
        probe = [sys.executable, "-c", RESIDENT_PROBE, str(path), threads, str(saved), input_name]
        done = subprocess.run(probe, capture_output=True, text=True, check=True, timeout=600)
    return int(done.stdout.strip().splitlines()[-1])


def throughput(
    models: dict[str, Path], row: np.ndarray, input_name: str, batches: list[int], rounds: int = 5
) -> tuple[dict[str, dict[int, float]], dict[str, int | None], dict[str, float]]:
    """Images per second per model and batch size, the resident memory each model costs
    once loaded and run at the largest batch (``resident_cost``), and the median time of one
    run at batch 1 in ms. A shared, noisy machine drifts over a run, so the models are timed
    in interleaved rounds (every model once per round) and each figure is the median of its
    rounds."""
    threads = os.cpu_count() or 1
    largest = np.repeat(row[None], max(batches), axis=0)
    memory = {name: resident_cost(path, input_name, largest) for name, path in models.items()}
    sessions = {name: accuracy.session(path, threads=threads) for name, path in models.items()}
    samples: dict[tuple[str, int], list[float]] = {}
    for batch in batches:
        inputs = {input_name: np.repeat(row[None], batch, axis=0)}
        for session in sessions.values():
            session.run(None, inputs)
        for round_ in range(1, rounds + 1):
            for name, session in sessions.items():
                runs, started = 0, time.perf_counter()
                while runs < 3 or time.perf_counter() - started < 0.5:
                    session.run(None, inputs)
                    runs += 1
                rate = batch * runs / (time.perf_counter() - started)
                samples.setdefault((name, batch), []).append(rate)
            print(f"  img/s at batch {batch}: round {round_}/{rounds}")
    speeds = {
        name: {batch: statistics.median(samples[(name, batch)]) for batch in batches}
        for name in models
    }
    single = {input_name: row[None]}
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(100):
        for name, session in sessions.items():
            started = time.perf_counter()
            session.run(None, single)
            times[name].append(time.perf_counter() - started)
    latency = {name: statistics.median(taken) * 1000 for name, taken in times.items()}
    return speeds, memory, latency


def no_plot() -> str | None:
    """Why the PNG cannot be drawn here (matplotlib, of the bench extra, is not installed);
    None where it can."""
    if importlib.util.find_spec("matplotlib") is not None:
        return None
    pip = Path(sys.executable).parent / "pip"
    return f"matplotlib is not installed ({pip} install -e '.[bench]' from the project folder)"


def run(args: argparse.Namespace, settings: Settings) -> int:
    if not args.images.is_dir():
        print(f"stoker accuracy: --images {args.images} is not a folder", file=sys.stderr)
        return 2
    files = photos(args.images, args.limit)
    if not files:
        suffixes = ", ".join(sorted(IMAGE_SUFFIXES))
        print(f"stoker accuracy: no photos ({suffixes}) in {args.images}", file=sys.stderr)
        return 2
    unplotted = no_plot()
    if unplotted is not None:
        print(f"stoker accuracy: no plot: {unplotted}; the table is written and printed")
    (entry,) = discover(args.repository or settings.models.repository, [args.model])
    model = models.source(entry)
    plan = model.plan
    prep = plan.preprocess or ImagePreprocess()
    if args.gpu and not backends.cuda_available():
        print("--gpu needs a CUDA GPU and torch built with CUDA; none is usable here")
        return 2
    calibration_note = f"configured ({entry.config.int8.calibration})"
    if args.calibrate_on:
        order = np.random.default_rng(0).permutation(len(files))
        calibration_files = [files[i] for i in order[: args.calibrate_on]]
        files = [files[i] for i in sorted(order[args.calibrate_on :])]
        digest = hashlib.sha256("\n".join(map(str, calibration_files)).encode()).hexdigest()[:16]
        calibration_path = settings.store.path / "calibration-sets" / f"{digest}.npy"
        if not calibration_path.exists():
            print(f"preprocessing {len(calibration_files)} calibration photos")
            calibration_path.parent.mkdir(parents=True, exist_ok=True)
            np.save(calibration_path, rows_of(calibration_files, prep))
        plan = dataclasses.replace(
            plan,
            int8=plan.int8.model_copy(
                update={"calibration": str(calibration_path), "samples": len(calibration_files)}
            ),
        )
        calibration_note = f"{len(calibration_files)} of the photos (held out of the evaluation)"
    print(f"preprocessing {len(files)} evaluation photos")
    data = rows_of(files, prep)
    found = [accuracy.imagenet_label_of(p) for p in files]
    labels = np.array([-1 if label is None else label for label in found])
    labelled = labels >= 0
    backend = backends.resolve(settings.models.backend or entry.config.backend)
    store = EngineStore(settings.store.path)
    batches = [int(b) for b in args.batches.split(",")]
    precisions = args.precisions.split(",") if args.precisions else entry.config.precisions
    calibrators = args.calibrators.split(",") if args.calibrators else [plan.int8.calibrator]
    recipes = args.int8_weights.split(",")
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        print(f"unknown --int8-weights {unknown}; choose from {', '.join(RECIPES)}")
        return 2
    chosen = int8_recipe(backend, plan.int8)
    # The report shows every variant, including those the gate would refuse; the gate's
    # verdict is a column.
    plan = dataclasses.replace(plan, override_accuracy=True)
    rows: list[tuple[str, BuildPlan]] = [("fp32", plan)]
    for precision in (p for p in precisions if p != "fp32"):
        if precision != "int8":
            rows.append((precision, plan))
            continue
        for calibrator in calibrators:
            for weights in recipes:
                forced = RECIPES[weights]
                update: dict[str, object] = {"calibrator": calibrator}
                if forced is not None:  # auto: what the server builds (config, else the CPU)
                    update |= {"reduce_range": forced, "keep_first_and_last": forced}
                int8 = plan.int8.model_copy(update=update)
                label = f"int8 {calibrator}" + ("" if weights == "auto" else f" {weights}-bit")
                rows.append((label, dataclasses.replace(plan, int8=int8)))
    results: list[dict[str, Any]] = []
    paths: dict[str, Path] = {}
    reference: np.ndarray | None = None
    for name, variant_plan in rows:
        precision = name.split()[0]
        print(f"{name}: building or loading the variant")
        variant = dataclasses.replace(model, plan=variant_plan)
        path, build_report, _ = models.build(variant, precision, backend, store)
        print(f"{name}: running {len(data)} photos")
        logits = accuracy.run_onnx(path, data, plan.input_name, threads=os.cpu_count() or 1)
        if reference is None:
            reference = logits
        result: dict[str, Any] = {"precision": name, **accuracy.scores(reference, logits, labels)}
        result["gate"] = gate_verdict(plan, precision, build_report)
        results.append(result)
        paths[name] = path
    print(f"timing {len(paths)} variants at batch {', '.join(map(str, batches))}")
    speeds, memory, latency = throughput(paths, data[0], plan.input_name, batches)
    for result in results:
        gate = result.pop("gate")
        for batch in batches:
            result[f"img/s@{batch}"] = speeds[result["precision"]][batch]
        result["ms@1 (median)"] = latency[result["precision"]]
        name = result["precision"]
        result["model MB"] = paths[name].stat().st_size / 1e6
        resident = memory[name]
        result[f"resident MB@{max(batches)}"] = "-" if resident is None else resident / 1e6
        result["gate"] = gate
    args.out.mkdir(parents=True, exist_ok=True)
    header = (
        f"# {entry.config.name}: precision against FP32\n\n"
        f"{len(data)} photos from `{args.images}` ({int(labelled.sum())} labelled); INT8 "
        f"calibration: {calibration_note}; INT8 recipe {chosen.describe()}; run on ONNX "
        f"Runtime on the CPU (variants built for {backend}); {os.cpu_count()} CPU threads; "
        f"img/s are medians of 5 interleaved rounds; ms@1: the median of 100 batch-1 "
        f"runs, interleaved the same way; "
        f"model MB: the ONNX file; resident MB: what a fresh process grew by when it "
        f"loaded the variant in ONNX Runtime and ran it once at batch {max(batches)} "
        f"(weights, arena, buffers); {time.strftime('%Y-%m-%d')}.\n\n"
    )
    table = markdown_table(results)
    if args.gpu:
        assert reference is not None
        gpu_variants = {
            precision: models.build(
                dataclasses.replace(model, plan=plan), precision, "torch", store
            )[0]
            for precision in ("fp32", "fp16")
        }
        gpu_results = accuracy_gpu.rows_on_gpu(
            gpu_variants, data, plan.input_name, reference, labels, batches, entry.config.gpu
        )
        table += (
            f"\n## On {accuracy_gpu.describe(entry.config.gpu)}\n\n"
            "Agreement and KL against ONNX Runtime's FP32 above; img/s of one runner "
            "(staging, copies, CUDA graph, wait; medians of 5 windows); ms@1: the median of "
            "200 batch-1 runs; GPU MiB: what torch's allocator grew by for the weights and "
            "for one runner's buffers and CUDA graphs.\n\n" + markdown_table(gpu_results)
        )
    (args.out / "accuracy.md").write_text(header + table)
    print()
    print(table)
    if unplotted is None:
        plot(results, batches[-1], args.out / "accuracy.png", entry.config.name)
        print(f"wrote {args.out / 'accuracy.md'} and {args.out / 'accuracy.png'}")
    else:
        print(f"wrote {args.out / 'accuracy.md'}; no plot: {unplotted}")
    return 0


def main(argv: list[str]) -> int:
    """``python -m bench accuracy ...``: this command from a source checkout, where no entry
    point names it for ``stoker accuracy``."""
    from app.cli import run_tool

    parser = argparse.ArgumentParser(
        prog="python -m bench accuracy",
        description="Measure each precision against fp32 on labelled photos (Markdown and PNG); "
        "the same command as stoker accuracy.",
    )
    add_arguments(parser)
    return run_tool(run, parser.parse_args(argv))


def gate_verdict(plan: BuildPlan, precision: str, report: dict[str, float]) -> str:
    """What the model's budget says of the variant, judged on the build's own held-out rows."""
    if not report:
        return "-"
    problems = budget_problems(plan, precision, report)
    return f"refused: {'; '.join(problems)}" if problems else "passes"


def markdown_table(results: list[dict[str, Any]]) -> str:
    columns = list(results[0])
    lines = [
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for result in results:
        cells = [cell(column, result.get(column, "")) for column in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def cell(column: str, value: object) -> str:
    """A number as its column reads it: milliseconds to 0.01, rates and sizes to 0.1, the
    accuracy measures to 0.0001."""
    if not isinstance(value, float):
        return str(value)
    if column.startswith("ms@"):
        return f"{value:.2f}"
    if column.startswith(("img/s", "model MB", "resident MB", "GPU MiB")):
        return f"{value:.1f}"
    return f"{value:.4f}"


def plot(results: list[dict[str, Any]], batch: int, path: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for i, result in enumerate(results):
        speed = result[f"img/s@{batch}"]
        score = result.get("top1", result["top1_agreement"])
        axis.scatter(speed, score * 100, s=60)
        # Staggered labels: variants often land on the same accuracy.
        axis.annotate(
            result["precision"],
            (speed, score * 100),
            textcoords="offset points",
            xytext=(6, 4 - 12 * (i % 3)),
        )
    axis.set_xlabel(f"img/s at batch {batch}")
    axis.set_ylabel("top-1 (%)" if "top1" in results[0] else "top-1 agreement with fp32 (%)")
    axis.set_title(f"{model}: accuracy against speed per precision")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
