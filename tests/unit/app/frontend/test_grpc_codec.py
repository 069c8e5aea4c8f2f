"""gRPC messages to and from the V2 binary form the data plane takes: a ModelInferRequest
must become the body HTTP's binary extension would carry for the same tensors (decoded here
by the V2 codec itself), and a V2 binary answer a ModelInferResponse with the same bytes."""

from __future__ import annotations

import struct
from typing import Any

import ml_dtypes
import numpy as np
import orjson
import pytest

from app.contract import Answer
from app.errors import BadRequest
from app.frontend.grpc import codec, contents
from app.frontend.grpc.generated import grpc_service_pb2 as pb
from app.frontend.grpc.generated import model_config_pb2 as config_pb
from app.protocol import RequestedOutput, decode_request, encode_response
from engines.spec import V2_TO_NUMPY, ModelSpec, TensorSpec

ANY_MODEL = ModelSpec("m", (TensorSpec("x", "FP32", (3,)),), (TensorSpec("y", "FP32", (3,)),))


def sample(datatype: str) -> np.ndarray:
    """Six values of ``datatype`` in shape [2, 3], the type's extremes among them."""
    if datatype == "BYTES":
        return np.array([[b"", b"cat", b"\xff\x00"], [b"x" * 70, b"q", b"\x00"]], dtype=np.object_)
    dtype = V2_TO_NUMPY[datatype]
    if datatype == "BOOL":
        return np.array([[True, False, True], [False, False, True]])
    if dtype.kind in "iu":
        info = np.iinfo(dtype.name)
        return np.array([[info.min, info.max, 0], [1, 7, info.max - 1]], dtype=dtype)
    return np.array([[0.0, -1.5, 0.25], [1024.0, 3.0e4, -0.0]], dtype=dtype)


def raw(array: np.ndarray) -> bytes:
    if array.dtype == np.object_:
        return b"".join(struct.pack("<I", len(e)) + e for e in array.reshape(-1))
    return array.tobytes()


def arrived(request: pb.ModelInferRequest) -> codec.InferCall:
    """``request`` as the server reads it off the wire."""
    return codec.read_request(request.SerializeToString())


def spec_of(request: pb.ModelInferRequest) -> ModelSpec:
    """A model that takes ``request``'s inputs in any shape of their rank."""
    inputs = tuple(TensorSpec(t.name, t.datatype, (-1,) * len(t.shape)) for t in request.inputs)
    return ModelSpec("m", inputs, (TensorSpec("y", "FP32", (3,)),))


def decoded(request: pb.ModelInferRequest, deadline_us: int | None = None) -> Any:
    header, chunks = codec.request_body(arrived(request), spec_of(request), deadline_us=deadline_us)
    return decode_request(b"".join([header, *chunks]), len(header), ANY_MODEL)


def raw_request(**arrays: tuple[np.ndarray, str]) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m")
    for name, (array, datatype) in arrays.items():
        request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        request.raw_input_contents.append(raw(array))
    return request


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == np.object_:
        assert got.tolist() == want.tolist()
    else:
        assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("datatype", list(V2_TO_NUMPY))
def test_raw_contents_decode_to_the_tensors_sent(datatype: str) -> None:
    want = sample(datatype)
    request = decoded(raw_request(t=(want, datatype)))
    assert_same(request.inputs["t"], want)
    # No outputs named: every output, each as binary data.
    assert request.outputs == () and request.binary_data_output is True


@pytest.mark.parametrize("datatype", [*sorted(contents.TYPED_CONTENTS), "BYTES"])
def test_typed_contents_decode_to_the_tensors_sent(datatype: str) -> None:
    want = sample(datatype)
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="t", datatype=datatype, shape=[2, 3])
    field = "bytes_contents" if datatype == "BYTES" else contents.TYPED_CONTENTS[datatype][0]
    getattr(tensor.contents, field).extend(want.reshape(-1).tolist())
    assert_same(decoded(request).inputs["t"], want)


