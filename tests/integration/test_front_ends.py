"""Front-end processes in front of one engine process (``server.front_ends`` > 1), for real:
``stoker serve --front-ends 2`` on a free port, its bodies in shared memory.

Front ends decode and validate V2 requests themselves and send the engine tensors only.
Answers are checked against numpy and ONNX Runtime under concurrency well above what the
shared-memory arena holds (so tensors travel in the arena and, when it is full or a body is too
big for a slot, over the control socket), in JSON and binary, raw and as classifications;
metrics keep one set of totals whichever front end answers, a request a front end refuses is
counted by the engine, a killed front end is replaced while the other keeps serving, SIGTERM
drains every process with no accepted request lost, and the supervisor stops when the engine
dies.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from prometheus_client.parser import text_string_to_metric_families

from engines.backends.onnxruntime import cpu_session
from engines.preprocess import ImagePreprocess, normalize, preprocess
from tests.conftest import (
    TINY_BIAS,
    TINY_CONFIG,
    TINY_WEIGHTS,
    configure,
    slow_onnx,
    tiny_model,
    tiny_onnx,
)
from tests.integration.conftest import (
    Server,
    launch_server,
    metric_samples,
    serve_one_model,
    start_server,
    stop_server,
)

ONES = [1.0] * 4
SLOT_BYTES = 256 * 1024  # one UINT8 224x224 image fits a slot; one FP32 image does not
# The arena: 2 x 256 KiB per front end, so three UINT8 images fill it.
ESPRESSO = 967


def front_end_env(**extra: str) -> dict[str, str]:
    return {
        "STOKER_SERVER__FRONT_ENDS": "2",
        "STOKER_SERVER__SHM_SLOTS": "2",
        "STOKER_SERVER__SHM_SLOT_BYTES": str(SLOT_BYTES),
        **extra,
    }


@pytest.fixture(scope="module")
def front_ends(
    tmp_path_factory: pytest.TempPathFactory, efficientnet_dir: Path
) -> Iterator[Server]:
    repo = tmp_path_factory.mktemp("front-ends") / "repository"
    shutil.copytree(efficientnet_dir, repo / "efficientnet_lite0")
    configure(repo / "efficientnet_lite0", {"precisions": ["fp32"]})  # no INT8 calibration
    tiny_model(repo / "tiny")
    server = start_server(repo, repo.parent / "server.log", front_end_env())
    yield server
    code = stop_server(server)
    assert code == 0, f"exit {code}:\n{server.log.read_text()[-3000:]}"


@pytest.fixture(scope="module")
def coffee(efficientnet_dir: Path, coffee_jpeg: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The coffee photo as UINT8 pixels and as normalised FP32 rows, and ONNX Runtime's
    logits for it: what every answer about it is checked against."""
    from app.image_pixels import decode

    pixels = preprocess(decode(coffee_jpeg, 10**8), ImagePreprocess(datatype="UINT8"))[None]
    floats = preprocess(decode(coffee_jpeg, 10**8), ImagePreprocess())[None]
    session = cpu_session(str(efficientnet_dir / "model.onnx"), threads=1)
    (want,) = session.run(None, {"input": floats})
    return pixels, floats, want


def tiny_infer(client: triton.InferenceServerClient, x: np.ndarray, binary: bool) -> np.ndarray:
    tensor = triton.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=binary)
    outputs = [triton.InferRequestedOutput("y", binary_data=binary)]
    result = client.infer("tiny", [tensor], outputs=outputs)
    answer: np.ndarray = result.as_numpy("y")
    return answer


def test_concurrent_requests_each_get_their_own_answer(front_ends: Server) -> None:
    """Far more concurrent requests than slots: a mixed-up slot would answer another
    request's numbers."""
    rng = np.random.default_rng(5)
    inputs = [
        rng.standard_normal((int(rng.integers(1, 16)), 4)).astype(np.float32) for _ in range(96)
    ]

    def one(i: int) -> np.ndarray:
        client = triton.InferenceServerClient(front_ends.address)
        try:
            return tiny_infer(client, inputs[i], binary=i % 2 == 0)
        finally:
            client.close()

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, range(len(inputs))))
    for x, y in zip(inputs, answers, strict=True):
        np.testing.assert_allclose(y, x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5, atol=1e-5)


