"""What a batch-1 binary V2 request's decoding and placing cost a front end's loop, in
microseconds: ``decode_infer`` read by the request's plan (the JSON seen before) and decoded
whole (a contract without a serial is never planned), decoded whole where each request's JSON
is its own (an id a request: seen once, never planned), ``place_inputs`` over a slot of a real
arena, and ``encode_response`` of one [1, 1000] FP32 output. Median of ``--rounds`` timings
of ``--calls`` calls each.

    python scripts/codec_cost.py [--calls 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from pathlib import Path

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from image_spec import image_spec

from app.contract import Contract, decode_infer, serial_of
from app.frontend.arena import Arena, place_inputs
from app.protocol import RequestedOutput, encode_response
from engines.spec import ModelSpec, TensorSpec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    spec = image_spec(ModelSpec, TensorSpec, "resnet50", 256)
    planned = Contract("resnet50", "fp16", spec, "input", 1, serial_of(spec, "input", 1))
    whole = Contract("resnet50", "fp16", spec, "input", 1, 0)
    size = 3 * 224 * 224
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "shape": [1, 3, 224, 224],
                    "datatype": "UINT8",
                    "parameters": {"binary_data_size": size},
                }
            ],
            "outputs": [{"name": "output", "parameters": {"binary_data": True}}],
        }
    )
    arena = Arena(slots=4, slot_bytes=1 << 20)
    slot = arena.lend(len(header) + size)
    assert slot is not None
    body = slot.view[: len(header) + size]
    body[: len(header)] = header
    inputs = decode_infer(planned, body, len(header), 64, None).request.inputs
    output = [(RequestedOutput("output", True), np.zeros((1, 1000), np.float32))]
    # Requests whose JSON is each its own (an id a request): never read by a plan.
    fresh = [header.replace(b"{", b'{"id":"r%d",' % i, 1) for i in range(args.calls)]
    room = memoryview(bytearray(max(map(len, fresh)) + size))
    turn = iter(fresh)

    def once() -> None:
        nonlocal turn
        head = next(turn, None)
        if head is None:
            turn = iter(fresh)
            head = next(turn)
        room[: len(head)] = head
        decode_infer(planned, room[: len(head) + size], len(head), 64, None)

    cases = {
        "decode_infer, planned": lambda: decode_infer(planned, body, len(header), 64, None),
        "decode_infer, whole": lambda: decode_infer(whole, body, len(header), 64, None),
        "decode_infer, a JSON of its own each request": once,
        "place_inputs (one input in the slot)": lambda: place_inputs(inputs, slot, len(body)),
        "encode_response ([1, 1000] FP32, binary)": lambda: encode_response(
            "resnet50", "fp16", None, output
        ),
    }
    print("| step | us a call (median of rounds) |")
    print("| --- | ---: |")
    for name, call in cases.items():
        times = [
            timeit.timeit(call, number=args.calls) / args.calls * 1e6 for _ in range(args.rounds)
        ]
        print(f"| {name} | {statistics.median(times):.1f} |")
    arena.close()


if __name__ == "__main__":
    main()
