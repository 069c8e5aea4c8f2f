"""Large numeric ``data`` arrays lifted out of a V2 JSON document and read by simdjson
(``app.json_numbers``): the same requests decode to the same arrays, and the same refusals
carry the same messages, as when orjson parses the whole document.

The property tests lower the lifting's threshold to one byte, so that every ``data`` array
of Hypothesis's small documents is lifted, and compare with the threshold out of reach.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from app import json_numbers, protocol
from app.errors import BadRequest
from app.json_numbers import Numbers, nesting
from app.protocol import decode_request
from engines.spec import ModelSpec, TensorSpec
from tests.unit.app.test_protocol_properties import (
    DATATYPES,
    FUZZ,
    LEAVES,
    SPECS,
    TINY,
    documents,
    dumps,
    regular,
)

IMAGE = ModelSpec(
    "image",
    (TensorSpec("input", "FP32", (3, 224, 224)),),
    (TensorSpec("output", "FP32", (1000,)),),
    max_batch_size=8,
)
ANY_LENGTH = ModelSpec("m", (TensorSpec("x", "FP32", (-1,)),), (TensorSpec("y", "FP32", (-1,)),))


@contextmanager
def lifted_from(size: int) -> Iterator[None]:
    """Lift ``data`` arrays of ``size`` bytes or more within the block."""
    kept = json_numbers.LIFTED_BYTES
    json_numbers.LIFTED_BYTES = size
    try:
        yield
    finally:
        json_numbers.LIFTED_BYTES = kept


def outcome(body: bytes, spec: ModelSpec, max_depth: int = 8) -> Any:
    """What decoding answers: the refusal's message, or every field of the request with each
    input as its dtype, shape and values."""
    try:
        request = decode_request(body, None, spec, max_depth)
    except BadRequest as refused:
        return ("refused", refused.message)
    inputs = {
        name: (
            array.dtype.str,
            array.shape,
            array.tolist() if array.dtype.hasobject else array.tobytes(),
        )
        for name, array in request.inputs.items()
    }
    return ("ok", inputs, request.id, request.outputs, request.binary_data_output,
            request.timeout_us, request.priority)  # fmt: skip


def both_ways(body: bytes, spec: ModelSpec, max_depth: int = 8) -> tuple[Any, Any]:
    """The outcome lifted (every ``data`` array) and whole (none); each also with numpy's
    one-call path taken at any size (as a large document takes it), which must not change
    it either."""
    found = []
    for lifted in (1, 1 << 62):
        for fast in (0, protocol._FAST_JSON_BYTES):
            with lifted_from(lifted), fast_from(fast):
                found.append(outcome(body, spec, max_depth))
    assert found[0] == found[1] and found[2] == found[3], found
    return found[0], found[2]


@contextmanager
def fast_from(size: int) -> Iterator[None]:
    """Let numeric ``data`` take numpy's one-call path in documents of ``size`` bytes or more
    (those without a boolean) within the block."""
    kept = protocol._FAST_JSON_BYTES
    protocol._FAST_JSON_BYTES = size
    try:
        yield
    finally:
        protocol._FAST_JSON_BYTES = kept


def image_request(data: Any) -> bytes:
    return orjson.dumps(
        {
            "inputs": [
                {"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP32", "data": data}
            ]
        },
        option=orjson.OPT_SERIALIZE_NUMPY,
    )


@FUZZ
@given(document=documents, spec=SPECS)
def test_v2_shaped_documents_decode_alike_lifted_or_whole(document: Any, spec: ModelSpec) -> None:
    lifted, whole = both_ways(dumps(document), spec)
    assert lifted == whole


@FUZZ
@given(
    data=regular(LEAVES),
    datatype=st.sampled_from([d for d in DATATYPES if d != "BYTES"]),
    depth=st.integers(1, 4),
    spaced=st.booleans(),
)
def test_numeric_data_decodes_alike_lifted_or_whole(
    data: Any, datatype: str, depth: int, spaced: bool
) -> None:
    """Numbers of every size and kind (integers past 64 bits, floats for integer types, out of
    range, null, strings), regular or ragged, within or past the depth limit, compact or with
    whitespace around every token: the same array or the same refusal."""

    def leaves(value: Any) -> int:
        return sum(leaves(v) for v in value) if type(value) is list else 1

    for count in {leaves(data), 1}:
        entry = {"name": "x", "datatype": datatype, "shape": [count], "data": data}
        body = dumps({"inputs": [entry], "id": "r"})
        if spaced:
            body = body.replace(b",", b" ,\n ").replace(b"[", b"[ \t").replace(b"]", b" ]")
        lifted, whole = both_ways(body, ANY_LENGTH, depth)
        assert lifted == whole, (data, datatype, count)


def test_an_image_is_read_by_simdjson_to_the_same_array() -> None:
    """A [1, 3, 224, 224] FP32 image, flat and nested along its shape, past the default
    threshold: lifted (its numbers read into a buffer, not Python floats) and decoded to
    the array that was sent."""
    image = np.random.default_rng(7).standard_normal((1, 3, 224, 224)).astype(np.float32)
    for data in (image.reshape(-1), image):
        body = image_request(data)
        document, parsed = json_numbers.loads(body)
        lifted = document["inputs"][0]["data"]
        assert type(lifted) is Numbers and lifted.values is not None
        assert len(parsed) < 300  # what orjson parsed: the document without the numbers
        request = decode_request(body, None, IMAGE)
        np.testing.assert_array_equal(request.inputs["input"], image)
        assert request.inputs["input"].dtype == np.float32
        lifted_way, whole_way = both_ways(body, IMAGE, 64)
        assert lifted_way == whole_way


@pytest.mark.parametrize(
    ("body", "why"),
    [
        # A "data" key that is not an input's: in the request's parameters.
        (
            b'{"parameters":{"data":[1,2]},"inputs":[{"name":"x","datatype":"FP32","shape":[1],'
            b'"data":[3]}]}',
            "not an input's data",
        ),
        # Two "data" keys in one input: the last one counts, as orjson reads it.
        (
            b'{"inputs":[{"name":"x","datatype":"FP32","shape":[2],"data":[1,2],"data":[3,4]}]}',
            "a duplicate key",
        ),
        # A key that ends in "data" after an escaped quote.
        (
            b'{"inputs":[{"name":"x","datatype":"FP32","shape":[2],"x\\"data":[9,9],"data":[3,4]}]}',
            "an escaped quote",
        ),
        # The text of an array inside a string.
        (
            b'{"id":"\\"data\\": [1, 2]","inputs":[{"name":"x","datatype":"FP32","shape":[1],'
            b'"data":[3]}]}',
            "a string",
        ),
        # Two arrays where one value belongs: invalid JSON.
        (b'{"inputs":[{"name":"x","datatype":"FP32","shape":[2],"data":[1],[2]}]}', "two arrays"),
        # A closing bracket too many: invalid JSON.
        (b'{"inputs":[{"name":"x","datatype":"FP32","shape":[2],"data":[1,2]]}]}', "a bracket"),
        # An array holding an object: the span stops at its brace.
        (b'{"inputs":[{"name":"x","datatype":"FP32","shape":[2],"data":[1,{}]}]}', "an object"),
        # A number past 64 bits: orjson reads it as a float, simdjson refuses it.
        (
            b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1],'
            b'"data":[18446744073709551616]}]}',
            "a big integer",
        ),
        (
            b'{"inputs":[{"name":"x","datatype":"INT64","shape":[1],'
            b'"data":[9223372036854775808]}]}',
            "out of range",
        ),
        (b'{"inputs":[{"name":"x","datatype":"UINT8","shape":[1],"data":[-1]}]}', "negative"),
        (b'{"inputs":[{"name":"x","datatype":"INT8","shape":[1],"data":[1.0]}]}', "a float"),
        (
            b'{"inputs":[{"name":"x","datatype":"FP32","shape":[2],"data":[1e400, 1]}]}',
            "an infinite number",
        ),
        (b'{"inputs":[{"name":"x","datatype":"FP32","shape":[2],"data":[1, true]}]}', "a boolean"),
        (b'{"inputs":[{"name":"x","datatype":"BOOL","shape":[2],"data":[true, false]}]}', "BOOL"),
        (
            b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[[[[[[[[[1]]]]]]]]]}]}',
            "too deep",
        ),
        (b'{"inputs":[{"name":"x","datatype":[1],"shape":[1],"data":[1]}]}', "a list datatype"),
        # Spaces after the array, before its object closes; and a stray number after it.
        (
            b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[1]'
            + b" " * 5000
            + b"}]}",
            "spaces after",
        ),
        (b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[1] 2}]}', "a stray value"),
        # Nested as deep as orjson takes a document (1021 levels at an input's data), and one
        # deeper: orjson's refusal of the whole document, not the data's depth limit.
        (
            b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":'
            + b"[" * 1021
            + b"1"
            + b"]" * 1021
            + b"}]}",
            "1021 levels",
        ),
        (
            b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":'
            + b"[" * 1022
            + b"1"
            + b"]" * 1022
            + b"}]}",
            "1022 levels",
        ),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_documents_the_lifting_cannot_vouch_for_decode_as_whole(body: bytes, why: str) -> None:
    lifted, whole = both_ways(body, ANY_LENGTH)
    assert lifted == whole, why


def test_integers_past_a_float32_step_round_alike_on_every_path() -> None:
    """2**60 + 2**36 + 1 lies just past halfway between two float32 values, and its double
    rounds to the halfway point: through a double it rounds down, straight to float32 up.
    Every path goes through a double, as numpy converts a Python int: element by element
    (a small document), numpy in one call (a large one without a boolean), and simdjson (a
    lifted array), whichever other input of the document holds a boolean."""
    n = 2**60 + 2**36 + 1
    expected = np.float32(float(n))
    filler = {"name": "f", "datatype": "FP32", "shape": [33_000], "data": [0] * 33_000}
    flags = {"name": "b", "datatype": "BOOL", "shape": [33_000], "data": [True] * 33_000}
    small = {"name": "x", "datatype": "FP32", "shape": [1], "data": [n]}
    large = {"name": "x", "datatype": "FP32", "shape": [33_000], "data": [n] + [0] * 32_999}
    spec = ModelSpec(
        "m",
        tuple(TensorSpec(name, datatype, (-1,)) for name, datatype in
              (("x", "FP32"), ("f", "FP32"), ("b", "BOOL"))),
        (TensorSpec("y", "FP32", (-1,)),),
    )  # fmt: skip
    for inputs in ([small], [large], [filler, small], [flags, large], [flags, small]):
        body = dumps({"inputs": inputs})
        for size in (1, json_numbers.LIFTED_BYTES, 1 << 62):
            with lifted_from(size):
                got = decode_request(body, None, spec).inputs["x"][0]
            assert got == expected, (len(inputs), size, got)


def test_a_lifted_array_is_refused_as_the_element_wise_path_refuses_it() -> None:
    """The refusals the lifted path makes itself (depth, element count, range), with the
    element-wise path's messages, on a document past the real threshold."""
    n = 20_000
    flat = list(range(n))
    cases = [
        ("FP32", [n + 1], flat, "data holds 20000 elements, the shape 20001"),
        ("INT8", [n], flat, "a value is out of range for INT8"),
        ("FP32", [n], [[[v]] for v in flat], '"data" nests deeper than 2 levels'),
    ]
    for datatype, shape, data, message in cases:
        body = orjson.dumps(
            {"inputs": [{"name": "x", "datatype": datatype, "shape": shape, "data": data}]}
        )
        assert len(body) > json_numbers.LIFTED_BYTES
        document, _ = json_numbers.loads(body)
        assert type(document["inputs"][0]["data"]) is Numbers
        with pytest.raises(BadRequest) as refused:
            decode_request(body, None, ANY_LENGTH, max_json_depth=2)
        assert message in refused.value.message
        lifted_way, whole_way = both_ways(body, ANY_LENGTH, 2)
        assert lifted_way == whole_way


@pytest.mark.parametrize(
    ("text", "depth"),
    [(b"[]", 1), (b"[1,2]", 1), (b"[[1],[2]]", 2), (b"[[1],[[2]],3]", 3), (b"[1,[2,[3,[4]]]]", 4)],
)
def test_nesting_is_the_deepest_point_of_the_brackets(text: bytes, depth: int) -> None:
    assert nesting(memoryview(text)) == depth


def test_small_documents_are_not_lifted() -> None:
    body = dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [4], "data": [1, 2, 3, 4]}]}
    )
    document, parsed = json_numbers.loads(body)
    assert document["inputs"][0]["data"] == [1, 2, 3, 4]
    assert parsed == body
    assert decode_request(body, None, TINY).inputs["x"].tolist() == [1, 2, 3, 4]
