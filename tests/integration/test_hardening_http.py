"""Hardening against a real ``stoker serve`` (uvicorn subprocess) with API keys and tight limits:
bad input hammered while others are served, every limit refused with its status, an engine
error confined to its batch, deadlines that bound a busy runner, disconnected clients dropped
before compute, every response matched to its own request under mixed traffic, keys with httpx
and tritonclient, and model names that cannot leave the repository.

The models are small real ONNX graphs whose answers are known: ``tiny`` (y = x @ W + b,
s = sum(x)), ``triple`` (y = 3x, INT64), ``tiny_image`` (per-channel sums of an 8x8 image)
and ``slow``, whose cost grows with its input's second dimension (``m``) and which fails, in
ONNX Runtime itself, on any value of 1000 or more: ``y = sum(x) * WIDTH + table[max(x)]``
with a 1000-entry table of zeros, so an index past it is a real engine error.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import random
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import pytest
import tritonclient.http as triton
from onnx import TensorProto, helper, numpy_helper
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from tests.conftest import TINY_BIAS, TINY_CONFIG, TINY_WEIGHTS, slow_onnx, tiny_onnx
from tests.integration.conftest import Server, metric_samples, start_server, stop_server
from tests.unit.app.test_hardening import png_bomb

WIDTH = 256
LAYERS = 8
FAULT = 5000.0  # any input value >= 1000 makes the slow model's Gather fail
BODY_LIMIT = 1024 * 1024
MAX_IMAGES = 3
MAX_PIXELS = 4_000_000
MAX_DEPTH = 8
KEY_FILE = "k-file-5b0e6a9c2f"
KEY_ENV = "k-env-1d7f3e8a44"

SLOW_CONFIG = """\
max_batch_size: 8
runners: 1
dynamic_batching:
  max_queue_delay_us: 0
  max_queue_size: 64
  default_timeout_us: 30000000
"""
TRIPLE_CONFIG = """\
max_batch_size: 8
runners: 1
dynamic_batching:
  max_queue_delay_us: 500