def test_bodies_in_a_slot_and_over_the_socket_answer_alike(
    front_ends: Server, coffee: tuple[np.ndarray, np.ndarray, np.ndarray]
) -> None:
    """A UINT8 image (150 KB, in a slot) and the same image in FP32 (602 KB, too big for a
    slot: over the control socket) give what ONNX Runtime gives."""
    pixels, floats, want = coffee
    client = triton.InferenceServerClient(front_ends.address)
    try:
        got = {}
        for name, value, datatype in (("uint8", pixels, "UINT8"), ("fp32", floats, "FP32")):
            tensor = triton.InferInput("input", list(value.shape), datatype)
            tensor.set_data_from_numpy(value, binary_data=True)
            result = client.infer("efficientnet_lite0", [tensor])
            got[name] = result.as_numpy("logits")
    finally:
        client.close()
    for name in got:
        np.testing.assert_allclose(got[name], want, rtol=1e-3, atol=1e-3, err_msg=name)
        assert int(np.argmax(got[name])) == ESPRESSO


def test_more_images_than_the_arena_holds_each_get_their_own_answer(
    front_ends: Server, efficientnet_dir: Path
) -> None:
    """Twelve different UINT8 images at once: three fit a front end's arena, the rest wait
    for its pages as the first are answered (back-pressure, not the socket); each answer is
    ONNX Runtime's for its own image, and none was refused for a full arena."""
    refused = ("stoker_http_refusals_total", (("reason", "arena_full"), ("status", "503")))
    before = metric_samples(front_ends).get(refused, 0.0)
    rng = np.random.default_rng(11)
    images = [rng.integers(0, 256, (1, 3, 224, 224), dtype=np.uint8) for _ in range(12)]
    session = cpu_session(str(efficientnet_dir / "model.onnx"), threads=1)

    def one(i: int) -> np.ndarray:
        client = triton.InferenceServerClient(front_ends.address, network_timeout=120)
        try:
            tensor = triton.InferInput("input", [1, 3, 224, 224], "UINT8")
            tensor.set_data_from_numpy(images[i], binary_data=True)
            answer: np.ndarray = client.infer("efficientnet_lite0", [tensor]).as_numpy("logits")
            return answer
        finally:
            client.close()

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(one, range(12)))
    for image, got in zip(images, answers, strict=True):
        floats = normalize(image, ImagePreprocess(), np.dtype(np.float32))
        (want,) = session.run(None, {"input": floats})
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
    assert metric_samples(front_ends).get(refused, 0.0) == before


def test_json_and_classification_answers_are_encoded_by_the_front_end(
    front_ends: Server, coffee: tuple[np.ndarray, np.ndarray, np.ndarray]
) -> None:
    """A JSON request asking for the top 3 classes in JSON and the logits in binary: what
    the engine sent back as tensors, encoded in the front end as V2 says."""
    pixels, _, want = coffee
    client = triton.InferenceServerClient(front_ends.address)
    try:
        tensor = triton.InferInput("input", list(pixels.shape), "UINT8")
        tensor.set_data_from_numpy(pixels, binary_data=False)
        outputs = [
            triton.InferRequestedOutput("logits", binary_data=False, class_count=3),
        ]
        top = client.infer("efficientnet_lite0", [tensor], outputs=outputs).as_numpy("logits")
        raw = client.infer(
            "efficientnet_lite0",
            [tensor],
            outputs=[triton.InferRequestedOutput("logits", binary_data=True)],
        ).as_numpy("logits")
    finally:
        client.close()
    order = np.argsort(-want[0])[:3]
    entries = [entry.decode() if isinstance(entry, bytes) else entry for entry in top[0]]
    assert [int(entry.split(":")[1]) for entry in entries] == [int(i) for i in order]
    assert entries[0].split(":")[2] == "espresso"
    np.testing.assert_allclose(raw, want, rtol=1e-3, atol=1e-3)


def test_a_request_a_front_end_refuses_is_counted_by_the_engine(front_ends: Server) -> None:
    key = (
        "stoker_inference_request_failure_total",
        (("model", "tiny"), ("reason", "invalid"), ("version", "fp32")),
    )
    before = metric_samples(front_ends).get(key, 0.0)
    for _ in range(3):
        bad = httpx.post(
            f"{front_ends.url}/v2/models/tiny/infer",
            json={"inputs": [{"name": "x", "datatype": "INT8", "shape": [1, 4], "data": [1] * 4}]},
        )
        assert bad.status_code == 400 and "datatype INT8" in bad.json()["error"]
    deadline = time.monotonic() + 60
    while metric_samples(front_ends).get(key, 0.0) - before < 3:
        assert time.monotonic() < deadline, "the front end's refusals never reached /metrics"
        time.sleep(0.1)
    time.sleep(0.6)  # counted once, not again at the next poll
    assert metric_samples(front_ends)[key] - before == 3


