"""One engine process per GPU behind the same front ends (``server.engine_gpus``), for real:
``stoker serve`` with two front ends and two engine processes on a free port. On a machine
without GPUs both engines run ONNX Runtime on the CPU; what is tested is the placement, not
the devices: each request goes to a ready engine, the metrics say which engine answered, and
an engine that dies leaves the other serving until the supervisor has it back.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import httpx
import numpy as np
import pytest

from tests.conftest import TINY_BIAS, TINY_CONFIG, TINY_WEIGHTS, tiny_onnx
from tests.integration.conftest import Server, metric_samples, serve_one_model, stop_server


@pytest.fixture(scope="module")
def two_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {"STOKER_SERVER__FRONT_ENDS": "2", "STOKER_SERVER__ENGINE_GPUS": "[0, 1]"}
    server = serve_one_model(
        tmp_path_factory.mktemp("engines"), "tiny", tiny_onnx(), TINY_CONFIG, env
    )
    yield server
    code = stop_server(server)
    assert code == 0, f"exit {code}:\n{server.log.read_text()[-3000:]}"


def infer(server: Server, x: np.ndarray) -> httpx.Response:
    tensor = {"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}
    return httpx.post(f"{server.url}/v2/models/tiny/infer", json={"inputs": [tensor]}, timeout=30)


def burst(server: Server, count: int, clients: int = 16) -> list[int]:
    """``count`` requests from ``clients`` threads; each answer checked against numpy."""

    def one(i: int) -> int:
        x = np.full((1 + i % 3, 4), float(i % 7), np.float32)
        response = infer(server, x)
        if response.status_code == 200:
            got = np.array(response.json()["outputs"][0]["data"], np.float32).reshape(-1, 3)
            np.testing.assert_allclose(got, x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5, atol=1e-5)
        return response.status_code

    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(one, range(count)))


def answered_by(
    server: Server, metric: str = "stoker_inference_request_success_total"
) -> dict[str, float]:
    """Per engine, the sum of a metric's samples in the merged ``/metrics``."""
    counts: dict[str, float] = {}
    for (name, labels), value in metric_samples(server).items():
        if name == metric:
            gpu = dict(labels)["gpu"]
            counts[gpu] = counts.get(gpu, 0.0) + value
    return counts


def readiness(server: Server) -> tuple[int, dict[str, bool]]:
    response = httpx.get(f"{server.url}/v2/health/ready")
    engines = response.json().get("engines", [])
    return response.status_code, {str(e["gpu"]): bool(e["ready"]) for e in engines}


def wait_for(condition: object, what: str, server: Server, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what}:\n{server.log.read_text()[-3000:]}"
        time.sleep(0.1)


def back_in_every_front_end(server: Server, gpu: int, since: int, front_ends: int = 2) -> bool:
    """Whether every front end has logged, after the log's first ``since`` characters, that
    the engine for ``gpu`` is back: readiness answers from one front end, and the other may
    still be reconnecting (a request it takes then is a 503)."""
    text = server.log.read_text()[since:]
    found = re.findall(rf"(front-end-\d+) \S+: the engine process for GPU {gpu} is back", text)
    return len(set(found)) >= front_ends


def engine_pid(server: Server, gpu: int) -> int:
    found = re.findall(
        rf"engine process for GPU {gpu} started \(pid (\d+)\)", server.log.read_text()
    )
    return int(found[-1])


def test_requests_spread_over_both_engines_and_metrics_say_which(two_engines: Server) -> None:
    assert readiness(two_engines) == (200, {"0": True, "1": True})
    before = answered_by(two_engines)
    assert burst(two_engines, 300) == [200] * 300
    after = answered_by(two_engines)
    served = {gpu: after.get(gpu, 0.0) - before.get(gpu, 0.0) for gpu in ("0", "1")}
    assert sum(served.values()) == 300  # every request counted once, by the engine it ran on
    assert served["0"] > 0 and served["1"] > 0, served
    # The front ends time each request and send its duration to the engine that served it
    # with their next poll (every 0.25 s): each engine's histogram holds its own requests.
    durations = "stoker_inference_request_duration_seconds_count"
    wait_for(
        lambda: answered_by(two_engines, durations) == answered_by(two_engines),
        "each engine's request durations should count its own requests",
        two_engines,
    )
    # The V2 statistics add both engines' shares up: every request this module sent so far.
    stats = httpx.get(f"{two_engines.url}/v2/models/tiny/stats").json()["model_stats"]
    assert sum(e["inference_stats"]["success"]["count"] for e in stats) == sum(after.values())
    text = httpx.get(f"{two_engines.url}/metrics").text
    # One family, both engines' samples in it.
    assert text.count("# TYPE stoker_inference_request_success_total counter") == 1


def test_a_dead_engine_leaves_the_other_serving_until_it_is_back(two_engines: Server) -> None:
    os.kill(engine_pid(two_engines, 1), signal.SIGKILL)
    wait_for(lambda: readiness(two_engines) == (200, {"0": True, "1": False}),
             "readiness should name the dead engine", two_engines)  # fmt: skip
    assert burst(two_engines, 100) == [200] * 100  # all of them on the engine left
    assert "the engine process for GPU 1 ended (exit code -9)" in two_engines.log.read_text()
    wait_for(lambda: readiness(two_engines) == (200, {"0": True, "1": True}),
             "the restarted engine should be ready again", two_engines)  # fmt: skip
    before = answered_by(two_engines).get("1", 0.0)
    assert burst(two_engines, 300) == [200] * 300
    assert answered_by(two_engines).get("1", 0.0) > before  # the new engine serves again


def test_an_engine_that_comes_back_holds_the_clients_shared_memory(two_engines: Server) -> None:
    """A system shared-memory region registered with both engines; engine 1 is killed and
    comes back without it, and copies it from engine 0. Then engine 0 is killed: requests
    naming the region, all on engine 1 now, still find it."""
    import tritonclient.http as triton
    import tritonclient.utils.shared_memory as shm

    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    region = shm.create_shared_memory_region("engines-in", "/stoker_engines_in", 4096)
    client = triton.InferenceServerClient(two_engines.address)
    try:
        shm.set_shared_memory_region(region, [x])
        client.register_system_shared_memory("engines-in", "/stoker_engines_in", 4096)
        for gpu in (1, 0):
            since = len(two_engines.log.read_text())
            os.kill(engine_pid(two_engines, gpu), signal.SIGKILL)
            out = {str(gpu): False, str(1 - gpu): True}
            wait_for(lambda out=out: readiness(two_engines)[1] == out,
                     f"engine {gpu} should be out", two_engines)  # fmt: skip
            tensor = triton.InferInput("x", [2, 4], "FP32")
            tensor.set_shared_memory("engines-in", x.nbytes)
            for _ in range(5):  # every request on the engine left
                y = client.infer("tiny", [tensor]).as_numpy("y")
                np.testing.assert_allclose(y, x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5, atol=1e-5)
            wait_for(lambda: readiness(two_engines)[1] == {"0": True, "1": True},
                     f"engine {gpu} should be back", two_engines)  # fmt: skip
            wait_for(partial(back_in_every_front_end, two_engines, gpu, since),
                     f"every front end should have engine {gpu} back", two_engines)  # fmt: skip
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(region)
