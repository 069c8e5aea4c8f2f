"""The V2 codec: round trips for every datatype, conformance with tritonclient, refusals."""

from __future__ import annotations

import struct
from math import prod
from typing import Any

import ml_dtypes
import numpy as np
import orjson
import pytest
import tritonclient.http as triton
from tritonclient.http._utils import _get_inference_request

from app.errors import BadRequest, EngineError
from app.protocol import (
    InferRequest,
    RequestedOutput,
    classify,
    decode_request,
    encode_response,
)
from engines.spec import V2_TO_NUMPY, ModelSpec, TensorSpec

DATATYPES = list(V2_TO_NUMPY)
SHAPES = [(4,), (2, 3), (), (0, 3)]
# The codec does not look at the model except for raw binary requests.
ANY_MODEL = ModelSpec("m", (TensorSpec("x", "FP32", (3,)),), (TensorSpec("y", "FP32", (3,)),))
# Stands for client data that must never come back in an error message.
MARKER = "Zq" * 100


def sample(datatype: str, shape: tuple[int, ...], *, text: bool = False) -> np.ndarray:
    """Representative values: integer extremes, floats rounded to the type, odd bytes."""
    n = prod(shape)
    dtype = V2_TO_NUMPY[datatype]
    if datatype == "BYTES":
        pool = [b"", b"cat", "caf\u00e9".encode(), b"\x00ab\x00"]
        if not text:
            pool.append(b"\xff\xfe")
        array = np.empty(n, dtype=np.object_)
        array[:] = [pool[i % len(pool)] for i in range(n)]
    elif datatype == "BOOL":
        array = np.arange(n) % 3 == 0
    elif dtype.kind in "iu":
        info = np.iinfo(dtype.name)
        pool_i = [int(info.min), int(info.max), 0, 1, 7]
        array = np.array([pool_i[i % len(pool_i)] for i in range(n)], dtype=dtype)
    else:
        pool_f = [0.0, -1.5, 0.1, 1024.0, 3.0e4]
        array = np.array([pool_f[i % len(pool_f)] for i in range(n)], dtype=dtype)
    return array.reshape(shape)


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    if want.dtype == np.object_:
        assert got.tolist() == want.tolist()
    else:
        assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()


def json_data(array: np.ndarray, datatype: str, *, nested: bool) -> Any:
    if datatype == "BYTES":
        array = np.vectorize(lambda b: b.decode(), otypes=[np.object_])(array)
    elif datatype in ("FP16", "BF16"):
        array = array.astype(np.float64)
    if not nested or array.ndim == 0:
        return array.reshape(-1).tolist()
    return array.tolist()


def binary_data(array: np.ndarray, datatype: str) -> bytes:
    if datatype == "BYTES":
        return b"".join(struct.pack("<I", len(e)) + e for e in array.reshape(-1))
    return array.tobytes()


def with_binary(header: dict[str, Any], *chunks: bytes) -> tuple[bytes, int]:
    encoded = orjson.dumps(header)
    return encoded + b"".join(chunks), len(encoded)


def decode_json(document: Any) -> InferRequest:
    return decode_request(orjson.dumps(document), None, ANY_MODEL)