def test_uploads_errors_and_metadata_come_from_the_engine(
    front_ends: Server, coffee_jpeg: bytes
) -> None:
    upload = httpx.post(
        f"{front_ends.url}/infer", files={"image": ("coffee.jpg", coffee_jpeg, "image/jpeg")}
    )
    assert upload.status_code == 200, upload.text
    assert upload.json()["predictions"][0][0]["label"] == "espresso"
    unknown = httpx.post(f"{front_ends.url}/v2/models/nope/infer", json={"inputs": []})
    assert unknown.status_code == 404 and unknown.json() == {"error": "unknown model 'nope'"}
    bad = httpx.post(
        f"{front_ends.url}/v2/models/tiny/infer",
        json={"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 5], "data": [0] * 5}]},
    )
    assert bad.status_code == 400 and "does not match" in bad.json()["error"]
    metadata = httpx.get(f"{front_ends.url}/v2/models/tiny").json()
    assert metadata["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
    assert httpx.get(f"{front_ends.url}/v2/models/tiny/ready").json()["ready"] is True
    assert httpx.get(f"{front_ends.url}/v2/health/live").status_code == 200


def decoded_where(server: Server) -> dict[str, float]:
    """The efficientnet model's decoded images by decoder label (``pillow``: in the engine,
    ``pillow_front_ends``: made rows by the front ends)."""
    found = {}
    for (name, labels), value in metric_samples(server).items():
        named = dict(labels)
        if name == "stoker_image_decode_total" and named["model"] == "efficientnet_lite0":
            found[named["decoder"]] = value
    return found


def settled(server: Server, key: tuple[str, tuple[tuple[str, str], ...]]) -> float:
    """A sample of /metrics once what earlier requests timed has come in with the front ends'
    polls (every 0.25 s): the same in two reads a second apart, within 60 s."""
    deadline = time.monotonic() + 60
    last = metric_samples(server).get(key, 0.0)
    while True:
        time.sleep(1.0)
        now = metric_samples(server).get(key, 0.0)
        if now == last:
            return now
        assert time.monotonic() < deadline, f"{key[0]} never settled"
        last = now


def test_uploads_are_made_rows_in_the_front_ends_on_a_cpu_machine(
    front_ends: Server,
    coffee_jpeg: bytes,
    astronaut_png: bytes,
    coffee: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> None:
    """No GPU decoder: the front ends decode, resize and crop the uploads and the engine only
    runs the rows. The answer is ONNX Runtime's on the CPU path's rows, the images are counted
    as the front ends', the request is timed once, and a broken JPEG is refused there (400)
    and counted once."""
    labels = (("model", "efficientnet_lite0"), ("version", "fp32"))
    timed = ("stoker_inference_request_duration_seconds_count", labels)
    before = decoded_where(front_ends)
    timed_before = settled(front_ends, timed)
    files = [
        ("image", ("a.jpg", coffee_jpeg, "image/jpeg")),
        ("image", ("b.png", astronaut_png, "image/png")),
    ]
    answer = httpx.post(f"{front_ends.url}/infer?k=3", files=files, timeout=60)
    assert answer.status_code == 200, answer.text
    coffee_top, astronaut_top = answer.json()["predictions"]
    logits = coffee[2][0].astype(np.float64)
    softmax = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    assert [p["index"] for p in coffee_top] == list(np.argsort(-softmax)[:3])
    assert coffee_top[0]["probability"] == pytest.approx(softmax.max(), abs=1e-4)
    assert len(astronaut_top) == 3
    after = decoded_where(front_ends)
    assert after["pillow_front_ends"] - before["pillow_front_ends"] == 2
    assert after["pillow"] == before["pillow"]
    failed = (
        "stoker_inference_request_failure_total",
        (("model", "efficientnet_lite0"), ("reason", "invalid"), ("version", "fp32")),
    )
    refused = metric_samples(front_ends).get(failed, 0.0)
    broken = httpx.post(
        f"{front_ends.url}/infer", content=coffee_jpeg[:600], headers={"Content-Type": "image/jpeg"}
    )
    assert broken.status_code == 400 and "cannot decode image" in broken.json()["error"]
    deadline = time.monotonic() + 60
    while (
        metric_samples(front_ends).get(failed, 0.0) - refused < 1
        or metric_samples(front_ends).get(timed, 0.0) - timed_before < 1
    ):
        assert time.monotonic() < deadline, "the refusal or the timing never reached /metrics"
        time.sleep(0.1)
    time.sleep(0.6)  # counted once, not again at the next poll
    after_all = metric_samples(front_ends)
    assert after_all[failed] - refused == 1
    assert after_all[timed] - timed_before == 1


def test_with_front_end_decoding_off_the_engine_decodes_the_files(
    tmp_path: Path, efficientnet_dir: Path, front_ends: Server, coffee_jpeg: bytes
) -> None:
    """``uploads.decode_in_front_ends`` false: the files cross and the engine decodes
    them, to the answer the rows a front end makes get (the front_ends fixture's)."""
    repo = tmp_path / "repository"
    shutil.copytree(efficientnet_dir, repo / "efficientnet_lite0")
    configure(repo / "efficientnet_lite0", {"precisions": ["fp32"]})
    env = front_end_env(STOKER_UPLOADS__DECODE_IN_FRONT_ENDS="false")
    server = start_server(repo, tmp_path / "server.log", env)
    jpeg = {"Content-Type": "image/jpeg"}
    try:
        answer = httpx.post(f"{server.url}/infer", content=coffee_jpeg, headers=jpeg)
        assert answer.status_code == 200, answer.text
        decoded = decoded_where(server)
        assert (decoded["pillow"], decoded["pillow_front_ends"]) == (1, 0)
    finally:
        assert stop_server(server) == 0
    made_rows = httpx.post(f"{front_ends.url}/infer", content=coffee_jpeg, headers=jpeg)
    engine_top, rows_top = answer.json()["predictions"][0], made_rows.json()["predictions"][0]
    assert [p["index"] for p in engine_top] == [p["index"] for p in rows_top]
    for engine, rows in zip(engine_top, rows_top, strict=True):
        assert engine["probability"] == pytest.approx(rows["probability"], abs=1e-6)


def test_concurrent_uploads_through_front_ends_fail_alone(
    front_ends: Server, coffee_jpeg: bytes
) -> None:
    """Uploads sent at once reach the engine gathered (one call per front end and loop turn);
    each answer is its own: the non-image is that request's 400, the others espresso."""

    async def many() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=front_ends.url, timeout=60) as client:
            bodies = [coffee_jpeg if i % 5 else b"GIF89a" + bytes(2) for i in range(40)]
            return await asyncio.gather(
                *(
                    client.post("/infer", content=body, headers={"Content-Type": "image/jpeg"})
                    for body in bodies
                )
            )

    responses = asyncio.run(many())
    for i, response in enumerate(responses):
        if i % 5:
            assert response.status_code == 200, response.text
            assert response.json()["predictions"][0][0]["label"] == "espresso"
        else:
            assert response.status_code == 400, response.text
            assert "cannot decode image" in response.json()["error"]


def test_metrics_keep_one_set_of_totals_across_front_ends(front_ends: Server) -> None:
    key = ("stoker_inference_request_success_total", (("model", "tiny"), ("version", "fp32")))
    time.sleep(0.6)  # what earlier tests' requests left in a front end reaches the engine
    first = metric_samples(front_ends)
    before = first.get(key, 0.0)
    durations_before = first.get(("stoker_inference_request_duration_seconds_count", key[1]), 0.0)
    sum_before = first.get(("stoker_inference_request_duration_seconds_sum", key[1]), 0.0)
    client = triton.InferenceServerClient(front_ends.address)
    try:
        for _ in range(40):  # new connections land on either front end
            tiny_infer(client, np.ones((1, 4), np.float32), binary=True)
    finally:
        client.close()
    # Scraped through several connections, hence several front ends: the same totals.
    seen = {metric_samples(front_ends)[key] - before for _ in range(6)}
    assert seen == {40.0}
    # Their durations, timed in the front ends, reach the engine's histogram with the poll.
    timed = ("stoker_inference_request_duration_seconds_count", key[1])
    deadline = time.monotonic() + 60
    while metric_samples(front_ends).get(timed, 0.0) - durations_before < 40:
        assert time.monotonic() < deadline, "the front ends' durations never reached /metrics"
        time.sleep(0.1)
    time.sleep(0.6)  # and once only
    samples = metric_samples(front_ends)
    assert samples[timed] - durations_before == 40
    total = ("stoker_inference_request_duration_seconds_sum", key[1])
    assert 0 < samples[total] - sum_before < 40 * 5.0


def front_end_pids(log: Path) -> list[int]:
    return [int(p) for p in re.findall(r"front end \d+ started \(pid (\d+)\)", log.read_text())]


def test_a_killed_front_end_is_replaced_and_the_other_keeps_serving(front_ends: Server) -> None:
    pids = front_end_pids(front_ends.log)
    assert len(pids) == 2
    os.kill(pids[0], signal.SIGKILL)
    ok = 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(front_end_pids(front_ends.log)) < 3:
        try:  # a fresh connection each time: the survivor or the replacement answers
            response = httpx.post(
                f"{front_ends.url}/v2/models/tiny/infer",
                json={
                    "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1] * 4}]
                },
            )
            ok += response.status_code == 200
        except httpx.TransportError:
            pass  # a connection the killed process had accepted
        time.sleep(0.05)
    assert len(front_end_pids(front_ends.log)) == 3, front_ends.log.read_text()[-2000:]
    assert ok > 0
    assert "front end 0 ended (exit code -9): restarting it" in front_ends.log.read_text()
    deadline = time.monotonic() + 30
    while httpx.get(f"{front_ends.url}/v2/health/ready").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)


SLOW_CONFIG = """\
max_batch_size: 64
runners: 1
dynamic_batching:
  max_queue_delay_us: 0
  default_timeout_us: 60000000
"""


def wait_pending(url: str, at_least: int, model: str = "slow") -> None:
    """Until the engine counts ``at_least`` requests of ``model`` queued or running (its
    pending gauge, through /metrics), for at most 60 s."""
    deadline = time.monotonic() + 60
    pending = 0.0
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        pending = sum(
            sample.value
            for family in text_string_to_metric_families(text)
            if family.name == "stoker_inference_pending_request_count"
            for sample in family.samples
            if sample.labels.get("model") == model
        )
        if pending >= at_least:
            return
        time.sleep(0.02)
    raise AssertionError(f"only {pending} of {at_least} requests pending after 60 s")


def test_sigterm_drains_every_process_and_loses_nothing(tmp_path: Path) -> None:
    server = serve_one_model(tmp_path, "slow", slow_onnx(512, 16), SLOW_CONFIG, front_end_env())
    url = f"{server.url}/v2/models/slow/infer"

    def body(value: float, m: int) -> dict[str, object]:
        return {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, m, 1], "data": [value] * m}]
        }

    try:
        started = time.perf_counter()
        httpx.post(url, json=body(1.0, 2048), timeout=60).raise_for_status()
        blocker = max(2048, int(2048 * 3.0 / (time.perf_counter() - started)))

        def send(i: int) -> httpx.Response:
            m = blocker if i == 0 else 1
            return httpx.post(url, json=body(float(i), m), timeout=60)

        with ThreadPoolExecutor(41) as pool:
            futures = [pool.submit(send, 0)]
            wait_pending(server.url, 1)  # the blocker holds the only runner
            futures += [pool.submit(send, i) for i in range(1, 41)]
            wait_pending(server.url, 41)  # the small ones are accepted and queued
            server.process.send_signal(signal.SIGTERM)
            responses = [f.result() for f in futures]
        assert [r.status_code for r in responses] == [200] * 41
        for i, response in enumerate(responses[1:], start=1):
            assert response.json()["outputs"][0]["data"][0] == pytest.approx(i * 512)
        assert server.process.wait(timeout=60) == 0
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


