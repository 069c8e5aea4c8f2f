"""A front end's shared-memory arena and where it puts a decoded request's tensors.

The arena is real POSIX shared memory (``multiprocessing.shared_memory``); inputs are
decoded by the real V2 codec from bodies read into a lent slot, as a front end reads them.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import orjson
import pytest

from app.dataplane import Contract, decode_infer
from app.frontend import ENGINE_REGIONS, PAGE, Arena, ForwardToEngine, place_inputs
from app.protocol import unpack_tensor
from engines.spec import ModelSpec, TensorSpec

SPEC = ModelSpec(
    "two",
    (TensorSpec("a", "FP32", (4,)), TensorSpec("b", "INT64", (2,))),
    (TensorSpec("y", "FP32", (1,)),),
    max_batch_size=8,
)
CONTRACT = Contract("two", "fp32", SPEC, None, 1)


@pytest.fixture
def arena() -> Iterator[Arena]:
    made = Arena(slots=4, slot_bytes=4 * PAGE)  # 16 pages, at most 4 to one body
    yield made
    made.close()


def test_small_bodies_share_the_arena_and_large_ones_get_contiguous_pages(arena: Arena) -> None:
    small = [arena.lend(100) for _ in range(8)]
    assert all(s is not None and len(s.view) == PAGE for s in small)
    offsets = [s.offset for s in small if s is not None]
    assert len(set(offsets)) == 8
    assert arena.lend(4 * PAGE + 1) is None  # larger than a slot, whatever is free
    big = arena.lend(3 * PAGE + 5)
    assert big is not None and len(big.view) == 4 * PAGE
    assert arena.free_bytes == 4 * PAGE


def test_returned_pages_join_their_neighbours_and_a_second_return_is_a_no_op(
    arena: Arena,
) -> None:
    slots = [arena.lend(PAGE) for _ in range(16)]
    assert arena.lend(1) is None  # full
    for i in (1, 3, 2):  # pages 1..3 come back out of order
        slot = slots[i]
        assert slot is not None
        arena.give_back(slot)
    again = slots[2]
    assert again is not None
    arena.give_back(again)  # no-op: not counted twice
    assert arena.free_bytes == 3 * PAGE
    joined = arena.lend(3 * PAGE)
    assert joined is not None and joined.offset == PAGE  # one run of three pages


def test_what_a_slot_holds_is_shared_with_whoever_maps_the_arena(arena: Arena) -> None:
    from multiprocessing import shared_memory

    slot = arena.lend(10)
    assert slot is not None
    slot.view[:5] = b"hello"
    other = shared_memory.SharedMemory(name=arena.name)
    try:
        assert other.buf is not None
        assert bytes(other.buf[slot.offset : slot.offset + 5]) == b"hello"
    finally:
        other.close()


def binary_body(a: np.ndarray, b: np.ndarray) -> tuple[bytes, int]:
    header = orjson.dumps(
        {
            "inputs": [
                {"name": "a", "datatype": "FP32", "shape": list(a.shape),
                 "parameters": {"binary_data_size": a.nbytes}},
                {"name": "b", "datatype": "INT64", "shape": list(b.shape),
                 "parameters": {"binary_data_size": b.nbytes}},
            ]
        }
    )  # fmt: skip
    return header + a.tobytes() + b.tobytes(), len(header)


def engine_reads(described: list[list[object]], source: memoryview) -> dict[str, np.ndarray]:
    """What the engine rebuilds from the descriptors (``app.engine_process``)."""
    found = {}
    for name, datatype, shape, at, size in described:
        assert isinstance(at, int) and isinstance(size, int)
        found[str(name)] = unpack_tensor(str(name), str(datatype), shape, source[at : at + size])  # type: ignore[arg-type]
    return found


def test_binary_inputs_stay_where_the_body_put_them(arena: Arena) -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.arange(6, dtype=np.int64).reshape(3, 2)
    body, length = binary_body(a, b)
    slot = arena.lend(len(body))
    assert slot is not None
    slot.view[: len(body)] = body
    decoded = decode_infer(CONTRACT, slot.view[: len(body)], length, 64, ENGINE_REGIONS)
    described, payload = place_inputs(decoded.request.inputs, slot, len(body))
    assert payload == b""
    assert [d[3] for d in described] == [length, length + a.nbytes]  # no copy: in the body
    got = engine_reads(described, slot.view)
    np.testing.assert_array_equal(got["a"], a)
    np.testing.assert_array_equal(got["b"], b)


def test_json_inputs_are_copied_into_the_slot_over_the_body(arena: Arena) -> None:
    body = orjson.dumps(
        {
            "inputs": [
                {"name": "a", "datatype": "FP32", "shape": [1, 4], "data": [1.5, 2, 3, 4]},
                {"name": "b", "datatype": "INT64", "shape": [1, 2], "data": [7, -8]},
            ]
        }
    )
    slot = arena.lend(len(body))
    assert slot is not None
    slot.view[: len(body)] = body
    decoded = decode_infer(CONTRACT, slot.view[: len(body)], None, 64, ENGINE_REGIONS)
    described, payload = place_inputs(decoded.request.inputs, slot, len(body))
    assert payload == b"" and described[0][3] == 0
    got = engine_reads(described, slot.view)
    np.testing.assert_array_equal(got["a"], [[1.5, 2, 3, 4]])
    np.testing.assert_array_equal(got["b"], [[7, -8]])


def test_mixed_inputs_are_copied_after_the_body_and_too_many_bytes_go_in_the_payload(
    arena: Arena,
) -> None:
    a = np.full((2, 4), 0.25, np.float32)
    header = orjson.dumps(
        {
            "inputs": [
                {"name": "a", "datatype": "FP32", "shape": [2, 4],
                 "parameters": {"binary_data_size": a.nbytes}},
                {"name": "b", "datatype": "INT64", "shape": [2, 2], "data": [1, 2, 3, 4]},
            ]
        }
    )  # fmt: skip
    body = header + a.tobytes()
    slot = arena.lend(len(body))
    assert slot is not None
    slot.view[: len(body)] = body
    decoded = decode_infer(CONTRACT, slot.view[: len(body)], len(header), 64, ENGINE_REGIONS)
    described, payload = place_inputs(decoded.request.inputs, slot, len(body))
    assert payload == b""
    assert described[0][3] == len(header) and described[1][3] >= len(body)  # after the body
    got = engine_reads(described, slot.view)
    np.testing.assert_array_equal(got["b"], [[1, 2], [3, 4]])
    np.testing.assert_array_equal(got["a"], a)

    # Without a slot (the arena was full) every input travels in the payload.
    described, payload = place_inputs(decoded.request.inputs, None, len(body))
    got = engine_reads(described, memoryview(payload))
    np.testing.assert_array_equal(got["a"], a)
    np.testing.assert_array_equal(got["b"], [[1, 2], [3, 4]])


def test_a_request_naming_a_shared_memory_region_goes_to_the_engine() -> None:
    body = orjson.dumps(
        {
            "inputs": [
                {"name": "a", "datatype": "FP32", "shape": [1, 4],
                 "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 16}},
                {"name": "b", "datatype": "INT64", "shape": [1, 2], "data": [1, 2]},
            ]
        }
    )  # fmt: skip
    with pytest.raises(ForwardToEngine):
        decode_infer(CONTRACT, body, None, 64, ENGINE_REGIONS)


def test_a_contract_survives_the_trip_to_a_front_end() -> None:
    again = Contract.from_json(orjson.loads(orjson.dumps(CONTRACT.as_json())))
    assert again == CONTRACT