X = {"name": "x", "datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}


def one_input(**changes: Any) -> dict[str, Any]:
    return {"inputs": [{**X, **changes}]}


# Round trips through our own encoder.


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("datatype", DATATYPES)
@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
def test_json_input_round_trip(datatype: str, shape: tuple[int, ...], nested: bool) -> None:
    want = sample(datatype, shape, text=True)
    tensor = {"name": "t", "datatype": datatype, "shape": list(shape)}
    request = decode_json(
        {"inputs": [{**tensor, "data": json_data(want, datatype, nested=nested)}]}
    )
    assert_same(request.inputs["t"], want)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("datatype", DATATYPES)
def test_binary_input_round_trip(datatype: str, shape: tuple[int, ...]) -> None:
    want = sample(datatype, shape)
    chunk = binary_data(want, datatype)
    tensor = {"name": "t", "datatype": datatype, "shape": list(shape)}
    header = {"inputs": [{**tensor, "parameters": {"binary_data_size": len(chunk)}}]}
    body, length = with_binary(header, chunk)
    assert_same(decode_request(body, length, ANY_MODEL).inputs["t"], want)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("datatype", DATATYPES)
@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_output_round_trip(datatype: str, shape: tuple[int, ...], binary: bool) -> None:
    """encode_response emits exactly what decode_request reads back as an input."""
    want = sample(datatype, shape, text=not binary)
    body, headers = encode_response("m", "1", None, [(RequestedOutput("t", binary, 0), want)])
    length = int(headers.get("Inference-Header-Content-Length", len(body)))
    document = orjson.loads(body[:length])
    document["inputs"] = document.pop("outputs")
    header = orjson.dumps(document)
    request = decode_request(header + body[length:], len(header) if binary else None, ANY_MODEL)
    assert_same(request.inputs["t"], want)


def test_mixed_json_and_binary_inputs_keep_their_order() -> None:
    a, b, c = sample("INT32", (2, 2)), sample("BYTES", (3,)), sample("FP64", (2,))
    header = {
        "inputs": [
            {
                "name": "a",
                "datatype": "INT32",
                "shape": [2, 2],
                "parameters": {"binary_data_size": 16},
            },
            {"name": "c", "datatype": "FP64", "shape": [2], "data": c.tolist()},
            {
                "name": "b",
                "datatype": "BYTES",
                "shape": [3],
                "parameters": {"binary_data_size": len(binary_data(b, "BYTES"))},
            },
        ]
    }
    body, length = with_binary(header, binary_data(a, "INT32"), binary_data(b, "BYTES"))
    inputs = decode_request(body, length, ANY_MODEL).inputs
    assert list(inputs) == ["a", "c", "b"]
    assert_same(inputs["a"], a)
    assert_same(inputs["b"], b)
    assert_same(inputs["c"], c)


def test_nesting_need_not_follow_the_shape() -> None:
    """Like Triton, JSON data is read row-major whatever its nesting."""
    request = decode_json(one_input(shape=[2, 2], data=[[1.0], [2.0, [3.0]], 4.0]))
    assert request.inputs["x"].tolist() == [[1.0, 2.0], [3.0, 4.0]]


def test_zero_size_dims_give_empty_arrays() -> None:
    """V2 allows 0 in a shape; the codec keeps it and leaves the verdict to the data plane."""
    assert decode_json(one_input(shape=[0, 5], data=[])).inputs["x"].shape == (0, 5)
    body, length = with_binary(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": [3, 0],
                    "parameters": {"binary_data_size": 0},
                }
            ]
        }
    )
    assert decode_request(body, length, ANY_MODEL).inputs["x"].shape == (3, 0)


def test_binary_inputs_are_read_only_views() -> None:
    body, length = with_binary(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": [2],
                    "parameters": {"binary_data_size": 8},
                }
            ]
        },
        np.ones(2, np.float32).tobytes(),
    )
    assert not decode_request(body, length, ANY_MODEL).inputs["x"].flags.writeable


def test_binary_bool_bytes_are_normalised() -> None:
    header = {
        "inputs": [
            {"name": "x", "datatype": "BOOL", "shape": [3], "parameters": {"binary_data_size": 3}}
        ]
    }
    body, length = with_binary(header, b"\x00\x01\x07")
    array = decode_request(body, length, ANY_MODEL).inputs["x"]
    assert array.tolist() == [False, True, True]
    assert array.view(np.uint8).tolist() == [0, 1, 1]


def test_fp16_and_bf16_accept_json_numbers() -> None:
    request = decode_json(
        {
            "inputs": [
                {"name": "h", "datatype": "FP16", "shape": [3], "data": [1, 0.5, 1e10]},
                {"name": "b", "datatype": "BF16", "shape": [2], "data": [3, -0.1]},
            ]
        }
    )
    assert request.inputs["h"].tolist() == [1.0, 0.5, np.inf]
    assert request.inputs["b"].dtype == ml_dtypes.bfloat16
    assert request.inputs["b"].astype(np.float32).tolist() == [3.0, float(ml_dtypes.bfloat16(-0.1))]


def test_bf16_takes_integers_beyond_int64_as_the_floats_they_are() -> None:
    """JSON integers from 2**63 to 2**64 - 1 reach the decoder as Python ints (orjson), and
    ml_dtypes converts none past int64: as BF16 they were a TypeError (a 500), found by the
    fast-path property test. FP32 reads them as the floats they are; so does BF16 now."""
    for datatype in ("BF16", "FP32"):
        body = (
            b'{"inputs": [{"name": "b", "datatype": "%s", "shape": [3], '
            b'"data": [9223372036854775808, 18446744073709551615, -3]}]}' % datatype.encode()
        )
        array = decode_request(body, None, ANY_MODEL).inputs["b"]
        assert array.astype(np.float64).tolist() == [2.0**63, 2.0**64, -3.0]