"""
IMAGE_CONFIG = """\
max_batch_size: 4
runners: 1
preprocess: {resize_shorter: 8, crop: 8}
"""


def model(nodes: list[Any], inputs: list[Any], outputs: list[Any], init: list[Any]) -> Any:
    graph = helper.make_graph(nodes, "test", inputs, outputs, initializer=init)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    onnx.checker.check_model(proto)
    return proto


def slow_model() -> Any:
    """The slow chain plus a bias looked up by the row's largest value, so a row's answer
    tells which row it was."""
    tail = [
        helper.make_node("ReduceMax", ["x"], ["top"], keepdims=0),
        helper.make_node("Cast", ["top"], ["index"], to=TensorProto.INT64),
        helper.make_node("Gather", ["table", "index"], ["bias"]),
        helper.make_node("Add", ["total", "bias"], ["y"]),
    ]
    table = numpy_helper.from_array(np.zeros(1000, np.float32), "table")
    return slow_onnx(WIDTH, LAYERS, tail, [table])


def triple_onnx() -> Any:
    return model(
        [helper.make_node("Mul", ["x", "three"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.INT64, ["batch", 2])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, ["batch", 2])],
        [numpy_helper.from_array(np.array([3], np.int64), "three")],
    )


def image_onnx() -> Any:
    return model(
        [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(np.array([2, 3], np.int64), "axes")],
    )


def write_model(repository: Path, name: str, proto: Any, config: str) -> None:
    folder = repository / name
    folder.mkdir(parents=True)
    onnx.save(proto, str(folder / "model.onnx"))
    (folder / "config.yaml").write_text(config)


def hardening_repository(root: Path) -> Path:
    repository = root / "repository"
    write_model(repository, "tiny", tiny_onnx(), TINY_CONFIG)
    write_model(repository, "triple", triple_onnx(), TRIPLE_CONFIG)
    write_model(repository, "tiny_image", image_onnx(), IMAGE_CONFIG)
    write_model(repository, "slow", slow_model(), SLOW_CONFIG)
    return repository


@pytest.fixture(scope="module")
def hardened(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("hardened")
    keys = root / "api-keys"
    keys.write_text(f"# test keys\n{KEY_FILE}\n")
    env = {
        "STOKER_LIMITS__MAX_BODY_BYTES": str(BODY_LIMIT),
        "STOKER_LIMITS__MAX_IMAGES_PER_REQUEST": str(MAX_IMAGES),
        "STOKER_LIMITS__MAX_IMAGE_PIXELS": str(MAX_PIXELS),
        "STOKER_LIMITS__MAX_JSON_DEPTH": str(MAX_DEPTH),
        "STOKER_AUTH__API_KEYS_FILE": str(keys),
        "STOKER_AUTH__API_KEYS": KEY_ENV,
    }
    server = start_server(hardening_repository(root), root / "server.log", env)
    yield server
    code = stop_server(server)
    log = server.log.read_text()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert KEY_FILE not in log and KEY_ENV not in log, "an API key reached the log"


AUTH = {"X-API-Key": KEY_FILE}


def client(server: Server, **kwargs: Any) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers=AUTH, timeout=30, **kwargs)


def counter(values: dict[Any, float], name: str, model: str, **labels: str) -> float:
    key = tuple(sorted({"model": model, "version": "fp32", **labels}.items()))
    return values.get((name, key), 0.0)


def failures(values: dict[Any, float], model: str, reason: str) -> float:
    return counter(values, "stoker_inference_request_failure_total", model, reason=reason)


def is_error(response: httpx.Response, status: int | None = None) -> bool:
    if status is not None and response.status_code != status:
        return False
    body = response.json()
    return set(body) == {"error"} and 0 < len(body["error"]) < 300


# -- request builders with known answers ---------------------------------------------------


def tiny_json(x: np.ndarray, request_id: str) -> dict[str, Any]:
    return {
        "id": request_id,
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}
        ],
    }


def binary_body(
    name: str, datatype: str, x: np.ndarray, request_id: str
) -> tuple[bytes, dict[str, str]]:
    header = json.dumps(
        {
            "id": request_id,
            "inputs": [
                {
                    "name": name,
                    "datatype": datatype,
                    "shape": list(x.shape),
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    headers = {"Inference-Header-Content-Length": str(len(header))}
    return header + x.tobytes(), headers


def binary_outputs(
    response: httpx.Response, spec: dict[str, np.dtype[Any]]
) -> dict[str, np.ndarray]:
    length = int(response.headers["inference-header-content-length"])
    header = json.loads(response.content[:length])
    outputs, offset = {}, length
    for out in header["outputs"]:
        size = out["parameters"]["binary_data_size"]
        chunk = response.content[offset : offset + size]
        outputs[out["name"]] = np.frombuffer(chunk, spec[out["name"]]).reshape(out["shape"])
        offset += size
    return outputs


def json_outputs(response: httpx.Response) -> dict[str, np.ndarray]:
    return {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in response.json()["outputs"]}


def tiny_answer(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return x @ TINY_WEIGHTS + TINY_BIAS, x.sum(axis=1, keepdims=True)


def slow_body(
    value: float, m: int = 1, rows: int = 1, timeout_us: int | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [rows, m, 1], "data": [value] * (rows * m)}
        ]
    }
    if timeout_us is not None:
        body["parameters"] = {"timeout": timeout_us}
    return body


def slow_answer(response: httpx.Response) -> list[float]:
    return [float(v) for v in response.json()["outputs"][0]["data"]]


def blocker_m(server: Server, seconds: float) -> int:
    """The ``m`` that keeps the slow model's runner busy for at least about ``seconds`` here:
    timed from the fastest of three probes, so a probe slowed by another process on the
    machine makes the blocker longer, never shorter (CI saw a busy moment's probe give a
    blocker that finished in under 0.4 s of its 1.5)."""
    probe = 4096
    times = []
    with client(server) as http:
        http.post("/v2/models/slow/infer", json=slow_body(0.0, probe)).raise_for_status()
        for _ in range(3):
            started = time.perf_counter()
            response = http.post("/v2/models/slow/infer", json=slow_body(1.0, probe))
            times.append(time.perf_counter() - started)
            assert slow_answer(response) == [pytest.approx(probe * WIDTH)]
    elapsed = min(times)
    # A faster machine asks for more, but the body must stay under the server's limit
    # (each value is at most "12.5," in JSON): the longest blocker the limit allows.
    fits = (BODY_LIMIT - 4096) // 5
    return min(fits, max(probe, int(probe * seconds / elapsed)))


@pytest.fixture(scope="module")
def busy_m(hardened: Server) -> int:
    return blocker_m(hardened, 2.0)


async def wait_pending(server: Server, at_least: int, model: str = "slow") -> None:
    deadline = time.monotonic() + 60
    async with httpx.AsyncClient(timeout=5) as http:
        while True:
            text = (await http.get(f"{server.url}/metrics")).text
            pending = 0.0
            for family in text_string_to_metric_families(text):
                if family.name == "stoker_inference_pending_request_count":
                    pending = sum(s.value for s in family.samples if s.labels["model"] == model)
            if pending >= at_least:
                return
            assert time.monotonic() < deadline, f"only {pending} pending"
            await asyncio.sleep(0.02)


# -- 1. bad input --------------------------------------------------------------------------


def deep_json(depth: int) -> bytes:
    data = "[" * (depth - 1) + "[1,2,3,4]" + "]" * (depth - 1)
    return (
        '{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":' + data + "}]}"
    ).encode()


def bad_requests(bomb: bytes) -> list[tuple[str, str, bytes, dict[str, str], int]]:
    """(name, path, body, headers, expected status): malformed in every layer."""
    tiny = "/v2/models/tiny/infer"
    valid = json.dumps(tiny_json(np.ones((1, 4), np.float32), "v")).encode()
    header = (
        b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],'
        b'"parameters":{"binary_data_size":16}}]}'
    )
    length = {"Inference-Header-Content-Length": str(len(header))}
    png = io.BytesIO()
    Image.new("RGB", (16, 16)).save(png, format="PNG")
    return [
        ("garbage", tiny, os.urandom(512), {}, 400),
        ("truncated json", tiny, valid[:-5], {}, 400),
        ("not an object", tiny, b"[1,2,3]", {}, 400),
        ("empty body", tiny, b"", {}, 400),
        ("json depth over the setting", tiny, deep_json(MAX_DEPTH + 1), {}, 400),
        ("json depth over the parser", tiny, b"[" * 5000 + b"]" * 5000, {}, 400),
        ("binary past the end", tiny, header + b"\0" * 8, length, 400),
        ("binary left over", tiny, header + b"\0" * 24, length, 400),
        ("header length past body", tiny, valid, {"Inference-Header-Content-Length": "99999"}, 400),
        ("header length negative", tiny, valid, {"Inference-Header-Content-Length": "-4"}, 400),
        (
            "header length not a number",
            tiny,
            valid,
            {"Inference-Header-Content-Length": "1e3"},
            400,
        ),
        ("raw body partial row", tiny, b"\0" * 15, {"Inference-Header-Content-Length": "0"}, 400),
        (
            "huge shape",
            tiny,
            b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1099511627776,4],"data":[1]}]}',
            {},
            400,
        ),
        (
            "negative size",
            tiny,
            header.replace(b"16", b"-16") + b"\0" * 16,
            {"Inference-Header-Content-Length": str(len(header) + 1)},
            400,
        ),
        ("wrong datatype", tiny, valid.replace(b"FP32", b"INT8"), {}, 400),
        (
            "17 rows",
            tiny,
            json.dumps(tiny_json(np.ones((17, 4), np.float32), "r")).encode(),
            {},
            400,
        ),
        ("body over the limit", tiny, b" " * (BODY_LIMIT + 1), {}, 413),
        ("unknown model", "/v2/models/nope/infer", valid, {}, 404),
        ("unknown version", "/v2/models/tiny/versions/int4/infer", valid, {}, 404),
        ("traversal", "/v2/models/..%2F..%2Fetc/infer", valid, {}, 404),
        ("image bomb", "/v2/models/tiny_image/classify", bomb, {"Content-Type": "image/png"}, 413),
        (
            "not an image",
            "/v2/models/tiny_image/classify",
            b"not an image, whatever the header says",
            {"Content-Type": "image/jpeg"},
            400,
        ),
        (
            "image to a tensor model",
            "/v2/models/tiny/classify",
            png.getvalue(),
            {"Content-Type": "image/png"},
            400,
        ),
        (
            "no content type",
            "/v2/models/tiny_image/classify",
            png.getvalue(),
            {"Content-Type": "text/plain"},
            400,
        ),
        (
            "k not a number",
            "/v2/models/tiny_image/classify?k=lots",
            png.getvalue(),
            {"Content-Type": "image/png"},
            400,
        ),
    ]


@pytest.fixture(scope="module")
def bomb() -> bytes:
    return png_bomb(30_000, 30_000)


def test_every_malformed_request_gets_its_4xx_with_an_error(hardened: Server, bomb: bytes) -> None:
    with client(hardened) as http:
        for name, path, body, headers, status in bad_requests(bomb):
            response = http.post(path, content=body, headers=headers)
            assert response.status_code == status, (name, response.text)
            assert is_error(response), (name, response.text)


def test_the_server_keeps_serving_while_bad_input_is_hammered(
    hardened: Server, bomb: bytes
) -> None:
    """600 malformed requests from 16 connections while 4 clients send valid ones: every bad
    request gets its 4xx, every valid one its own right answer, and the process never blinks."""
    corpus = bad_requests(bomb)
    answers: list[tuple[np.ndarray, httpx.Response]] = []
    refused: list[tuple[str, int, httpx.Response]] = []
    stop = asyncio.Event()

    async def hammer(http: httpx.AsyncClient, seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(600 // 16):
            name, path, body, headers, status = rng.choice(corpus)
            refused.append((name, status, await http.post(path, content=body, headers=headers)))

    async def serve(http: httpx.AsyncClient, seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            x = rng.standard_normal((int(rng.integers(1, 17)), 4)).astype(np.float32)
            answers.append((x, await http.post("/v2/models/tiny/infer", json=tiny_json(x, "ok"))))

    async def scenario() -> None:
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(
            base_url=hardened.url, headers=AUTH, timeout=60, limits=limits
        ) as http:
            good = [asyncio.create_task(serve(http, i)) for i in range(4)]
            await asyncio.gather(*(hammer(http, i) for i in range(16)))
            stop.set()
            await asyncio.gather(*good)

    asyncio.run(scenario())
    assert len(refused) == 592
    for name, status, response in refused:
        assert response.status_code == status and is_error(response), (name, response.text)
    assert len(answers) >= 20
    for x, response in answers:
        assert response.status_code == 200, response.text
        y, s = tiny_answer(x)
        outputs = json_outputs(response)
        np.testing.assert_allclose(outputs["y"], y, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(outputs["s"], s, rtol=1e-5, atol=1e-5)
    assert httpx.get(f"{hardened.url}/v2/health/ready").status_code == 200
    assert httpx.get(f"{hardened.url}/v2/health/live").status_code == 200


# -- 2. limits -----------------------------------------------------------------------------


def raw_exchange(
    server: Server, head: bytes, body_chunks: Iterable[bytes] = ()
) -> tuple[bytes, int]:
    """Send ``head`` then chunks until the server answers; return the answer's first bytes and
    how many body bytes had been sent when it came."""
    host, port = server.address.split(":")
    sent = 0
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head)
        for chunk in body_chunks:
            if select.select([sock], [], [], 0)[0]:
                break
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
        sock.settimeout(10)
        return read_response(sock), sent


def read_response(sock: socket.socket) -> bytes:
    """The whole answer: headers, then as many body bytes as its Content-Length says (head and
    body can arrive in separate segments, so one recv is not enough)."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = sock.recv(4096)
        if not chunk:
            return answer
        answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = sock.recv(4096)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_a_huge_declared_body_is_refused_without_being_read(hardened: Server) -> None:
    """Content-Length of 1 TB and not one byte of body: 413 comes at once."""
    head = (
        b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: stoker\r\n"
        b"X-API-Key: " + KEY_FILE.encode() + b"\r\n"
        b"Content-Type: application/json\r\nContent-Length: 1000000000000\r\n\r\n"
    )
    started = time.perf_counter()
    answer, _ = raw_exchange(hardened, head)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b'{"error":"request body of 1000000000000 bytes exceeds 1048576"}' in answer
    assert time.perf_counter() - started < 2


