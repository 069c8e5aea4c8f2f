"""Model control for real (``models.control``): a ``stoker serve`` subprocess in explicit mode
loads, reloads and unloads a model while clients keep sending requests to it and to another
model, over HTTP, gRPC (tritonclient) and the CLI, with API keys; its memory comes back after
an unload. Poll mode picks up changed, broken, new and removed folders. Mode none refuses.

What is asserted of requests, by the time they were sent: to the other model, every one is
answered 200 with the right numbers; to the model being changed, every one is 200 until its
unload begins, 200 or 503 while it is unloaded, 503 once the unload has returned; never a 500,
never an unanswered request (a client timeout of 30 s counts as one).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bench.launch import free_port
from tests.conftest import TINY_BIAS, TINY_CONFIG, TINY_WEIGHTS, slow_onnx, tiny_onnx
from tests.integration.conftest import Server, metric_samples, start_server, stop_server

KEY = "control-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# The model being changed takes a few ms a request on one runner, so that with ``CLIENTS``
# clients requests queue behind each other whenever a reload switches or an unload begins.
WIDTH, LAYERS, M = 256, 8, 128
CLIENTS = 6
WORK_CONFIG = """\
max_batch_size: 16
dynamic_batching:
  max_queue_delay_us: 1000
  max_queue_size: 512
"""
# The reload's config: a smaller max batch (another contract) and no queue delay.
SMALLER = {"max_batch_size": 8, "dynamic_batching": {"max_queue_delay_us": 0}}
WAIT_S = 120.0


def add_model(repo: Path, name: str, model: onnx.ModelProto, config: str) -> Path:
    folder = repo / name
    folder.mkdir(parents=True)
    onnx.save(model, str(folder / "model.onnx"))
    (folder / "config.yaml").write_text(config)
    return folder


def heavy_onnx(inputs: int = 2048, outputs: int = 8192) -> onnx.ModelProto:
    """y = x @ W with W of 64 MiB: a model whose load shows in the process's RSS."""
    weights = np.random.default_rng(3).standard_normal((inputs, outputs)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "heavy",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", inputs])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", outputs])],
        initializer=[numpy_helper.from_array(weights, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def tiny_request(i: int) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    """A request to the tiny model and the check of its answer, against numpy."""
    x = np.full((1 + i % 3, 4), float(i % 7), np.float32)
    body = {
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}
        ]
    }

    def check(answer: dict[str, Any]) -> None:
        y = np.array(answer["outputs"][0]["data"], np.float32).reshape(-1, 3)
        np.testing.assert_allclose(y, x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5, atol=1e-5)

    return body, check


def work_request(
    i: int, rows: int | None = None
) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    """A request to the slow model (``slow_onnx``: y is WIDTH * sum(x) per row)."""
    rows = rows or 1 + i % 4
    x = np.full((rows, M, 1), 0.5 + i % 5, np.float32)
    body = {
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}
        ]
    }

    def check(answer: dict[str, Any]) -> None:
        y = np.array(answer["outputs"][0]["data"], np.float32)
        np.testing.assert_allclose(y, WIDTH * x.sum(axis=(1, 2)), rtol=1e-4)

    return body, check


@dataclass
class Sent:
    started: float
    ended: float
    status: int
    """The HTTP status; -1: no answer (a timeout or a broken connection); 0: a 200 whose
    numbers were wrong."""
    said: str = ""


