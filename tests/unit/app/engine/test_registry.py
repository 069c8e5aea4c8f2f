"""The registry over a real repository: what serves, what is refused and why, the default
model, readiness, and closing."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from app.engine.registry import Registry
from app.errors import NotFound, Unavailable
from tests.unit.app.engine.test_models import settings_for, write_tiny


def test_the_registry_serves_what_loads_and_says_why_the_rest_does_not(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_tiny(repo / "tiny")
    write_tiny(repo / "tiny2", autoload=False)  # loaded only when named
    gone = repo / "gone"
    gone.mkdir()
    (gone / "config.yaml").write_text("max_batch_size: 8\n")
    registry = Registry(settings_for(repo, tmp_path))

    async def scenario() -> dict[str, Any]:
        assert not registry.ready
        await registry.load_all()
        seen = {
            "ready": registry.ready,
            "versions": registry.versions("tiny"),
            "index": registry.index(),
            "default": registry.default(None).name,
        }
        with pytest.raises(Unavailable, match=r"'gone' version 'fp32' is not served: .*not exist"):
            registry.get("gone")
        with pytest.raises(NotFound, match="unknown model"):
            registry.get("nope")
        with pytest.raises(NotFound, match="has no version 'int8'; versions: fp32"):
            registry.get("tiny", "int8")
        await registry.close()
        seen["after_close"] = (registry.ready, registry.loaded())
        return seen

    seen = asyncio.run(scenario())
    assert seen["ready"] and seen["versions"] == ["fp32"]
    states = {(i["name"], i["version"]): i["state"] for i in seen["index"]}
    assert states == {("gone", "fp32"): "UNAVAILABLE", ("tiny", "fp32"): "READY"}
    assert seen["default"] == "tiny"  # the first model that serves
    assert seen["after_close"] == (False, [])


def test_a_registry_with_nothing_to_serve_is_an_error(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "gone").mkdir(parents=True)
    (repo / "gone" / "config.yaml").write_text("max_batch_size: 8\n")
    registry = Registry(settings_for(repo, tmp_path))
    with pytest.raises(RuntimeError, match=r"no model version could be served: gone\[fp32\]"):
        asyncio.run(registry.load_all())
    assert not registry.ready


def test_exit_on_error_stops_loading_at_the_first_refusal(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "gone").mkdir(parents=True)
    (repo / "gone" / "config.yaml").write_text("max_batch_size: 8\n")
    write_tiny(repo / "tiny")
    registry = Registry(settings_for(repo, tmp_path, exit_on_error=True))
    with pytest.raises(FileNotFoundError):
        asyncio.run(registry.load_all())
    assert registry.loaded() == []


@pytest.mark.parametrize(("one_device", "devices"), [(False, (0, 1)), (True, ())])
def test_an_engine_process_of_one_gpu_places_every_runner_on_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_device: bool, devices: tuple[int, ...]
) -> None:
    """``server.engine_gpus``: each engine process sees one GPU (as its device 0), so a
    model configured for ``gpus: [0, 1]`` is loaded there with no GPU list (every runner on
    the one it sees); the one engine of the default layout loads it as configured."""
    from engines import backends
    from engines.backends import onnxruntime
    from engines.base import Engine, EngineOptions
    from engines.spec import ModelSpec

    seen: list[tuple[int, ...]] = []

    def capture(path: Path, spec: ModelSpec, options: EngineOptions) -> Engine:
        seen.append(options.devices)
        return onnxruntime.load(path, spec, options)

    monkeypatch.setitem(backends.LOADERS, "capture", capture)
    repo = tmp_path / "repo"
    write_tiny(repo / "tiny", backend="capture", gpus=[0, 1], runners=2)
    registry = Registry(settings_for(repo, tmp_path), one_device=one_device)

    async def scenario() -> None:
        await registry.load_all()
        await registry.close()

    asyncio.run(scenario())
    assert seen == [devices]