# Request-level fields.


def test_request_fields_and_defaults() -> None:
    request = decode_json(one_input())
    assert (request.id, request.outputs, request.binary_data_output) == (None, (), False)
    assert (request.timeout_us, request.priority) == (None, 0)

    request = decode_json(
        {
            **one_input(),
            "id": "r-1",
            "parameters": {"binary_data_output": True, "timeout": 2500, "priority": 3, "x": 1},
            "outputs": [
                {"name": "a"},
                {"name": "b", "parameters": {"binary_data": False, "classification": 5}},
            ],
        }
    )
    assert request.id == "r-1"
    assert (request.binary_data_output, request.timeout_us, request.priority) == (True, 2500, 3)
    assert request.outputs == (RequestedOutput("a", True, 0), RequestedOutput("b", False, 5))


def test_raw_binary_request_batched() -> None:
    spec = ModelSpec(
        "raw", (TensorSpec("img", "FP32", (2, 3)),), (TensorSpec("y", "FP32", (2,)),), 4
    )
    data = np.arange(18, dtype=np.float32).reshape(3, 2, 3)
    request = decode_request(data.tobytes(), 0, spec)
    assert_same(request.inputs["img"], data)
    assert (request.id, request.outputs, request.binary_data_output) == (None, (), True)


def test_raw_binary_request_unbatched() -> None:
    spec = ModelSpec("raw", (TensorSpec("img", "UINT8", (2, 2)),), (TensorSpec("y", "FP32", (2,)),))
    request = decode_request(b"\x01\x02\x03\x04", 0, spec)
    assert request.inputs["img"].tolist() == [[1, 2], [3, 4]]


# Conformance with the real Triton client.

TRITON_SHAPES = [(4,), (2, 3), (0, 3)]


def triton_request(
    inputs: list[triton.InferInput],
    outputs: list[triton.InferRequestedOutput] | None = None,
    request_id: str = "",
    priority: int = 0,
    timeout: int | None = None,
) -> tuple[bytes, int | None]:
    body, length = _get_inference_request(
        inputs=inputs,
        request_id=request_id,
        outputs=outputs,
        sequence_id=0,
        sequence_start=False,
        sequence_end=False,
        priority=priority,
        timeout=timeout,
        custom_parameters=None,
    )
    return body, length


def triton_result(body: bytes, headers: dict[str, str]) -> triton.InferResult:
    length = headers.get("Inference-Header-Content-Length")
    return triton.InferResult.from_response_body(
        body, verbose=False, header_length=int(length) if length else None, content_encoding=None
    )


@pytest.mark.parametrize("shape", TRITON_SHAPES, ids=str)
@pytest.mark.parametrize("datatype", DATATYPES)
@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_round_trip(datatype: str, shape: tuple[int, ...], binary: bool) -> None:
    if datatype == "BF16" and not binary:
        pytest.skip("tritonclient sends BF16 only as binary data")
    want = sample(datatype, shape, text=not binary)
    tensor = triton.InferInput("t", list(shape), datatype)
    tensor.set_data_from_numpy(want, binary_data=binary)
    output = triton.InferRequestedOutput("t", binary_data=binary)
    body, length = triton_request([tensor], [output], request_id="req-7")

    request = decode_request(body, length, ANY_MODEL)
    assert_same(request.inputs["t"], want)
    assert request.id == "req-7"
    assert request.outputs == (RequestedOutput("t", binary, 0),)

    reply, headers = encode_response(
        "m", "fp32", request.id, [(request.outputs[0], request.inputs["t"])]
    )
    result = triton_result(reply, headers)
    assert result.get_response()["model_version"] == "fp32"
    assert result.get_response()["id"] == "req-7"
    got = result.as_numpy("t")
    if datatype == "BYTES" and not binary:
        # tritonclient reads JSON BYTES back as str.
        want = np.vectorize(lambda b: b.decode(), otypes=[np.object_])(want)
    assert_same(got, want)