@dataclass
class Traffic:
    """Clients that send requests to one model, each as soon as its last is answered, until
    stopped; every outcome is kept with when it was sent and answered."""

    url: str
    model: str
    request: Callable[[int], tuple[dict[str, Any], Callable[[dict[str, Any]], None]]]
    clients: int = 2
    sent: list[Sent] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Traffic:
        for n in range(self.clients):
            thread = threading.Thread(target=self._send, args=(n,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _send(self, n: int) -> None:
        url = f"{self.url}/v2/models/{self.model}/infer"
        with httpx.Client(timeout=30, headers=AUTH) as client:
            i = n
            while not self._stop.is_set():
                body, check = self.request(i)
                i += self.clients
                started = time.monotonic()
                try:
                    response = client.post(url, json=body)
                except httpx.HTTPError as error:
                    self.sent.append(Sent(started, time.monotonic(), -1, repr(error)))
                    continue
                status, said = response.status_code, ""
                if status == 200:
                    try:
                        check(response.json())
                    except AssertionError as wrong:
                        status, said = 0, str(wrong)[:200]
                else:
                    said = response.text[:300]
                self.sent.append(Sent(started, time.monotonic(), status, said))

    def wait_for(self, answers: int, since: float = 0.0) -> None:
        """Until ``answers`` more requests sent after ``since`` are answered."""
        deadline = time.monotonic() + WAIT_S
        while sum(1 for s in list(self.sent) if s.started >= since) < answers:
            assert time.monotonic() < deadline, f"{self.model}: {self.statuses()}"
            time.sleep(0.05)

    def statuses(self, after: float = 0.0, before: float = float("inf")) -> Counter[int]:
        """Of the requests sent after ``after`` and answered before ``before``."""
        return Counter(s.status for s in list(self.sent) if after <= s.started and s.ended < before)

    def overlapping(self, start: float, end: float) -> Counter[int]:
        """Of the requests on their way at some time between ``start`` and ``end``."""
        return Counter(s.status for s in list(self.sent) if s.started < end and s.ended >= start)

    def said(self, status: int) -> list[str]:
        return sorted({s.said for s in list(self.sent) if s.status == status})[:5]


def post(server: Server, path: str, body: Any = None, key: bool = True) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH if key else {}, timeout=WAIT_S)


def load(server: Server, name: str, config: dict[str, Any] | None = None) -> httpx.Response:
    body = {"parameters": {"config": json.dumps(config)}} if config else None
    return post(server, f"/v2/repository/models/{name}/load", body)


def unload(server: Server, name: str) -> httpx.Response:
    return post(
        server, f"/v2/repository/models/{name}/unload", {"parameters": {"unload_dependents": True}}
    )


def index(server: Server) -> dict[tuple[str, str], dict[str, str]]:
    response = post(server, "/v2/repository/index")
    assert response.status_code == 200, response.text
    return {(item["name"], item["version"]): item for item in response.json()}


def model_config(server: Server, name: str) -> httpx.Response:
    return httpx.get(f"{server.url}/v2/models/{name}/config", headers=AUTH, timeout=30)


def series_of(server: Server, model: str) -> list[str]:
    return [name for name, labels in metric_samples(server) if ("model", model) in labels]


def control_under_load(server: Server) -> None:
    """Load, reload (the same config, then a smaller max batch), a broken reload and an
    unload of ``work`` while clients send to it and to ``tiny``: the module's assertions."""
    with Traffic(server.url, "tiny", tiny_request) as other:
        other.wait_for(10)
        loaded = load(server, "work")
        assert loaded.status_code == 200, loaded.text
        assert index(server)[("work", "fp32")]["state"] == "READY"
        with Traffic(server.url, "work", work_request, CLIENTS) as mine:
            mine.wait_for(20)
            again = load(server, "work")
            assert again.status_code == 200, again.text
            mine.wait_for(20, since=time.monotonic())
            smaller = load(server, "work", SMALLER)
            assert smaller.status_code == 200, smaller.text
            assert model_config(server, "work").json()["max_batch_size"] == 8
            mine.wait_for(20, since=time.monotonic())
            broken = load(server, "work", {"max_batch_size": "many"})
            assert broken.status_code == 400, broken.text
            assert "max_batch_size" in broken.json()["error"]
            # The version before the broken load serves on, and the index says why.
            assert model_config(server, "work").json()["max_batch_size"] == 8
            entry = index(server)[("work", "fp32")]
            assert entry["state"] == "READY" and "last load failed" in entry["reason"], entry
            mine.wait_for(20, since=time.monotonic())
            unloading = time.monotonic()
            gone = unload(server, "work")
            unloaded = time.monotonic()
            assert gone.status_code == 200, gone.text
            mine.wait_for(10, since=unloaded)
        other.wait_for(10, since=time.monotonic())
    assert set(other.statuses()) == {200}, (other.statuses(), other.said(-1), other.said(500))
    before, during = mine.statuses(before=unloading), mine.overlapping(unloading, unloaded)
    after = mine.statuses(after=unloaded)
    assert set(before) == {200}, (before, mine.said(0), mine.said(400), mine.said(503))
    assert set(during) <= {200, 503}, (during, mine.said(500), mine.said(-1))
    assert set(after) == {503}, (after, mine.said(200))
    assert "not loaded" in mine.said(503)[-1] or "unload" in mine.said(503)[-1]
    entry = index(server)[("work", "fp32")]
    assert (entry["state"], entry["reason"]) == ("UNAVAILABLE", "unloaded"), entry
    assert series_of(server, "work") == []  # its label sets left the registry
    assert series_of(server, "tiny")


@dataclass
class Explicit:
    server: Server
    grpc_port: int


@pytest.fixture(scope="module")
def explicit_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Explicit]:
    repo = tmp_path_factory.mktemp("control") / "repository"
    add_model(repo, "tiny", tiny_onnx(), TINY_CONFIG)
    add_model(repo, "work", slow_onnx(WIDTH, LAYERS), WORK_CONFIG)
    add_model(repo, "heavy", heavy_onnx(), "max_batch_size: 4\n")
    env = {
        "STOKER_MODELS__CONTROL": "explicit",
        "STOKER_MODELS__STARTUP": '["tiny"]',
        "STOKER_AUTH__API_KEYS": KEY,
        "STOKER_SERVER__GRPC_PORT": str(free_port()),
        "STOKER_SERVER__DRAIN_TIMEOUT_S": "10",
    }
    server = start_server(repo, repo.parent / "server.log", env)
    yield Explicit(server, int(env["STOKER_SERVER__GRPC_PORT"]))
    code = stop_server(server)
    assert code == 0, f"exit {code}:\n{server.log.read_text()[-3000:]}"