def test_a_client_gone_mid_body_costs_one_log_line(hardened: Server) -> None:
    """Twenty clients that declare a body, send a little of it and hang up: one INFO line
    each, no traceback, and the next client is answered."""
    host, port = hardened.address.split(":")
    head = (
        b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: stoker\r\n"
        b"X-API-Key: " + KEY_FILE.encode() + b"\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
    )
    before = hardened.log.read_text()
    for _ in range(20):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(head + b'{"inputs": [' * 10)
    with client(hardened) as http:
        assert http.get("/v2/health/ready").status_code == 200
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        added = hardened.log.read_text()[len(before) :]
        if added.count("went away mid-request") == 20:
            break
        time.sleep(0.1)
    assert added.count("went away mid-request") == 20, added[-2000:]
    assert "Traceback" not in added and "ERROR" not in added
    assert len(added.splitlines()) == 20


def test_a_long_or_hostile_model_name_is_not_echoed(hardened: Server) -> None:
    with client(hardened) as http:
        long = http.get(f"/v2/models/{'m' * 60_000}%0aforged")
        hostile = http.get("/v2/models/x%0a%1b[31mforged")
    assert long.status_code == hostile.status_code == 404
    error = long.json()["error"]
    assert len(error) < 200 and "60007 characters" in error
    assert hostile.json() == {"error": "unknown model 'x\\n\\x1b[31mforged'"}