def test_tritonclient_request_parameters() -> None:
    tensors = [triton.InferInput(n, [2], "INT64") for n in ("a", "b")]
    tensors[0].set_data_from_numpy(np.array([1, 2]), binary_data=True)
    tensors[1].set_data_from_numpy(np.array([3, 4]), binary_data=False)
    outputs = [
        triton.InferRequestedOutput("scores", binary_data=False, class_count=3),
        triton.InferRequestedOutput("raw", binary_data=True),
    ]
    body, length = triton_request(tensors, outputs, priority=2, timeout=1000)
    request = decode_request(body, length, ANY_MODEL)
    assert request.inputs["a"].tolist() == [1, 2]
    assert request.inputs["b"].tolist() == [3, 4]
    assert request.outputs == (RequestedOutput("scores", False, 3), RequestedOutput("raw", True, 0))
    assert (request.id, request.priority, request.timeout_us) == (None, 2, 1000)


def test_tritonclient_without_outputs_asks_for_binary() -> None:
    tensor = triton.InferInput("a", [1], "FP32")
    tensor.set_data_from_numpy(np.array([1.0], np.float32), binary_data=False)
    request = decode_request(*triton_request([tensor]), ANY_MODEL)
    assert (request.outputs, request.binary_data_output) == ((), True)


def test_tritonclient_reads_classification_and_mixed_outputs() -> None:
    scores = np.array([[0.1, 0.7, 0.2], [0.5, 0.1, 0.4]], np.float32)
    top = classify(scores, 2, ["cat", "dog", "eel"])
    reply, headers = encode_response(
        "m",
        "1",
        None,
        [(RequestedOutput("top", False, 2), top), (RequestedOutput("scores", True, 0), scores)],
    )
    result = triton_result(reply, headers)
    assert "id" not in result.get_response()
    assert result.as_numpy("top").tolist() == [
        ["0.700000:1:dog", "0.200000:2:eel"],
        ["0.500000:0:cat", "0.400000:2:eel"],
    ]
    assert_same(result.as_numpy("scores"), scores)


# Response encoding details.


def test_json_response_shape_and_headers() -> None:
    body, headers = encode_response(
        "m", "1", "abc", [(RequestedOutput("y", False, 0), np.array([[1, 2]], np.int32))]
    )
    assert headers == {"Content-Type": "application/json"}
    assert orjson.loads(body) == {
        "model_name": "m",
        "model_version": "1",
        "id": "abc",
        "outputs": [{"name": "y", "datatype": "INT32", "shape": [1, 2], "data": [1, 2]}],
    }


def test_binary_response_layout() -> None:
    a = np.array([1.0, 2.0], np.float32)
    b = np.array([[7]], np.uint8)
    outputs = [
        (RequestedOutput("a", True, 0), a),
        (RequestedOutput("j", False, 0), np.array([True])),
        (RequestedOutput("b", True, 0), b),
    ]
    body, headers = encode_response("m", "1", None, outputs)
    length = int(headers["Inference-Header-Content-Length"])
    assert headers["Content-Type"] == "application/octet-stream"
    document = orjson.loads(body[:length])
    assert [t.get("parameters") for t in document["outputs"]] == [
        {"binary_data_size": 8},
        None,
        {"binary_data_size": 1},
    ]
    assert "data" not in document["outputs"][0]
    assert document["outputs"][1]["data"] == [True]
    assert body[length:] == a.tobytes() + b.tobytes()


def test_response_handles_strided_big_endian_and_str_arrays() -> None:
    strided = np.arange(6, dtype=np.int16).reshape(2, 3).T
    big = np.array([1.5, -2.0], dtype=">f8")
    text = np.array(["h\u00e9", "yo"])
    for binary in (False, True):
        outputs = [
            (RequestedOutput(n, binary, 0), a) for n, a in [("s", strided), ("g", big), ("u", text)]
        ]
        result = triton_result(*encode_response("m", "1", None, outputs))
        assert result.as_numpy("s").tolist() == strided.tolist()
        assert result.as_numpy("g").tolist() == big.tolist()
        want_text = [t.encode() for t in text] if binary else text.tolist()
        assert result.as_numpy("u").tolist() == want_text


def test_non_utf8_bytes_in_json_are_replaced() -> None:
    array = np.array([b"ok", b"\xff"], dtype=np.object_)
    body, _ = encode_response("m", "1", None, [(RequestedOutput("s", False, 0), array)])
    assert orjson.loads(body)["outputs"][0]["data"] == ["ok", "\ufffd"]


