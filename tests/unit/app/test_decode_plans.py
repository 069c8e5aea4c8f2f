"""A binary request's JSON decoded whole and then read by its plan: the third request with the
same JSON gets its own body's tensors and every field a whole decode gives, without parsing;
what may not be planned never is; a header sent once makes no plan. Bodies are written by
tritonclient, the way a client sends them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import tritonclient.http as triton
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.http._utils import _get_inference_request

import app.contract
from app.contract import Contract, Decoded, decode_infer, serial_of
from app.decode_plans import DecodePlans, Plan
from app.errors import BadRequest
from app.protocol import decode_request
from engines.spec import ModelSpec, TensorSpec

FIXED = ["FP32", "FP16", "BF16", "FP64", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16"]
NUMPY = {"BF16": ml_dtypes.bfloat16}


@contextlib.contextmanager
def own_plans() -> Iterator[DecodePlans]:
    """Plans of their own for what runs inside (a test, or one of Hypothesis's examples)."""
    saved = app.contract.PLANS
    app.contract.PLANS = fresh = DecodePlans()
    try:
        yield fresh
    finally:
        app.contract.PLANS = saved


@pytest.fixture(autouse=True)
def plans() -> Iterator[DecodePlans]:
    with own_plans() as fresh:
        yield fresh


@pytest.fixture
def parsed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A count of the whole decodes (``decode_request`` calls)."""
    calls: list[int] = []
    whole = decode_request

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return whole(*args, **kwargs)

    monkeypatch.setattr(app.contract, "decode_request", counted)
    return calls


def contract(
    *inputs: tuple[str, str, tuple[int, ...]], serial: bool = True, levels: int = 1
) -> Contract:
    spec = ModelSpec(
        "m",
        tuple(TensorSpec(name, datatype, shape) for name, datatype, shape in inputs),
        (TensorSpec("y", "FP32", (3,)), TensorSpec("s", "FP32", (1,))),
        max_batch_size=64,
    )
    return Contract("m", "1", spec, None, levels, serial_of(spec, None, levels) if serial else 0)


def written(inputs: list[Any], outputs: list[Any] | None, **request: Any) -> tuple[bytes, int]:
    """The body tritonclient writes and its JSON's length."""
    made, length = _get_inference_request(
        inputs=inputs,
        request_id=request.get("request_id", ""),
        outputs=outputs,
        sequence_id=0,
        sequence_start=False,
        sequence_end=False,
        priority=request.get("priority", 0),
        timeout=request.get("timeout"),
        custom_parameters=None,
    )
    return bytes(made), int(length or 0)


def body(arrays: dict[str, tuple[str, np.ndarray]], **request: Any) -> tuple[bytes, int]:
    """A request as tritonclient writes it: every input binary, output ``y`` binary."""
    inputs = []
    for name, (datatype, array) in arrays.items():
        given_ = triton.InferInput(name, list(array.shape), datatype)
        given_.set_data_from_numpy(array, binary_data=True)
        inputs.append(given_)
    return written(inputs, [triton.InferRequestedOutput("y", binary_data=True)], **request)


def random(datatype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    numbers = np.random.default_rng(seed).integers(0, 100, size=shape)
    return numbers.astype(NUMPY.get(datatype, triton.triton_to_np_dtype(datatype)))


def same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype.newbyteorder("=") == want.dtype
    np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))


def same_decode(got: Decoded, want: Decoded) -> None:
    """Every field alike, the arrays by value, dtype and shape."""
    assert list(got.request.inputs) == list(want.request.inputs)
    for name, array in want.request.inputs.items():
        assert got.request.inputs[name].dtype == array.dtype
        same(got.request.inputs[name], array.astype(array.dtype.newbyteorder("=")))
    assert (got.rows, got.wanted) == (want.rows, want.wanted)
    fields = ("id", "outputs", "binary_data_output", "timeout_us", "priority")
    assert [getattr(got.request, f) for f in fields] == [getattr(want.request, f) for f in fields]