def test_a_streamed_body_is_cut_off_at_the_limit(hardened: Server) -> None:
    """Chunked, with no length declared: 413 as soon as the limit is passed; the client is
    told long before it could send its 64 MB (what it sent beyond the limit sat in the
    sockets' buffers)."""
    head = (
        b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: stoker\r\n"
        b"X-API-Key: " + KEY_FILE.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    piece = b"%x\r\n" % 65536 + b" " * 65536 + b"\r\n"
    answer, sent = raw_exchange(hardened, head, iter([piece] * 1024))
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert sent < 8 * BODY_LIMIT


def test_rows_per_request_are_bounded_by_the_model(hardened: Server) -> None:
    with client(hardened) as http:
        ok = http.post("/v2/models/tiny/infer", json=tiny_json(np.ones((16, 4), np.float32), "a"))
        assert ok.status_code == 200
        over = http.post("/v2/models/tiny/infer", json=tiny_json(np.ones((17, 4), np.float32), "b"))
        assert is_error(over, 400) and "1 to 16" in over.json()["error"]


def test_json_depth_follows_the_setting(hardened: Server) -> None:
    with client(hardened) as http:
        assert http.post("/v2/models/tiny/infer", content=deep_json(MAX_DEPTH)).status_code == 200
        deeper = http.post("/v2/models/tiny/infer", content=deep_json(MAX_DEPTH + 1))
        assert is_error(deeper, 400) and f"deeper than {MAX_DEPTH}" in deeper.json()["error"]
        parser = http.post("/v2/models/tiny/infer", content=b"[" * 1100 + b"]" * 1100)
        assert is_error(parser, 400) and "1024" in parser.json()["error"]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_decompression_bombs_and_oversized_images_are_refused(
    hardened: Server, bomb: bytes
) -> None:
    """A 30000x30000 PNG of 110 kB (2.7 GB as RGB) and an honest 2100x2000 PNG over the
    4-megapixel setting: 413 from the header, read in the front end (counted among the
    refusals no model saw), and the server's memory does not move."""
    refused = ("stoker_http_refusals_total", (("reason", "image_header"), ("status", "413")))
    refusals = metric_samples(hardened).get(refused, 0.0)
    before = rss_bytes(hardened.process.pid)
    with client(hardened) as http:
        for data in (bomb, png(2100, 2000)):
            started = time.perf_counter()
            response = http.post(
                "/v2/models/tiny_image/classify",
                content=data,
                headers={"Content-Type": "image/png"},
            )
            assert is_error(response, 413), response.text
            assert time.perf_counter() - started < 2
        ok = http.post(
            "/v2/models/tiny_image/classify",
            content=png(1000, 1000),
            headers={"Content-Type": "image/png"},
        )
        assert ok.status_code == 200, ok.text
    assert rss_bytes(hardened.process.pid) - before < 64 * 1024 * 1024
    assert metric_samples(hardened)[refused] == refusals + 2


def test_an_aspect_ratio_bomb_is_refused_before_any_resize(hardened: Server) -> None:
    """Four concurrent 1x8000 PNGs of ~100 bytes, each of which the resize to a shorter side
    would have made 2 GB (4.7 GB peak seen): 413 from the header, at once, and the server's
    memory does not move."""
    bomb = png(1, 8000)
    assert len(bomb) < 1000
    before = rss_bytes(hardened.process.pid)

    async def four() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=hardened.url, headers=AUTH, timeout=30) as http:
            return await asyncio.gather(
                *(
                    http.post(
                        "/v2/models/tiny_image/classify",
                        content=bomb,
                        headers={"Content-Type": "image/png"},
                    )
                    for _ in range(4)
                )
            )

    started = time.perf_counter()
    answers = asyncio.run(four())
    assert time.perf_counter() - started < 2
    for answer in answers:
        assert is_error(answer, 413), answer.text
        assert "aspect ratio over 32:1" in answer.json()["error"]
    assert rss_bytes(hardened.process.pid) - before < 32 * 1024 * 1024