def test_non_finite_floats_become_null_in_json() -> None:
    array = np.array([np.nan, np.inf, 1.0], np.float32)
    body, _ = encode_response("m", "1", None, [(RequestedOutput("y", False, 0), array)])
    assert orjson.loads(body)["outputs"][0]["data"] == [None, None, 1.0]


@pytest.mark.parametrize(
    "array",
    [np.array([1 + 2j]), np.array([object()], dtype=np.object_)],
    ids=["complex", "object"],
)
def test_unencodable_outputs_are_engine_errors(array: np.ndarray) -> None:
    for binary in (False, True):
        with pytest.raises(EngineError):
            encode_response("m", "1", None, [(RequestedOutput("y", binary, 0), array)])


# classify


def test_classify_orders_by_score_then_index() -> None:
    scores = np.array([[0.1, 0.9, 0.5, 0.9], [4.0, 3.0, 2.0, 1.0]], np.float32)
    top = classify(scores, 3, ["a", "b", "c", "d"])
    assert top.dtype == np.object_
    assert top.tolist() == [
        [b"0.900000:1:b", b"0.900000:3:d", b"0.500000:2:c"],
        [b"4.000000:0:a", b"3.000000:1:b", b"2.000000:2:c"],
    ]


def test_classify_without_labels_and_unbatched() -> None:
    top = classify(np.array([1, 5, 3], np.int64), 2, None)
    assert top.shape == (2,)
    assert top.tolist() == [b"5.000000:1", b"3.000000:2"]


def test_classify_clamps_k_and_tolerates_missing_labels() -> None:
    top = classify(np.array([[0.25, 0.75]], ml_dtypes.bfloat16), 10, ["only", ""])
    assert top.tolist() == [[b"0.750000:1", b"0.250000:0:only"]]


def test_classify_flattens_trailing_axes() -> None:
    scores = np.array([0.25, 0.75, 0.5, 0.125], np.float16).reshape(2, 2, 1, 1)
    assert classify(scores, 1, None).tolist() == [[b"0.750000:1"], [b"0.500000:0"]]


def test_classify_empty_batch() -> None:
    assert classify(np.empty((0, 5), np.float32), 3, None).shape == (0, 3)


@pytest.mark.parametrize("k", [0, -1])
def test_classify_refuses_non_positive_k(k: int) -> None:
    with pytest.raises(BadRequest):
        classify(np.array([1.0]), k, None)


def test_classify_refuses_scalars() -> None:
    with pytest.raises(BadRequest):
        classify(np.array(1.0), 1, None)


# Refusals. Each case: (body, header_length, model); the model only matters for raw binary.

RAW_BATCHED = ModelSpec("r", (TensorSpec("x", "FP32", (2,)),), (TensorSpec("y", "FP32", (2,)),), 4)
RAW_UNBATCHED = ModelSpec("r", (TensorSpec("x", "FP32", (2,)),), (TensorSpec("y", "FP32", (2,)),))


def js(document: Any) -> tuple[bytes, int | None, ModelSpec]:
    return orjson.dumps(document), None, ANY_MODEL


def binary_case(
    tensors: list[dict[str, Any]], payload: bytes, extra: int = 0
) -> tuple[bytes, int | None, ModelSpec]:
    body, length = with_binary({"inputs": tensors}, payload)
    return body, length + extra, ANY_MODEL


def binary_input(datatype: str, shape: list[int], size: Any) -> dict[str, Any]:
    return {
        "name": "x",
        "datatype": datatype,
        "shape": shape,
        "parameters": {"binary_data_size": size},
    }


def raw(spec: ModelSpec, body: bytes) -> tuple[bytes, int | None, ModelSpec]:
    return body, 0, spec


def with_outputs(*outputs: Any, **parameters: Any) -> dict[str, Any]:
    document: dict[str, Any] = {**one_input(), "outputs": list(outputs)}
    if parameters:
        document["parameters"] = parameters
    return document


SECRET_BYTES = MARKER.encode()

