"""End to end against a real uvicorn server: KServe V2 with real clients, /infer with a
real photo, batching read from /metrics, and errors that never break the server."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as triton
from PIL import Image

from app.image_pixels import decode
from engines.preprocess import ImagePreprocess, preprocess
from tests.integration.conftest import BODY_LIMIT, Server, metric_samples

ESPRESSO = 967


def image_row(jpeg: bytes) -> np.ndarray:
    return preprocess(decode(jpeg, 10**8), ImagePreprocess())


def reference(model: Path, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    result: list[np.ndarray] = session.run(None, inputs)
    return result


def test_health_and_server_metadata(server: Server) -> None:
    assert httpx.get(f"{server.url}/v2/health/live").json() == {"live": True}
    assert httpx.get(f"{server.url}/v2/health/ready").json() == {"ready": True}
    meta = httpx.get(f"{server.url}/v2").json()
    assert meta["name"] == "stoker" and "binary_tensor_data" in meta["extensions"]


def test_model_metadata_reads_the_onnx_contract(server: Server) -> None:
    meta = httpx.get(f"{server.url}/v2/models/efficientnet_lite0").json()
    assert meta["versions"] == ["fp32", "fp16", "int8"]
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 224, 224]}]
    assert meta["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 1000]}]
    versioned = httpx.get(f"{server.url}/v2/models/tiny/versions/fp32").json()
    assert [o["name"] for o in versioned["outputs"]] == ["y", "s"]
    ready = httpx.get(f"{server.url}/v2/models/tiny/versions/fp32/ready")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    config = httpx.get(f"{server.url}/v2/models/tiny/config").json()
    assert config["max_batch_size"] == 16 and config["instance_group"][0]["count"] == 2


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_gets_the_numbers_onnxruntime_gives(
    server: Server, repository: Path, binary: bool
) -> None:
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    client = triton.InferenceServerClient(server.address)
    inp = triton.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    outputs = [triton.InferRequestedOutput(n, binary_data=binary) for n in ("y", "s")]
    result = client.infer("tiny", [inp], outputs=outputs, request_id="r-1")
    want_y, want_s = reference(repository / "tiny" / "model.onnx", {"x": x})
    np.testing.assert_allclose(result.as_numpy("y"), want_y, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(result.as_numpy("s"), want_s, rtol=1e-6, atol=1e-6)
    assert result.get_response()["id"] == "r-1"
    assert result.get_response()["model_version"] == "fp32"
    client.close()


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_on_the_default_model_matches_onnxruntime(
    server: Server, repository: Path, coffee_jpeg: bytes, binary: bool
) -> None:
    x = image_row(coffee_jpeg)[None]
    client = triton.InferenceServerClient(server.address)
    inp = triton.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    result = client.infer(
        "efficientnet_lite0",
        [inp],
        model_version="fp32",
        outputs=[triton.InferRequestedOutput("logits", binary_data=binary)],
    )
    (want,) = reference(repository / "efficientnet_lite0" / "model.onnx", {"input": x})
    np.testing.assert_allclose(result.as_numpy("logits"), want, rtol=1e-4, atol=1e-4)
    assert int(np.argmax(result.as_numpy("logits"))) == ESPRESSO
    client.close()


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_uint8_pixels_answer_as_the_normalised_tensor_does(
    server: Server, repository: Path, coffee_jpeg: bytes, binary: bool
) -> None:
    """A model with preprocessing takes its image input as UINT8 pixels too (a quarter of the
    bytes): the answer is the one the FP32 tensor of the same photo gets. Pixel and FP32
    requests sent at once never share a batch (that would mix dtypes)."""
    pixels = preprocess(decode(coffee_jpeg, 10**8), ImagePreprocess(datatype="UINT8"))[None]
    (want,) = reference(
        repository / "efficientnet_lite0" / "model.onnx", {"input": image_row(coffee_jpeg)[None]}
    )

    def infer(x: np.ndarray, datatype: str) -> np.ndarray:
        client = triton.InferenceServerClient(server.address)
        inp = triton.InferInput("input", list(x.shape), datatype)
        inp.set_data_from_numpy(x, binary_data=binary)
        out = triton.InferRequestedOutput("logits", binary_data=binary)
        result = client.infer("efficientnet_lite0", [inp], model_version="fp32", outputs=[out])
        client.close()
        logits: np.ndarray = result.as_numpy("logits")
        return logits

    async def mixed() -> list[np.ndarray]:
        calls = [
            asyncio.to_thread(infer, pixels, "UINT8")
            if i % 2
            else asyncio.to_thread(infer, image_row(coffee_jpeg)[None], "FP32")
            for i in range(8)
        ]
        return list(await asyncio.gather(*calls))

    for got in asyncio.run(mixed()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    wrong = httpx.post(
        f"{server.url}/v2/models/tiny/infer",
        json={"inputs": [{"name": "x", "shape": [1, 4], "datatype": "UINT8", "data": [1] * 4}]},
    )
    assert wrong.status_code == 400
    assert wrong.json() == {"error": "input 'x': datatype UINT8, the model takes FP32"}


def test_classification_extension_names_the_label(server: Server, coffee_jpeg: bytes) -> None:
    x = image_row(coffee_jpeg)[None]
    client = triton.InferenceServerClient(server.address)
    inp = triton.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    result = client.infer(
        "efficientnet_lite0",
        [inp],
        outputs=[triton.InferRequestedOutput("logits", binary_data=True, class_count=3)],
    )
    top = result.as_numpy("logits")
    assert top.shape == (1, 3)
    _score, index, label = top[0, 0].decode().split(":", 2)
    assert (int(index), label) == (ESPRESSO, "espresso")
    client.close()


def test_infer_upload_answers_espresso(server: Server, coffee_jpeg: bytes) -> None:
    response = httpx.post(
        f"{server.url}/infer", files={"image": ("coffee.jpg", coffee_jpeg, "image/jpeg")}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model_name"] == "efficientnet_lite0"
    (top,) = body["predictions"]
    assert len(top) == 5
    assert top[0]["label"] == "espresso" and top[0]["index"] == ESPRESSO
    assert 0.0 < top[0]["probability"] <= 1.0
    assert [p["probability"] for p in top] == sorted((p["probability"] for p in top), reverse=True)


def test_decoded_uploads_are_counted_by_device(
    server: Server, coffee_jpeg: bytes, astronaut_png: bytes
) -> None:
    """No GPU here: every image is decoded on the CPU (Pillow) and counted there; the gpu series
    exists at zero from the start, and an image that fails to decode is not counted."""

    def key(device: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        decoder = {"gpu": "torchvision", "cpu": "pillow"}[device]
        labels = {"model": "efficientnet_lite0", "version": "fp32", "device": device}
        labels["decoder"] = decoder
        return "stoker_image_decode_total", tuple(sorted(labels.items()))

    before = metric_samples(server)
    files = [
        ("image", ("a.jpg", coffee_jpeg, "image/jpeg")),
        ("image", ("b.png", astronaut_png, "image/png")),
    ]
    assert httpx.post(f"{server.url}/infer", files=files).status_code == 200
    broken = httpx.post(
        f"{server.url}/infer", content=coffee_jpeg[:600], headers={"Content-Type": "image/jpeg"}
    )
    assert broken.status_code == 400 and "cannot decode image" in broken.json()["error"]
    not_image = httpx.post(
        f"{server.url}/infer", content=b"plain text " * 10, headers={"Content-Type": "image/png"}
    )
    assert not_image.status_code == 400
    assert not_image.json() == {
        "error": "cannot decode image: 110 bytes that are not an image format this server "
        "reads (JPEG, PNG, WEBP, BMP, GIF)"
    }
    after = metric_samples(server)
    assert after[key("cpu")] - before.get(key("cpu"), 0.0) == 2
    assert after[key("gpu")] == 0


def test_infer_raw_body_and_several_images(
    server: Server, coffee_jpeg: bytes, astronaut_png: bytes
) -> None:
    raw = httpx.post(
        f"{server.url}/infer?k=2", content=coffee_jpeg, headers={"Content-Type": "image/jpeg"}
    )
    assert raw.status_code == 200
    assert [p["label"] for p in raw.json()["predictions"][0]][:1] == ["espresso"]
    assert len(raw.json()["predictions"][0]) == 2
    several = httpx.post(
        f"{server.url}/v2/models/efficientnet_lite0/classify",
        files=[
            ("image", ("a.png", astronaut_png, "image/png")),
            ("image", ("b.jpg", coffee_jpeg, "image/jpeg")),
        ],
        data={"k": "1"},
    )
    assert several.status_code == 200
    first, second = several.json()["predictions"]
    assert second[0]["label"] == "espresso" and first[0]["label"] != "espresso"


def test_concurrent_requests_are_batched(server: Server, coffee_jpeg: bytes) -> None:
    """64 concurrent single-image requests: the realised mean batch size, read from the
    server's own /metrics, is above 1."""
    labels = (("model", "efficientnet_lite0"), ("version", "fp32"))
    before = metric_samples(server)
    row = image_row(coffee_jpeg)[None]
    body = (
        b'{"inputs":[{"name":"input","datatype":"FP32","shape":[1,3,224,224],'
        b'"parameters":{"binary_data_size":%d}}],'
        b'"outputs":[{"name":"logits","parameters":{"classification":1}}]}' % row.nbytes
    )
    headers = {"Inference-Header-Content-Length": str(len(body))}

    async def fire() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        "/v2/models/efficientnet_lite0/infer",
                        content=body + row.tobytes(),
                        headers=headers,
                    )
                    for _ in range(64)
                )
            )

    responses = asyncio.run(fire())
    assert [r.status_code for r in responses] == [200] * 64
    assert all(b"espresso" in r.content for r in responses)
    after = metric_samples(server)

    def delta(name: str) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    batches = delta("stoker_inference_batch_size_count")
    rows = delta("stoker_inference_batch_size_sum")
    assert rows == 64
    assert delta("stoker_inference_count_total") == 64
    assert delta("stoker_inference_exec_count_total") == batches
    assert delta("stoker_inference_request_success_total") == 64
    assert rows / batches > 1, f"mean batch size {rows / batches}"


