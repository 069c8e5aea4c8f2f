"""The engine store survives killed builds, corrupted files and concurrent builders."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from engines.store import EngineKey, EngineStore

KEY = EngineKey(
    model="m",
    model_hash="abc",
    precision="int8",
    backend="onnxruntime",
    backend_version="1.0",
    device="cpu-x86_64",
    profile=(1, 8, 32),
    options={"calibrator": "entropy", "exclude_nodes": ("a", "b"), "samples": 500},
)


def write(content: bytes) -> Callable[[Path], dict[str, int]]:
    def build(path: Path) -> dict[str, int]:
        path.write_bytes(content)
        return {"answer": 42}

    return build


def test_build_once_then_load_with_manifest(tmp_path: Path) -> None:
    store = EngineStore(tmp_path)
    calls = []

    def build(path: Path) -> dict[str, int]:
        calls.append(path)
        path.write_bytes(b"engine")
        return {"top1": 1}

    first = store.get_or_build(KEY, build, ".onnx")
    second = store.get_or_build(KEY, build, ".onnx")
    # A new process reads the manifest back from JSON (tuples became lists): still a match.
    third = EngineStore(tmp_path).get_or_build(KEY, build, ".onnx")
    assert len(calls) == 1 and third.path == first.path
    assert first.path == second.path and first.path.read_bytes() == b"engine"
    assert second.extra == {"top1": 1}
    assert second.manifest["key"] == KEY.as_json()


def test_every_key_field_separates_files(tmp_path: Path) -> None:
    store = EngineStore(tmp_path)
    variants = [
        KEY,
        EngineKey(**{**KEY.as_json(), "model_hash": "abd", "profile": (1, 8, 32)}),
        EngineKey(**{**KEY.as_json(), "device": "NVIDIA H200 sm_90", "profile": (1, 8, 32)}),
        EngineKey(**{**KEY.as_json(), "profile": (1, 16, 32)}),
        EngineKey(**{**KEY.as_json(), "options": {"calibrator": "minmax"}, "profile": (1, 8, 32)}),
        EngineKey(
            **{**KEY.as_json(), "options": {**KEY.options, "samples": 501}, "profile": (1, 8, 32)}
        ),
        EngineKey(**{**KEY.as_json(), "backend_version": "1.1", "profile": (1, 8, 32)}),
    ]
    paths = {store.path_for(k, ".onnx") for k in variants}
    assert len(paths) == len(variants)


def test_corrupted_file_is_rebuilt_not_loaded(tmp_path: Path) -> None:
    store = EngineStore(tmp_path)
    stored = store.get_or_build(KEY, write(b"good engine"), ".onnx")
    stored.path.write_bytes(b"good enginf")  # one flipped byte
    assert store.load(KEY, ".onnx") is None
    rebuilt = store.get_or_build(KEY, write(b"rebuilt"), ".onnx")
    assert rebuilt.path.read_bytes() == b"rebuilt"


def test_foreign_manifest_is_rebuilt(tmp_path: Path) -> None:
    store = EngineStore(tmp_path)
    stored = store.get_or_build(KEY, write(b"x"), ".onnx")
    manifest = stored.path.with_name(stored.path.name + ".manifest.json")
    data = json.loads(manifest.read_text())
    data["key"]["device"] = "some other GPU"
    manifest.write_text(json.dumps(data))
    assert store.load(KEY, ".onnx") is None
    assert store.get_or_build(KEY, write(b"y"), ".onnx").path.read_bytes() == b"y"


def test_file_without_manifest_is_never_loaded(tmp_path: Path) -> None:
    store = EngineStore(tmp_path)
    path = store.path_for(KEY, ".onnx")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"dropped here by hand")
    assert store.load(KEY, ".onnx") is None


def test_failed_build_leaves_nothing(tmp_path: Path) -> None:
    store = EngineStore(tmp_path)

    def broken(path: Path) -> None:
        path.write_bytes(b"half")
        raise RuntimeError("parser error")

    with pytest.raises(RuntimeError):
        store.get_or_build(KEY, broken, ".onnx")
    assert store.load(KEY, ".onnx") is None
    assert [
        p.name for p in tmp_path.rglob("*") if p.is_file() and not p.name.endswith(".lock")
    ] == []


def _slow_build(root: str, marker: str) -> None:
    store = EngineStore(Path(root))

    def build(path: Path) -> None:
        with open(marker, "a") as f:
            f.write(f"{os.getpid()}\n")
        path.write_bytes(b"partial")
        time.sleep(0.5)
        path.write_bytes(b"complete engine")

    store.get_or_build(KEY, build, ".onnx")


def test_killed_build_never_leaves_a_loadable_file(tmp_path: Path) -> None:
    marker = tmp_path / "builds.txt"
    ctx = multiprocessing.get_context("spawn")
    victim = ctx.Process(target=_slow_build, args=(str(tmp_path / "store"), str(marker)))
    victim.start()
    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(victim.pid or 0, signal.SIGKILL)
    victim.join()
    store = EngineStore(tmp_path / "store")
    assert store.load(KEY, ".onnx") is None
    rebuilt = store.get_or_build(KEY, write(b"fresh"), ".onnx")
    assert rebuilt.path.read_bytes() == b"fresh"
    leftovers = [p.name for p in rebuilt.path.parent.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


def test_two_concurrent_builders_build_once(tmp_path: Path) -> None:
    marker = tmp_path / "builds.txt"
    ctx = multiprocessing.get_context("spawn")
    builders = [
        ctx.Process(target=_slow_build, args=(str(tmp_path / "store"), str(marker)))
        for _ in range(2)
    ]
    for process in builders:
        process.start()
    for process in builders:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert len(marker.read_text().split()) == 1
    stored = EngineStore(tmp_path / "store").load(KEY, ".onnx")
    assert stored is not None and stored.path.read_bytes() == b"complete engine"


def test_a_discarded_entry_is_built_again(tmp_path: Path) -> None:
    """What verifies but its backend cannot load is discarded, and the next lookup builds."""
    store = EngineStore(tmp_path)
    store.get_or_build(KEY, write(b"refused"), ".bin")
    store.discard(KEY, ".bin", "its backend could not load it")
    assert store.load(KEY, ".bin") is None
    assert store.get_or_build(KEY, write(b"good"), ".bin").path.read_bytes() == b"good"


def test_the_store_times_each_model_s_lookups_builds_and_compiles(tmp_path: Path) -> None:
    """Per model: lookups, builds, and compiles (the ``aoti`` kind) apart; a build nested in
    a build (a variant's calibration) counted once, as the outer build's time."""
    store = EngineStore(tmp_path)
    calibration = EngineKey("m", "abc", "int8", "onnxruntime", "1.0", "cpu", kind="calibration")

    def variant(path: Path) -> None:
        time.sleep(0.05)
        store.get_or_build(calibration, write(b"table"), ".json")
        path.write_bytes(b"variant")

    store.get_or_build(KEY, variant, ".onnx")
    package = EngineKey("m", "abc", "fp16", "torch", "2.11", "H200", kind="aoti")
    store.get_or_build(package, write(b"package"), ".pt2")
    first = store.phases.of("m")
    assert set(first) == {"store lookup", "build", "compile"}
    assert 0.05 <= first["build"] < 5 and first["compile"] > 0
    assert store.phases.of("other") == {}

    again = EngineStore(tmp_path)  # a restart: everything found
    again.get_or_build(KEY, variant, ".onnx")
    again.get_or_build(package, write(b"package"), ".pt2")
    assert set(again.phases.of("m")) == {"store lookup"}
