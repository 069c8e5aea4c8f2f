"""Model control with two front ends in front of two engine processes (``server.front_ends``
2, ``server.engine_gpus`` [0, 1]; on the CPU both engines run ONNX Runtime): a load, a reload
with another contract and an unload reach every engine, under load on the model and on
another, with the same answers as in one process (``test_model_control``); the index and
readiness agree across the engines, and every front end learns the new contract."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import TINY_CONFIG, slow_onnx, tiny_onnx
from tests.integration.conftest import Server, start_server, stop_server
from tests.integration.test_model_control import (
    AUTH,
    KEY,
    LAYERS,
    SMALLER,
    WIDTH,
    WORK_CONFIG,
    add_model,
    control_under_load,
    index,
    load,
    unload,
    work_request,
)


@pytest.fixture(scope="module")
def processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    repo = tmp_path_factory.mktemp("control-processes") / "repository"
    add_model(repo, "tiny", tiny_onnx(), TINY_CONFIG)
    add_model(repo, "work", slow_onnx(WIDTH, LAYERS), WORK_CONFIG)
    env = {
        "STOKER_MODELS__CONTROL": "explicit",
        "STOKER_MODELS__STARTUP": '["tiny"]',
        "STOKER_AUTH__API_KEYS": KEY,
        "STOKER_SERVER__FRONT_ENDS": "2",
        "STOKER_SERVER__ENGINE_GPUS": "[0, 1]",
    }
    server = start_server(repo, repo.parent / "server.log", env)
    yield server
    code = stop_server(server)
    assert code == 0, f"exit {code}:\n{server.log.read_text()[-3000:]}"


def test_load_reload_and_unload_under_load_drop_nothing(processes: Server) -> None:
    control_under_load(processes)


def test_every_engine_and_every_front_end_follow_a_load(processes: Server) -> None:
    assert load(processes, "work").status_code == 200
    ready = httpx.get(f"{processes.url}/v2/health/ready").json()
    assert [e["ready"] for e in ready["engines"]] == [True, True], ready
    # Agreed by both engines: no reason naming one of them.
    assert index(processes)[("work", "fp32")] == {
        "name": "work",
        "version": "fp32",
        "state": "READY",
    }
    assert load(processes, "work", SMALLER).status_code == 200
    # Twelve rows fit the old contract (16) and not the new (8): each request on a fresh
    # connection, so both front ends answer some, whichever cached the old contract.
    body, _ = work_request(0, rows=12)
    for _ in range(16):
        with httpx.Client(headers=AUTH, timeout=30) as client:
            refused = client.post(f"{processes.url}/v2/models/work/infer", json=body)
        assert refused.status_code == 400 and "1 to 8" in refused.text, refused.text
    assert unload(processes, "work").status_code == 200
    states = {key: item["state"] for key, item in index(processes).items()}
    assert states == {("tiny", "fp32"): "READY", ("work", "fp32"): "UNAVAILABLE"}