def test_images_per_upload_follow_the_setting(hardened: Server) -> None:
    image = png(12, 10)
    with client(hardened) as http:
        files = [("image", (f"{i}.png", image, "image/png")) for i in range(MAX_IMAGES)]
        ok = http.post("/v2/models/tiny_image/classify", files=files, data={"k": "2"})
        assert ok.status_code == 200, ok.text
        assert len(ok.json()["predictions"]) == MAX_IMAGES
        files.append(("image", ("extra.png", image, "image/png")))
        over = http.post("/v2/models/tiny_image/classify", files=files)
        assert is_error(over, 400) and "files" in over.json()["error"].lower()


# -- 4. faults -----------------------------------------------------------------------------


def test_an_engine_error_fails_only_its_own_batch(hardened: Server, busy_m: int) -> None:
    """Behind a busy runner, four m=2 requests (one holding the faulting value) queue up and
    will form one batch, four m=3 requests another. ONNX Runtime fails the first batch: its
    four requests get 500, the other batch's four get their own right answers, the failures
    are counted as backend, and the server stays ready."""
    before = metric_samples(hardened)

    async def scenario() -> tuple[httpx.Response, list[httpx.Response], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=hardened.url, headers=AUTH, timeout=60) as http:
            url = "/v2/models/slow/infer"
            blocker = asyncio.create_task(http.post(url, json=slow_body(1.0, busy_m)))
            await wait_pending(hardened, 1)
            doomed = [
                asyncio.create_task(http.post(url, json=slow_body(FAULT if i == 2 else i, m=2)))
                for i in range(4)
            ]
            await wait_pending(hardened, 5)
            spared = [
                asyncio.create_task(http.post(url, json=slow_body(i + 1, m=3))) for i in range(4)
            ]
            await wait_pending(hardened, 9)
            return await blocker, await asyncio.gather(*doomed), await asyncio.gather(*spared)

    blocker, doomed, spared = asyncio.run(scenario())
    assert blocker.status_code == 200
    for response in doomed:
        assert is_error(response, 500) and "inference failed" in response.json()["error"]
    for i, response in enumerate(spared):
        assert response.status_code == 200, response.text
        assert slow_answer(response) == [pytest.approx((i + 1) * 3 * WIDTH)]
    after = metric_samples(hardened)
    assert failures(after, "slow", "backend") - failures(before, "slow", "backend") == 4
    assert httpx.get(f"{hardened.url}/v2/health/ready").status_code == 200
    with client(hardened) as http:
        assert slow_answer(http.post("/v2/models/slow/infer", json=slow_body(2.0))) == [2.0 * WIDTH]


