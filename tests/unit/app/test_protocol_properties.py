"""Property tests of the V2 codec and the request validation behind it: whatever the bytes,
the answer is a decoded request or a ``BadRequest`` with a short message, never another
exception; and what decodes is exactly what was sent.

Hypothesis draws the cases: arbitrary bytes and header lengths, V2-shaped documents whose
every field may be garbage, valid binary requests with one length or shape corrupted, ragged
and deep JSON nesting. ``database=None`` keeps runs free of files; a failure prints its seed.
"""

from __future__ import annotations

import json
import struct
from math import prod
from typing import Any

import numpy as np
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.contract import requested_outputs, validate_inputs
from app.errors import BadRequest
from app.protocol import MAX_JSON_DEPTH, decode_request
from engines.spec import V2_TO_NUMPY, ModelSpec, TensorSpec

DATATYPES = list(V2_TO_NUMPY)
TINY = ModelSpec(
    "tiny",
    (TensorSpec("x", "FP32", (4,)),),
    (TensorSpec("y", "FP32", (3,)), TensorSpec("s", "FP32", (1,))),
    max_batch_size=16,
)
RAW_UNBATCHED = ModelSpec(
    "r", (TensorSpec("x", "INT32", (2, 2)),), (TensorSpec("y", "INT32", (1,)),)
)
TWO_INPUTS = ModelSpec(
    "two",
    (TensorSpec("a", "INT64", (-1,)), TensorSpec("b", "BYTES", (1,))),
    (TensorSpec("y", "FP32", (1,)),),
    max_batch_size=8,
)
SPECS = st.sampled_from([TINY, RAW_UNBATCHED, TWO_INPUTS])
FUZZ = settings(
    max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)


def dumps(document: Any) -> bytes:
    """JSON as a client may send it: integers of any size, which orjson cannot write."""
    return json.dumps(document, separators=(",", ":")).encode()


def maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a plausible value, sometimes any JSON at all."""
    return st.one_of(valid, valid, valid, json_values)


def refused_or_decoded(body: bytes, header_length: int | None, spec: ModelSpec) -> Any:
    """Decode, then validate against the model as the data plane does; only BadRequest may
    escape, with a message short enough never to carry the payload back."""
    try:
        request = decode_request(body, header_length, spec)
        validate_inputs(spec, request.inputs)
        requested_outputs(spec, request)
    except BadRequest as refused:
        assert 0 < len(refused.message) < 300
        return None
    return request


@FUZZ
@given(
    body=st.binary(max_size=300),
    header_length=st.none() | st.integers(min_value=-3, max_value=400),
    spec=SPECS,
)
def test_any_bytes_are_refused_or_decoded(
    body: bytes, header_length: int | None, spec: ModelSpec
) -> None:
    refused_or_decoded(body, header_length, spec)


@FUZZ
@given(document=json_values, spec=SPECS)
def test_any_json_document_is_refused_or_decoded(document: Any, spec: ModelSpec) -> None:
    refused_or_decoded(dumps(document), None, spec)


nested_data = st.recursive(
    st.floats(-1e3, 1e3, width=32) | st.integers(-5, 5) | st.booleans() | st.text(max_size=3),
    lambda children: st.lists(children, max_size=5),
    max_leaves=24,
)
input_entries = st.fixed_dictionaries(
    {
        "name": maybe(st.sampled_from(["x", "a", "b", ""])),
        "datatype": maybe(st.sampled_from(DATATYPES)),
        "shape": maybe(
            st.lists(st.integers(min_value=-2, max_value=2**64), max_size=4)
            | st.lists(st.integers(0, 5), max_size=3)
        ),
    },
    optional={
        "data": maybe(st.lists(nested_data, max_size=8)),
        "parameters": maybe(
            st.fixed_dictionaries(
                {},
                optional={
                    "binary_data_size": maybe(st.integers(min_value=-4, max_value=80)),
                    "shared_memory_region": st.text(max_size=3),
                },
            )
        ),
    },
)


def elements(datatype: str) -> st.SearchStrategy[Any]:
    if datatype == "BOOL":
        return st.booleans()
    if datatype == "BYTES":
        return st.text(max_size=4)
    dtype = V2_TO_NUMPY[datatype]
    if dtype.kind in "iu":
        info = np.iinfo(dtype.name)
        return st.integers(int(info.min), int(info.max))
    return st.floats(-1e4, 1e4, width=16 if datatype in ("FP16", "BF16") else 32)


@st.composite
def coherent_inputs(draw: st.DrawFn) -> dict[str, Any]:
    """An input whose data matches its datatype and shape, so that decoding gets past the
    syntax and the checks that come after it are exercised too."""
    datatype = draw(st.sampled_from(DATATYPES))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    data = draw(st.lists(elements(datatype), min_size=prod(shape), max_size=prod(shape)))
    return {
        "name": draw(st.sampled_from(["x", "a", "b"])),
        "datatype": datatype,
        "shape": shape,
        "data": data,
    }


documents = st.fixed_dictionaries(
    {"inputs": maybe(st.lists(coherent_inputs() | input_entries, min_size=1, max_size=3))},
    optional={
        "id": maybe(st.text(max_size=5)),
        "outputs": maybe(
            st.lists(
                st.fixed_dictionaries(
                    {"name": maybe(st.sampled_from(["y", "s", "z"]))},
                    optional={
                        "parameters": maybe(
                            st.fixed_dictionaries(
                                {},
                                optional={
                                    "binary_data": maybe(st.booleans()),
                                    "classification": maybe(st.integers(-1, 4)),
                                },
                            )
                        )
                    },
                ),
                max_size=3,
            )
        ),
        "parameters": maybe(
            st.fixed_dictionaries(
                {},
                optional={
                    "timeout": maybe(st.integers(-1, 10**7)),
                    "priority": maybe(st.integers(-1, 3)),
                    "binary_data_output": maybe(st.booleans()),
                },
            )
        ),
    },
)


@FUZZ
@given(
    document=documents,
    tail=st.binary(max_size=80),
    delta=st.sampled_from([0, 0, 0, -1, 1, -7, 10_000]),
    spec=SPECS,
)
def test_v2_shaped_garbage_is_refused_or_decoded_to_what_it_says(
    document: dict[str, Any], tail: bytes, delta: int, spec: ModelSpec
) -> None:
    header = dumps(document)
    length = len(header) + delta if tail or delta else None
    try:
        request = decode_request(header + tail, length, spec)
    except BadRequest as refused:
        assert 0 < len(refused.message) < 300
        return
    # What decodes is what the document declared: the shapes, in the document's order.
    entries = document["inputs"]
    assert [e["name"] for e in entries] == list(request.inputs)
    for entry in entries:
        array = request.inputs[entry["name"]]
        assert list(array.shape) == entry["shape"]
        assert array.dtype == V2_TO_NUMPY[entry["datatype"]]
    refused_or_decoded(header + tail, length, spec)


def binary_request(datatype: str, shape: list[int], data: bytes) -> tuple[bytes, int]:
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": datatype,
                    "shape": shape,
                    "parameters": {"binary_data_size": len(data)},
                }
            ]
        }
    )
    return header + data, len(header)


def fixed_tensor(datatype: str, shape: list[int], seed: int) -> bytes:
    itemsize = V2_TO_NUMPY[datatype].itemsize
    return np.random.default_rng(seed).bytes(prod(shape) * itemsize)


def bytes_tensor(elements: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


fixed_types = st.sampled_from([d for d in DATATYPES if d != "BYTES"])
shapes = st.lists(st.integers(1, 4), min_size=1, max_size=3)


@FUZZ
@given(datatype=fixed_types, shape=shapes, seed=st.integers(0, 2**32 - 1))
def test_valid_binary_requests_decode_to_their_bytes(
    datatype: str, shape: list[int], seed: int
) -> None:
    data = fixed_tensor(datatype, shape, seed)
    body, length = binary_request(datatype, shape, data)
    array = decode_request(body, length, TINY).inputs["x"]
    assert list(array.shape) == shape
    if datatype == "BOOL":
        assert array.tolist() == (np.frombuffer(data, np.uint8) != 0).reshape(shape).tolist()
    else:
        assert array.astype(array.dtype.newbyteorder("<")).tobytes() == data


MUTATIONS = ["size+", "size-", "header+", "header-", "cut", "append", "shape"]


@FUZZ
@given(
    datatype=fixed_types,
    shape=shapes,
    mutation=st.sampled_from(MUTATIONS),
    amount=st.integers(1, 50),
)
def test_corrupted_binary_lengths_and_shapes_are_refused(
    datatype: str, shape: list[int], mutation: str, amount: int
) -> None:
    """Lengths past the end or short of it, header lengths beyond the JSON or into it, a body
    cut or padded, a shape that no longer matches the bytes: each is a BadRequest."""
    data = fixed_tensor(datatype, shape, amount)
    declared_size, declared_shape = len(data), list(shape)
    if mutation == "size+":
        declared_size += amount
    elif mutation == "size-":
        declared_size = max(-amount, declared_size - amount)
    elif mutation == "shape":
        declared_shape = [*shape[:-1], shape[-1] + amount]
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": datatype,
                    "shape": declared_shape,
                    "parameters": {"binary_data_size": declared_size},
                }
            ]
        }
    )
    body, length = header + data, len(header)
    if mutation == "header+":
        length += amount
    elif mutation == "header-":
        length -= min(amount, length)
    elif mutation == "cut":
        body = body[: -min(amount, len(data))]
    elif mutation == "append":
        body += b"\0" * amount
    try:
        decode_request(body, length, TINY)
    except BadRequest as refused:
        assert len(refused.message) < 300
    else:
        raise AssertionError(f"{mutation} by {amount} was accepted")


@FUZZ
@given(
    elements=st.lists(st.binary(max_size=12), min_size=1, max_size=6),
    corrupt=st.none() | st.tuples(st.integers(0, 5), st.integers(-3, 2**32 - 1)),
)
def test_binary_bytes_elements_round_trip_or_are_refused(
    elements: list[bytes], corrupt: tuple[int, int] | None
) -> None:
    """Triton's BYTES layout (4-byte little-endian length, then the bytes): what parses is the
    elements; a length prefix changed to anything else is refused, never read past the data."""
    data = bytearray(bytes_tensor(elements))
    if corrupt is not None:
        index, value = corrupt
        offset = sum(4 + len(e) for e in elements[: index % len(elements)])
        original = struct.unpack_from("<I", data, offset)[0]
        if value < 0 or value == original:
            value = original + 1
        struct.pack_into("<I", data, offset, value)
    body, length = binary_request("BYTES", [len(elements)], bytes(data))
    try:
        array = decode_request(body, length, TINY).inputs["x"]
    except BadRequest:
        assert corrupt is not None, "a well-formed BYTES tensor was refused"
        return
    assert corrupt is None, "a corrupted length prefix was accepted"
    assert array.tolist() == elements


def reference_flatten(data: Any) -> list[Any]:
    if type(data) is not list:
        return [data]
    return [v for item in data for v in reference_flatten(item)]


def depth_of(data: Any) -> int:
    if type(data) is not list:
        return 0
    return 1 + max((depth_of(item) for item in data), default=0)


ragged = st.recursive(
    st.floats(-1e6, 1e6, width=32),
    lambda children: st.lists(children, max_size=4),
    max_leaves=40,
)


@FUZZ
@given(data=st.lists(ragged, max_size=6), limit=st.integers(1, 12))
def test_ragged_json_data_is_read_row_major_within_the_depth_limit(
    data: list[Any], limit: int
) -> None:
    """Nesting need not follow the shape (as with Triton): values are read row-major; data
    nested deeper than the limit is refused, whatever mix of lists and values each level has."""
    values = reference_flatten(data)
    document = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [len(values)], "data": data}]}
    try:
        array = decode_request(orjson.dumps(document), None, TINY, max_json_depth=limit).inputs["x"]
    except BadRequest as refused:
        assert depth_of(data) > limit, refused.message
        assert "nests deeper" in refused.message
        return
    assert depth_of(data) <= limit
    assert array.tolist() == np.array(values, dtype=np.float32).tolist()


@settings(max_examples=60, deadline=None, database=None)
@given(depth=st.integers(1, 1100))
def test_any_depth_is_refused_or_decoded(depth: int) -> None:
    data = "[" * (depth - 1) + "[1.0,2.0,3.0,4.0]" + "]" * (depth - 1)
    body = '{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":' + data + "}]}"
    try:
        request = decode_request(body.encode(), None, TINY)
    except BadRequest as refused:
        # The data sits four levels down in the document; the parser stops at 1024.
        assert depth > MAX_JSON_DEPTH
        expected = "1024 levels" if depth + 3 > 1024 else f"deeper than {MAX_JSON_DEPTH}"
        assert expected in refused.message
        return
    assert depth <= MAX_JSON_DEPTH
    assert request.inputs["x"].tolist() == [[1.0, 2.0, 3.0, 4.0]]


NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.integers(-300, 300),
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(-1e6, 1e6, allow_nan=False),
)
LEAVES = st.one_of(NUMBERS, NUMBERS, NUMBERS, st.none(), st.text(max_size=3))


def regular(leaves: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Nested lists, mostly regular (every row the same length), sometimes ragged."""
    return st.recursive(
        st.lists(leaves, min_size=0, max_size=6),
        lambda inner: st.one_of(
            st.integers(1, 4).flatmap(lambda n: st.lists(inner, min_size=n, max_size=n)),
            st.lists(inner, min_size=1, max_size=3),
        ),
        max_leaves=40,
    )


