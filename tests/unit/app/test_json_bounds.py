"""JSON that no valid request for its model could be is refused before it is parsed, by
counting three characters; large decodes run one at a time (per process) with the cyclic
garbage collector paused. No I/O."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import numpy as np
import pytest

from app.contract import Contract, Decoded, decode_infer, elementwise
from app.errors import PayloadTooLarge
from app.json_bounds import LargeDecodes, check_json_size, nested_lists
from engines.spec import ModelSpec, TensorSpec


def contract(*inputs: TensorSpec, max_batch_size: int = 8) -> Contract:
    spec = ModelSpec("m", inputs, (TensorSpec("y", "FP32", (1,)),), max_batch_size)
    return Contract("m", "fp32", spec, None, 1)


IMAGE = contract(TensorSpec("x", "FP32", (3, 4, 4)))  # fixed: 8 x 48 elements at most
RAGGED = contract(TensorSpec("x", "FP32", (-1,)))  # only the last dimension varies
DEEP = contract(TensorSpec("x", "FP32", (-1, 1)))  # a dynamic dimension before the last
TEXT = contract(TensorSpec("x", "BYTES", (1,)))


def body(data: str, shape: str = "[1,3,4,4]") -> memoryview:
    text = '{"inputs":[{"name":"x","datatype":"FP32","shape":' + shape + ',"data":[' + data + "]}]}"
    padding = " " * max(0, 70_000 - len(text))  # counted from 64 KiB of JSON up
    return memoryview((text + padding).encode())


def test_the_nested_lists_a_shape_holds() -> None:
    # (8, 3, 4, 4): the data list, 8 rows, 8 x 3 planes, 8 x 3 x 4 lines
    assert nested_lists(IMAGE.spec) == 1 + 8 + 24 + 96
    assert nested_lists(RAGGED.spec) == 1 + 8
    assert nested_lists(DEEP.spec) is None


def test_valid_requests_pass_at_the_largest_size() -> None:
    rows = np.zeros((8, 3, 4, 4)).tolist()
    nested = str(rows).replace(" ", "")
    check_json_size(IMAGE.spec, body(nested[1:-1], "[8,3,4,4]"))
    check_json_size(IMAGE.spec, body(",".join(["0.5"] * 8 * 48), "[8,3,4,4]"))
    check_json_size(RAGGED.spec, body(",".join(["1.5"] * 30_000), "[1,30000]"))
    check_json_size(TEXT.spec, body(",".join(['"{[,]}"'] * 20_000), "[1,1]"))  # strings not counted


@pytest.mark.parametrize(
    ("model", "data", "refusal"),
    [
        (IMAGE, ",".join(["{}"] * 30_000), "objects"),
        (RAGGED, ",".join(["{}"] * 30_000), "objects"),
        (IMAGE, ",".join(["0"] * 30_000), "values"),
        (IMAGE, ",".join(["[0]"] * 30_000), "lists"),
        (RAGGED, ",".join(["[]"] * 30_000), "lists"),
    ],
)
def test_more_than_a_valid_request_holds_is_refused(
    model: Contract, data: str, refusal: str
) -> None:
    with pytest.raises(PayloadTooLarge, match=f"request JSON holds .* {refusal}"):
        check_json_size(model.spec, body(data))


def test_what_only_parsing_can_refuse_is_left_to_it() -> None:
    """Any number of lists may be valid for a dynamic dimension before the last, and of
    elements for a dynamic one: the decoder refuses them after parsing (and small JSON is
    never counted)."""
    check_json_size(DEEP.spec, body(",".join(["[0]"] * 30_000)))
    check_json_size(RAGGED.spec, body(",".join(["0"] * 30_000)))
    check_json_size(IMAGE.spec, memoryview(b'{"inputs":[' + b"{}," * 1000 + b"{}]}"))


def test_decode_infer_refuses_before_parsing() -> None:
    junk = bytes(body(",".join(["{}"] * 30_000)))
    with pytest.raises(PayloadTooLarge):
        decode_infer(IMAGE, junk, None, 64, None)
    with pytest.raises(PayloadTooLarge):  # the JSON part of a binary request is counted too
        decode_infer(IMAGE, junk + b"\0" * 16, len(junk), 64, None)


def test_large_decodes_run_one_at_a_time_with_the_collector_paused() -> None:
    gate = LargeDecodes()
    running, most, collecting = 0, 0, []
    lock = threading.Lock()

    def decode() -> Decoded:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        collecting.append(gc.isenabled())
        time.sleep(0.02)  # a decode's duration, on its worker thread
        with lock:
            running -= 1
        raise ValueError("refused")  # a refusal leaves the collector as it found it

    async def many() -> list[BaseException | Decoded]:
        return await asyncio.gather(
            *(gate.run(decode, 1) for _ in range(6)), return_exceptions=True
        )

    assert gc.isenabled()
    results = asyncio.run(many())
    assert all(isinstance(r, ValueError) for r in results)
    assert most == 1 and collecting == [False] * 6
    assert gc.isenabled()


@pytest.mark.parametrize(
    ("header", "threaded"),
    [
        (b'{"inputs":[{"name":"x","datatype":"UINT8","shape":[32,3,224,224]}]}', False),
        (b'{"inputs":[{"name":"x","datatype":"FP16","parameters":{"binary_data_size":8}}]}', False),
        (b'{"inputs":[{"name":"s","datatype":"BYTES","shape":[4]}]}', True),
        (b'{"inputs":[{"name":"b","datatype":"BOOL","shape":[4]}]}', True),
        (b'{"inputs":[{"name":"s","datatype":"\\u0042YTES","shape":[4]}]}', True),
        (b'{"inputs":[{"name":"x","parameters":{"shared_memory_region":"r"}}]}', True),
    ],
)
def test_a_binary_body_is_decoded_on_the_loop_only_when_its_tensors_are_views(
    header: bytes, threaded: bool
) -> None:
    """``elementwise``: a large binary body whose JSON names only fixed-size datatypes is
    decoded where it is (views of the body); BYTES, BOOL, an escape that could spell them,
    and a shared-memory region (read out of its file) go to a thread."""
    assert elementwise(memoryview(header)) is threaded