def test_errors_are_json_with_the_right_status_and_the_server_keeps_serving(
    server: Server,
) -> None:
    url = server.url
    good = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
    cases: list[tuple[int, httpx.Response]] = [
        (404, httpx.post(f"{url}/v2/models/nope/infer", json=good)),
        (404, httpx.post(f"{url}/v2/models/tiny/versions/int4/infer", json=good)),
        (404, httpx.get(f"{url}/v2/no/such/route")),
        (400, httpx.post(f"{url}/v2/models/tiny/infer", content=b"{not json")),
        (
            400,
            httpx.post(
                f"{url}/v2/models/tiny/infer",
                json={
                    "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 5], "data": [0] * 5}]
                },
            ),
        ),
        (
            400,
            httpx.post(
                f"{url}/v2/models/tiny/infer",
                json={
                    "inputs": [{"name": "x", "datatype": "INT32", "shape": [1, 4], "data": [1] * 4}]
                },
            ),
        ),
        (
            400,
            httpx.post(
                f"{url}/v2/models/tiny/infer",
                json={
                    "inputs": [
                        {"name": "x", "datatype": "FP32", "shape": [17, 4], "data": [0] * 68}
                    ]
                },
            ),
        ),
        (
            400,
            httpx.post(
                f"{url}/infer", content=b"not an image", headers={"Content-Type": "image/jpeg"}
            ),
        ),
        (400, httpx.post(f"{url}/infer", json={"image": "x"})),
        (413, httpx.post(f"{url}/v2/models/tiny/infer", content=b"0" * (BODY_LIMIT + 1))),
    ]
    for status, response in cases:
        assert response.status_code == status, (status, response.request.url, response.text)
        body = response.json()
        assert set(body) == {"error"} and 0 < len(body["error"]) < 300
    ok = httpx.post(f"{url}/v2/models/tiny/infer", json=good)
    assert ok.status_code == 200
    failures = metric_samples(server)
    key = (
        "stoker_inference_request_failure_total",
        (("model", "tiny"), ("reason", "invalid"), ("version", "fp32")),
    )
    assert failures[key] >= 4