MALFORMED = {
    # JSON and the request object
    "invalid json": (b'{"inputs": [' + SECRET_BYTES, None, ANY_MODEL),
    "invalid utf8": (b'{"id": "\xff\xfe' + SECRET_BYTES + b'"}', None, ANY_MODEL),
    "not an object": js([MARKER]),
    "id not a string": js({**one_input(), "id": [MARKER]}),
    "parameters not an object": js({**one_input(), "parameters": [MARKER]}),
    "binary_data_output not bool": js(
        {**one_input(), "parameters": {"binary_data_output": MARKER}}
    ),
    "timeout string": js({**one_input(), "parameters": {"timeout": MARKER}}),
    "timeout negative": js({**one_input(), "parameters": {"timeout": -1}}),
    "timeout float": js({**one_input(), "parameters": {"timeout": 1.5}}),
    "timeout bool": js({**one_input(), "parameters": {"timeout": True}}),
    "priority string": js({**one_input(), "parameters": {"priority": MARKER}}),
    "priority negative": js({**one_input(), "parameters": {"priority": -2}}),
    "priority float": js({**one_input(), "parameters": {"priority": 2.0}}),
    # inputs
    "inputs missing": js({"id": MARKER}),
    "inputs not a list": js({"inputs": {"x": MARKER}}),
    "inputs empty": js({"inputs": []}),
    "input not an object": js({"inputs": [MARKER]}),
    "name missing": js({"inputs": [{k: v for k, v in X.items() if k != "name"}]}),
    "name not a string": js(one_input(name=[MARKER])),
    "name empty": js(one_input(name="")),
    "duplicate input": js({"inputs": [X, X]}),
    "datatype missing": js({"inputs": [{k: v for k, v in X.items() if k != "datatype"}]}),
    "datatype not a string": js(one_input(datatype=7)),
    "unknown datatype": js(one_input(datatype=MARKER)),
    "shape missing": js({"inputs": [{k: v for k, v in X.items() if k != "shape"}]}),
    "shape not a list": js(one_input(shape=MARKER)),
    "negative dim": js(one_input(shape=[-1, 2])),
    "float dim": js(one_input(shape=[2.0])),
    "string dim": js(one_input(shape=[MARKER])),
    "bool dim": js(one_input(shape=[True, 2])),
    "too many dims": js(one_input(shape=[1] * 65, data=[1.0])),
    "shape too large": js(one_input(shape=[2**62, 2**62], data=[1.0])),
    "huge shape, small data": js(one_input(shape=[2**40], data=[1.0])),
    "too few elements": js(one_input(data=[1.0])),
    "too many elements": js(one_input(data=[[1.0, 2.0], [3.0]])),
    "data not a list": js(one_input(data=MARKER)),
    "data and binary_data_size": js(one_input(parameters={"binary_data_size": 8})),
    "neither data nor binary": js({"inputs": [{k: v for k, v in X.items() if k != "data"}]}),
    "input parameters not an object": js(one_input(parameters=MARKER)),
    "shared memory input": js(one_input(data=None, parameters={"shared_memory_region": MARKER})),
    # JSON element types
    "strings for FP32": js(one_input(data=[MARKER, MARKER])),
    "null in data": js(one_input(data=[None, 1.0])),
    "object in data": js(one_input(data=[{"k": MARKER}, 1.0])),
    "bool for FP32": js(one_input(data=[True, 1.0])),
    "float for INT32": js(one_input(datatype="INT32", data=[1.5, 2])),
    "out of range INT8": js(one_input(datatype="INT8", data=[1, 128])),
    "negative UINT64": js(one_input(datatype="UINT64", data=[1, -1])),
    "too big UINT64": (
        orjson.dumps(one_input(datatype="UINT64", data=[1, 0])).replace(b"0]", b"%d]" % 2**64),
        None,
        ANY_MODEL,
    ),
    "int for BOOL": js(one_input(datatype="BOOL", data=[1, 0])),
    "number for BYTES": js(one_input(datatype="BYTES", data=[1, MARKER])),
    # binary data
    "binary size past the body": binary_case([binary_input("FP32", [2], 16)], b"\0" * 8),
    "binary size without binary": js({"inputs": [binary_input("FP32", [2], 8)]}),
    "binary size negative": binary_case([binary_input("FP32", [2], -8)], b"\0" * 8),
    "binary size not an int": binary_case([binary_input("FP32", [2], MARKER)], b"\0" * 8),
    "binary size bool": binary_case([binary_input("BOOL", [1], True)], b"\1"),
    "binary size wrong for shape": binary_case([binary_input("FP32", [2], 4)], b"\0" * 4),
    "binary huge shape": binary_case([binary_input("FP32", [2**40], 8)], b"\0" * 8),
    "bytes left over": binary_case([binary_input("FP32", [2], 8)], b"\0" * 8 + SECRET_BYTES),
    "json only, bytes after": binary_case([X], SECRET_BYTES),
    "BYTES count too large": binary_case([binary_input("BYTES", [2**40], 8)], b"\0" * 8),
    "BYTES element overruns": binary_case(
        [binary_input("BYTES", [1], 4 + len(SECRET_BYTES))],
        struct.pack("<I", 999) + SECRET_BYTES,
    ),
    "BYTES too few elements": binary_case(
        [binary_input("BYTES", [3], 10)], struct.pack("<I", 1) + b"a" + struct.pack("<I", 1) + b"b"
    ),
    "BYTES trailing bytes": binary_case(
        [binary_input("BYTES", [1], 5 + len(SECRET_BYTES))],
        struct.pack("<I", 1) + b"a" + SECRET_BYTES,
    ),
    # Inference-Header-Content-Length
    "header length past body": (orjson.dumps(one_input()), 10_000, ANY_MODEL),
    "header length negative": (orjson.dumps(one_input()), -1, ANY_MODEL),
    "header length cuts the JSON": binary_case([binary_input("FP32", [2], 8)], b"\0" * 8, extra=-3),
    # outputs
    "outputs not a list": js(with_outputs() | {"outputs": {"y": MARKER}}),
    "output not an object": js(with_outputs(MARKER)),
    "output without name": js(with_outputs({"parameters": {"binary_data": True}})),
    "output name not a string": js(with_outputs({"name": 3})),
    "duplicate output": js(with_outputs({"name": "y"}, {"name": "y"})),
    "output binary_data not bool": js(
        with_outputs({"name": "y", "parameters": {"binary_data": 1}})
    ),
    "classification zero": js(with_outputs({"name": "y", "parameters": {"classification": 0}})),
    "classification negative": js(
        with_outputs({"name": "y", "parameters": {"classification": -3}})
    ),
    "classification string": js(
        with_outputs({"name": "y", "parameters": {"classification": MARKER}})
    ),
    "classification float": js(with_outputs({"name": "y", "parameters": {"classification": 2.5}})),
    "classification bool": js(with_outputs({"name": "y", "parameters": {"classification": True}})),
    "shared memory output": js(
        with_outputs({"name": "y", "parameters": {"shared_memory_region": MARKER}})
    ),
    # raw binary
    "raw, two inputs": raw(
        ModelSpec("r", (TensorSpec("a", "FP32", (1,)), TensorSpec("b", "FP32", (1,))), ()),
        b"\0" * 8,
    ),
    "raw, dynamic shape": raw(ModelSpec("r", (TensorSpec("a", "FP32", (-1,)),), ()), b"\0" * 8),
    "raw, BYTES input": raw(ModelSpec("r", (TensorSpec("a", "BYTES", (1,)),), ()), b"\0" * 8),
    "raw, partial row": raw(RAW_BATCHED, b"\0" * 12),
    "raw, empty body": raw(RAW_BATCHED, b""),
    "raw, wrong size unbatched": raw(RAW_UNBATCHED, b"\0" * 16),
}


