"""A start: the decode processes start while the engine loads, readiness waits for the
warm-up, and the last start-up line gives each phase's time."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.engine import startup
from app.engine.registry import Registry
from engines import backends
from engines.backends import onnxruntime
from engines.base import Engine, EngineOptions, Runner
from engines.spec import ModelSpec
from tests.unit.app.engine.test_models import settings_for, write_tiny

WAIT_S = 60.0


class Gate:
    """Events a test and a start's threads meet at."""

    def __init__(self) -> None:
        self.decoding = threading.Event()  # the decode processes' start began
        self.decoding_before_engine = False  # ... before the engine had loaded
        self.warming = threading.Event()  # a runner's warm-up run began
        self.release = threading.Event()  # the test lets the warm-up finish


class GatedEngine:
    """ONNX Runtime's engine, whose runners' first runs (the warm-up) wait for the test."""

    def __init__(self, engine: Engine, gate: Gate) -> None:
        self._engine, self._gate = engine, gate
        self.backend, self.pixel_input, self.spec = engine.backend, engine.pixel_input, engine.spec

    def new_runner(self) -> Runner:
        inner, gate = self._engine.new_runner(), self._gate

        class Waiting:
            def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
                gate.warming.set()
                assert gate.release.wait(WAIT_S)
                return inner.run(inputs)

            def close(self) -> None:
                inner.close()

        return Waiting()

    def close(self) -> None:
        self._engine.close()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Gate:
    gate = Gate()

    def loader(path: Path, spec: ModelSpec, options: EngineOptions) -> Engine:
        # The engine loads only once the decode processes have begun starting (or a minute
        # has passed: a start that starts them after the engine).
        gate.decoding_before_engine = gate.decoding.wait(WAIT_S)
        return GatedEngine(onnxruntime.load(path, spec, options), gate)

    def decoders(*args: Any) -> list[Any]:
        gate.decoding.set()
        return []

    monkeypatch.setitem(backends.LOADERS, "gated", loader)
    monkeypatch.setattr(startup, "gpu_decoders", decoders)
    return gate


def test_decoders_start_beside_the_engine_and_ready_waits_for_the_warm_up(
    tmp_path: Path, gate: Gate, caplog: pytest.LogCaptureFixture
) -> None:
    write_tiny(tmp_path / "repo" / "tiny", backend="gated", runners=2)
    registry = Registry(settings_for(tmp_path / "repo", tmp_path))

    async def scenario() -> tuple[bool, bool]:
        loading = asyncio.create_task(registry.load_all())
        warming = await asyncio.to_thread(gate.warming.wait, WAIT_S)
        ready_while_warming = registry.ready
        gate.release.set()
        await loading
        ready = registry.ready
        await registry.close()
        return warming and not ready_while_warming, ready

    with caplog.at_level("INFO"):
        waited, ready = asyncio.run(scenario())
    assert gate.decoding_before_engine
    assert waited and ready
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("ready: "))
    # the last start-up line: how long, and where it went, per version and phase
    assert "tiny fp32: store lookup " in line and " s, build " in line and ", compile " in line
    assert ", engine " in line and ", capture " in line and ", warm-up " in line


def test_the_phases_of_a_load_are_the_store_s_and_the_rest_of_the_engine_s() -> None:
    phases = startup.start_phases({"store lookup": 0.5}, {"store lookup": 1.5, "build": 2.0}, 4.0)
    assert phases == {"store lookup": 1.0, "build": 2.0, "engine": 1.0}
    text = startup.describe_phases({**phases, "capture": 3.25, "decode processes": 6.0})
    assert text == (
        "store lookup 1.0 s, build 2.0 s, compile 0.0 s, load 0.0 s, engine 1.0 s, "
        "capture 3.2 s, warm-up 0.0 s; decode processes 6.0 s beside"
    )
