"""The registry over a real repository: what serves, what is refused and why, the default
model, readiness, closing; and model control: reloads that switch beside the old version,
failed loads that change nothing, unloads that drain, the index's states."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import yaml
from prometheus_client import REGISTRY

from app.contract import batch_key
from app.engine.models import LoadedModel
from app.engine.registry import Registry
from app.errors import BadRequest, NotFound, Reloaded, Unavailable
from app.settings import Settings
from tests.conftest import slow_onnx
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
            "index": await registry.index(),
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


# -- model control ------------------------------------------------------------------------


def write_slow(folder: Path, **config: Any) -> None:
    """A model that takes a few ms a request (``slow_onnx``: y is 64 * sum(x) per row)."""
    folder.mkdir(parents=True)
    onnx.save(slow_onnx(64, 4), str(folder / "model.onnx"))
    (folder / "config.yaml").write_text(yaml.safe_dump({"max_batch_size": 8, **config}))


def ask(model: LoadedModel, value: float) -> Awaitable[dict[str, np.ndarray]]:
    """One request of 2 rows of 256 values to the slow model, through its batcher."""
    x = np.full((2, 256, 1), value, np.float32)
    return model.batcher.infer({"x": x}, 2, batch_key(model.spec, {"x": x}), 30.0)


def controlled(repo: Path, tmp_path: Path, **models_: Any) -> Registry:
    return Registry(settings_for(repo, tmp_path, control="explicit", **models_))


def test_a_reload_switches_at_once_and_what_the_old_version_queued_finishes(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "repo"
    write_slow(repo / "slow")
    registry = controlled(repo, tmp_path)

    async def scenario() -> tuple[list[float], LoadedModel, LoadedModel, list[dict[str, str]]]:
        await registry.load_all()
        old = registry.get("slow")
        queued = [asyncio.ensure_future(ask(old, float(i))) for i in range(12)]
        await asyncio.sleep(0)
        assert old.batcher.pending == 12
        await registry.load("slow")
        new = registry.get("slow")
        answers = [float((await q)["y"][0, 0, 0]) for q in queued]
        later = await ask(new, 1.0)
        assert float(later["y"][0, 0, 0]) == 64 * 256
        index = await registry.index()
        await registry.close()
        return answers, old, new, index

    answers, old, new, index = asyncio.run(scenario())
    assert answers == [64 * 256 * i for i in range(12)]  # every queued one, on the old
    assert new is not old and old.replaced_by is new and old.current() is new
    assert new.serial == old.serial  # the same contract: nothing is decoded again
    assert index == [{"name": "slow", "version": "fp32", "state": "READY"}]


def test_a_reload_with_another_contract_makes_requests_decode_again(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_slow(repo / "slow")
    registry = controlled(repo, tmp_path)

    async def scenario() -> tuple[LoadedModel, LoadedModel]:
        await registry.load_all()
        old = registry.get("slow")
        await registry.load("slow", {"max_batch_size": 4})
        new = registry.get("slow")
        await registry.close()
        return old, new

    old, new = asyncio.run(scenario())
    assert new.spec.max_batch_size == 4 and new.serial != old.serial
    with pytest.raises(Reloaded, match="was reloaded; retry"):
        old.current()


def test_a_reload_that_fails_keeps_the_old_version_serving_and_says_why(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_slow(repo / "slow")
    registry = controlled(repo, tmp_path)

    async def scenario() -> tuple[float, list[dict[str, str]], list[dict[str, str]]]:
        await registry.load_all()
        before = registry.get("slow")
        (repo / "slow" / "config.yaml").write_text("max_batch_size: -3\n")
        with pytest.raises(BadRequest, match=r"did not load: .*max_batch_size"):
            await registry.load("slow")
        broken_config = await registry.index()
        (repo / "slow" / "config.yaml").write_text("max_batch_size: 8\n")
        (repo / "slow" / "model.onnx").write_bytes(b"not an onnx file")
        with pytest.raises(BadRequest, match="versions loaded before serve on"):
            await registry.load("slow")
        broken_file = await registry.index()
        assert registry.get("slow") is before and before.replaced_by is None
        answer = float((await ask(before, 1.0))["y"][0, 0, 0])
        await registry.close()
        return answer, broken_config, broken_file

    answer, broken_config, broken_file = asyncio.run(scenario())
    assert answer == 64 * 256
    for index in (broken_config, broken_file):
        (entry,) = index
        assert entry["state"] == "READY" and entry["reason"].startswith("the last load failed")
    assert "max_batch_size" in broken_config[0]["reason"]


def test_an_unload_lets_what_was_queued_finish_then_refuses_and_forgets_the_metrics(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "repo"
    write_slow(repo / "slow")
    write_tiny(repo / "tiny")
    registry = controlled(repo, tmp_path)

    async def scenario() -> tuple[list[float], list[str], str]:
        await registry.load_all()
        model = registry.get("slow")
        queued = [asyncio.ensure_future(ask(model, float(i))) for i in range(8)]
        await asyncio.sleep(0)
        unloading = asyncio.ensure_future(registry.unload("slow"))
        for _ in range(2):  # the unload starts, then its batcher's close
            await asyncio.sleep(0)
        states = [i["state"] for i in await registry.index() if i["name"] == "slow"]
        with pytest.raises(Unavailable, match="is being unloaded"):
            registry.get("slow")
        with pytest.raises(Unavailable, match="is unloaded"):
            await ask(model, 1.0)  # a late request to the version itself: 503, not queued
        await unloading
        answers = [float((await q)["y"][0, 0, 0]) for q in queued]
        with pytest.raises(Unavailable, match=r"'slow' is not loaded \(unloaded\)"):
            registry.get("slow")
        assert registry.ready  # tiny serves on
        after = [i["state"] for i in await registry.index() if i["name"] == "slow"]
        await registry.close()
        return answers, states + after, model.pool.engine.spec.name

    answers, states, _ = asyncio.run(scenario())
    assert answers == [64 * 256 * i for i in range(8)]
    assert states == ["UNLOADING", "UNAVAILABLE"]
    labels = {
        dict(s.labels).get("model")
        for family in REGISTRY.collect()
        for s in family.samples
        if family.name.startswith("stoker_inference")
    }
    assert "slow" not in labels and "tiny" in labels


def test_an_unload_past_the_drain_timeout_answers_what_is_left_with_503(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_slow(repo / "slow", dynamic_batching={"max_queue_delay_us": 0})
    registry = Registry(
        Settings(
            models={"repository": repo, "control": "explicit"},  # type: ignore[arg-type]
            store={"path": tmp_path / "store"},  # type: ignore[arg-type]
            server={"drain_timeout_s": 0},  # type: ignore[arg-type]
        )
    )

    async def scenario() -> list[str]:
        await registry.load_all()
        model = registry.get("slow")
        queued = [asyncio.ensure_future(ask(model, 1.0)) for _ in range(40)]
        await asyncio.sleep(0)
        await registry.unload("slow")
        outcomes = await asyncio.gather(*queued, return_exceptions=True)
        await registry.close()
        return [type(o).__name__ for o in outcomes]

    outcomes = asyncio.run(scenario())
    assert set(outcomes) <= {"dict", "Unavailable"} and "Unavailable" in outcomes, outcomes


def test_explicit_mode_loads_what_startup_names_and_lists_the_rest(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_tiny(repo / "tiny")
    write_tiny(repo / "other")
    (repo / "bad").mkdir()
    (repo / "bad" / "config.yaml").write_text("max_batch_size: [1]\n")
    none_at_start = controlled(repo, tmp_path, startup=[])
    some = controlled(repo, tmp_path, startup=["other"])

    async def scenario() -> tuple[bool, list[dict[str, str]], list[str]]:
        await none_at_start.load_all()
        ready, index = none_at_start.ready, await none_at_start.index()
        with pytest.raises(Unavailable, match="'tiny' is not loaded"):
            none_at_start.get("tiny")
        with pytest.raises(NotFound):
            none_at_start.get("nope")
        with pytest.raises(NotFound, match="no model 'nope' in the repository"):
            await none_at_start.load("nope")
        await none_at_start.unload("tiny")  # not loaded: nothing to do
        await some.load_all()
        served = [m.name for m in some.loaded()]
        await none_at_start.close()
        await some.close()
        return ready, index, served

    ready, index, served = asyncio.run(scenario())
    assert ready  # nothing loaded, and models can be loaded later: ready, as Triton
    states = {(i["name"], i["state"], i["reason"].split(":")[0]) for i in index}
    assert states == {
        ("bad", "UNAVAILABLE", "not loaded"),
        ("other", "UNAVAILABLE", "not loaded"),
        ("tiny", "UNAVAILABLE", "not loaded"),
    }
    assert served == ["other"]


def test_a_first_load_is_loading_until_warm_and_unavailable_with_why_if_it_fails(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "repo"
    write_tiny(repo / "tiny")
    (repo / "gone").mkdir()
    (repo / "gone" / "config.yaml").write_text("max_batch_size: 8\n")
    release = asyncio.Event

    class Held(Registry):
        gate: asyncio.Event

        async def _load(self, *args: Any, **kwargs: Any) -> Any:
            await self.gate.wait()
            return await super()._load(*args, **kwargs)

    registry = Held(settings_for(repo, tmp_path, control="explicit", startup=[]))

    async def scenario() -> tuple[list[str], list[dict[str, str]]]:
        registry.gate = release()
        await registry.load_all()
        loading = asyncio.ensure_future(registry.load("tiny"))
        await asyncio.sleep(0.01)
        seen = [i["state"] for i in await registry.index() if i["name"] == "tiny"]
        with pytest.raises(Unavailable, match="is loading"):
            registry.get("tiny")
        registry.gate.set()
        await loading
        seen += [i["state"] for i in await registry.index() if i["name"] == "tiny"]
        with pytest.raises(BadRequest, match="does not exist"):
            await registry.load("gone")
        failed = [i for i in await registry.index() if i["name"] == "gone"]
        await registry.close()
        return seen, failed

    seen, failed = asyncio.run(scenario())
    assert seen == ["LOADING", "READY"]
    (entry,) = failed
    assert entry["state"] == "UNAVAILABLE" and entry["reason"].startswith("load failed:")


def test_loading_leaves_the_heap_frozen(tmp_path: Path) -> None:
    """What the load made (imports, sessions, compiled graphs on a GPU) is out of the
    collector's sight once the registry is ready (``engines.heap.freeze_heap``)."""
    import gc

    write_tiny(tmp_path / "repo" / "tiny")
    write_tiny(tmp_path / "repo" / "later", autoload=False)  # loaded only when asked
    registry = Registry(settings_for(tmp_path / "repo", tmp_path))
    gc.unfreeze()

    async def scenario() -> tuple[int, int, int]:
        before = gc.get_freeze_count()
        await registry.load_all()
        frozen = gc.get_freeze_count()
        gc.unfreeze()
        await registry.load("later")  # a first load while serving: nothing retired
        again = gc.get_freeze_count()
        await registry.close()
        return before, frozen, again

    before, frozen, again = asyncio.run(scenario())
    assert before == 0 and frozen > 0 and again > 0
