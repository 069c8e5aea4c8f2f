"""Triton's system shared-memory extension, with tritonclient's own helpers
(``tritonclient.utils.shared_memory``) against a real server: in one process and with front
ends before an engine process. Inputs are read from, and outputs written to, regions the
client created; no tensor byte travels in the HTTP body.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.http as triton
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from tests.conftest import TINY_BIAS, TINY_WEIGHTS, tiny_model
from tests.integration.conftest import Server, start_server, stop_server

ROWS = 5
NOT_A_REGION = "is not a region of at least offset \\+ byte_size bytes that this server's user"


@pytest.fixture(scope="module", params=["one process", "front ends"])
def server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Server]:
    repo = tmp_path_factory.mktemp("shm") / "repository"
    tiny_model(repo / "tiny")
    env = {"STOKER_SERVER__FRONT_ENDS": "2"} if request.param == "front ends" else {}
    running = start_server(repo, repo.parent / "server.log", env)
    yield running
    assert stop_server(running) == 0, running.log.read_text()[-3000:]


@pytest.fixture
def regions(request: pytest.FixtureRequest) -> Iterator[dict[str, object]]:
    """Client-side regions: inputs at an offset, outputs in their own region."""
    tag = request.node.name.replace("[", "_").replace("]", "").replace(" ", "_")
    made = {
        "in": shm.create_shared_memory_region(f"in-{tag}", f"/stoker_in_{tag}", 4096),
        "out": shm.create_shared_memory_region(f"out-{tag}", f"/stoker_out_{tag}", 4096),
    }
    yield {"tag": tag, **made}
    for handle in made.values():
        shm.destroy_shared_memory_region(handle)


def test_inputs_and_outputs_travel_in_shared_memory(
    server: Server, regions: dict[str, object]
) -> None:
    tag = regions["tag"]
    x = np.random.default_rng(3).standard_normal((ROWS, 4)).astype(np.float32)
    shm.set_shared_memory_region(regions["in"], [x], offset=256)
    client = triton.InferenceServerClient(server.address)
    try:
        client.register_system_shared_memory(f"in-{tag}", f"/stoker_in_{tag}", 4096)
        client.register_system_shared_memory(f"out-{tag}", f"/stoker_out_{tag}", 4096)
        status = {r["name"]: r for r in client.get_system_shared_memory_status()}
        assert status[f"in-{tag}"]["byte_size"] == 4096
        tensor = triton.InferInput("x", [ROWS, 4], "FP32")
        tensor.set_shared_memory(f"in-{tag}", x.nbytes, offset=256)
        y_out = triton.InferRequestedOutput("y")
        y_out.set_shared_memory(f"out-{tag}", ROWS * 3 * 4)
        s_out = triton.InferRequestedOutput("s", binary_data=False)  # in the body, as JSON
        result = client.infer("tiny", [tensor], outputs=[y_out, s_out])
        described = result.get_output("y")
        assert described["parameters"]["shared_memory_region"] == f"out-{tag}"
        assert "data" not in described  # the bytes are in the region, not the body
        y = shm.get_contents_as_numpy(regions["out"], np.float32, [ROWS, 3])
        np.testing.assert_allclose(y, x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(result.as_numpy("s"), x.sum(axis=1, keepdims=True), rtol=1e-5)
        client.unregister_system_shared_memory(f"in-{tag}")
        names = [r["name"] for r in client.get_system_shared_memory_status()]
        assert f"in-{tag}" not in names and f"out-{tag}" in names
        with pytest.raises(InferenceServerException, match="no shared memory region"):
            client.infer("tiny", [tensor])
    finally:
        client.unregister_system_shared_memory()
        client.close()


def test_bad_registrations_and_requests_are_refused_with_the_reason(
    server: Server, regions: dict[str, object]
) -> None:
    tag = regions["tag"]
    client = triton.InferenceServerClient(server.address)
    try:
        # A missing file, a link and a file too small get one answer: the server does not
        # tell whether a file exists, what it is or how large.
        with pytest.raises(InferenceServerException, match=NOT_A_REGION):
            client.register_system_shared_memory("gone", "/stoker_no_such_key", 64)
        with pytest.raises(InferenceServerException, match="one name of letters"):
            client.register_system_shared_memory("escape", "/../../etc/passwd", 64)
        os.symlink(f"/dev/shm/stoker_in_{tag}", f"/dev/shm/stoker_link_{tag}")
        try:
            with pytest.raises(InferenceServerException, match=NOT_A_REGION):
                client.register_system_shared_memory("link", f"/stoker_link_{tag}", 64)
        finally:
            os.unlink(f"/dev/shm/stoker_link_{tag}")
        with pytest.raises(InferenceServerException, match="is the server's own"):
            client.register_system_shared_memory("arena", "/stoker-1-0", 64)
        with pytest.raises(InferenceServerException, match=NOT_A_REGION) as big:
            client.register_system_shared_memory("big", f"/stoker_in_{tag}", 8192)
        assert "4096" not in str(big.value)  # the file's size stays the client's business
        with pytest.raises(InferenceServerException, match="from 0 to 2"):
            client.register_system_shared_memory("huge", f"/stoker_in_{tag}", 64, 2**64)
        client.register_system_shared_memory(f"in-{tag}", f"/stoker_in_{tag}", 64)
        with pytest.raises(InferenceServerException, match="already registered"):
            client.register_system_shared_memory(f"in-{tag}", f"/stoker_in_{tag}", 64)
        tensor = triton.InferInput("x", [ROWS, 4], "FP32")
        tensor.set_shared_memory(f"in-{tag}", ROWS * 16)  # 80 bytes of a 64-byte region
        with pytest.raises(InferenceServerException, match="runs past shared memory region"):
            client.infer("tiny", [tensor])
        small = triton.InferInput("x", [1, 4], "FP32")
        small.set_shared_memory(f"in-{tag}", 16)
        tight = triton.InferRequestedOutput("y")
        tight.set_shared_memory(f"in-{tag}", 4)  # y takes 12 bytes
        with pytest.raises(InferenceServerException, match="takes 12 bytes"):
            client.infer("tiny", [small], outputs=[tight])
        # Nothing of that hurt the server: a plain request still answers.
        plain = triton.InferInput("x", [1, 4], "FP32")
        plain.set_data_from_numpy(np.ones((1, 4), np.float32))
        assert client.infer("tiny", [plain]).as_numpy("y").shape == (1, 3)
    finally:
        client.unregister_system_shared_memory()
        client.close()


def test_a_region_its_client_shrank_is_a_400_and_the_server_lives(
    server: Server, regions: dict[str, object]
) -> None:
    """Registered, then truncated to nothing by its client: reading an input from it and
    writing an output into it are 400s, not a SIGBUS in the process that holds it."""
    tag = regions["tag"]
    client = triton.InferenceServerClient(server.address)
    try:
        client.register_system_shared_memory(f"in-{tag}", f"/stoker_in_{tag}", 4096)
        client.register_system_shared_memory(f"out-{tag}", f"/stoker_out_{tag}", 4096)
        os.truncate(f"/dev/shm/stoker_in_{tag}", 0)
        os.truncate(f"/dev/shm/stoker_out_{tag}", 0)
        read = triton.InferInput("x", [1, 4], "FP32")
        read.set_shared_memory(f"in-{tag}", 16)
        with pytest.raises(InferenceServerException, match="smaller than when it was registered"):
            client.infer("tiny", [read])
        plain = triton.InferInput("x", [1, 4], "FP32")
        plain.set_data_from_numpy(np.ones((1, 4), np.float32))
        written = triton.InferRequestedOutput("y")
        written.set_shared_memory(f"out-{tag}", 12)
        with pytest.raises(InferenceServerException, match="smaller than when it was registered"):
            client.infer("tiny", [plain], outputs=[written])
        assert client.infer("tiny", [plain]).as_numpy("y").shape == (1, 3)
        assert client.is_server_live()
        # Ready too: polled, since with front ends readiness is each front end's view of the
        # engine at its last poll (once a CI run saw one not ready at the first look).
        deadline = time.monotonic() + 30
        while not client.is_server_ready():
            assert time.monotonic() < deadline, "the server did not turn ready again"
            time.sleep(0.1)
    finally:
        client.unregister_system_shared_memory()
        client.close()


def test_a_large_sparse_file_costs_its_window_and_a_hard_link_is_refused(
    server: Server, regions: dict[str, object]
) -> None:
    """A 1 TiB sparse file registered 127 times (16 bytes each) maps nothing, so requests
    keep their memory; a second name of a file (a hard link: perhaps to a front end's
    arena) is never a region."""
    tag = regions["tag"]
    sparse = f"/dev/shm/stoker_sparse_{tag}"
    with open(sparse, "wb") as file:
        file.truncate(1 << 40)
    os.link(f"/dev/shm/stoker_in_{tag}", f"/dev/shm/stoker_hard_{tag}")
    client = triton.InferenceServerClient(server.address)
    try:
        for i in range(127):
            client.register_system_shared_memory(f"sparse-{i}", f"/stoker_sparse_{tag}", 16)
        assert len(client.get_system_shared_memory_status()) == 127
        plain = triton.InferInput("x", [ROWS, 4], "FP32")
        plain.set_data_from_numpy(np.ones((ROWS, 4), np.float32))
        assert client.infer("tiny", [plain]).as_numpy("y").shape == (ROWS, 3)
        with pytest.raises(InferenceServerException, match=NOT_A_REGION):
            client.register_system_shared_memory("hard", f"/stoker_hard_{tag}", 64)
    finally:
        client.unregister_system_shared_memory()
        client.close()
        os.unlink(sparse)
        os.unlink(f"/dev/shm/stoker_hard_{tag}")


def test_the_extension_is_announced(server: Server) -> None:
    client = triton.InferenceServerClient(server.address)
    try:
        assert "system_shared_memory" in client.get_server_metadata()["extensions"]
    finally:
        client.close()
