"""A model that takes no images, as a new user adds one: served as FP32 and FP16, or refused
saying what to provide.

A real ``stoker serve`` in poll mode with the tiny ``[batch, 4]`` model served as fp32 and
fp16 (no preprocess: section, no rows of the user's). Its FP16 variant is checked on rows
made from the input's spec and answers within FP16's rounding of the exact result; a second
model dropped into the repository asks for int8 with no calibration rows, and its int8 is
refused with a reason that says what to give, while its fp32 serves.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest
import yaml

from tests.conftest import TINY_BIAS, TINY_CONFIG, TINY_WEIGHTS, tiny_onnx
from tests.integration.conftest import Server, start_server, stop_server

WAIT_S = 120

# Row values that are not exact in float16 (float16 keeps 11 significant bits), so that an
# FP16 graph's answer differs from float32's.
X = [[0.1, -1.7, 2.3, 0.45], [3.3, 0.2, -0.9, 1.1]]


def write_model(folder: Path, precisions: list[str]) -> None:
    folder.mkdir(parents=True)
    onnx.save(tiny_onnx(), str(folder / "model.onnx"))
    config = yaml.safe_load(TINY_CONFIG) | {"precisions": precisions}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))


@pytest.fixture(scope="module")
def polled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    repo = tmp_path_factory.mktemp("plain") / "repository"
    write_model(repo / "tiny", ["fp32", "fp16"])
    env = {"STOKER_MODELS__CONTROL": "poll", "STOKER_MODELS__POLL_S": "0.2"}
    server = start_server(repo, repo.parent / "server.log", env)
    yield server
    code = stop_server(server)
    assert code == 0, f"exit {code}:\n{server.log.read_text()[-3000:]}"


def infer(server: Server, model: str, version: str) -> httpx.Response:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4], "data": X}]}
    path = f"/v2/models/{model}/versions/{version}/infer"
    return httpx.post(server.url + path, json=body, timeout=30)


def output(response: httpx.Response, name: str) -> np.ndarray:
    assert response.status_code == 200, response.text
    found = next(o for o in response.json()["outputs"] if o["name"] == name)
    return np.array(found["data"], dtype=np.float64).reshape(found["shape"])


def index(server: Server) -> dict[tuple[str, str], dict[str, str]]:
    answer = httpx.post(f"{server.url}/v2/repository/index", timeout=30)
    return {(item["name"], item["version"]): item for item in answer.json()}


def test_fp16_answers_within_fp16s_rounding_of_the_exact_result(polled: Server) -> None:
    want = np.array(X, dtype=np.float64) @ TINY_WEIGHTS.astype(np.float64) + TINY_BIAS
    fp32 = output(infer(polled, "tiny", "fp32"), "y")
    fp16 = output(infer(polled, "tiny", "fp16"), "y")
    np.testing.assert_allclose(fp32, want, rtol=1e-6, atol=1e-6)
    # A 4-term dot product in float16: each of its few roundings is within 2^-11 of the value,
    # so the answer is well within 1% of the output's scale; and it is float16's, not float32's.
    scale = np.abs(want).max()
    assert np.abs(fp16 - want).max() < 1e-2 * scale
    assert np.abs(fp16 - fp32).max() > 1e-6 * scale
    sums = output(infer(polled, "tiny", "fp16"), "s")
    np.testing.assert_allclose(sums[:, 0], np.sum(X, axis=1), rtol=1e-2)


def test_the_load_log_says_nothing_of_pixels_or_jpeg(polled: Server) -> None:
    lines = [line for line in polled.log.read_text().splitlines() if "model tiny version" in line]
    assert len(lines) == 2, lines
    for line in lines:
        assert "no preprocessing" in line and "loaded and warmed" in line
        assert "pixels" not in line and "JPEG" not in line


def test_int8_without_rows_is_refused_saying_what_to_give(polled: Server) -> None:
    repo = polled.log.parent / "repository"
    # Written beside the repository and moved in whole, so the poll never sees half a model.
    write_model(repo.parent / "staging", ["fp32", "int8"])
    os.replace(repo.parent / "staging", repo / "rowless")
    deadline = time.monotonic() + WAIT_S
    while True:
        current = index(polled)
        states = {v: current.get(("rowless", v), {}).get("state") for v in ("fp32", "int8")}
        if states == {"fp32": "READY", "int8": "UNAVAILABLE"}:
            break
        assert time.monotonic() < deadline, f"{states}:\n{polled.log.read_text()[-3000:]}"
        time.sleep(0.2)
    reason = index(polled)[("rowless", "int8")]["reason"]
    assert "takes no images" in reason and "int8.calibration" in reason
    assert "[4] float32 for input 'x'" in reason and str(repo) not in reason
    refused = infer(polled, "rowless", "int8")
    assert refused.status_code == 503 and set(refused.json()) == {"error"}
    assert "int8.calibration" in refused.json()["error"]
    np.testing.assert_allclose(
        output(infer(polled, "rowless", "fp32"), "y"),
        np.array(X) @ TINY_WEIGHTS + TINY_BIAS,
        rtol=1e-5,
    )
    log = polled.log.read_text()
    assert "Traceback" not in log and "Invalid rank" not in log
