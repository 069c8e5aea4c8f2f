"""A real ``stoker serve`` (uvicorn) subprocess on a free port, shared by the module's tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import onnx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.launch import free_port, stop

BODY_LIMIT = 8 * 1024 * 1024


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def address(self) -> str:
        return self.url.removeprefix("http://")


def launch_server(repository: Path, log: Path, env: dict[str, str] | None = None) -> Server:
    """``stoker serve`` on a free port, not waited for."""
    port = free_port()
    # Tests never touch the user's engine store: each server gets one beside its log.
    environment = {**os.environ, "STOKER_STORE__PATH": str(log.parent / "store"), **(env or {})}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "app",
                "serve",
                "--repository",
                str(repository),
                "--port",
                str(port),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=environment,
        )
    return Server(f"http://127.0.0.1:{port}", process, log)


def start_server(repository: Path, log: Path, env: dict[str, str] | None = None) -> Server:
    """``stoker serve`` on a free port, once it reports ready."""
    server = launch_server(repository, log, env)
    process = server.process
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{server.url}/v2/health/ready", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"server not ready in 120 s:\n{log.read_text()}")


def metric_samples(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the server's /metrics, parsed by prometheus_client, keyed by name and
    sorted labels."""
    text = httpx.get(f"{server.url}/metrics").text
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def serve_one_model(
    tmp_path: Path,
    name: str,
    model: onnx.ModelProto,
    config: str,
    env: dict[str, str] | None = None,
) -> Server:
    """``start_server`` on a repository of one model (``name``: its ONNX graph and
    config.yaml), written under ``tmp_path``; the log is ``tmp_path / "server.log"``."""
    folder = tmp_path / "repository" / name
    folder.mkdir(parents=True)
    onnx.save(model, str(folder / "model.onnx"))
    (folder / "config.yaml").write_text(config)
    return start_server(tmp_path / "repository", tmp_path / "server.log", env)


def stop_server(server: Server) -> int:
    return stop(server.process)


@pytest.fixture(scope="session")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    running = start_server(repository, log, {"STOKER_LIMITS__MAX_BODY_BYTES": str(BODY_LIMIT)})
    yield running
    code = stop_server(running)
    assert code == 0, f"server exited with {code}:\n{log.read_text()[-3000:]}"