@settings(max_examples=40, deadline=None, database=None)
@given(
    datatypes=st.lists(st.sampled_from(FIXED), min_size=1, max_size=3),
    rows=st.integers(1, 5),
    width=st.integers(1, 4),
    seeds=st.lists(st.integers(0, 1000), min_size=3, max_size=3),
)
def test_the_third_request_of_a_header_is_read_by_its_plan_as_a_whole_decode_reads_it(
    datatypes: list[str], rows: int, width: int, seeds: list[int]
) -> None:
    names = [f"in{i}" for i in range(len(datatypes))]
    terms = contract(*((n, d, (width,)) for n, d in zip(names, datatypes, strict=True)))
    unplanned = contract(
        *((n, d, (width,)) for n, d in zip(names, datatypes, strict=True)), serial=False
    )
    with own_plans() as plans:
        for turn, seed in enumerate(seeds):  # seen once, planned at the second, read at the third
            sent = {
                n: (d, random(d, (rows, width), seed + i))
                for i, (n, d) in enumerate(zip(names, datatypes, strict=True))
            }
            data, length = body(sent)
            key = (terms.serial, 64, data[:length], len(data) - length)
            assert (key in plans) == (turn == 2)
            decoded = decode_infer(terms, data, length, 64, None)
            for name, (_, array) in sent.items():
                same(decoded.request.inputs[name], array)
            same_decode(decoded, decode_infer(unplanned, data, length, 64, None))
            assert (key in plans) == (turn > 0)


def test_a_planned_request_keeps_its_id_priority_timeout_and_outputs(parsed: list[int]) -> None:
    terms = contract(("x", "INT32", (2,)), levels=3)
    x = triton.InferInput("x", [1, 2], "INT32")
    outputs = [
        triton.InferRequestedOutput("y", binary_data=False, class_count=2),
        triton.InferRequestedOutput("s", binary_data=True),
    ]
    for values in ([1, 2], [3, 4], [5, 6]):
        x.set_data_from_numpy(np.array([values], np.int32), binary_data=True)
        data, length = written([x], outputs, request_id="r7", priority=2, timeout=1500)
        decoded = decode_infer(terms, data, length, 64, None)
        assert decoded.request.inputs["x"].tolist() == [values]
        assert (decoded.request.id, decoded.request.priority) == ("r7", 2)
        assert decoded.request.timeout_us == 1500
        assert [(o.name, o.binary, o.classification) for o in decoded.wanted] == [
            ("y", False, 2),
            ("s", True, 0),
        ]
    assert len(parsed) == 2  # the third was read by the plan


def test_a_kept_header_with_a_body_of_another_length_is_checked_and_refused() -> None:
    terms = contract(("x", "FP32", (4,)))
    data, length = body({"x": ("FP32", np.ones((2, 4), np.float32))})
    for _ in range(3):
        decode_infer(terms, data, length, 64, None)
    with pytest.raises(BadRequest, match="binary data of input 'x' runs past the body"):
        decode_infer(terms, data[:-4], length, 64, None)
    with pytest.raises(BadRequest, match="4 bytes of binary data follow the last input"):
        decode_infer(terms, data + bytes(4), length, 64, None)


def test_a_header_one_model_took_is_checked_against_another_models_terms() -> None:
    takes_four = contract(("x", "FP32", (4,)))
    takes_three = contract(("x", "FP32", (3,)))
    data, length = body({"x": ("FP32", np.ones((1, 12), np.float32).reshape(3, 4))})
    for _ in range(3):
        assert decode_infer(takes_four, data, length, 64, None).rows == 3
    with pytest.raises(BadRequest, match="does not match"):
        decode_infer(takes_three, data, length, 64, None)


def test_a_header_sent_once_with_every_request_makes_no_plan(
    plans: DecodePlans, parsed: list[int]
) -> None:
    """A client that gives each request an ``id`` of its own: every request decoded whole."""
    terms = contract(("x", "INT64", (1,)))
    for i in range(300):
        data, length = body({"x": ("INT64", np.array([[i]], np.int64))}, request_id=f"r{i}")
        assert decode_infer(terms, data, length, 64, None).request.id == f"r{i}"
    assert len(plans) == 0 and len(parsed) == 300