@pytest.mark.parametrize(
    ("body", "header_length", "spec"), MALFORMED.values(), ids=MALFORMED.keys()
)
def test_malformed_requests_are_refused_briefly(
    body: bytes, header_length: int | None, spec: ModelSpec
) -> None:
    with pytest.raises(BadRequest) as caught:
        decode_request(body, header_length, spec)
    message = caught.value.message
    assert message == str(caught.value)
    assert 0 < len(message) < 300
    assert MARKER[:20] not in message


def test_long_names_are_cut_short_in_messages() -> None:
    long_name = MARKER * 50
    for document in (
        {"inputs": [{**X, "name": long_name}, {**X, "name": long_name}]},
        with_outputs({"name": long_name}, {"name": long_name}),
        one_input(name=long_name, datatype="NOPE"),
    ):
        with pytest.raises(BadRequest) as caught:
            decode_json(document)
        assert len(caught.value.message) < 300


def test_messages_name_the_problem() -> None:
    cases = {
        "shared memory": one_input(parameters={"shared_memory_region": "r"}),
        "more than once": {"inputs": [X, X]},
        '"timeout"': {**one_input(), "parameters": {"timeout": "1"}},
        '"classification"': with_outputs({"name": "y", "parameters": {"classification": 0}}),
        "holds 1 elements, the shape 2": one_input(data=[1.0]),
    }
    for expected, document in cases.items():
        with pytest.raises(BadRequest, match=expected):
            decode_json(document)
