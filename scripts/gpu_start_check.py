"""Checks for scripts/h200_start.sh on the GPU machine.

python3 scripts/gpu_start_check.py answer PORT FILE   one batch of 8 seeded UINT8 images
                                                      inferred over HTTP; logits to FILE
python3 scripts/gpu_start_check.py compare FOLDER     every answers_*.json against the first
python3 scripts/gpu_start_check.py replay STORE       the compiled package from STORE against
                                                      the uncompiled graph: CUDA-graph replay
                                                      rate at 32 and 256, relative error
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np


def answer(port: str, out: str) -> None:
    import httpx

    base = f"http://127.0.0.1:{port}/v2/models/resnet50"
    meta = httpx.get(base, timeout=30).json()
    name, output = meta["inputs"][0]["name"], meta["outputs"][0]["name"]
    pixels = np.random.default_rng(7).integers(0, 256, (8, 3, 224, 224), dtype=np.uint8)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": name,
                    "shape": list(pixels.shape),
                    "datatype": "UINT8",
                    "parameters": {"binary_data_size": pixels.nbytes},
                }
            ],
            "outputs": [{"name": output, "parameters": {"binary_data": False}}],
        }
    ).encode()
    reply = httpx.post(
        f"{base}/infer",
        content=header + pixels.tobytes(),
        headers={"Inference-Header-Content-Length": str(len(header))},
        timeout=60,
    )
    reply.raise_for_status()
    logits = reply.json()["outputs"][0]["data"]
    Path(out).write_text(json.dumps(logits))
    print(f"answered: {len(logits)} logits")


def compare(folder: str) -> None:
    files = sorted(Path(folder).glob("answers_*.json"))
    if not files:
        print("no answers")
        return
    ref = np.array(json.loads(files[0].read_text()), dtype=np.float64).reshape(8, -1)
    for file in files:
        got = np.array(json.loads(file.read_text()), dtype=np.float64).reshape(8, -1)
        error = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        top1 = float(np.mean(got.argmax(1) == ref.argmax(1)))
        print(f"{file.name} against {files[0].name}: relative error {error:.2e}, top-1 {top1:.2f}")


def replay(store_root: str) -> None:
    import torch

    from engines.backends.onnxruntime import read_spec
    from engines.backends.torch.engine import TorchEngine, TorchOptions
    from engines.base import EngineOptions
    from engines.devices.options import GpuOptions
    from engines.preprocess import ImagePreprocess
    from engines.store import EngineStore

    store = EngineStore(Path(store_root))
    variant = next(p for p in store.root.rglob("*fp16*.onnx"))
    spec = read_spec(variant, "resnet50", 256)
    pixels = np.random.default_rng(3).integers(0, 256, (32, 3, 224, 224), dtype=np.uint8)
    results = {}
    for mode in ("default", "none"):
        started = time.perf_counter()
        engine = TorchEngine(
            variant,
            spec,
            EngineOptions(store=store),
            TorchOptions(
                image=ImagePreprocess(), batch_buckets=(32, 256), gpu=GpuOptions(compile=mode)
            ),
        )
        runner = engine.new_runner()
        made = time.perf_counter() - started
        rates = {}
        for bucket in (32, 256):
            graph = runner.graph(bucket, "UINT8")
            with torch.cuda.stream(runner.stream):
                for _ in range(5):
                    graph.replay()
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                begin.record()
                for _ in range(40):
                    graph.replay()
                end.record()
            end.synchronize()
            rates[bucket] = bucket * 40 / (begin.elapsed_time(end) / 1e3)
        results[mode] = runner.run({spec.inputs[0].name: pixels})[spec.outputs[0].name]
        print(f"compile {mode}: engine and one runner in {made:.1f} s; graph replay "
              f"{rates[32]:,.0f} img/s at 32, {rates[256]:,.0f} at 256; store phases "
              f"{ {k: round(v, 2) for k, v in store.phases.of('resnet50').items()} }")  # fmt: skip
        runner.close()
        engine.close()
    a, b = results["default"].astype(np.float64), results["none"].astype(np.float64)
    error = np.linalg.norm(a - b) / np.linalg.norm(b)
    top1 = np.mean(a.argmax(1) == b.argmax(1))
    print(f"compiled against uncompiled: relative error {error:.2e}, top-1 {top1:.2f}")


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"answer": answer, "compare": compare, "replay": replay}[command](*args)