@pytest.fixture
def explicit(explicit_server: Explicit) -> Server:
    return explicit_server.server


def test_load_reload_and_unload_under_load_drop_nothing(explicit: Server) -> None:
    control_under_load(explicit)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_memory_comes_back_after_an_unload(explicit: Server) -> None:
    """The heavy model (64 MiB of weights, which ONNX Runtime holds and packs) raises the
    server's RSS by well over 64 MiB (~130 MB here); after a reload, and after its unload,
    RSS is back within a quarter of that rise of where it was (measured: within 2 MB)."""
    pid = explicit.process.pid
    before = rss_kib(pid)
    assert load(explicit, "heavy").status_code == 200
    x = np.full((4, 2048), 0.25, np.float32)
    body = {
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": [4, 2048], "data": x.ravel().tolist()}
        ],
        "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
    }
    for _ in range(3):
        answered = post(explicit, "/v2/models/heavy/infer", body)
        assert answered.status_code == 200, answered.text
    loaded = rss_kib(pid)
    # A reload holds both versions while the new one warms, then frees the old one.
    assert load(explicit, "heavy").status_code == 200
    reloaded = rss_kib(pid)
    assert unload(explicit, "heavy").status_code == 200
    after = rss_kib(pid)
    rise = loaded - before
    assert rise > 64 * 1024, (before, loaded, reloaded, after)
    assert reloaded - loaded < rise / 4, (before, loaded, reloaded, after)
    assert after - before < rise / 4, (before, loaded, reloaded, after)


def test_control_needs_a_key_and_the_cli_sends_it(explicit: Server) -> None:
    refused = post(explicit, "/v2/repository/models/work/load", key=False)
    assert refused.status_code == 401, refused.text
    path = os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]
    )
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("STOKER_API_KEY", None)
    command = [sys.executable, "-m", "app", "models", "--url", explicit.url]

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*command, *args], capture_output=True, text=True, env=env, timeout=WAIT_S, check=False
        )

    wrong = cli("--load", "work", "--api-key", "not-the-key")
    assert wrong.returncode == 1 and "HTTP 401" in wrong.stderr, wrong.stderr
    done = cli("--load", "work", "--api-key", KEY, "--index")
    assert done.returncode == 0, done.stderr
    assert "work: loaded" in done.stdout
    assert any(
        line.split()[:3] == ["work", "fp32", "READY"] for line in done.stdout.splitlines()
    ), done.stdout
    gone = cli("--unload", "work", "--api-key", KEY)
    assert gone.returncode == 0 and "work: unloaded" in gone.stdout, gone.stderr
    assert index(explicit)[("work", "fp32")]["state"] == "UNAVAILABLE"


def test_grpc_loads_and_unloads_through_the_same_engine(explicit_server: Explicit) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    port = explicit_server.grpc_port
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    headers = {"authorization": f"Bearer {KEY}"}
    try:
        with pytest.raises(InferenceServerException, match="API key"):
            client.load_model("work")
        client.load_model("work", headers=headers, config='{"max_batch_size": 4}')
        assert client.is_model_ready("work", headers=headers)
        assert client.get_model_config("work", headers=headers).config.max_batch_size == 4
        x = np.ones((2, M, 1), np.float32)
        tensor = grpcclient.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        answer = client.infer("work", [tensor], headers=headers).as_numpy("y")
        np.testing.assert_allclose(answer.ravel(), [WIDTH * M] * 2)
        with pytest.raises(InferenceServerException, match="not supported"):
            client.load_model("work", headers=headers, files={"file:1/model.onnx": b"x"})
        client.unload_model("work", headers=headers, unload_dependents=True)
        assert not client.is_model_ready("work", headers=headers)
        states = {
            m.name: m.state for m in client.get_model_repository_index(headers=headers).models
        }
        assert states["work"] == "UNAVAILABLE" and states["tiny"] == "READY"
    finally:
        client.close()