def stats(server: Server, model: str) -> dict[str, Any]:
    with client(server) as http:
        result: dict[str, Any] = http.get(f"/v2/models/{model}/stats").json()["model_stats"][0]
        return result


def test_deadlines_bound_a_busy_runner(hardened: Server, busy_m: int) -> None:
    """A batch that runs past its deadline answers 504 at the deadline, not when the runner is
    done; a request queued behind it answers 504 at its own deadline and never runs."""
    before = stats(hardened, "slow")

    async def scenario() -> list[tuple[httpx.Response, float]]:
        async with httpx.AsyncClient(base_url=hardened.url, headers=AUTH, timeout=60) as http:
            url = "/v2/models/slow/infer"

            async def timed(body: dict[str, Any]) -> tuple[httpx.Response, float]:
                started = time.perf_counter()
                response = await http.post(url, json=body)
                return response, time.perf_counter() - started

            running = asyncio.create_task(timed(slow_body(1.0, busy_m, timeout_us=400_000)))
            await wait_pending(hardened, 1)
            queued = asyncio.create_task(timed(slow_body(1.0, 1, timeout_us=300_000)))
            results = [await running, await queued]
            # The runner is still busy with the expired batch; this waits for it to finish.
            await http.post(url, json=slow_body(0.0))
            return results

    (running, running_s), (queued, queued_s) = asyncio.run(scenario())
    assert is_error(running, 504) and "while executing" in running.json()["error"]
    assert is_error(queued, 504) and "while queued" in queued.json()["error"]
    assert running_s < 1.0 and queued_s < 1.0
    after = stats(hardened, "slow")
    # The expired batch ran to its end (a runner cannot be interrupted), then the last probe;
    # the request that expired in the queue never reached the runner.
    assert after["inference_count"] - before["inference_count"] == 2