def test_deadline_answers_504(server: Server) -> None:
    body = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}],
        "parameters": {"timeout": 1},
    }
    response = httpx.post(f"{server.url}/v2/models/tiny/infer", json=body)
    assert response.status_code == 504 and "deadline" in response.json()["error"]


def test_statistics_extension_counts_what_ran(server: Server) -> None:
    x = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [3, 4], "data": [0.0] * 12}]}
    before = httpx.get(f"{server.url}/v2/models/tiny/stats").json()["model_stats"][0]
    assert httpx.post(f"{server.url}/v2/models/tiny/infer", json=x).status_code == 200
    after = httpx.get(f"{server.url}/v2/models/tiny/stats").json()["model_stats"][0]
    assert after["inference_count"] - before["inference_count"] == 3
    assert (
        after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"]
        == 1
    )
    everything = httpx.get(f"{server.url}/v2/models/stats").json()["model_stats"]
    assert {s["name"] for s in everything} == {"efficientnet_lite0", "tiny"}


def test_png_upload_is_accepted(server: Server) -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (300, 200), (200, 30, 30)).save(buffer, format="PNG")
    response = httpx.post(
        f"{server.url}/infer", content=buffer.getvalue(), headers={"Content-Type": "image/png"}
    )
    assert response.status_code == 200