def test_the_supervisor_stops_when_the_engine_dies(tmp_path: Path) -> None:
    server = serve_one_model(tmp_path, "tiny", tiny_onnx(), TINY_CONFIG, front_end_env())
    try:
        engine = int(re.findall(r"engine process started \(pid (\d+)\)", server.log.read_text())[0])
        os.kill(engine, signal.SIGKILL)
        assert server.process.wait(timeout=60) == 1
        assert "the engine process ended (exit code -9): stopping" in server.log.read_text()
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


def test_a_megabyte_answer_crosses_and_the_front_end_stays(
    front_ends: Server, coffee_jpeg: bytes
) -> None:
    """16 images with k=1000: the labels come to more than a megabyte, which travels as the
    frame's payload (a descriptor that big would have been a broken channel)."""
    files = [("image", (f"{i}.jpg", coffee_jpeg, "image/jpeg")) for i in range(16)]
    answer = httpx.post(f"{front_ends.url}/infer?k=1000", files=files, timeout=60)
    assert answer.status_code == 200, answer.text[:300]
    predictions = answer.json()["predictions"]
    assert len(predictions) == 16 and all(len(p) == 1000 for p in predictions)
    assert len(answer.content) > 1 << 20
    for _ in range(6):  # every front end still serves
        assert httpx.get(f"{front_ends.url}/v2/health/ready").status_code == 200


