"""A server without API keys (the default) against what a web page can make a browser send,
in one process and with two front ends: a cross-origin or form-typed POST is refused before
it registers shared memory or runs anything, a rebound ``Host`` is refused on the loopback
bind, and clients that are not browsers (httpx, curl's ``-F``, tritonclient) see no change.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
import tritonclient.utils.shared_memory as shm

from tests.conftest import TINY_BIAS, TINY_WEIGHTS, tiny_model
from tests.integration.conftest import Server, start_server, stop_server

LISTED = "https://app.example"
FOREIGN = "http://evil.example"
REGISTER = '{"key": "/stoker_guard_%s", "offset": 0, "byte_size": 64}'
INFER = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}]}'


@pytest.fixture(scope="module", params=["one process", "front ends"])
def server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Server]:
    repo = tmp_path_factory.mktemp("guard") / "repository"
    tiny_model(repo / "tiny")
    env = {"STOKER_SERVER__ALLOWED_ORIGINS": f'["{LISTED}"]'}
    if request.param == "front ends":
        env["STOKER_SERVER__FRONT_ENDS"] = "2"
    running = start_server(repo, repo.parent / "server.log", env)
    yield running
    assert stop_server(running) == 0, running.log.read_text()[-3000:]


@pytest.fixture
def region(server: Server) -> Iterator[str]:
    """A client's shared-memory region of 64 bytes; its tag."""
    tag = server.address.rsplit(":", 1)[1]
    handle = shm.create_shared_memory_region(f"guard-{tag}", f"/stoker_guard_{tag}", 64)
    yield tag
    shm.destroy_shared_memory_region(handle)


def regions(server: Server) -> list[str]:
    status = httpx.get(f"{server.url}/v2/systemsharedmemory/status", timeout=10)
    return [r["name"] for r in status.json()]


def test_a_cross_origin_simple_request_registers_nothing(server: Server, region: str) -> None:
    url = f"{server.url}/v2/systemsharedmemory/region/evil/register"
    body = REGISTER % region
    for headers in (
        {"Content-Type": "text/plain", "Origin": FOREIGN},  # fetch(..., {mode: "no-cors"})
        {"Content-Type": "text/plain"},  # a form in a browser that sends no Origin
        {"Content-Type": "application/x-www-form-urlencoded"},
        {"Content-Type": "multipart/form-data; boundary=x"},
        {"Content-Type": "application/json", "Origin": "null"},  # a sandboxed frame
        {"Origin": FOREIGN},  # no content type, as tritonclient sends, but a page's origin
    ):
        answer = httpx.post(url, content=body, headers=headers, timeout=10)
        assert answer.status_code == 403, (headers, answer.text)
        assert answer.json()["error"].startswith(("cross-origin request", "Content-Type"))
    assert "evil" not in regions(server)
    answer = httpx.post(
        f"{server.url}/v2/models/tiny/infer",
        content=INFER,
        headers={"Content-Type": "text/plain", "Origin": FOREIGN},
        timeout=10,
    )
    assert answer.status_code == 403


def test_own_listed_and_origin_less_requests_are_served(server: Server, region: str) -> None:
    own = f"http://{server.address}"
    for headers in (
        {"Content-Type": "application/json"},
        {"Content-Type": "application/json", "Origin": own},
        {"Content-Type": "text/plain", "Origin": own},  # the server's own page may POST text...
        {"Content-Type": "application/json", "Origin": LISTED},
        {},
    ):
        answer = httpx.post(
            f"{server.url}/v2/models/tiny/infer", content=INFER, headers=headers, timeout=10
        )
        if headers.get("Content-Type") == "text/plain":  # ...but a JSON route takes no text
            assert answer.status_code == 403
            continue
        assert answer.status_code == 200, (headers, answer.text)
        y = np.array(answer.json()["outputs"][0]["data"])
        np.testing.assert_allclose(y, np.arange(1, 5) @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5)
    url = f"{server.url}/v2/systemsharedmemory/region/mine/register"
    assert httpx.post(url, content=REGISTER % region, headers={"Origin": own}).status_code == 200
    assert "mine" in regions(server)
    assert httpx.post(f"{server.url}/v2/systemsharedmemory/region/mine/unregister").is_success


def test_uploads_take_multipart_but_not_from_another_origin(server: Server) -> None:
    """``POST /infer`` takes ``curl -F``'s multipart; from a foreign page it is refused."""
    files = {"image": ("a.jpg", b"not an image", "image/jpeg")}
    served = httpx.post(f"{server.url}/infer", files=files, timeout=10)
    assert served.status_code == 400 and "error" in served.json()  # decoded, and refused
    refused = httpx.post(f"{server.url}/infer", files=files, headers={"Origin": FOREIGN})
    assert refused.status_code == 403


def test_a_rebound_host_is_refused_on_a_loopback_bind(server: Server) -> None:
    port = server.address.rsplit(":", 1)[1]
    for host in (f"evil.example:{port}", "evil.example", f"10.0.0.1:{port}"):
        answer = httpx.get(f"{server.url}/v2/models/tiny", headers={"Host": host}, timeout=10)
        assert answer.status_code == 403, host
        assert "DNS rebinding" in answer.json()["error"]
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"app.localhost:{port}"):
        answer = httpx.get(f"{server.url}/v2/models/tiny", headers={"Host": host}, timeout=10)
        assert answer.status_code == 200, host
    probe = httpx.get(f"{server.url}/v2/health/ready", headers={"Host": "evil.example"})
    assert probe.status_code == 200  # probes answer whatever Host they carry


def test_tritonclient_is_unaffected(server: Server, region: str) -> None:
    client = triton.InferenceServerClient(server.address)
    try:
        assert client.is_server_ready()
        client.register_system_shared_memory(f"t-{region}", f"/stoker_guard_{region}", 64)
        assert f"t-{region}" in regions(server)
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        for binary in (True, False):
            tensor = triton.InferInput("x", [2, 4], "FP32")
            tensor.set_data_from_numpy(x, binary_data=binary)
            result = client.infer("tiny", [tensor])
            y = result.as_numpy("y")
            assert y is not None
            np.testing.assert_allclose(y, x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5)
        client.unregister_system_shared_memory(f"t-{region}")
    finally:
        client.close()