def test_a_model_not_in_the_repository_is_404_and_a_missing_file_keeps_it_unloaded(
    explicit: Server, tmp_path: Path
) -> None:
    assert load(explicit, "nope").status_code == 404
    assert load(explicit, ".tiny").status_code == 404
    broken = explicit.log.parent / "repository" / "broken"
    broken.mkdir()
    (broken / "config.yaml").write_text("max_batch_size: 4\n")  # and no model.onnx
    failed = load(explicit, "broken")
    assert failed.status_code == 400 and "does not exist" in failed.json()["error"], failed.text
    entry = index(explicit)[("broken", "fp32")]
    assert entry["state"] == "UNAVAILABLE" and "load failed" in entry["reason"], entry
    refused = post(explicit, "/v2/models/broken/infer", {"inputs": []})
    assert refused.status_code == 503, refused.text


def test_mode_none_refuses_the_control_endpoints(server: Server) -> None:
    """The session's server runs with models.control none (the default)."""
    for action in ("load", "unload"):
        refused = httpx.post(f"{server.url}/v2/repository/models/tiny/{action}", timeout=30)
        assert refused.status_code == 400, refused.text
        assert "model control is off" in refused.json()["error"]
    assert httpx.get(f"{server.url}/v2/models/tiny/ready").status_code == 200


# -- poll mode ------------------------------------------------------------------------------


def wait_until(condition: Callable[[], bool], what: str, server: Server) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}:\n{server.log.read_text()[-3000:]}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def polled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    repo = tmp_path_factory.mktemp("poll") / "repository"
    add_model(repo, "tiny", tiny_onnx(), TINY_CONFIG)
    add_model(repo, "work", slow_onnx(WIDTH, LAYERS), WORK_CONFIG)
    env = {
        "STOKER_MODELS__CONTROL": "poll",
        "STOKER_MODELS__POLL_S": "0.2",
        "STOKER_AUTH__API_KEYS": KEY,
    }
    server = start_server(repo, repo.parent / "server.log", env)
    yield server
    code = stop_server(server)
    assert code == 0, f"exit {code}:\n{server.log.read_text()[-3000:]}"


def replace_text(path: Path, text: str) -> None:
    """Write a file whole, as an operator (or a ConfigMap's symlink swap) should: the poll
    never sees it half written. A plain write truncates first, and a look between the two
    reads an empty config.yaml, which is a valid config of defaults (CI loaded one)."""
    partial_path = path.with_name(f".{path.name}.new")
    partial_path.write_text(text)
    os.replace(partial_path, path)


def test_poll_mode_follows_the_repository(polled: Server) -> None:
    """A changed config.yaml reloads its model (under load, without a failed request), a
    broken one keeps the version that serves, a new folder loads, a removed one is gone
    (404, not in the index) and loads again when put back unchanged; the endpoints are
    refused."""
    repo = polled.log.parent / "repository"
    refused = load(polled, "work")
    assert refused.status_code == 400 and "poll mode" in refused.json()["error"]

    def max_batch() -> int:
        response = model_config(polled, "work")
        return int(response.json()["max_batch_size"]) if response.status_code == 200 else -1

    with Traffic(polled.url, "work", work_request) as mine:
        mine.wait_for(10)
        replace_text(repo / "work" / "config.yaml", WORK_CONFIG.replace("16", "8"))
        wait_until(lambda: max_batch() == 8, "the changed config was not loaded", polled)
        mine.wait_for(10, since=time.monotonic())
        replace_text(repo / "work" / "config.yaml", "max_batch_size: [not, a, number]\n")
        wait_until(
            lambda: "last load failed" in index(polled)[("work", "fp32")].get("reason", ""),
            "the broken config was not noticed",
            polled,
        )
        mine.wait_for(10, since=time.monotonic())
    assert set(mine.statuses()) == {200}, (mine.statuses(), mine.said(503), mine.said(500))
    assert max_batch() == 8

    shutil.copytree(repo / "tiny", repo / ".tiny-copy")  # hidden: never a model
    os.rename(repo / ".tiny-copy", repo / "tiny2")
    wait_until(
        lambda: index(polled).get(("tiny2", "fp32"), {}).get("state") == "READY",
        "tiny2 did not load",
        polled,
    )
    # Moved away: gone (404, not in the index); moved back unchanged: a model again.
    os.rename(repo / "tiny2", repo.parent / "tiny2-aside")
    wait_until(
        lambda: not any(name == "tiny2" for name, _ in index(polled)),
        "tiny2 stayed in the index",
        polled,
    )
    gone = post(polled, "/v2/models/tiny2/infer", tiny_request(0)[0])
    assert gone.status_code == 404 and "unknown model" in gone.text, gone.text
    os.rename(repo.parent / "tiny2-aside", repo / "tiny2")
    wait_until(
        lambda: index(polled).get(("tiny2", "fp32"), {}).get("state") == "READY",
        "tiny2 put back unchanged did not load again",
        polled,
    )
    shutil.rmtree(repo / "tiny2")
    wait_until(
        lambda: not any(name == "tiny2" for name, _ in index(polled)),
        "tiny2 stayed in the index",
        polled,
    )
