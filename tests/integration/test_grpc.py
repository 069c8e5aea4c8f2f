"""The KServe V2 / Triton gRPC API against a real ``stoker serve``, with tritonclient.grpc as
it is published: every datatype (raw and typed contents), BYTES, classification, a stream
with many requests in flight, system shared memory, metadata, config, statistics and the
index, API keys, deadlines, the message limit, health, and a drain on SIGTERM. Answers are
compared byte for byte with what HTTP's binary extension gives for the same request.

The echo models (``y = Identity(x)``, one per datatype) answer what they were sent, so every
datatype's expected answer is its input.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import queue
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import ml_dtypes
import numpy as np
import onnx
import orjson
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.grpc.aio as tgrpc_aio
import tritonclient.http as thttp
import tritonclient.utils.shared_memory as shm
from grpc_health.v1 import health_pb2, health_pb2_grpc
from onnx import TensorProto, helper
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

from app.image_pixels import decode
from bench import cli
from bench.launch import free_port
from engines.preprocess import ImagePreprocess, preprocess
from tests.conftest import TINY_BIAS, TINY_CONFIG, TINY_WEIGHTS, configure, slow_onnx, tiny_onnx
from tests.integration.conftest import (
    BODY_LIMIT,
    Server,
    launch_server,
    metric_samples,
    start_server,
    stop_server,
)

ESPRESSO = 967
ONNX_TYPES = {
    "BOOL": TensorProto.BOOL,
    "UINT8": TensorProto.UINT8,
    "UINT16": TensorProto.UINT16,
    "UINT32": TensorProto.UINT32,
    "UINT64": TensorProto.UINT64,
    "INT8": TensorProto.INT8,
    "INT16": TensorProto.INT16,
    "INT32": TensorProto.INT32,
    "INT64": TensorProto.INT64,
    "FP16": TensorProto.FLOAT16,
    "BF16": TensorProto.BFLOAT16,
    "FP32": TensorProto.FLOAT,
    "FP64": TensorProto.DOUBLE,
    "BYTES": TensorProto.STRING,
}
NUMERIC = [d for d in ONNX_TYPES if d != "BYTES"]
TYPED_FIELDS = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
SLOW_WIDTH = 512
SLOW_LAYERS = 16
SLOW_CONFIG = """\
max_batch_size: 64
runners: 1
dynamic_batching:
  max_queue_delay_us: 0
  max_queue_size: 1024
  default_timeout_us: 60000000