def test_a_disconnected_client_is_dropped_before_compute(hardened: Server, busy_m: int) -> None:
    """A request queued behind a busy runner whose client hangs up is dropped from the queue:
    counted as cancelled, never run."""
    before, counted_before = stats(hardened, "slow"), metric_samples(hardened)

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(base_url=hardened.url, headers=AUTH, timeout=60) as http:
            url = "/v2/models/slow/infer"
            blocker = asyncio.create_task(http.post(url, json=slow_body(1.0, busy_m)))
            await wait_pending(hardened, 1)
            async with httpx.AsyncClient(base_url=hardened.url, headers=AUTH) as impatient:
                with pytest.raises(httpx.ReadTimeout):
                    await impatient.post(url, json=slow_body(7.0, rows=3), timeout=0.3)
            return await blocker

    blocker = asyncio.run(scenario())
    assert blocker.status_code == 200
    deadline = time.monotonic() + 60
    while failures(metric_samples(hardened), "slow", "cancelled") == failures(
        counted_before, "slow", "cancelled"
    ):
        assert time.monotonic() < deadline, "the disconnect was never counted"
        time.sleep(0.05)
    after = stats(hardened, "slow")
    assert after["inference_count"] - before["inference_count"] == 1, "only the blocker ran"
    assert after["execution_count"] - before["execution_count"] == 1


# -- 5. isolation --------------------------------------------------------------------------


def test_every_response_matches_its_own_request_under_mixed_traffic(hardened: Server) -> None:
    """480 requests, 32 at a time, across three models, JSON, binary and raw binary, 1 to 16
    rows each: every answer is checked against its own inputs and id."""
    rng = np.random.default_rng(8)
    url = hardened.url

    async def one(http: httpx.AsyncClient, i: int) -> None:
        kind = i % 6
        rid = f"req-{i}"
        rows = int(rng.integers(1, 9 if kind >= 3 else 17))
        if kind in (0, 1, 2):
            x = (rng.standard_normal((rows, 4)) * 10).astype(np.float32)
            y, s = tiny_answer(x)
            if kind == 0:
                response = await http.post(f"{url}/v2/models/tiny/infer", json=tiny_json(x, rid))
                got = json_outputs(response)
                assert response.json()["id"] == rid
            elif kind == 1:
                body, headers = binary_body("x", "FP32", x, rid)
                response = await http.post(
                    f"{url}/v2/models/tiny/infer", content=body, headers=headers
                )
                got = binary_outputs(response, {"y": np.dtype("<f4"), "s": np.dtype("<f4")})
            else:
                response = await http.post(
                    f"{url}/v2/models/tiny/infer",
                    content=x.tobytes(),
                    headers={"Inference-Header-Content-Length": "0"},
                )
                got = binary_outputs(response, {"y": np.dtype("<f4"), "s": np.dtype("<f4")})
            np.testing.assert_allclose(got["y"], y, rtol=1e-5, atol=1e-4)
            np.testing.assert_allclose(got["s"], s, rtol=1e-5, atol=1e-4)
        elif kind in (3, 4):
            ints = rng.integers(-(10**12), 10**12, (rows, 2), dtype=np.int64)
            if kind == 3:
                document = {
                    "id": rid,
                    "inputs": [
                        {
                            "name": "x",
                            "datatype": "INT64",
                            "shape": [rows, 2],
                            "data": ints.ravel().tolist(),
                        }
                    ],
                }
                response = await http.post(f"{url}/v2/models/triple/infer", json=document)
                assert response.json()["id"] == rid
                got_y = json_outputs(response)["y"]
            else:
                content, headers = binary_body("x", "INT64", ints, rid)
                response = await http.post(
                    f"{url}/v2/models/triple/infer", content=content, headers=headers
                )
                got_y = binary_outputs(response, {"y": np.dtype("<i8")})["y"]
            assert got_y.tolist() == (ints * 3).tolist()
        else:
            values = rng.integers(0, 900, rows).astype(np.float32)
            m = int(rng.integers(1, 4))
            document = {
                "id": rid,
                "inputs": [
                    {
                        "name": "x",
                        "datatype": "FP32",
                        "shape": [rows, m, 1],
                        "data": np.repeat(values, m).tolist(),
                    }
                ],
            }
            response = await http.post(f"{url}/v2/models/slow/infer", json=document)
            assert response.json()["id"] == rid
            assert slow_answer(response) == pytest.approx((values * m * WIDTH).tolist())
        assert response.status_code == 200

    async def scenario() -> None:
        async with httpx.AsyncClient(
            headers=AUTH, timeout=60, limits=httpx.Limits(max_connections=32)
        ) as http:
            semaphore = asyncio.Semaphore(32)

            async def bounded(i: int) -> None:
                async with semaphore:
                    await one(http, i)

            await asyncio.gather(*(bounded(i) for i in range(480)))

    before = metric_samples(hardened)
    asyncio.run(scenario())
    after = metric_samples(hardened)
    batches = counter(after, "stoker_inference_exec_count_total", "tiny") - counter(
        before, "stoker_inference_exec_count_total", "tiny"
    )
    requests = counter(after, "stoker_inference_request_success_total", "tiny") - counter(
        before, "stoker_inference_request_success_total", "tiny"
    )
    assert requests == 240
    assert batches < requests, "requests were batched together, and still each got its own rows"


