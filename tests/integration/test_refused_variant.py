"""A version that misses its accuracy budget is not served, and takes nothing else down.

A real ``stoker serve`` with the tiny model served as fp32 and int8, its int8 budget set so
that no quantized variant can meet it (a mean KL of exactly 0): the server becomes ready,
fp32 answers, int8 answers 503 with the reason on every route, the repository index, model
metadata, ``stoker models`` and ``/metrics`` say so; with ``exit_on_error`` the server stops.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest
import yaml

from tests.conftest import TINY_BIAS, TINY_CONFIG, TINY_WEIGHTS, tiny_onnx
from tests.integration.conftest import Server, metric_samples, start_server, stop_server

MODEL = "tiny"


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("refused")
    folder = repo / MODEL
    folder.mkdir()
    onnx.save(tiny_onnx(), str(folder / "model.onnx"))
    rows = np.random.default_rng(3).standard_normal((48, 4)).astype(np.float32)
    np.save(folder / "rows.npy", rows)
    config = yaml.safe_load(TINY_CONFIG) | {
        "precisions": ["fp32", "int8"],
        "int8": {"calibration": "rows.npy", "samples": 32, "calibrator": "minmax"},
        "accuracy": {
            "evaluation_samples": 16,
            "budgets": {"int8": {"min_top1_agreement": 0.0, "max_mean_kl": 0.0}},
        },
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    # A model that cannot load at all: its ONNX file is missing and nothing generates it.
    broken = repo / "broken"
    broken.mkdir()
    (broken / "config.yaml").write_text(TINY_CONFIG)
    return repo


@pytest.fixture(scope="module")
def served(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("refused-server") / "server.log"
    running = start_server(repository, log)
    yield running
    assert stop_server(running) == 0


def infer(server: Server, version: str | None) -> httpx.Response:
    path = f"/v2/models/{MODEL}" + (f"/versions/{version}" if version else "") + "/infer"
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
    return httpx.post(server.url + path, json=body, timeout=30)


def test_the_other_version_serves_and_the_server_is_ready(served: Server) -> None:
    assert httpx.get(f"{served.url}/v2/health/ready").status_code == 200
    assert httpx.get(f"{served.url}/v2/health/live").status_code == 200
    answer = infer(served, None)
    assert answer.status_code == 200
    y = next(o for o in answer.json()["outputs"] if o["name"] == "y")
    want = np.array([1, 2, 3, 4], dtype=np.float32) @ TINY_WEIGHTS + TINY_BIAS
    np.testing.assert_allclose(y["data"], want, rtol=1e-5)
    assert infer(served, "fp32").status_code == 200


def test_the_refused_version_answers_503_with_its_reason(served: Server) -> None:
    for answer in (
        infer(served, "int8"),
        httpx.get(f"{served.url}/v2/models/{MODEL}/versions/int8/ready"),
        httpx.get(f"{served.url}/v2/models/{MODEL}/versions/int8"),
    ):
        assert answer.status_code == 503
        assert set(answer.json()) == {"error"}
        message = answer.json()["error"]
        assert "int8" in message and "misses its accuracy budget" in message
        assert "mean KL" in message


def test_metadata_index_and_metrics_name_the_refusal(served: Server) -> None:
    metadata = httpx.get(f"{served.url}/v2/models/{MODEL}").json()
    assert metadata["versions"] == ["fp32"]
    (unavailable,) = metadata["unavailable_versions"]
    assert unavailable["version"] == "int8" and "accuracy budget" in unavailable["reason"]

    index = httpx.post(f"{served.url}/v2/repository/index").json()
    states = {item["version"]: item for item in index if item["name"] == MODEL}
    assert states["fp32"]["state"] == "READY" and "reason" not in states["fp32"]
    assert states["int8"]["state"] == "UNAVAILABLE"
    assert "accuracy budget" in states["int8"]["reason"]

    samples = metric_samples(served)
    key = (
        "stoker_model_unavailable",
        (("model", MODEL), ("reason", "accuracy"), ("version", "int8")),
    )
    assert samples[key] == 1
    assert not any(
        name == "stoker_model_unavailable"
        and ("model", MODEL) in labels
        and ("version", "fp32") in labels
        for name, labels in samples
    )


def test_a_model_that_cannot_load_is_unavailable_with_the_reason(served: Server) -> None:
    answer = httpx.post(
        f"{served.url}/v2/models/broken/infer",
        json={"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [0] * 4}]},
    )
    assert answer.status_code == 503
    assert "model.onnx does not exist" in answer.json()["error"]
    index = httpx.post(f"{served.url}/v2/repository/index").json()
    (item,) = [i for i in index if i["name"] == "broken"]
    assert item["state"] == "UNAVAILABLE" and "does not exist" in item["reason"]
    key = (
        "stoker_model_unavailable",
        (("model", "broken"), ("reason", "load"), ("version", "fp32")),
    )
    assert metric_samples(served)[key] == 1
    assert httpx.get(f"{served.url}/v2/health/ready").status_code == 200


def test_the_log_says_it_once_before_ready(served: Server) -> None:
    lines = served.log.read_text().splitlines()
    refusals = [i for i, line in enumerate(lines) if "version int8 is NOT served" in line]
    ready = [i for i, line in enumerate(lines) if " ready: " in line]
    assert len(refusals) == 1 and len(ready) == 1
    assert refusals[0] < ready[0]
    assert "NOT served: broken[fp32], tiny[int8]" in lines[ready[0]]
    assert "Traceback" not in served.log.read_text()


def test_stoker_models_shows_the_refusal(served: Server, repository: Path) -> None:
    store = served.log.parent / "store"
    listing = subprocess.run(
        [sys.executable, "-m", "app", "models", "--repository", str(repository)],
        capture_output=True,
        text=True,
        env={**os.environ, "STOKER_STORE__PATH": str(store)},
        check=True,
    ).stdout
    lines = {line.split()[0]: line for line in listing.splitlines() if line.startswith("  ")}
    assert "source" in lines["fp32"]
    assert "refused:" in lines["int8"] and "mean KL" in lines["int8"]


def test_exit_on_error_keeps_the_old_behaviour(repository: Path, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="server exited with 1"):
        start_server(
            repository,
            tmp_path / "server.log",
            {"STOKER_MODELS__EXIT_ON_ERROR": "1", "STOKER_MODELS__MODELS": f'["{MODEL}"]'},
        )
    assert "misses its accuracy budget" in (tmp_path / "server.log").read_text()


def test_the_default_model_is_the_first_that_serves(served: Server) -> None:
    """``broken`` sorts first but serves nothing: ``/infer`` goes to ``tiny`` (which takes no
    images, so 400 says so), not to a 503 about ``broken``."""
    answer = httpx.post(f"{served.url}/infer", content=b"x", headers={"Content-Type": "image/png"})
    assert answer.status_code == 400
    assert "'tiny' does not take image uploads" in answer.json()["error"]
    assert httpx.get(f"{served.url}/v2/models/broken/stats").status_code == 503
    assert httpx.get(f"{served.url}/v2/models/nope/stats").status_code == 404


def test_a_server_with_nothing_to_serve_stops(repository: Path, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="server exited with 1"):
        start_server(repository, tmp_path / "server.log", {"STOKER_MODELS__MODELS": '["broken"]'})
    assert "no model version could be served: broken[fp32]" in (tmp_path / "server.log").read_text()