"""


@dataclass
class GrpcServer:
    http: Server
    address: str  # the gRPC host:port

    def client(self, **kwargs: Any) -> tgrpc.InferenceServerClient:
        return tgrpc.InferenceServerClient(self.address, **kwargs)

    def stub(self) -> service_pb2_grpc.GRPCInferenceServiceStub:
        return service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(self.address))


def start_grpc(repository: Path, log: Path, env: dict[str, str] | None = None) -> GrpcServer:
    port = free_port()
    server = start_server(repository, log, {"STOKER_SERVER__GRPC_PORT": str(port), **(env or {})})
    return GrpcServer(server, f"127.0.0.1:{port}")


def health_stub(channel: grpc.Channel | grpc.aio.Channel) -> Any:
    """grpc.health.v1's client (its stubs do not declare the stub's methods)."""
    return health_pb2_grpc.HealthStub(channel)


def echo_onnx(datatype: str) -> onnx.ModelProto:
    kind = ONNX_TYPES[datatype]
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "echo",
        [helper.make_tensor_value_info("x", kind, ["batch", 3])],
        [helper.make_tensor_value_info("y", kind, ["batch", 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def add_model(repo: Path, name: str, model: onnx.ModelProto, config: str) -> None:
    (repo / name).mkdir(parents=True)
    onnx.save(model, str(repo / name / "model.onnx"))
    (repo / name / "config.yaml").write_text(config)


def echo_name(datatype: str) -> str:
    return f"echo_{datatype.lower()}"


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, efficientnet_dir: Path
) -> Iterator[GrpcServer]:
    """One process serving the tiny model, an echo model per datatype, the default model
    (FP32 only: no INT8 build) and a slow model, over HTTP and gRPC."""
    repo = tmp_path_factory.mktemp("grpc") / "repository"
    add_model(repo, "tiny", tiny_onnx(), TINY_CONFIG)
    for datatype in ONNX_TYPES:
        add_model(repo, echo_name(datatype), echo_onnx(datatype), "max_batch_size: 8\nrunners: 1\n")
    add_model(repo, "slow", slow_onnx(SLOW_WIDTH, SLOW_LAYERS), SLOW_CONFIG)
    shutil.copytree(efficientnet_dir, repo / "efficientnet_lite0")
    configure(repo / "efficientnet_lite0", {"precisions": ["fp32"]})
    env = {"STOKER_LIMITS__MAX_BODY_BYTES": str(BODY_LIMIT)}
    running = start_grpc(repo, repo.parent / "server.log", env)
    yield running
    code = stop_server(running.http)
    assert code == 0, running.http.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def front_ends(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrpcServer]:
    """Two front-end processes before an engine process, both on the one gRPC port."""
    repo = tmp_path_factory.mktemp("grpc-front-ends") / "repository"
    add_model(repo, "tiny", tiny_onnx(), TINY_CONFIG)
    for datatype in ONNX_TYPES:
        add_model(repo, echo_name(datatype), echo_onnx(datatype), "max_batch_size: 8\nrunners: 1\n")
    running = start_grpc(repo, repo.parent / "server.log", {"STOKER_SERVER__FRONT_ENDS": "2"})
    yield running
    code = stop_server(running.http)
    assert code == 0, running.http.log.read_text()[-3000:]


@pytest.fixture(params=["one process", "front ends"])
def either(request: pytest.FixtureRequest) -> GrpcServer:
    server: GrpcServer = request.getfixturevalue(
        "served" if request.param == "one process" else "front_ends"
    )
    return server


def sample(datatype: str) -> np.ndarray:
    """Two rows of three values of ``datatype``, its extremes among them."""
    if datatype == "BYTES":
        # UTF-8 (é and a NUL among them): ONNX Runtime takes BYTES as text.
        return np.array(
            [[b"a", b"\xc3\xa9\x00", b""], [b"xyz", b"q" * 300, b"r"]], dtype=np.object_
        )
    dtype = np.dtype(triton_to_np_dtype(datatype))
    if dtype.kind == "b":
        return np.array([[True, False, True], [False, False, True]])
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.array([[info.min, info.max, 0], [1, 7, info.max - 1]], dtype=dtype)
    info_f = ml_dtypes.finfo(dtype)
    return np.array([[info_f.min, info_f.max, -0.0], [1.5, info_f.tiny, np.pi]], dtype=dtype)


def grpc_input(name: str, array: np.ndarray, datatype: str) -> tgrpc.InferInput:
    tensor = tgrpc.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def http_binary(
    server: GrpcServer,
    model: str,
    inputs: dict[str, tuple[np.ndarray, str]],
    outputs: dict[str, int],
) -> dict[str, tuple[str, list[int], bytes]]:
    """What HTTP's binary extension answers for these inputs (every output binary;
    ``outputs``: name -> classification count, 0 for the tensor): per output its datatype,
    shape and bytes, cut from the body as the Inference-Header-Content-Length says."""
    tensors = []
    for name, (array, datatype) in inputs.items():
        tensor = thttp.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array, binary_data=True)
        tensors.append(tensor)
    wanted = [
        thttp.InferRequestedOutput(n, binary_data=True, class_count=k) for n, k in outputs.items()
    ]
    body, length = thttp.InferenceServerClient.generate_request_body(tensors, outputs=wanted)
    response = httpx.post(
        f"{server.http.url}/v2/models/{model}/infer",
        content=body,
        headers={"Inference-Header-Content-Length": str(length)},
    )
    assert response.status_code == 200, response.text
    split = int(response.headers["inference-header-content-length"])
    document = orjson.loads(response.content[:split])
    answers, offset = {}, split
    for output in document["outputs"]:
        size = output["parameters"]["binary_data_size"]
        answers[output["name"]] = (
            output["datatype"],
            output["shape"],
            response.content[offset : offset + size],
        )
        offset += size
    return answers


def grpc_outputs(response: Any) -> dict[str, tuple[str, list[int], bytes]]:
    return {
        o.name: (o.datatype, list(o.shape), raw)
        for o, raw in zip(response.outputs, response.raw_output_contents, strict=True)
    }


# -- health, metadata, config, statistics, index ----------------------------------------------


def test_health_liveness_and_readiness(served: GrpcServer) -> None:
    client = served.client()
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("tiny") and client.is_model_ready("tiny", "fp32")
    assert not client.is_model_ready("tiny", "int8")  # not configured: not ready
    health = health_stub(grpc.insecure_channel(served.address))
    for service in ("", "inference.GRPCInferenceService"):
        answer = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as unknown:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
    client.close()


def test_metadata_config_index_as_http_says(served: GrpcServer) -> None:
    client = served.client()
    url = served.http.url
    server = client.get_server_metadata(as_json=True)
    assert server["name"] == "stoker"
    assert server["extensions"] == httpx.get(f"{url}/v2").json()["extensions"]

    metadata = client.get_model_metadata("efficientnet_lite0", as_json=True)
    want = httpx.get(f"{url}/v2/models/efficientnet_lite0").json()
    assert metadata["name"] == want["name"] and metadata["versions"] == want["versions"]
    assert metadata["platform"] == want["platform"]
    for key in ("inputs", "outputs"):
        # protobuf's JSON writes int64 as strings.
        got = [{**t, "shape": [int(d) for d in t["shape"]]} for t in metadata[key]]
        assert got == want[key]

    config = client.get_model_config("tiny").config
    http_config = httpx.get(f"{url}/v2/models/tiny/config").json()
    assert config.name == "tiny" and config.max_batch_size == http_config["max_batch_size"]
    assert [(t.name, list(t.dims)) for t in config.input] == [("x", [4])]
    assert [t.name for t in config.output] == ["y", "s"]
    assert config.input[0].data_type == model_config_pb2.TYPE_FP32
    assert config.instance_group[0].count == http_config["instance_group"][0]["count"]
    queue_policy = config.dynamic_batching.default_queue_policy
    assert queue_policy.max_queue_size == 256
    assert config.dynamic_batching.max_queue_delay_microseconds == 1000
    bytes_config = client.get_model_config(echo_name("BYTES")).config
    assert bytes_config.input[0].data_type == model_config_pb2.TYPE_STRING

    index = client.get_model_repository_index(as_json=True)["models"]
    http_index = httpx.post(f"{url}/v2/repository/index").json()
    assert [(m["name"], m["version"], m["state"]) for m in index] == [
        (m["name"], m["version"], m["state"]) for m in http_index
    ]
    with pytest.raises(InferenceServerException) as missing:
        client.get_model_metadata("no_such_model")
    assert missing.value.status() == "StatusCode.NOT_FOUND"
    client.close()


def test_statistics_count_grpc_requests_as_http_does(served: GrpcServer) -> None:
    client = served.client()

    def stats() -> Any:
        return client.get_inference_statistics("tiny", "fp32").model_stats[0]

    before = stats()
    x = np.ones((3, 4), np.float32)
    for _ in range(4):
        client.infer("tiny", [grpc_input("x", x, "FP32")])
    after = stats()
    assert after.inference_count - before.inference_count == 12
    success = after.inference_stats.success.count - before.inference_stats.success.count
    assert success == 4
    http_stats = httpx.get(f"{served.http.url}/v2/models/tiny/stats").json()["model_stats"][0]
    assert http_stats["inference_count"] == after.inference_count
    everything = {s.name for s in client.get_inference_statistics().model_stats}
    assert {"tiny", "efficientnet_lite0", "slow"} <= everything
    client.close()


# -- inference ------------------------------------------------------------------------------


@pytest.mark.parametrize("datatype", NUMERIC)
def test_raw_contents_of_every_datatype_come_back_whole(served: GrpcServer, datatype: str) -> None:
    x = sample(datatype)
    client = served.client()
    result = client.infer(echo_name(datatype), [grpc_input("x", x, datatype)], request_id="r-7")
    y = result.as_numpy("y")
    assert y.dtype == x.dtype and y.shape == x.shape
    assert y.tobytes() == x.tobytes()
    response = result.get_response()
    assert response.id == "r-7" and response.model_version == "fp32"
    client.close()


@pytest.mark.parametrize("datatype", [*TYPED_FIELDS, "FP16", "BF16"])
def test_typed_contents_answer_as_raw_contents_do(served: GrpcServer, datatype: str) -> None:
    """Typed ``contents`` (which tritonclient never sends, other clients do) give the answer
    the same values in ``raw_input_contents`` give; FP16 and BF16 have no typed field, as in
    Triton."""
    x = sample(datatype)
    request = service_pb2.ModelInferRequest(model_name=echo_name(datatype))
    tensor = request.inputs.add(name="x", datatype=datatype, shape=list(x.shape))
    field = TYPED_FIELDS.get(datatype, "fp32_contents")
    values = x.astype(np.float32) if datatype == "BF16" else x  # Python floats, not bfloat16s
    getattr(tensor.contents, field).extend(values.ravel().tolist())
    stub = served.stub()
    if datatype in ("FP16", "BF16"):
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(request)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "raw_input_contents" in str(refused.value.details())
        return
    typed = grpc_outputs(stub.ModelInfer(request))
    raw = grpc_outputs(
        served.client().infer(echo_name(datatype), [grpc_input("x", x, datatype)]).get_response()
    )
    assert typed == raw


def test_typed_contents_out_of_range_are_refused(served: GrpcServer) -> None:
    request = service_pb2.ModelInferRequest(model_name=echo_name("INT8"))
    tensor = request.inputs.add(name="x", datatype="INT8", shape=[1, 3])
    tensor.contents.int_contents.extend([1, 2, 300])
    with pytest.raises(grpc.RpcError) as refused:
        served.stub().ModelInfer(request)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "input 'x': a value is out of range for INT8"


@pytest.mark.parametrize("datatype", [*NUMERIC, "BYTES"])
def test_answers_are_bit_for_bit_http_binarys(either: GrpcServer, datatype: str) -> None:
    x = sample(datatype)
    want = http_binary(either, echo_name(datatype), {"x": (x, datatype)}, {"y": 0})
    client = either.client()
    got = grpc_outputs(
        client.infer(echo_name(datatype), [grpc_input("x", x, datatype)]).get_response()
    )
    assert got == want
    client.close()


def test_tiny_answers_what_onnxruntimes_numbers_and_http_give(either: GrpcServer) -> None:
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    client = either.client()
    result = client.infer("tiny", [grpc_input("x", x, "FP32")])
    np.testing.assert_allclose(
        result.as_numpy("y"), x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(result.as_numpy("s"), x.sum(axis=1, keepdims=True), rtol=1e-5)
    want = http_binary(either, "tiny", {"x": (x, "FP32")}, {"y": 0, "s": 0})
    assert grpc_outputs(result.get_response()) == want
    only_s = client.infer(
        "tiny", [grpc_input("x", x, "FP32")], outputs=[tgrpc.InferRequestedOutput("s")]
    )
    assert [o.name for o in only_s.get_response().outputs] == ["s"]
    client.close()


def test_bytes_come_back_as_sent(served: GrpcServer) -> None:
    """Exactly as sent, NUL and non-ASCII included; an element that is not UTF-8 is that
    request's INVALID_ARGUMENT (ONNX Runtime's Python API takes BYTES as text)."""
    x = sample("BYTES")
    client = served.client()
    y = client.infer(echo_name("BYTES"), [grpc_input("x", x, "BYTES")]).as_numpy("y")
    assert y.tolist() == x.tolist()
    bad = np.array([[b"ok", b"\xff\xfe", b""]], dtype=np.object_)
    with pytest.raises(InferenceServerException, match="not UTF-8"):
        client.infer(echo_name("BYTES"), [grpc_input("x", bad, "BYTES")])


def test_the_default_model_classifies_espresso_as_http_does(
    served: GrpcServer, coffee_jpeg: bytes
) -> None:
    x = preprocess(decode(coffee_jpeg, 10**8), ImagePreprocess())[None]
    client = served.client()
    logits = client.infer("efficientnet_lite0", [grpc_input("input", x, "FP32")])
    want = http_binary(served, "efficientnet_lite0", {"input": (x, "FP32")}, {"logits": 0})
    assert grpc_outputs(logits.get_response()) == want
    assert int(np.argmax(logits.as_numpy("logits"))) == ESPRESSO

    wanted = [tgrpc.InferRequestedOutput("logits", class_count=3)]
    top = client.infer("efficientnet_lite0", [grpc_input("input", x, "FP32")], outputs=wanted)
    classes = top.as_numpy("logits")
    assert classes.shape == (1, 3) and top.get_response().outputs[0].datatype == "BYTES"
    _score, index, label = classes[0, 0].decode().split(":", 2)
    assert (int(index), label) == (ESPRESSO, "espresso")
    http_top = http_binary(served, "efficientnet_lite0", {"input": (x, "FP32")}, {"logits": 3})
    assert grpc_outputs(top.get_response()) == http_top
    client.close()


def test_errors_carry_tritons_codes_and_no_traceback(served: GrpcServer) -> None:
    client = served.client()
    x = np.ones((1, 4), np.float32)
    HANDLE = base64.b64encode(b"a CUDA IPC handle")
    cases = [
        (lambda: client.infer("no_such_model", [grpc_input("x", x, "FP32")]), "NOT_FOUND"),
        (
            lambda: client.infer("tiny", [grpc_input("x", x, "FP32")], model_version="int8"),
            "NOT_FOUND",
        ),
        (
            lambda: client.infer("tiny", [grpc_input("x", x.astype(np.float64), "FP64")]),
            "INVALID_ARGUMENT",
        ),
        (
            lambda: client.infer("tiny", [grpc_input("x", np.ones((1, 5), np.float32), "FP32")]),
            "INVALID_ARGUMENT",
        ),
        (
            lambda: client.infer("tiny", [grpc_input("x", np.ones((17, 4), np.float32), "FP32")]),
            "INVALID_ARGUMENT",
        ),
        (
            lambda: client.infer("tiny", [grpc_input("x", x, "FP32")], timeout=1),
            "DEADLINE_EXCEEDED",
        ),
        (lambda: client.register_cuda_shared_memory("gpu", HANDLE, 0, 64), "UNIMPLEMENTED"),
        (lambda: client.get_cuda_shared_memory_status(), "UNIMPLEMENTED"),
        # models.control is none here: refused as HTTP refuses it (400 "model control is off").
        (lambda: client.load_model("tiny"), "INVALID_ARGUMENT"),
        # No OTEL_* variables: nothing to trace with, said as such.
        (
            lambda: client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]}),
            "INVALID_ARGUMENT",
        ),
        (lambda: client.update_log_settings({"log_file": "/tmp/stoker.log"}), "INVALID_ARGUMENT"),
    ]
    for call, code in cases:
        with pytest.raises(InferenceServerException) as failed:
            call()
        assert failed.value.status() == f"StatusCode.{code}", failed.value.message()
        assert "Traceback" not in failed.value.message() and len(failed.value.message()) < 300
    # What the server answered, never how it broke: it goes on serving.
    assert client.infer("tiny", [grpc_input("x", x, "FP32")]).as_numpy("y").shape == (1, 3)
    client.close()


def test_a_wrong_input_name_is_named_with_the_missing_one_over_both_protocols(
    either: GrpcServer,
) -> None:
    x = np.ones((1, 4), np.float32)
    client = either.client()
    with pytest.raises(InferenceServerException) as failed:
        client.infer("tiny", [grpc_input("input", x, "FP32")])
    assert failed.value.status() == "StatusCode.INVALID_ARGUMENT"
    said = failed.value.message()
    client.close()
    body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [1] * 4}]}
    answer = httpx.post(f"{either.http.url}/v2/models/tiny/infer", json=body)
    assert answer.status_code == 400
    for message in (said, answer.json()["error"]):
        assert "missing input(s): x" in message and "unexpected input(s): input" in message


def test_errors_never_echo_a_long_name_or_id_whole(either: GrpcServer) -> None:
    """A 100,000-character input name, model name or id comes back cut short in every
    error: unary or in a stream, with raw or typed contents."""
    long = "n" * 100_000
    stub = either.stub()
    no_data = service_pb2.ModelInferRequest(model_name="tiny")
    no_data.inputs.add(name=long, datatype="FP32", shape=[1, 4])
    typed = service_pb2.ModelInferRequest(model_name="tiny")
    typed.inputs.add(name=long, datatype="FP32", shape=[1, 4]).contents.fp32_contents.extend(
        [1.0] * 4
    )
    unknown = service_pb2.ModelInferRequest(model_name=long)
    raw = service_pb2.ModelInferRequest(model_name="tiny", id=long)
    raw.inputs.add(name=long, datatype="FP32", shape=[1, 4])
    raw.raw_input_contents.append(np.ones((1, 4), np.float32).tobytes())
    for request in (no_data, typed, unknown, raw):
        with pytest.raises(grpc.RpcError) as failed:
            stub.ModelInfer(request)
        assert len(str(failed.value.details())) < 1000, str(failed.value.details())[:200]
    (answer,) = stub.ModelStreamInfer(iter([raw]))
    assert answer.error_message and len(answer.error_message) < 1000
    assert len(answer.infer_response.id) <= 1024


def test_typed_contents_are_counted_against_the_model_before_they_are_parsed(
    either: GrpcServer,
) -> None:
    """1 M empty strings (2 MB on the wire, 4 MB as tensors) for the tiny model's 16 rows of
    4 values: refused for what the model takes, before protobuf makes an object of each."""
    count = 1 << 20
    request = service_pb2.ModelInferRequest(model_name="tiny")
    tensor = request.inputs.add(name="x", datatype="BYTES", shape=[1, count])
    tensor.contents.bytes_contents.extend([b""] * count)
    with pytest.raises(grpc.RpcError) as refused:
        either.stub().ModelInfer(request)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "contents hold over 64 BYTES values" in str(refused.value.details())
    numbers = service_pb2.ModelInferRequest(model_name="tiny")
    tensor = numbers.inputs.add(name="x", datatype="FP32", shape=[count // 4, 4])
    tensor.contents.fp32_contents.extend([0.0] * count)
    with pytest.raises(grpc.RpcError) as too_many:
        either.stub().ModelInfer(numbers)
    assert "contents hold over 64 FP32 values" in str(too_many.value.details())


def test_a_message_over_the_body_limit_is_resource_exhausted(served: GrpcServer) -> None:
    client = served.client()
    rows = BODY_LIMIT // 16 + 1024  # FP32 [rows, 4]: past the limit
    with pytest.raises(InferenceServerException) as too_large:
        client.infer("tiny", [grpc_input("x", np.zeros((rows, 4), np.float32), "FP32")])
    assert too_large.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    # Typed contents that are small in the message but past the limit as tensors: counted
    # against the model (8 rows of 3) before they are parsed.
    request = service_pb2.ModelInferRequest(model_name=echo_name("INT64"))
    count = BODY_LIMIT // 8 + 3
    tensor = request.inputs.add(name="x", datatype="INT64", shape=[count // 3, 3])
    tensor.contents.int64_contents.extend([0] * (count // 3 * 3))
    with pytest.raises(grpc.RpcError) as expanded:
        served.stub().ModelInfer(request)
    assert expanded.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "contents hold over 24 INT64 values" in str(expanded.value.details())
    ok = client.infer("tiny", [grpc_input("x", np.zeros((2, 4), np.float32), "FP32")])
    assert ok.as_numpy("y").shape == (2, 3)
    client.close()


# -- streaming ------------------------------------------------------------------------------


def blocker_size(server: GrpcServer, seconds: float) -> int:
    """The ``M`` of the slow model's input that keeps its one runner busy for about
    ``seconds`` on this machine (measured once, then scaled)."""
    probe = 2048
    client = server.client()
    x = np.ones((1, probe, 1), np.float32)
    client.infer("slow", [grpc_input("x", x, "FP32")])
    started = time.perf_counter()
    y = client.infer("slow", [grpc_input("x", x, "FP32")]).as_numpy("y")
    elapsed = time.perf_counter() - started
    assert float(y.ravel()[0]) == pytest.approx(probe * SLOW_WIDTH)
    client.close()
    return max(probe, int(probe * seconds / elapsed))


def test_a_stream_answers_each_request_as_it_completes(served: GrpcServer) -> None:
    """A slow request first, then 60 small ones on the same stream: the small ones are all
    answered while the slow one still runs (many in flight, answered as they complete), each
    with its own numbers, and a bad one is answered with its error in the stream."""
    m = blocker_size(served, 3.0)
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = served.client()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    client.async_stream_infer(
        "slow", [grpc_input("x", np.ones((1, m, 1), np.float32), "FP32")], request_id="slow"
    )
    rng = np.random.default_rng(5)
    sent = {f"r{i}": rng.standard_normal((1, 4)).astype(np.float32) for i in range(60)}
    for request_id, x in sent.items():
        client.async_stream_infer("tiny", [grpc_input("x", x, "FP32")], request_id=request_id)
    client.async_stream_infer(
        "tiny", [grpc_input("x", np.ones((1, 5), np.float32), "FP32")], request_id="bad"
    )
    order: list[str] = []
    errors = []
    for _ in range(len(sent) + 2):
        result, error = answers.get(timeout=120)
        if error is not None:
            errors.append(error)
            order.append("error")
            continue
        response = result.get_response()
        order.append(response.id)
        if response.id == "slow":
            assert float(result.as_numpy("y").ravel()[0]) == pytest.approx(m * SLOW_WIDTH)
        else:
            x = sent[response.id]
            np.testing.assert_allclose(
                result.as_numpy("y"), x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5, atol=1e-5
            )
    client.stop_stream()
    client.close()
    assert sorted(i for i in order if i.startswith("r")) == sorted(sent)
    assert order[-1] == "slow", "the slow request held back the answers sent after it"
    assert len(errors) == 1 and "shape" in errors[0].message()


def test_an_asyncio_stream_keeps_many_requests_in_flight(either: GrpcServer) -> None:
    async def scenario() -> dict[str, tuple[np.ndarray, np.ndarray]]:
        client = tgrpc_aio.InferenceServerClient(either.address)
        rng = np.random.default_rng(9)
        sent = {f"a{i}": rng.standard_normal((2, 4)).astype(np.float32) for i in range(100)}

        async def requests() -> Any:
            for request_id, x in sent.items():
                yield {
                    "model_name": "tiny",
                    "inputs": [grpc_input("x", x, "FP32")],
                    "request_id": request_id,
                }

        got = {}
        async for result, error in client.stream_infer(requests()):
            assert error is None, error
            got[result.get_response().id] = (sent[result.get_response().id], result.as_numpy("y"))
        await client.close()
        return got

    got = asyncio.run(scenario())
    assert len(got) == 100
    for x, y in got.values():
        np.testing.assert_allclose(y, x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5, atol=1e-5)


# -- shared memory --------------------------------------------------------------------------


@pytest.fixture
def regions(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    tag = "".join(c if c.isalnum() else "_" for c in request.node.name)
    made = {
        "in": shm.create_shared_memory_region(f"gin-{tag}", f"/stoker_gin_{tag}", 4096),
        "out": shm.create_shared_memory_region(f"gout-{tag}", f"/stoker_gout_{tag}", 4096),
    }
    yield {"tag": tag, **made}
    for handle in made.values():
        shm.destroy_shared_memory_region(handle)


def test_inputs_and_outputs_travel_in_system_shared_memory(
    either: GrpcServer, regions: dict[str, Any]
) -> None:
    tag = regions["tag"]
    rows = 5
    x = np.random.default_rng(3).standard_normal((rows, 4)).astype(np.float32)
    shm.set_shared_memory_region(regions["in"], [x], offset=256)
    client = either.client()
    try:
        client.register_system_shared_memory(f"gin-{tag}", f"/stoker_gin_{tag}", 4096)
        client.register_system_shared_memory(f"gout-{tag}", f"/stoker_gout_{tag}", 4096)
        status = client.get_system_shared_memory_status().regions
        assert (
            status[f"gin-{tag}"].byte_size == 4096
            and status[f"gin-{tag}"].key == f"/stoker_gin_{tag}"
        )
        tensor = tgrpc.InferInput("x", [rows, 4], "FP32")
        tensor.set_shared_memory(f"gin-{tag}", x.nbytes, offset=256)
        y_out = tgrpc.InferRequestedOutput("y")
        y_out.set_shared_memory(f"gout-{tag}", rows * 3 * 4)
        result = client.infer("tiny", [tensor], outputs=[y_out, tgrpc.InferRequestedOutput("s")])
        described = result.get_output("y")
        assert described.parameters["shared_memory_region"].string_param == f"gout-{tag}"
        assert result.get_response().raw_output_contents[0] == b""  # the bytes are in the region
        y = shm.get_contents_as_numpy(regions["out"], np.float32, [rows, 3])
        np.testing.assert_allclose(y, x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(result.as_numpy("s"), x.sum(axis=1, keepdims=True), rtol=1e-5)
        client.unregister_system_shared_memory(f"gin-{tag}")
        assert f"gin-{tag}" not in client.get_system_shared_memory_status().regions
        with pytest.raises(InferenceServerException, match="no shared memory region") as gone:
            client.infer("tiny", [tensor])
        assert gone.value.status() == "StatusCode.INVALID_ARGUMENT"
        with pytest.raises(InferenceServerException, match="is not a region of at least offset"):
            client.register_system_shared_memory("nothing", "/stoker_no_such_key", 64)
    finally:
        client.unregister_system_shared_memory()
        client.close()


# -- deadlines ------------------------------------------------------------------------------


def failures(server: GrpcServer, model: str) -> float:
    return sum(
        value
        for (name, labels), value in metric_samples(server.http).items()
        if name == "stoker_inference_request_failure_total" and ("model", model) in labels
    )


def test_the_grpc_deadline_is_the_requests_timeout(served: GrpcServer) -> None:
    """A request whose deadline passes while a slow one holds the runner is DEADLINE_EXCEEDED
    and counted as failed by the server; the slow one is answered."""
    m = blocker_size(served, 3.0)
    client = served.client()
    before = failures(served, "slow")
    answered: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.async_infer(
        "slow",
        [grpc_input("x", np.ones((1, m, 1), np.float32), "FP32")],
        callback=lambda result, error: answered.put((result, error)),
    )
    deadline = time.monotonic() + 30
    while pending(served) < 1:  # the slow request holds the runner before the small one comes
        assert time.monotonic() < deadline, "the slow request never reached the server"
        time.sleep(0.02)
    small = grpc_input("x", np.ones((1, 1, 1), np.float32), "FP32")
    with pytest.raises(InferenceServerException) as late:
        client.infer("slow", [small], client_timeout=0.5)
    assert late.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    result, error = answered.get(timeout=120)
    assert error is None and float(result.as_numpy("y").ravel()[0]) == pytest.approx(m * SLOW_WIDTH)
    deadline = time.monotonic() + 30
    while failures(served, "slow") < before + 1:
        assert time.monotonic() < deadline, "the server never counted the late request"
        time.sleep(0.05)
    client.close()


# -- API keys -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrpcServer]:
    repo = tmp_path_factory.mktemp("grpc-keys") / "repository"
    add_model(repo, "tiny", tiny_onnx(), TINY_CONFIG)
    running = start_grpc(repo, repo.parent / "server.log", {"STOKER_AUTH__API_KEYS": "k-one,k-two"})
    yield running
    assert stop_server(running.http) == 0


def test_api_keys_are_asked_for_as_over_http(keyed: GrpcServer) -> None:
    x = np.ones((1, 4), np.float32)
    client = keyed.client()
    # Probes are open, as /v2/health/* are.
    assert client.is_server_live() and client.is_server_ready()
    health = health_stub(grpc.insecure_channel(keyed.address))
    assert (
        health.Check(health_pb2.HealthCheckRequest()).status
        == health_pb2.HealthCheckResponse.SERVING
    )
    refused = [
        (lambda h: client.infer("tiny", [grpc_input("x", x, "FP32")], headers=h)),
        (lambda h: client.get_model_metadata("tiny", headers=h)),
        (lambda h: client.is_model_ready("tiny", headers=h)),
        (lambda h: client.get_system_shared_memory_status(headers=h)),
    ]
    for headers, problem in [
        (None, "missing API key"),
        ({"authorization": "Bearer k-three"}, "invalid API key"),
        ({"authorization": "Basic k-one"}, "missing API key"),
        ({"x-api-key": "k-on"}, "invalid API key"),
    ]:
        for call in refused:
            with pytest.raises(InferenceServerException) as failed:
                call(headers)
            assert failed.value.status() == "StatusCode.UNAUTHENTICATED"
            assert problem in failed.value.message()
    for headers in ({"authorization": "Bearer k-one"}, {"x-api-key": "k-two"}):
        result = client.infer("tiny", [grpc_input("x", x, "FP32")], headers=headers)
        assert result.as_numpy("y").shape == (1, 3)
        assert client.get_model_metadata("tiny", headers=headers).name == "tiny"
    # A stream without a key is refused too.
    errors: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: errors.put(error))
    # The call is refused as it opens, so the client may find its stream closed already.
    with contextlib.suppress(InferenceServerException):
        client.async_stream_infer("tiny", [grpc_input("x", x, "FP32")])
    error = errors.get(timeout=30)
    assert error is not None and error.status() == "StatusCode.UNAUTHENTICATED"
    client.stop_stream()
    client.close()


def test_unauthenticated_calls_are_logged_at_most_once_a_second_per_address(
    keyed: GrpcServer,
) -> None:
    stub = keyed.stub()
    log = keyed.http.log
    before = log.read_text().count("UNAUTHENTICATED")
    summaries = log.read_text().count("UNAUTHENTICATED for")
    started = time.monotonic()
    for _ in range(200):
        with pytest.raises(grpc.RpcError) as refused:
            stub.ServerMetadata(service_pb2.ServerMetadataRequest())
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    seconds = time.monotonic() - started
    # One line as the first comes, one per second after it for those of that second: 200
    # refusals in a second or two are a few lines, not 200.
    deadline = time.monotonic() + 60
    while log.read_text().count("UNAUTHENTICATED for") == summaries:
        assert time.monotonic() < deadline, "the refusals after the first were never logged"
        time.sleep(0.1)
    lines = log.read_text().count("UNAUTHENTICATED") - before
    # (The first may have come in an earlier test's second: then only its summary is new.)
    assert 1 <= lines <= 2 * (seconds + 2), lines


def test_a_taken_grpc_port_stops_the_server(tmp_path: Path) -> None:
    """As a taken HTTP port does: one process binds without SO_REUSEPORT, so a port another
    socket holds is an error at startup, not a silent share."""
    repo = tmp_path / "repository"
    add_model(repo, "tiny", tiny_onnx(), TINY_CONFIG)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {"STOKER_SERVER__GRPC_PORT": str(port)}
        process = launch_server(repo, tmp_path / "server.log", env).process
        code = process.wait(120)
    assert code != 0
    assert f"gRPC cannot listen on 127.0.0.1:{port}" in (tmp_path / "server.log").read_text()


# -- drain ----------------------------------------------------------------------------------


DOOR_CLOSED = "drain: new requests refused from now on"  # the data plane's log line


def pending(server: GrpcServer) -> float:
    return sum(
        value
        for (name, _), value in metric_samples(server.http).items()
        if name == "stoker_inference_pending_request_count"
    )


@pytest.mark.slow
def test_sigterm_answers_every_call_in_flight_and_refuses_new_ones(tmp_path: Path) -> None:
    """A slow request holds the runner while 40 unary calls and a stream of 20 queue behind
    it; SIGTERM: new calls are UNAVAILABLE, health says NOT_SERVING, every accepted call is
    answered with its own number, and the server exits 0."""
    repo = tmp_path / "repository"
    add_model(repo, "slow", slow_onnx(SLOW_WIDTH, SLOW_LAYERS), SLOW_CONFIG)
    server = start_grpc(repo, tmp_path / "server.log", {"STOKER_SERVER__DRAIN_TIMEOUT_S": "60"})
    try:
        m = blocker_size(server, 6.0)

        async def scenario() -> tuple[list[tuple[float, Any]], list[Any], dict[str, Any]]:
            client = tgrpc_aio.InferenceServerClient(server.address)

            async def one(value: float, rows_m: int = 1) -> tuple[float, Any]:
                x = np.full((1, rows_m, 1), value, np.float32)
                result = await client.infer("slow", [grpc_input("x", x, "FP32")])
                return value * rows_m, result

            blocker = asyncio.create_task(one(1.0, m))
            deadline = time.monotonic() + 30
            while await asyncio.to_thread(pending, server) < 1:  # it holds the runner first
                assert time.monotonic() < deadline, "the slow request never reached the server"
                await asyncio.sleep(0.02)
            unary = [asyncio.create_task(one(float(i + 2))) for i in range(40)]

            async def requests() -> Any:
                for i in range(20):
                    x = np.full((1, 1, 1), 100.0 + i, np.float32)
                    yield {
                        "model_name": "slow",
                        "inputs": [grpc_input("x", x, "FP32")],
                        "request_id": f"s{i}",
                    }

            async def stream() -> list[Any]:
                return [answer async for answer in client.stream_infer(requests())]

            streamed = asyncio.create_task(stream())
            deadline = time.monotonic() + 60
            while await asyncio.to_thread(pending, server) < 61:
                assert time.monotonic() < deadline, "the calls never all reached the queue"
                assert not blocker.done(), "the slow request finished before all were queued"
                await asyncio.sleep(0.05)
            server.http.process.send_signal(signal.SIGTERM)
            # A call that arrives while the drain still reads what came before the signal is
            # taken: the late one is made once the door has closed.
            deadline = time.monotonic() + 60
            while DOOR_CLOSED not in server.http.log.read_text():
                assert time.monotonic() < deadline, "the drain's door never closed"
                await asyncio.sleep(0.02)
            after: dict[str, Any] = {}
            try:
                await one(7.0)
            except InferenceServerException as refused:
                after["infer"] = refused
            health = health_stub(grpc.aio.insecure_channel(server.address))
            after["health"] = (await health.Check(health_pb2.HealthCheckRequest())).status
            after["ready"] = await client.is_server_ready()
            after["live"] = await client.is_server_live()
            answered = await asyncio.gather(blocker, *unary)
            stream_answers = await streamed
            await client.close()
            return answered, stream_answers, after

        answered, streamed, after = asyncio.run(scenario())
        code = server.http.process.wait(75)
    finally:
        if server.http.process.poll() is None:
            server.http.process.kill()
            server.http.process.wait()
    refused = after["infer"]
    assert refused.status() == "StatusCode.UNAVAILABLE" and "shutting down" in refused.message()
    assert after["health"] == health_pb2.HealthCheckResponse.NOT_SERVING
    assert after["ready"] is False and after["live"] is True
    for want, result in answered:
        assert float(result.as_numpy("y").ravel()[0]) == pytest.approx(want * SLOW_WIDTH)
    assert len(streamed) == 20
    for result, error in streamed:
        assert error is None, error
        i = int(result.get_response().id[1:])
        assert float(result.as_numpy("y").ravel()[0]) == pytest.approx((100.0 + i) * SLOW_WIDTH)
    assert code == 0, server.http.log.read_text()[-3000:]


# -- the bench ------------------------------------------------------------------------------


def test_the_bench_measures_grpc_beside_http_on_one_server(
    served: GrpcServer, tmp_path: Path
) -> None:
    """``stoker bench --protocol http,grpc,grpc-stream --check-answers`` against a running
    server: the three targets answer without errors, the gRPC ones over the server's gRPC
    port (ModelInfer calls, and messages on ModelStreamInfer streams), every answer of each
    the request's own (2-row requests, batched), and the server's own counts see every
    request."""
    port = served.address.rpartition(":")[2]
    before = tiny_successes(served)
    document = run_bench(
        tmp_path,
        "--url",
        served.http.url,
        "--grpc-port",
        port,
        "--model",
        "tiny",
        "--protocol",
        "http,grpc,grpc-stream",
        "--rows",
        "2",
        "--check-answers",
        "--concurrency",
        "4",
        "--duration",
        "1",
        "--warmup",
        "0.3",
    )
    targets = document["targets"]
    assert [t["name"] for t in targets] == ["target-http", "target-grpc", "target-grpc-stream"]
    for target in targets:
        (step,) = target["steps"]
        assert step["errors"] == 0 and step["requests"] > 0, step
        assert step["server"]["mean_batch_size"] is not None
    assert tiny_successes(served) - before >= sum(t["steps"][0]["requests"] for t in targets)


def tiny_successes(server: GrpcServer) -> float:
    client = server.client()
    stats = client.get_inference_statistics("tiny", "fp32").model_stats[0]
    client.close()
    return float(stats.inference_stats.success.count)


def run_bench(folder: Path, *args: str) -> Any:
    out = folder / "bench.json"
    assert cli.main([*args, "--json", str(out)]) == 0
    return orjson.loads(out.read_bytes())
