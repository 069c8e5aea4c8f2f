"""Servers the bench starts itself (Stoker, the naive baseline), each on a free port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

READY_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def stop(process: subprocess.Popen[bytes], timeout_s: float = 30) -> int:
    """SIGTERM, wait up to ``timeout_s`` for a graceful exit, then SIGKILL; the exit code."""
    process.terminate()
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def is_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=1) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def stoker_command(
    repository: Path, model: str, backend: str | None, port: int, grpc_port: int = 0
) -> list[str]:
    """``stoker serve`` on ``port``, with gRPC on ``grpc_port`` (0: none, so the default
    8001 is never taken by a bench run)."""
    command = [sys.executable, "-m", "app", "serve", "--repository", str(repository)]
    command += ["--model", model, "--port", str(port), "--grpc-port", str(grpc_port)]
    command += ["--log-level", "warning"]
    return command + (["--backend", backend] if backend else [])


def naive_command(repository: Path, model: str, backend: str | None, port: int) -> list[str]:
    command = [sys.executable, "-m", "bench.naive", "--repository", str(repository)]
    command += ["--model", model, "--port", str(port)]
    return command + (["--backend", backend] if backend else [])


@contextmanager
def running(command: list[str], port: int) -> Iterator[str]:
    """Start a server, wait until it is ready, yield its URL; stop it on the way out."""
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ}
        )
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not is_ready(url):
                if process.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    tail = log.read()[-3000:].decode(errors="replace")
                    raise RuntimeError(f"{' '.join(command)} did not become ready:\n{tail}")
                time.sleep(0.2)
            yield url
        finally:
            stop(process)
