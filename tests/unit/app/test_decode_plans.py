"""A binary request's JSON decoded once and read again from the plan: the next request with the
same JSON gets its own body's tensors, the same checks' outcome, and nothing of another
model's or another body's. Bodies are written by tritonclient, the way a client sends them."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
import tritonclient.http as triton
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.http._utils import _get_inference_request

from app.contract import PLANS, Contract, decode_infer, serial_of
from app.decode_plans import DecodePlans, Plan
from app.errors import BadRequest
from engines.spec import ModelSpec, TensorSpec

FIXED = ["FP32", "FP16", "BF16", "FP64", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16"]
NUMPY = {"BF16": ml_dtypes.bfloat16}


def contract(*inputs: tuple[str, str, tuple[int, ...]], pixels: str | None = None) -> Contract:
    spec = ModelSpec(
        "m",
        tuple(TensorSpec(name, datatype, shape) for name, datatype, shape in inputs),
        (TensorSpec("y", "FP32", (3,)), TensorSpec("s", "FP32", (1,))),
        max_batch_size=64,
    )
    return Contract("m", "1", spec, pixels, 1, serial_of(spec, pixels, 1))


def written(inputs: list[Any], outputs: list[Any] | None) -> tuple[bytes, int]:
    """The body tritonclient writes and its JSON's length."""
    made, length = _get_inference_request(
        inputs=inputs,
        request_id="",
        outputs=outputs,
        sequence_id=0,
        sequence_start=False,
        sequence_end=False,
        priority=0,
        timeout=None,
        custom_parameters=None,
    )
    return bytes(made), int(length or 0)


def body(arrays: dict[str, tuple[str, np.ndarray]]) -> tuple[bytes, int]:
    """A request as tritonclient writes it: every input binary, output ``y`` binary."""
    inputs = []
    for name, (datatype, array) in arrays.items():
        given_ = triton.InferInput(name, list(array.shape), datatype)
        given_.set_data_from_numpy(array, binary_data=True)
        inputs.append(given_)
    return written(inputs, [triton.InferRequestedOutput("y", binary_data=True)])


def random(datatype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    numbers = np.random.default_rng(seed).integers(0, 100, size=shape)
    return numbers.astype(NUMPY.get(datatype, triton.triton_to_np_dtype(datatype)))


def same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype.newbyteorder("=") == want.dtype
    np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))


@settings(max_examples=60, deadline=None, database=None)
@given(
    datatypes=st.lists(st.sampled_from(FIXED), min_size=1, max_size=3),
    rows=st.integers(1, 5),
    width=st.integers(1, 4),
    seeds=st.tuples(st.integers(0, 1000), st.integers(0, 1000)),
)
def test_a_header_sent_again_gives_the_new_bodys_tensors_and_the_same_checks(
    datatypes: list[str], rows: int, width: int, seeds: tuple[int, int]
) -> None:
    names = [f"in{i}" for i in range(len(datatypes))]
    terms = contract(*((n, d, (width,)) for n, d in zip(names, datatypes, strict=True)))
    first, second = (
        {
            n: (d, random(d, (rows, width), seed + i))
            for i, (n, d) in enumerate(zip(names, datatypes, strict=True))
        }
        for seed in seeds
    )
    for sent in (first, second):  # the second reads the first's plan (one kept for both)
        data, length = body(sent)
        decoded = decode_infer(terms, data, length, 64, None)
        assert list(decoded.request.inputs) == names
        for name, (_, array) in sent.items():
            same(decoded.request.inputs[name], array)
        assert decoded.rows == rows
        assert [(o.name, o.binary) for o in decoded.wanted] == [("y", True)]
        assert decoded.request.outputs == tuple(decoded.wanted)


def test_a_kept_header_with_a_body_of_another_length_is_checked_and_refused() -> None:
    terms = contract(("x", "FP32", (4,)))
    data, length = body({"x": ("FP32", np.ones((2, 4), np.float32))})
    decode_infer(terms, data, length, 64, None)
    with pytest.raises(BadRequest, match="binary data of input 'x' runs past the body"):
        decode_infer(terms, data[:-4], length, 64, None)
    with pytest.raises(BadRequest, match="4 bytes of binary data follow the last input"):
        decode_infer(terms, data + bytes(4), length, 64, None)


def test_a_header_one_model_took_is_checked_against_another_models_terms() -> None:
    takes_four = contract(("x", "FP32", (4,)))
    takes_three = contract(("x", "FP32", (3,)))
    data, length = body({"x": ("FP32", np.ones((1, 12), np.float32).reshape(3, 4))})
    assert decode_infer(takes_four, data, length, 64, None).rows == 3
    with pytest.raises(BadRequest, match="does not match"):
        decode_infer(takes_three, data, length, 64, None)


def test_inputs_converted_element_by_element_are_read_from_each_body() -> None:
    """BOOL is made 0 or 1 from any byte, BYTES is parsed: neither is a view of the body, so
    neither is planned, and a second body of the same JSON gives its own values."""
    terms = contract(("flag", "BOOL", (3,)), ("word", "BYTES", (1,)))
    for flags, word in (([True, False, True], b"one"), ([False, True, False], b"two")):
        sent = {
            "flag": ("BOOL", np.array([flags])),
            "word": ("BYTES", np.array([[word]], dtype=np.object_)),
        }
        held = len(PLANS)
        data, length = body(sent)
        decoded = decode_infer(terms, data, length, 64, None)
        np.testing.assert_array_equal(decoded.request.inputs["flag"], [flags])
        assert decoded.request.inputs["word"].tolist() == [[word]]
        assert len(PLANS) == held


def test_a_json_input_beside_a_binary_one_is_not_planned() -> None:
    terms = contract(("a", "INT32", (2,)), ("b", "INT32", (2,)))
    a = triton.InferInput("a", [1, 2], "INT32")
    a.set_data_from_numpy(np.array([[1, 2]], np.int32), binary_data=False)
    b = triton.InferInput("b", [1, 2], "INT32")
    held = len(PLANS)
    for values in ([3, 4], [5, 6]):
        b.set_data_from_numpy(np.array([values], np.int32), binary_data=True)
        data, length = written([a, b], None)
        decoded = decode_infer(terms, data, length, 64, None)
        assert decoded.request.inputs["a"].tolist() == [[1, 2]]
        assert decoded.request.inputs["b"].tolist() == [values]
    assert len(PLANS) == held


def test_plans_are_bounded_and_drop_the_oldest() -> None:
    terms = contract(("x", "INT64", (1,)))
    plans = DecodePlans(limit=3)
    for i in range(5):
        data, length = body({"x": ("INT64", np.array([[i]], np.int64))})
        decoded = decode_infer(terms, data, length, 64, None)
        plan = Plan.of(decoded.request, decoded.rows, decoded.wanted, memoryview(data)[length:])
        assert plan is not None
        plans.keep((terms.serial, 64, bytes([i]), 8), plan)
    assert len(plans) == 3
    assert plans.get((terms.serial, 64, bytes([0]), 8)) is None
    kept = plans.get((terms.serial, 64, bytes([4]), 8))
    assert kept is not None
    request, rows, _ = kept.decode(memoryview(np.array([7], np.int64).tobytes()))
    assert request.inputs["x"].tolist() == [[7]] and rows == 1