# -- 6. access -----------------------------------------------------------------------------


def test_api_keys_with_httpx(hardened: Server) -> None:
    body = tiny_json(np.ones((1, 4), np.float32), "k")
    url = f"{hardened.url}/v2/models/tiny/infer"
    for headers in ({}, {"X-API-Key": "wrong"}, {"Authorization": f"Basic {KEY_FILE}"}):
        response = httpx.post(url, json=body, headers=headers)
        assert is_error(response, 401)
        assert response.headers["www-authenticate"].startswith("Bearer")
        assert KEY_FILE not in response.text
    for headers in ({"X-API-Key": KEY_FILE}, {"Authorization": f"Bearer {KEY_ENV}"}):
        assert httpx.post(url, json=body, headers=headers).status_code == 200
    assert httpx.get(f"{hardened.url}/v2/models/tiny").status_code == 401
    assert httpx.get(f"{hardened.url}/v2/health/live").status_code == 200
    assert httpx.get(f"{hardened.url}/v2/health/ready").status_code == 200
    assert httpx.get(f"{hardened.url}/metrics").status_code == 200


def test_api_keys_with_tritonclient(hardened: Server) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    triton_client = triton.InferenceServerClient(hardened.address)
    inp = triton.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    try:
        assert triton_client.is_server_ready()
        with pytest.raises(InferenceServerException, match="missing API key"):
            triton_client.infer("tiny", [inp])
        with pytest.raises(InferenceServerException, match="invalid API key"):
            triton_client.get_model_metadata("tiny", headers={"Authorization": "Bearer nope"})
        result = triton_client.infer("tiny", [inp], headers={"Authorization": f"Bearer {KEY_FILE}"})
        y, s = tiny_answer(x)
        np.testing.assert_allclose(result.as_numpy("y"), y, rtol=1e-5)
        np.testing.assert_allclose(result.as_numpy("s"), s, rtol=1e-5)
        meta = triton_client.get_model_metadata("tiny", headers={"X-API-Key": KEY_ENV})
        assert meta["name"] == "tiny"
    finally:
        triton_client.close()


# -- 7. files ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/v2/models/..%2F..%2Fetc%2Fpasswd/infer",
        "/v2/models/%2e%2e/infer",
        "/v2/models/..%2Ftiny/infer",
        "/v2/models/tiny/versions/..%2F..%2Ffp32/infer",
        "/v2/models/%2Fetc%2Fpasswd/config",
        "/v2/models/..%5C..%5Ctiny/ready",
    ],
)
def test_model_names_in_routes_never_reach_the_filesystem(hardened: Server, path: str) -> None:
    """A model name is a key into the loaded models, never a path: traversal finds nothing."""
    with client(hardened) as http:
        response = http.request("POST" if path.endswith("infer") else "GET", path, json={})
    assert is_error(response, 404), response.text


@pytest.mark.parametrize(
    ("how", "name"), [("option", "../x"), ("option", "/etc"), ("environment", "..")]
)
def test_model_names_from_the_command_line_cannot_leave_the_repository(
    tmp_path: Path, how: str, name: str
) -> None:
    repository = tmp_path / "repository"
    write_model(repository, "tiny", tiny_onnx(), TINY_CONFIG)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.yaml").write_text(TINY_CONFIG)
    args = [sys.executable, "-m", "app", "models", "--repository", str(repository)]
    env = dict(os.environ)
    if how == "option":
        args += ["--model", name]
    else:
        env["STOKER_MODELS__MODELS"] = json.dumps([name])
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "config.yaml" in done.stderr and "Traceback" not in done.stderr
