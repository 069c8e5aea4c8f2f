"""An unrecoverable engine fault, end to end in process: the batch that hit it gets 500, then
readiness and liveness answer 503 and every later request 503, so that Kubernetes takes the pod
out of the Service at once and restarts it after the liveness probe's failure threshold.

A real fault of this kind (a broken CUDA context) cannot be produced on demand, so the engine
here is a test-only backend, registered in this process only: ONNX Runtime running the tiny
model, whose runner raises ``FatalEngineError`` when a batch holds the value -999.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import pytest

from app.frontend.server import create_app
from app.settings import ModelRepositorySettings, Settings, StoreSettings
from engines import backends
from engines.backends import onnxruntime
from engines.base import EngineOptions, FatalEngineError
from engines.spec import ModelSpec
from tests.conftest import TINY_CONFIG, tiny_onnx

MODEL = "doomed"


class BrokenContextRunner:
    def __init__(self, inner: onnxruntime.OrtRunner) -> None:
        self._inner = inner

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if (inputs["x"] == -999).any():
            raise FatalEngineError("CUDA error 700: an illegal memory access was encountered")
        return self._inner.run(inputs)

    def close(self) -> None:
        self._inner.close()


class BrokenContextEngine:
    backend = "broken-context"
    pixel_input: str | None = None

    def __init__(self, path: Path, spec: ModelSpec, options: EngineOptions) -> None:
        self._inner = onnxruntime.load(path, spec, options)
        self.spec = spec

    def new_runner(self) -> BrokenContextRunner:
        return BrokenContextRunner(self._inner.new_runner())

    def close(self) -> None:
        self._inner.close()


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setitem(backends.LOADERS, "broken-context", BrokenContextEngine)
    folder = tmp_path / "repository" / MODEL
    folder.mkdir(parents=True)
    onnx.save(tiny_onnx(), str(folder / "model.onnx"))
    (folder / "config.yaml").write_text(TINY_CONFIG + "backend: broken-context\n")
    return Settings(
        models=ModelRepositorySettings(repository=tmp_path / "repository"),
        store=StoreSettings(path=tmp_path / "store"),
    )


def body(value: float) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [value] * 4}]}


async def failures(client: httpx.AsyncClient, reason: str) -> float:
    labels = f'model="{MODEL}",reason="{reason}",version="fp32"'
    wanted = f"stoker_inference_request_failure_total{{{labels}}}"
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith(wanted):
            return float(line.split()[-1])
    return 0.0


def test_an_unrecoverable_fault_turns_readiness_and_liveness_off(settings: Settings) -> None:
    app = create_app(settings)
    url = f"/v2/models/{MODEL}/infer"

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client,
        ):
            deadline = time.monotonic() + 30
            while (await client.get("/v2/health/ready")).status_code != 200:
                assert time.monotonic() < deadline, "never ready"
                await asyncio.sleep(0.05)
            assert (await client.post(url, json=body(1.0))).status_code == 200
            assert (await client.get("/v2/health/live")).status_code == 200

            fault = await client.post(url, json=body(-999.0))
            assert fault.status_code == 500
            assert set(fault.json()) == {"error"}
            assert "illegal memory access" in fault.json()["error"]

            ready = await client.get("/v2/health/ready")
            assert ready.status_code == 503 and ready.json() == {"ready": False}
            assert (await client.get("/v2/health/live")).status_code == 503
            assert (await client.get(f"/v2/models/{MODEL}/ready")).status_code == 503
            after = await client.post(url, json=body(1.0))
            assert after.status_code == 503 and "retry" in after.json()["error"]
            assert await failures(client, "backend") == 1
            assert await failures(client, "unavailable") == 1

    asyncio.run(scenario())