@pytest.mark.parametrize("datatype", ["FP16", "BF16"])
def test_half_floats_have_no_typed_field(datatype: str) -> None:
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="h", datatype=datatype, shape=[1])
    tensor.contents.fp32_contents.append(1.0)
    with pytest.raises(BadRequest, match="send it in raw_input_contents"):
        codec.request_body(arrived(request), spec_of(request))


def test_bf16_raw_bytes_are_read_as_bfloat16() -> None:
    values = np.array([1.0, -2.5, 0.1], dtype=ml_dtypes.bfloat16)
    request = decoded(raw_request(b=(values, "BF16")))
    assert request.inputs["b"].dtype == ml_dtypes.bfloat16
    assert request.inputs["b"].tobytes() == values.tobytes()


@pytest.mark.parametrize(
    ("datatype", "field", "values", "problem"),
    [
        ("INT8", "int_contents", [1, 128, 0], "out of range for INT8"),
        ("UINT16", "uint_contents", [70000, 1, 2], "out of range for UINT16"),
        ("INT16", "int_contents", [-40000, 1, 2], "out of range for INT16"),
        ("FP32", "fp32_contents", [1.0, 2.0], "contents hold 2 FP32 values, the shape 3"),
    ],
)
def test_typed_contents_that_do_not_fit_are_refused(
    datatype: str, field: str, values: list[Any], problem: str
) -> None:
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="t", datatype=datatype, shape=[3])
    getattr(tensor.contents, field).extend(values)
    with pytest.raises(BadRequest, match=problem):
        codec.request_body(arrived(request), spec_of(request))


def test_raw_contents_are_views_of_the_message_as_it_arrived() -> None:
    x = np.arange(4096, dtype=np.float32)
    request = raw_request(x=(x, "FP32"))
    request.raw_input_contents.append(b"")
    request.inputs.add(name="empty", datatype="INT8", shape=[0])
    request.parameters["priority"].int64_param = 1
    data = request.SerializeToString()
    call = codec.read_request(data)
    assert [bytes(chunk) for chunk in call.raw] == [x.tobytes(), b""]
    assert all(chunk.obj is data for chunk in call.raw)  # not copied
    assert call.request.inputs[1].name == "empty" and not call.request.raw_input_contents
    assert call.request.parameters["priority"].int64_param == 1
    # Fields in any order on the wire, as protobuf allows: the tensors first, then the rest.
    rest = pb.ModelInferRequest()
    rest.CopyFrom(request)
    del rest.raw_input_contents[:]
    shuffled = pb.ModelInferRequest(raw_input_contents=request.raw_input_contents)
    call = codec.read_request(shuffled.SerializeToString() + rest.SerializeToString())
    assert [bytes(chunk) for chunk in call.raw] == [x.tobytes(), b""]
    assert call.request == rest


@pytest.mark.parametrize(
    "data",
    [b"\x3a\xff\xff\x03abc", b"\x0b", b"\x0a\x05ab", b"\xff" * 11, b"\x2a\x02\xff\xff"],
    ids=["raw runs past the end", "a group", "a name cut short", "a bad varint", "bad inputs"],
)
def test_bytes_that_are_no_request_are_refused(data: bytes) -> None:
    with pytest.raises(BadRequest, match="not a ModelInferRequest"):
        codec.read_request(data)


