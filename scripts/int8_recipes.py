"""INT8 recipes of EfficientNet-Lite0 against FP32 on real labelled photos, on this CPU.

Calibrates once (percentile 99.99 on 200 photos, as the model's config does), builds each
recipe with the project's own ``to_int8``, and measures every recipe on the held-out photos
with the integer kernels this CPU dispatches: top-1 agreement with FP32, top-1 against the
labels, mean KL, and img/s at batch 8 with 2 threads (medians of interleaved rounds). To
see what an AVX2-only CPU computes from a VNNI machine, run the ``evaluate`` step under
``qemu-x86_64 -cpu Haswell`` (its img/s are then emulated and mean nothing; its accuracy is
the AVX2 kernels').

    python scripts/int8_recipes.py build --photos ../shared/data/imagenet-sample --out /tmp/r
    python scripts/int8_recipes.py evaluate --out /tmp/r --tag native
    qemu-x86_64 -cpu Haswell .venv/bin/python scripts/int8_recipes.py evaluate --out /tmp/r \
        --tag haswell --only u8s8-8bit,u8s8-7bit-edges-float --rounds 1
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

from engines import preprocess as imaging
from engines.devices import cpu
from engines.precision import accuracy, calibration, int8

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
        variant = int8.to_int8(
            model,
            ranges,
            form=form,  # type: ignore[arg-type]
            reduce_range=bool(options.get("reduce_range")),
            keep_first_and_last=bool(options.get("keep_first_and_last")),
        )
        onnx.save(variant, str(args.out / f"{name}.onnx"))
        print(f"built {name}", flush=True)


def speeds(
    models: dict[str, Path], batch: np.ndarray, rounds: int, per_round: int = 10
) -> dict[str, tuple[float, float]]:
    """Name -> (median img/s, median ratio to fp32 within a round), timed in interleaved
    rounds of ``per_round`` batches each, so a machine that drifts drifts for all alike."""
    sessions = {name: accuracy.session(path, threads=2) for name, path in models.items()}
    for session in sessions.values():
        session.run(None, {INPUT: batch})
    samples: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(rounds):
        for name, session in sessions.items():
            started = time.perf_counter()
            for _ in range(per_round):
                session.run(None, {INPUT: batch})
            samples[name].append(per_round * len(batch) / (time.perf_counter() - started))
    fp32 = samples["fp32"]
    return {
        name: (
            float(np.median(values)),
            float(np.median([v / f for v, f in zip(values, fp32, strict=True)])),
        )
        for name, values in samples.items()
    }


def evaluate(args: argparse.Namespace) -> None:
    with np.load(args.out / "rows.npz") as saved:
        data, labels = saved["evaluation"], saved["labels"]
    reference = accuracy.run_onnx(SOURCE, data, INPUT, batch=8, threads=2)
    kernels = cpu.integer_kernels().name
    only = set(args.only.split(",")) if args.only else set(RECIPES)
    names = [n for n in RECIPES if n in only]
    results: dict[str, dict[str, float]] = {
        "fp32": {
            "agreement": 1.0,
            "top1": float((reference.argmax(1) == labels).mean()),
            "mean_kl": 0.0,
        }
    }
    for name in names:
        logits = accuracy.run_onnx(args.out / f"{name}.onnx", data, INPUT, batch=8, threads=2)
        results[name] = {
            "agreement": accuracy.top1_agreement(reference, logits),
            "top1": float((logits.argmax(1) == labels).mean()),
            "mean_kl": accuracy.mean_kl(reference, logits),
        }
    models = {"fp32": SOURCE, **{name: args.out / f"{name}.onnx" for name in names}}
    for name, (img_s, ratio) in speeds(models, data[:8], args.rounds).items():
        results[name] |= {"img_s": img_s, "x_fp32": ratio}
    print(
        f"{len(data)} held-out photos, integer kernels {kernels}; img/s at batch 8, 2 "
        f"threads: medians of {args.rounds} interleaved rounds"
    )
    print(f"{'variant':24} {'agree':>6} {'top1':>6} {'KL':>8} {'img/s@8':>8} {'x fp32':>7}")
    for name, r in results.items():
        print(
            f"{name:24} {r['agreement']:6.3f} {r['top1']:6.3f} {r['mean_kl']:8.5f} "
            f"{r['img_s']:8.1f} {r['x_fp32']:7.2f}"
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
    evaluating.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    args = parser.parse_args()
    build(args) if args.step == "build" else evaluate(args)


if __name__ == "__main__":
    main()
