"""INT8 recipes of EfficientNet-Lite0 against FP32 on real labelled photos, on this CPU.

Calibrates once (percentile 99.99 on 200 photos, as the model's config does), builds each
recipe with the project's own ``to_int8``, and measures every recipe on the held-out photos
with the integer kernels this CPU dispatches: top-1 agreement with FP32, top-1 against the
labels, mean KL, and img/s at batch 8 with 2 threads. To see what an AVX2-only CPU computes
from a VNNI machine, run the ``evaluate`` step under ``qemu-x86_64 -cpu Haswell`` (its img/s
are then emulated and mean nothing; its accuracy is the AVX2 kernels').

    python scripts/int8_recipes.py build --photos ../shared/data/imagenet-sample --out /tmp/r
    python scripts/int8_recipes.py evaluate --out /tmp/r --tag native
    qemu-x86_64 -cpu Haswell .venv/bin/python scripts/int8_recipes.py evaluate --out /tmp/r \
        --tag haswell --only u8s8-8bit,u8s8-7bit-edges-float
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines import accuracy, calibration, cpu, variants
from engines import preprocess as imaging

SOURCE = Path(__file__).resolve().parents[1] / "models" / "efficientnet_lite0" / "model.onnx"
INPUT = "input"
RECIPES = {
    "u8s8-8bit": {},
    "u8s8-7bit": {"reduce_range": True},
    "u8s8-7bit-edges-float": {"reduce_range": True, "keep_first_and_last": True},
    "u8s8-8bit-edges-float": {"keep_first_and_last": True},
    "s8s8-8bit": {"form": "s8s8"},
}


def rows(photos: Path, out: Path, calibrate: int, evaluate: int) -> dict[str, np.ndarray]:
    cache = out / "rows.npz"
    if cache.exists():
        with np.load(cache) as saved:
            return {k: saved[k] for k in saved.files}
    files = sorted(p for p in photos.iterdir() if p.is_file())
    order = np.random.default_rng(0).permutation(len(files))
    chosen = [files[i] for i in order[: calibrate + evaluate]]
    spec = imaging.ImagePreprocess()
    data = np.stack([imaging.preprocess(imaging.load_image(p), spec) for p in chosen])
    labels = np.array([accuracy.imagenet_label_of(p) for p in chosen[calibrate:]])
    found = {"calibration": data[:calibrate], "evaluation": data[calibrate:], "labels": labels}
    np.savez(cache, **found)
    return found


def build(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    data = rows(args.photos, args.out, args.calibrate, args.evaluate)
    model = onnx.load(str(SOURCE))
    ranges = calibration.collect_ranges(model, data["calibration"], INPUT, "percentile")
    for name, options in RECIPES.items():
        form = options.get("form", "u8s8")
        variant = variants.to_int8(
            model,
            ranges,
            form=form,  # type: ignore[arg-type]
            reduce_range=bool(options.get("reduce_range")),
            keep_first_and_last=bool(options.get("keep_first_and_last")),
        )
        onnx.save(variant, str(args.out / f"{name}.onnx"))
        print(f"built {name}", flush=True)


def speed(model: Path, batch: np.ndarray, rounds: int = 5) -> float:
    session = accuracy.session(model, threads=2)
    session.run(None, {INPUT: batch})
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        session.run(None, {INPUT: batch})
        times.append(time.perf_counter() - started)
    return len(batch) / float(np.median(times))


def evaluate(args: argparse.Namespace) -> None:
    with np.load(args.out / "rows.npz") as saved:
        data, labels = saved["evaluation"], saved["labels"]
    reference = accuracy.run_onnx(SOURCE, data, INPUT, batch=8, threads=2)
    fp32_speed = speed(SOURCE, data[:8])
    kernels = cpu.integer_kernels().name
    results: dict[str, dict[str, float]] = {
        "fp32": {"top1": float((reference.argmax(1) == labels).mean()), "img_s": fp32_speed}
    }
    print(f"{len(data)} held-out photos, integer kernels {kernels}")
    print(f"{'variant':24} {'agree':>6} {'top1':>6} {'KL':>8} {'img/s@8':>8} {'x fp32':>7}")
    print(f"{'fp32':24} {1:6.3f} {results['fp32']['top1']:6.3f} {0:8.5f} {fp32_speed:8.1f}")
    only = set(args.only.split(",")) if args.only else set(RECIPES)
    for name in (n for n in RECIPES if n in only):
        path = args.out / f"{name}.onnx"
        logits = accuracy.run_onnx(path, data, INPUT, batch=8, threads=2)
        result = {
            "agreement": accuracy.top1_agreement(reference, logits),
            "top1": float((logits.argmax(1) == labels).mean()),
            "mean_kl": accuracy.mean_kl(reference, logits),
            "img_s": speed(path, data[:8]),
        }
        results[name] = result
        print(
            f"{name:24} {result['agreement']:6.3f} {result['top1']:6.3f} "
            f"{result['mean_kl']:8.5f} {result['img_s']:8.1f} {result['img_s'] / fp32_speed:7.2f}",
            flush=True,
        )
    (args.out / f"results-{args.tag}.json").write_text(
        json.dumps({"kernels": kernels, "results": results}, indent=1)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    steps = parser.add_subparsers(dest="step", required=True)
    building = steps.add_parser("build")
    building.add_argument("--photos", type=Path, required=True)
    building.add_argument("--out", type=Path, required=True)
    building.add_argument("--calibrate", type=int, default=200)
    building.add_argument("--evaluate", type=int, default=300)
    evaluating = steps.add_parser("evaluate")
    evaluating.add_argument("--out", type=Path, required=True)
    evaluating.add_argument("--tag", default="native")
    evaluating.add_argument("--only", help="comma-separated recipes (default: all)")
    args = parser.parse_args()
    build(args) if args.step == "build" else evaluate(args)


if __name__ == "__main__":
    main()