def test_inputs_converted_element_by_element_are_read_from_each_body(plans: DecodePlans) -> None:
    """BOOL is made 0 or 1 from any byte, BYTES is parsed: neither is a view of the body, so
    neither is planned, and each body of the same JSON gives its own values."""
    terms = contract(("flag", "BOOL", (3,)), ("word", "BYTES", (1,)))
    sent = [
        ([True, False, True], b"one"),
        ([False, True, False], b"two"),
        ([True, True, False], b"six"),
    ]
    for flags, word in sent:
        data, length = body(
            {
                "flag": ("BOOL", np.array([flags])),
                "word": ("BYTES", np.array([[word]], dtype=np.object_)),
            }
        )
        decoded = decode_infer(terms, data, length, 64, None)
        np.testing.assert_array_equal(decoded.request.inputs["flag"], [flags])
        assert decoded.request.inputs["word"].tolist() == [[word]]
    assert len(plans) == 0


def test_a_json_input_beside_a_binary_one_is_not_planned(plans: DecodePlans) -> None:
    terms = contract(("a", "INT32", (2,)), ("b", "INT32", (2,)))
    a = triton.InferInput("a", [1, 2], "INT32")
    a.set_data_from_numpy(np.array([[1, 2]], np.int32), binary_data=False)
    b = triton.InferInput("b", [1, 2], "INT32")
    for values in ([3, 4], [5, 6], [7, 8]):
        b.set_data_from_numpy(np.array([values], np.int32), binary_data=True)
        data, length = written([a, b], None)
        decoded = decode_infer(terms, data, length, 64, None)
        assert decoded.request.inputs["a"].tolist() == [[1, 2]]
        assert decoded.request.inputs["b"].tolist() == [values]
    assert len(plans) == 0


def test_shared_memory_parameters_are_refused_without_regions_however_often_seen() -> None:
    """Whether shared memory is taken depends on the caller's regions, which no plan's key
    names: a header with a shared-memory parameter is never planned."""
    terms = contract(("x", "INT32", (2,)))

    class Regions:  # a caller that has regions (the engine's); none is read here
        def view(self, name: str, offset: int, size: int, what: str) -> memoryview:
            raise AssertionError("no input names a region")

        def write(self, name: str, offset: int, data: bytes | memoryview, what: str) -> None:
            raise AssertionError("no output names a region")

    x = triton.InferInput("x", [1, 2], "INT32")
    x.set_data_from_numpy(np.array([[1, 2]], np.int32), binary_data=True)
    data, length = written([x], None)
    request_parameters = b'"parameters":{"binary_data_output":true}'
    assert request_parameters in data[:length]
    header = data[:length].replace(
        request_parameters, b'"parameters":{"binary_data_output":true,"shared_memory_offset":0}'
    )
    data, length = header + data[length:], len(header)
    for _ in range(3):
        assert decode_infer(terms, data, length, 64, Regions()).rows == 1
    with pytest.raises(BadRequest, match="shared memory is not supported"):
        decode_infer(terms, data, length, 64, None)


def test_plans_are_bounded_and_drop_the_oldest() -> None:
    terms = contract(("x", "INT64", (1,)))
    bounded = DecodePlans(limit=3)
    for i in range(5):
        data, length = body({"x": ("INT64", np.array([[i]], np.int64))})
        decoded = decode_infer(terms, data, length, 64, None)
        plan = Plan.of(decoded.request, decoded.rows, decoded.wanted, memoryview(data)[length:])
        assert plan is not None
        bounded.keep((terms.serial, 64, bytes([i]), 8), plan)
        assert not bounded.again((terms.serial, 64, bytes([9, i]), 8))
    assert len(bounded) == 3 and len(bounded._once) == 3
    assert bounded.get((terms.serial, 64, bytes([0]), 8)) is None
    kept = bounded.get((terms.serial, 64, bytes([4]), 8))
    assert kept is not None
    request, rows, _ = kept.decode(memoryview(np.array([7], np.int64).tobytes()))
    assert request.inputs["x"].tolist() == [[7]] and rows == 1