def test_raw_contents_are_read_in_input_order_skipping_shared_memory() -> None:
    a, b = np.arange(3, dtype=np.int32), np.ones(2, dtype=np.float64)
    request = pb.ModelInferRequest(model_name="m", id="req-1")
    request.inputs.add(name="a", datatype="INT32", shape=[3])
    shared = request.inputs.add(name="s", datatype="FP32", shape=[4])
    shared.parameters["shared_memory_region"].string_param = "region"
    shared.parameters["shared_memory_byte_size"].int64_param = 16
    request.inputs.add(name="b", datatype="FP64", shape=[2])
    request.raw_input_contents.extend([a.tobytes(), b.tobytes()])
    header, chunks = codec.request_body(arrived(request), spec_of(request))
    document = orjson.loads(header)
    assert document["id"] == "req-1"
    assert [i["parameters"] for i in document["inputs"]] == [
        {"binary_data_size": 12},
        {"shared_memory_region": "region", "shared_memory_byte_size": 16},
        {"binary_data_size": 16},
    ]
    assert [bytes(chunk) for chunk in chunks] == [a.tobytes(), b.tobytes()]


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ("extra raw", "2 raw_input_contents for 1 input"),
        ("no data", "input 'x' has no data"),
        ("both", "contents must not be set when raw_input_contents are used"),
    ],
)
def test_inputs_and_raw_contents_that_disagree_are_refused(change: str, problem: str) -> None:
    request = raw_request(x=(np.zeros(3, np.float32), "FP32"))
    if change == "extra raw":
        request.raw_input_contents.append(b"\x00" * 12)
    elif change == "no data":
        del request.raw_input_contents[:]
    else:
        request.inputs[0].contents.fp32_contents.extend([0.0, 0.0, 0.0])
    with pytest.raises(BadRequest, match=problem):
        codec.request_body(arrived(request), spec_of(request))


def test_outputs_are_asked_for_as_binary_with_their_own_parameters() -> None:
    request = raw_request(x=(np.zeros(3, np.float32), "FP32"))
    top = request.outputs.add(name="scores")
    top.parameters["classification"].int64_param = 3
    shared = request.outputs.add(name="y")
    shared.parameters["shared_memory_region"].string_param = "out"
    shared.parameters["shared_memory_byte_size"].int64_param = 12
    request.parameters["priority"].uint64_param = 2
    request.parameters["sequence_id"].int64_param = 9  # a parameter the decoder ignores
    header, _ = codec.request_body(arrived(request), spec_of(request))
    document = orjson.loads(header)
    assert document["outputs"] == [
        {"name": "scores", "parameters": {"classification": 3, "binary_data": True}},
        {"name": "y", "parameters": {"shared_memory_region": "out", "shared_memory_byte_size": 12}},
    ]
    assert document["parameters"] == {"priority": 2, "sequence_id": 9, "binary_data_output": True}
    decoded_request = decode_request(
        header + b"\x00" * 12, len(header), ANY_MODEL, regions=Region(64)
    )
    assert decoded_request.priority == 2
    assert decoded_request.outputs[0] == RequestedOutput("scores", True, 3)


@pytest.mark.parametrize(
    ("timeout_us", "deadline_us", "sent"),
    [
        (None, None, None),
        (500, None, 500),
        (None, 2_000_000, 2_000_000),
        (500, 2_000_000, 500),  # the request's own timeout is the sooner
        (5_000_000, 2_000_000, 2_000_000),  # the call's deadline is the sooner
        (0, 2_000_000, 2_000_000),  # 0 is the model's default, which the deadline bounds
        (None, -30, 1),  # passed already: the engine refuses it at once
    ],
)
def test_the_calls_deadline_bounds_the_requests_timeout(
    timeout_us: int | None, deadline_us: int | None, sent: int | None
) -> None:
    request = raw_request(x=(np.zeros(3, np.float32), "FP32"))
    if timeout_us is not None:
        request.parameters["timeout"].int64_param = timeout_us
    assert decoded(request, deadline_us).timeout_us == sent


class Region:
    """A registered shared-memory region, as the codec's ``Regions`` protocol sees it."""

    def __init__(self, size: int) -> None:
        self.memory = bytearray(size)

    def view(self, name: str, offset: int, size: int, what: str) -> memoryview:
        return memoryview(self.memory)[offset : offset + size]

    def write(self, name: str, offset: int, data: bytes | memoryview, what: str) -> None:
        self.memory[offset : offset + len(data)] = data


