"""The cpu image, reproduced without a container engine: the build context is what
.dockerignore lets through, the ``cpu-build`` stage's COPY, ENV, WORKDIR and RUN instructions
are carried out as written (absolute paths moved under a temporary root), and the ``cpu``
stage's ENV, ENTRYPOINT, CMD and HEALTHCHECK start and probe the server. A broken install
step, a file missing from the context or a wrong variable fails here, not in a release.

Two differences from a real build, neither of which changes what gets installed: the system
changes of the runtime stage (creating the user) are skipped, and pip may use its cache.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, cast

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.launch import free_port
from tests.unit.test_deploy_files import ROOT, dockerfile_stages

ESPRESSO = 967
SKIPPED_DIRECTORIES = {".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache"}


def dockerignore_rules() -> list[tuple[str, bool]]:
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            negated = line.startswith("!")
            rules.append((line.removeprefix("!").rstrip("/"), negated))
    return rules


def ignored(relative: str, rules: list[tuple[str, bool]]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = relative.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for pattern, negated in rules:
        patterns = {pattern, pattern.removeprefix("**/")}
        if any(fnmatch.fnmatchcase(c, p) for c in candidates for p in patterns):
            result = not negated
    return result


def build_context(destination: Path) -> Path:
    rules = dockerignore_rules()
    for folder, directories, files in os.walk(ROOT):
        directories[:] = [d for d in directories if d not in SKIPPED_DIRECTORIES]
        for name in files:
            source = Path(folder) / name
            relative = source.relative_to(ROOT).as_posix()
            if not ignored(relative, rules):
                target = destination / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target)
    return destination


class Image:
    """A filesystem root under a temporary folder, built by a Dockerfile stage's instructions."""

    def __init__(self, root: Path, context: Path) -> None:
        self.root = root
        self.context = context
        self.workdir = root
        self.env: dict[str, str] = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def path(self, text: str) -> str:
        """Absolute image paths moved under the root."""
        return re.sub(r"(?<![\w./-])/(opt|src|var)\b", lambda m: f"{self.root}/{m[1]}", text)

    def apply(self, keyword: str, rest: str) -> None:
        if keyword == "WORKDIR":
            self.workdir = Path(self.path(rest))
            self.workdir.mkdir(parents=True, exist_ok=True)
        elif keyword == "ENV":
            for token in shlex.split(rest):
                name, _, value = token.partition("=")
                self.env[name] = self.path(value).replace("$PATH", self.env.get("PATH", ""))
            # The cache decides where wheels come from, not what is installed.
            self.env.pop("PIP_NO_CACHE_DIR", None)
        elif keyword == "COPY":
            *sources, target = shlex.split(rest)
            assert not any(s.startswith("--") for s in sources), "COPY --from: see the test"
            destination = Path(self.path(target))
            if not destination.is_absolute():
                destination = self.workdir / destination
            for source in sources:
                origin = self.context / source
                assert origin.exists(), f"COPY {source}: not in the build context"
                if origin.is_dir():
                    shutil.copytree(origin, destination, dirs_exist_ok=True)
                elif target.endswith("/"):
                    destination.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(origin, destination / origin.name)
                else:
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(origin, destination)
        elif keyword == "RUN":
            result = subprocess.run(
                ["sh", "-c", self.path(rest)],
                cwd=self.workdir,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=400,
            )
            assert result.returncode == 0, f"RUN {rest}\n{result.stdout}\n{result.stderr}"
        elif keyword not in ("FROM", "ARG"):
            raise AssertionError(f"the test does not know {keyword} in a build stage")

    def exec_form(self, rest: str) -> list[str]:
        command: list[str] = json.loads(rest)
        return command


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    """The cpu-build stage carried out, then the cpu stage's environment."""
    if shutil.which("sh") is None:
        pytest.skip("needs a POSIX shell")
    base = tmp_path_factory.mktemp("image")
    built = Image(base / "root", build_context(base / "context"))
    stages = dockerfile_stages()
    for keyword, rest in stages["cpu-build"]:
        built.apply(keyword, rest)
    runtime = Image(built.root, built.context)
    for keyword, rest in stages["cpu"]:
        if keyword == "COPY":
            source, target = shlex.split(rest)[-2:]
            assert rest.startswith("--from=cpu-build") and source == target, rest
        elif keyword == "ENV":
            runtime.apply(keyword, rest)
    # What `install -d -o stoker /var/cache/stoker` makes in the image: the writable volume.
    Path(runtime.path("/var/cache/stoker")).mkdir(parents=True, exist_ok=True)
    return runtime


def entrypoint(image: Image) -> list[str]:
    stage = dict(dockerfile_stages()["cpu"])
    return image.exec_form(stage["ENTRYPOINT"]) + image.exec_form(stage["CMD"])


@pytest.mark.slow
def test_the_image_environment_installs_and_lists_the_prepared_model(image: Image) -> None:
    stoker = shutil.which("stoker", path=image.env["PATH"])
    assert stoker is not None and stoker.startswith(str(image.root)), stoker
    listing = subprocess.run(
        [stoker, "models"], env=image.env, cwd=image.root, capture_output=True, text=True
    )
    assert listing.returncode == 0, listing.stderr
    assert "efficientnet_lite0" in listing.stdout and "ready to load" in listing.stdout
    # The installed package, not the source tree, is what runs.
    where = subprocess.run(
        [image.env["PATH"].split(":")[0] + "/python", "-c", "import app; print(app.__file__)"],
        env=image.env,
        cwd=image.root,
        capture_output=True,
        text=True,
    )
    assert where.stdout.startswith(str(image.root / "opt")), where.stdout + where.stderr


@pytest.mark.slow
def test_the_image_serves_offline_and_its_healthcheck_passes(
    image: Image, coffee_jpeg: bytes, tmp_path: Path
) -> None:
    port, grpc_port = free_port(), free_port()
    # Loopback only in tests; the image binds 0.0.0.0 (its own ports, 8000 and 8001, may be
    # taken on the test machine).
    env = {
        **image.env,
        "STOKER_SERVER__HOST": "127.0.0.1",
        "STOKER_SERVER__PORT": str(port),
        "STOKER_SERVER__GRPC_PORT": str(grpc_port),
    }
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            entrypoint(image), env=env, cwd=image.root, stdout=out, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    healthcheck = dict(dockerfile_stages()["cpu"])["HEALTHCHECK"]
    probe = image.exec_form(healthcheck.split(" CMD ", 1)[1])
    try:
        # The first start calibrates and builds the int8 variant: about a minute on 2 cores.
        deadline = time.monotonic() + 300
        while subprocess.run(probe, env=env, capture_output=True).returncode != 0:
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the HEALTHCHECK never passed"
            time.sleep(0.3)
        assert httpx.get(f"{url}/v2/health/ready").json() == {"ready": True}
        answer = httpx.post(f"{url}/infer", files={"image": coffee_jpeg}, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.json()["predictions"][0][0]["index"] == ESPRESSO
        # gRPC too: the image's dependencies serve it.
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            health = cast(Any, health_pb2_grpc.HealthStub(channel))
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=40)
    assert code == 0, log.read_text()[-3000:]
    assert "generating" not in log.read_text(), "the model was prepared at build time"