@pytest.mark.parametrize("version", ["fp16", "int8"])
def test_every_precision_is_a_version_with_its_own_metrics(
    server: Server, coffee_jpeg: bytes, version: str
) -> None:
    x = image_row(coffee_jpeg)[None]
    client = triton.InferenceServerClient(server.address)
    inp = triton.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    fp32 = client.infer("efficientnet_lite0", [inp], model_version="fp32").as_numpy("logits")
    result = client.infer("efficientnet_lite0", [inp], model_version=version)
    assert result.get_response()["model_version"] == version
    logits = result.as_numpy("logits")
    assert int(np.argmax(logits)) == ESPRESSO
    assert not np.array_equal(logits, fp32), "a variant that equals fp32 bit for bit is not one"
    tolerance = 0.05 if version == "fp16" else 1.5
    np.testing.assert_allclose(logits, fp32, atol=tolerance)
    client.close()
    labels = (("model", "efficientnet_lite0"), ("version", version))
    assert metric_samples(server)[("stoker_inference_count_total", labels)] >= 1


def test_the_deadline_counts_from_arrival_so_decoding_spends_it(server: Server) -> None:
    """A 150,000-value JSON tensor with a 100 us deadline: its decoding alone outlasts the
    deadline, so it is answered 504 before it is queued, and no batch runs for it."""
    body = {
        "inputs": [
            {
                "name": "input",
                "datatype": "FP32",
                "shape": [1, 3, 224, 224],
                "data": np.zeros(3 * 224 * 224, dtype=np.float32).tolist(),
            }
        ],
        "parameters": {"timeout": 100},
    }
    key = (
        "stoker_inference_exec_count_total",
        (("model", "efficientnet_lite0"), ("version", "fp32")),
    )
    before = metric_samples(server).get(key, 0.0)
    answer = httpx.post(f"{server.url}/v2/models/efficientnet_lite0/infer", json=body, timeout=30)
    assert answer.status_code == 504
    assert answer.json() == {"error": "deadline of 0.1 ms passed while decoding"}
    assert metric_samples(server).get(key, 0.0) == before


def test_the_infer_path_answers_what_its_route_declares(server: Server) -> None:
    """``POST .../infer`` is answered without FastAPI's router (``InferFastPath``): the
    path is decoded as the router decodes it, and what is not a POST on an infer path still
    gets the router's answers."""
    url = server.url
    good = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
    encoded = httpx.post(f"{url}/v2/models/t%69ny/versions/fp32/infer", json=good)
    assert encoded.status_code == 200 and encoded.json()["model_name"] == "tiny"
    wrong_method = httpx.get(f"{url}/v2/models/tiny/infer")
    assert wrong_method.status_code == 405 and set(wrong_method.json()) == {"error"}
    bad_length = httpx.post(
        f"{url}/v2/models/tiny/infer",
        json=good,
        headers={"Inference-Header-Content-Length": "many"},
    )
    assert bad_length.status_code == 400
    assert bad_length.json() == {"error": "Inference-Header-Content-Length must be an integer"}
    empty_version = httpx.post(f"{url}/v2/models/tiny/versions//infer", json=good)
    assert empty_version.status_code == 404 and set(empty_version.json()) == {"error"}