def test_a_binary_answer_becomes_raw_output_contents_in_output_order() -> None:
    y = np.arange(6, dtype=np.float32).reshape(2, 3)
    top = np.array([[b"0.9:1:cat", b"0.1:0:dog"]], dtype=np.object_)
    shared = np.array([7, 8], dtype=np.int64)
    region = Region(64)
    content, headers = encode_response(
        "m",
        "fp32",
        "req-9",
        [
            (RequestedOutput("y", True), y),
            (RequestedOutput("shared", True, 0, ("out", 8, 16)), shared),
            (RequestedOutput("scores", True, 2), top),
        ],
        region,
    )
    response = pb.ModelInferResponse.FromString(
        codec.infer_response(Answer("m", "fp32", headers, content))
    )
    assert (response.model_name, response.model_version, response.id) == ("m", "fp32", "req-9")
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
        ("y", "FP32", [2, 3]),
        ("shared", "INT64", [2]),
        ("scores", "BYTES", [1, 2]),
    ]
    assert list(response.raw_output_contents) == [y.tobytes(), b"", raw(top)]
    parameters = response.outputs[1].parameters
    assert parameters["shared_memory_region"].string_param == "out"
    assert parameters["shared_memory_byte_size"].int64_param == 16
    assert parameters["shared_memory_offset"].int64_param == 8
    assert "binary_data_size" not in response.outputs[0].parameters
    assert bytes(region.memory[8:24]) == shared.tobytes()


def test_an_answer_all_in_shared_memory_has_no_binary_part() -> None:
    content, headers = encode_response(
        "m",
        "fp32",
        None,
        [(RequestedOutput("y", True, 0, ("out", 0, 8)), np.ones(2, np.float32))],
        Region(8),
    )
    assert "Inference-Header-Content-Length" not in headers
    response = pb.ModelInferResponse.FromString(
        codec.infer_response(Answer("m", "fp32", headers, content))
    )
    assert list(response.raw_output_contents) == [b""] and response.id == ""


def test_a_stream_answer_wraps_the_response() -> None:
    content, headers = encode_response(
        "m", "fp32", "s-1", [(RequestedOutput("y", True), np.ones(3, np.float32))]
    )
    response = codec.infer_response(Answer("m", "fp32", headers, content))
    wrapped = pb.ModelStreamInferResponse.FromString(codec.stream_answer(response))
    assert wrapped.error_message == ""
    assert wrapped.infer_response == pb.ModelInferResponse.FromString(response)
    assert wrapped.infer_response.raw_output_contents[0] == np.ones(3, np.float32).tobytes()


def test_a_stream_error_names_the_request() -> None:
    request = pb.ModelInferRequest(model_name="m", model_version="fp16", id="r-3")
    answer = pb.ModelStreamInferResponse.FromString(
        codec.stream_error(request, "input 'x': wrong shape")
    )
    assert answer.error_message == "input 'x': wrong shape"
    assert (answer.infer_response.id, answer.infer_response.model_version) == ("r-3", "fp16")


def test_a_stream_error_echoes_no_megabyte() -> None:
    request = pb.ModelInferRequest(model_name="m" * 2**20, id="i" * 2**20)
    answer = pb.ModelStreamInferResponse.FromString(codec.stream_error(request, "refused"))
    assert answer.infer_response.id == "i" * codec.ECHOED_ID_CHARS
    assert answer.infer_response.model_name == "m" * codec.ECHOED_ID_CHARS


def test_parameters_keep_their_json_types() -> None:
    for value, field in [
        (True, "bool_param"),
        (3, "int64_param"),
        (2**64 - 1, "uint64_param"),
        (0.5, "double_param"),
        ("a", "string_param"),
    ]:
        parameter = pb.InferParameter()
        codec.set_parameter(parameter, value)
        assert parameter.WhichOneof("parameter_choice") == field
        assert codec.parameter_value(parameter) == value
    assert codec.parameter_value(pb.InferParameter()) is None


# -- the other answers ------------------------------------------------------------------------