def decoded_or_refused(
    data: Any, datatype: str, count: int, plain: bool
) -> tuple[str, np.ndarray | None]:
    from app.tensor_data import from_json

    try:
        return "ok", from_json("x", data, datatype, count, 8, plain)
    except BadRequest:
        return "refused", None


@FUZZ
@given(data=regular(LEAVES), datatype=st.sampled_from([d for d in DATATYPES if d != "BYTES"]))
def test_numeric_json_fast_path_decodes_as_the_element_wise_path(data: Any, datatype: str) -> None:
    """Data without booleans (what the fast path is allowed for) decodes to the same array
    whether numpy converts it in one call or the element-wise path walks it: same dtype,
    same values, or refused by both."""

    def leaves(value: Any) -> int:
        return sum(leaves(v) for v in value) if type(value) is list else 1

    count = leaves(data)
    for elements in {count, 1, 6}:
        fast = decoded_or_refused(data, datatype, elements, plain=True)
        slow = decoded_or_refused(data, datatype, elements, plain=False)
        assert fast[0] == slow[0], (data, datatype, elements, fast, slow)
        if fast[1] is not None and slow[1] is not None:
            assert fast[1].dtype == slow[1].dtype
            np.testing.assert_array_equal(fast[1], slow[1])


def test_the_fast_path_is_taken_for_regular_numbers_and_declines_the_rest() -> None:
    from app.tensor_data import _numbers

    got = _numbers([[1.5, 2], [3, 4]], "FP32", 4, 8)
    assert got is not None and got.dtype == np.float32
    np.testing.assert_array_equal(got, [1.5, 2, 3, 4])
    assert _numbers([[1, 2], [3]], "FP32", 3, 8) is None  # ragged
    assert _numbers([1.5, 2], "INT32", 2, 8) is None  # a float for an integer type
    assert _numbers([300], "INT8", 1, 8) is None  # out of range: the element-wise 400
    assert _numbers([1, "2"], "FP32", 2, 8) is None  # a string
    assert _numbers([[[1]]], "FP32", 1, 2) is None  # deeper than allowed


def test_a_boolean_among_many_numbers_is_still_refused() -> None:
    """A large JSON body (the fast path's size) with one ``true`` in FP32 data: refused, as
    the element-wise path refuses it; without it the same body decodes."""
    spec = ModelSpec("m", (TensorSpec("x", "FP32", (-1,)),), (TensorSpec("y", "FP32", (-1,)),))
    values: list[Any] = [0.5] * 20_000
    clean = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [20_000],
                                      "data": values}]})  # fmt: skip
    assert len(clean) > 64 * 1024
    np.testing.assert_array_equal(decode_request(clean, None, spec).inputs["x"], values)
    values[1234] = True
    dirty = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [20_000],
                                      "data": values}]})  # fmt: skip
    try:
        decode_request(dirty, None, spec)
    except BadRequest as refused:
        assert "not all FP32 values" in refused.message
    else:
        raise AssertionError("a JSON boolean passed as an FP32 value")