def test_a_front_ends_refusals_reach_the_engines_metrics(front_ends: Server) -> None:
    host, port = front_ends.address.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        fields = b"".join(b"X-%d: 1\r\n" % i for i in range(150))
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n" + fields + b"\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 431 ")
    key = ("stoker_http_refusals_total", (("reason", "header_count"), ("status", "431")))
    deadline = time.monotonic() + 60
    while metric_samples(front_ends).get(key, 0) < 1:
        assert time.monotonic() < deadline, "the refusal never reached /metrics"
        time.sleep(0.1)


def test_a_killed_supervisor_leaves_no_server_behind(tmp_path: Path) -> None:
    """SIGKILL to the supervisor (an OOM kill): the engine and the front ends get SIGTERM
    from the kernel, drain and exit; the port is free again."""
    server = serve_one_model(tmp_path, "tiny", tiny_onnx(), TINY_CONFIG, front_end_env())
    log = server.log.read_text()
    children = front_end_pids(server.log)
    children.append(int(re.findall(r"engine process started \(pid (\d+)\)", log)[0]))
    server.process.kill()
    server.process.wait()
    deadline = time.monotonic() + 30
    alive = children
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [pid for pid in children if Path(f"/proc/{pid}").exists()]
    assert alive == [], f"still running: {alive}"
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/v2/health/live", timeout=2)