def test_the_model_config_holds_what_tritons_message_has() -> None:
    document = {
        "name": "words",
        "platform": "onnxruntime_onnx",
        "backend": "onnxruntime",
        "max_batch_size": 8,
        "input": [{"name": "text", "data_type": "TYPE_BYTES", "dims": [-1]}],
        "output": [{"name": "y", "data_type": "TYPE_FP16", "dims": [3, 2]}],
        "dynamic_batching": {
            "preferred_batch_size": [4, 8],
            "max_queue_delay_microseconds": 100,
            "priority_levels": 2,
            "default_queue_policy": {"max_queue_size": 64, "default_timeout_microseconds": 9},
        },
        "instance_group": [{"count": 2, "kind": "onnxruntime"}],
        "version_policy": {"specific": {"versions": ["fp32", "int8"]}},
        "default_version": "fp32",
        "labels": ["a", "b"],
    }
    config = codec.model_config(document).config
    assert (config.name, config.platform, config.backend, config.max_batch_size) == (
        "words",
        "onnxruntime_onnx",
        "onnxruntime",
        8,
    )
    assert config.input[0].data_type == config_pb.TYPE_STRING  # Triton's name for BYTES
    assert list(config.input[0].dims) == [-1]
    assert config.output[0].data_type == config_pb.TYPE_FP16 and list(config.output[0].dims) == [
        3,
        2,
    ]
    batching = config.dynamic_batching
    assert list(batching.preferred_batch_size) == [4, 8]
    assert batching.max_queue_delay_microseconds == 100 and batching.priority_levels == 2
    assert batching.default_queue_policy.max_queue_size == 64
    assert batching.default_queue_policy.default_timeout_microseconds == 9
    assert config.instance_group[0].count == 2
    assert config.instance_group[0].kind == config_pb.ModelInstanceGroup.KIND_AUTO
    assert not config.HasField("version_policy")  # precisions are not integer versions


def test_statistics_index_metadata_and_regions() -> None:
    stats = codec.message(
        pb.ModelStatisticsResponse,
        {
            "model_stats": [
                {
                    "name": "m",
                    "version": "fp32",
                    "last_inference": 17,
                    "inference_count": 5,
                    "execution_count": 2,
                    "inference_stats": {
                        "success": {"count": 2, "ns": 300},
                        "queue": {"count": 2, "ns": 40},
                    },
                    "batch_stats": [{"batch_size": 4, "compute_infer": {"count": 1}}],
                }
            ]
        },
    ).model_stats[0]
    assert (stats.name, stats.version, stats.inference_count, stats.execution_count) == (
        "m",
        "fp32",
        5,
        2,
    )
    assert stats.inference_stats.success.ns == 300 and stats.inference_stats.queue.count == 2
    assert stats.batch_stats[0].batch_size == 4 and stats.batch_stats[0].compute_infer.count == 1

    index = codec.message(
        pb.RepositoryIndexResponse,
        {
            "models": [
                {"name": "m", "version": "fp32", "state": "READY"},
                {"name": "m", "version": "int8", "state": "UNAVAILABLE", "reason": "budget"},
            ]
        },
    )
    assert [(e.name, e.version, e.state, e.reason) for e in index.models] == [
        ("m", "fp32", "READY", ""),
        ("m", "int8", "UNAVAILABLE", "budget"),
    ]
    metadata = codec.message(
        pb.ModelMetadataResponse,
        {
            "name": "m",
            "versions": ["fp32"],
            "platform": "onnxruntime_onnx",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 3]}],
            "unavailable_versions": [{"version": "int8", "reason": "budget"}],
        },
    )
    assert list(metadata.inputs[0].shape) == [-1, 4] and metadata.outputs[0].name == "y"
    region = {"name": "r", "key": "/k", "offset": 8, "byte_size": 64}
    regions = codec.message(pb.SystemSharedMemoryStatusResponse, {"regions": {"r": region}}).regions
    assert (regions["r"].key, regions["r"].offset, regions["r"].byte_size) == ("/k", 8, 64)
