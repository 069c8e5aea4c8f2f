"""The model repository the H200 run serves: ResNet-50 (seeded weights) at FP16 on the GPU.

python scripts/gpu_repo.py /tmp/stoker-repo

The repo's ``models/resnet50`` config with: FP16 as the only version; its accuracy gate
measured on 16 images and overridden, because seeded random weights give near-uniform
logits whose top-1 means nothing (the FP16 variant itself is built and measured as for any
model); the GPU default of runners (`--runners N` sets them); batches up to 256, preferred
64, 128 and 256 (``--preferred 32,64,...`` sets others: every power of two cuts a batch that
waited out its delay to the largest CUDA graph it fills, instead of padding it to the next);
a 2 ms delay (``--queue-delay-us``); ``--compile MODE`` sets ``gpu.compile``.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("repository", type=Path)
    parser.add_argument(
        "--compile", default="default", help="gpu.compile: none, default, max-autotune"
    )
    parser.add_argument(
        "--runners", type=int, default=0, help="runners (0: unset, the GPU default)"
    )
    parser.add_argument(
        "--queue-delay-us", type=int, default=2000, help="dynamic_batching.max_queue_delay_us"
    )
    parser.add_argument(
        "--preferred",
        default="64,128,256",
        help="dynamic_batching.preferred_batch_size, comma-separated",
    )
    parser.add_argument(
        "--split-batches",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="gpu.split_batches (unset: the served default, off): a batch as graphs of its rows",
    )
    args = parser.parse_args()
    preferred = [int(size) for size in args.preferred.split(",") if size]
    folder = args.repository / "resnet50"
    folder.mkdir(parents=True, exist_ok=True)
    config = yaml.safe_load((ROOT / "models" / "resnet50" / "config.yaml").read_text())
    config.update(
        precisions=["fp16"],
        default_precision="fp16",
        max_batch_size=256,
        accuracy={"evaluation_samples": 16, "override": True},
        dynamic_batching={
            "preferred_batch_size": preferred,
            "max_queue_delay_us": args.queue_delay_us,
        },
        gpu={
            "compile": args.compile,
            **({} if args.split_batches is None else {"split_batches": args.split_batches}),
        },
    )
    config.pop("runners", None)
    if args.runners:
        config["runners"] = args.runners
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    onnx = ROOT / "models" / "resnet50" / "model.onnx"
    if onnx.exists():
        shutil.copy(onnx, folder / "model.onnx")
    print(f"{folder}: {config}")


if __name__ == "__main__":
    main()
