"""What a V2 JSON image request's decoding costs, in milliseconds: ``decode_infer`` (the size
check, the parse, the data to an array, the contract's checks) of one FP32 [1, 3, 224, 224]
image, its data flat (as tritonclient and MLServer's codecs send it) and nested along its
shape. With ``--against DIR`` the same cases run on another tree's code in a child process,
round after round alternately, and the table gives both and their ratio.

    python scripts/json_cost.py [--calls 20] [--rounds 5] [--against /tmp/before]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import timeit
from pathlib import Path

import numpy as np
import orjson
from image_spec import image_spec

ROOT = Path(__file__).resolve().parents[1]


def measure(root: Path, calls: int) -> dict[str, float]:
    """ms a call of each case, on the code under ``root``."""
    sys.path.insert(0, str(root))
    from app.contract import Contract, decode_infer, serial_of
    from engines.spec import ModelSpec, TensorSpec

    spec = image_spec(ModelSpec, TensorSpec, "image", 32)
    contract = Contract("image", "fp32", spec, "input", 1, serial_of(spec, "input", 1))
    image = np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)
    times = {}
    for form, data in (("flat", image.reshape(-1)), ("nested", image)):
        document = {"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32",
                                "data": data}]}  # fmt: skip
        body = orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)
        got = decode_infer(contract, body, None, 64, None).request.inputs["input"]
        assert np.array_equal(got, image), "decoded to another array"
        seconds = timeit.timeit(lambda: decode_infer(contract, body, None, 64, None), number=calls)
        times[f"{form} ({len(body) / 1e6:.1f} MB)"] = seconds / calls * 1e3
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", type=Path, help="another tree, measured alternately")
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    parser.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.once:
        print(json.dumps(measure(args.root, args.calls)))
        return
    trees = [ROOT] + ([args.against.resolve()] if args.against else [])
    rounds: dict[Path, list[dict[str, float]]] = {tree: [] for tree in trees}
    for _ in range(args.rounds):
        for tree in trees:
            command = [sys.executable, __file__, "--once", "--root", str(tree)]
            command += ["--calls", str(args.calls)]
            answer = subprocess.run(command, check=True, capture_output=True, text=True, cwd=tree)
            rounds[tree].append(json.loads(answer.stdout))
    cases = list(rounds[ROOT][0])
    head = "| case | this tree, ms |" + (" other tree, ms | this ÷ other |" if args.against else "")
    print(head)
    print("| --- | ---: |" + (" ---: | ---: |" if args.against else ""))
    for case in cases:
        mine = statistics.median(r[case] for r in rounds[ROOT])
        line = f"| decode_infer, {case} | {mine:.2f} |"
        if args.against:
            other = statistics.median(r[case] for r in rounds[trees[1]])
            ratios = [
                a[case] / b[case] for a, b in zip(rounds[ROOT], rounds[trees[1]], strict=True)
            ]
            line += f" {other:.2f} | {statistics.median(ratios):.2f} |"
        print(line)


if __name__ == "__main__":
    main()