def test_front_ends_that_cannot_start_stop_the_server(tmp_path: Path) -> None:
    """A front end failing at its start (here its gRPC port is taken by another program)
    fails in every front end: the supervisor restarts it a few times, then exits 1 saying so,
    rather than restarting it for ever behind a server that never turns ready."""
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        env = front_end_env(STOKER_SERVER__GRPC_PORT=str(holder.getsockname()[1]))
        tiny_model(tmp_path / "repo" / "tiny")
        server = launch_server(tmp_path / "repo", tmp_path / "server.log", env)
        try:
            assert server.process.wait(timeout=120) == 1
            assert "times in a row soon after its start" in server.log.read_text()
        finally:
            if server.process.poll() is None:
                server.process.kill()
                server.process.wait()
    finally:
        holder.close()


def test_one_address_holding_declared_bodies_leaves_the_arena_to_others(
    front_ends: Server,
) -> None:
    """Twelve connections from 127.0.0.1 declare a slot-sized body and send one byte: each
    front end lends one address at most its share of its arena (0.75 of two slots), so its
    holders past the first wait for that address's own pages, and requests from 127.0.0.2
    are served at once on whichever front end they reach (before, a front end's arena
    filled and they waited for arena_wait_s, then 503)."""
    import socket

    holders = []
    head = (
        "POST /v2/models/tiny/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        "Content-Type: application/octet-stream\r\nInference-Header-Content-Length: 10\r\n"
        f"Content-Length: {SLOT_BYTES}\r\n\r\n{{"
    ).encode()
    try:
        for _ in range(12):
            host, port = front_ends.address.split(":")
            holder = socket.create_connection((host, int(port)), timeout=10)
            holder.sendall(head)
            holders.append(holder)
        transport = httpx.HTTPTransport(local_address="127.0.0.2")
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": ONES}]}
        for _ in range(10):  # new connections: both front ends
            with httpx.Client(transport=transport, timeout=30) as client:
                started = time.monotonic()
                answer = client.post(f"{front_ends.url}/v2/models/tiny/infer", json=body)
                assert answer.status_code == 200, answer.text
                assert time.monotonic() - started < 4.0  # not after a wait for pages
    finally:
        for holder in holders:
            holder.close()
