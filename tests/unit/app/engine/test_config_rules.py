"""What any model config is held to, whoever wrote it: paths inside the model's folder, a model
folder inside the repository, handlers the operator allows, numbers within ``models.bounds``,
a config.yaml of bounded size without aliases or deep nesting, and names a file system takes.
The configs the repository ships pass."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

import zoo
from app.engine.folders import ConfigError, check_folder, inside, model_folder
from app.engine.models import prepare
from app.engine.registry import Registry
from app.engine.repository import discover, load_config, parse_config
from app.errors import BadRequest
from app.settings import ModelRepositorySettings, Settings
from tests.conftest import ROOT


def folder_with(root: Path, name: str, config: str) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(config)
    return folder


def refused(folder: Path, raw: object, rules: ModelRepositorySettings | None = None) -> str:
    with pytest.raises(ConfigError) as refusal:
        parse_config(folder, raw, "the config", rules)
    return str(refusal.value)


@pytest.mark.parametrize("name", ["efficientnet_lite0", "resnet50"])
def test_the_shipped_configs_pass_the_default_rules(name: str) -> None:
    entry = load_config(ROOT / "models" / name)
    assert entry.config.max_batch_size > 0


@pytest.mark.parametrize("runners", [0, 4, 8])
def test_the_gpu_benchmarks_config_passes_the_default_rules(tmp_path: Path, runners: int) -> None:
    """ResNet-50 at max batch 256 with the GPU default of runners, or up to 8 of them."""
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "gpu_repo.py"),
            str(tmp_path),
            "--runners",
            str(runners),
        ],
        check=True,
        capture_output=True,
    )
    config = load_config(tmp_path / "resnet50").config
    assert config.max_batch_size == 256
    assert config.runner_count("torch") == (runners or 4)


@pytest.mark.parametrize(
    "path",
    ["/etc/passwd", "../other/model.onnx", "sub/../../x", "/proc/self/environ", "a\x00b", ""],
)
def test_a_path_out_of_the_folder_is_refused(tmp_path: Path, path: str) -> None:
    folder = folder_with(tmp_path, "m", "")
    with pytest.raises(ConfigError, match="model's folder"):
        inside(folder, path, "labels")
    assert "model's folder" in refused(folder, {"labels": path})
    assert "model's folder" in refused(folder, {"onnx": path})
    assert "model's folder" in refused(folder, {"int8": {"calibration": path}})


def test_a_symlink_is_followed_only_within_the_folder(tmp_path: Path) -> None:
    folder = folder_with(tmp_path, "m", "")
    (tmp_path / "secret.txt").write_text("root:x:0:0\n")
    (folder / "leak.txt").symlink_to(tmp_path / "secret.txt")
    (folder / "real.txt").write_text("cat\ndog\n")
    (folder / "alias.txt").symlink_to("real.txt")
    (folder / "loop").symlink_to("loop")
    assert "leads out of the model's folder" in refused(folder, {"labels": "leak.txt"})
    assert "leads out of the model's folder" in refused(folder, {"labels": "loop"})
    assert inside(folder, "alias.txt", "labels") == folder / "alias.txt"
    assert inside(folder, "sub/../real.txt", "labels") == folder / "sub/../real.txt"
    # A symlink put in after the config was read is caught where the labels are read.
    entry = parse_config(folder, {"labels": "real.txt"}, "the config")
    assert entry.labels() == ["cat", "dog"]
    (folder / "real.txt").unlink()
    (folder / "real.txt").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(ConfigError, match="leads out"):
        entry.labels()
    # config.yaml itself, too.
    linked = tmp_path / "linked"
    linked.mkdir()
    (tmp_path / "elsewhere.yaml").write_text("max_batch_size: 4\n")
    (linked / "config.yaml").symlink_to(tmp_path / "elsewhere.yaml")
    with pytest.raises(ConfigError, match=r"^model 'linked': config.yaml: 'config.yaml' leads out"):
        load_config(linked)


def test_a_model_folder_linked_out_of_the_repository_is_refused(tmp_path: Path) -> None:
    repository = tmp_path / "repository"
    folder_with(repository, "real", "")
    folder_with(tmp_path, "outside", "")
    (repository / "out").symlink_to(tmp_path / "outside", target_is_directory=True)
    (repository / "alias").symlink_to("real", target_is_directory=True)
    check_folder(repository, repository / "alias")
    with pytest.raises(ConfigError, match=r"^model 'out': its folder is a link out of the repo"):
        check_folder(repository, repository / "out")
    with pytest.raises(ConfigError, match="link out of the repository"):
        discover(repository, [])


def test_a_handler_is_built_in_or_allowed_by_the_operator(tmp_path: Path) -> None:
    folder = folder_with(tmp_path, "m", "")
    for handler in ("sys:exit", "os:system", "app.engine.handlers:ImageClassifier"):
        assert "models.handlers lists" in refused(folder, {"handler": handler})
    for handler in ("image-classifier", "none"):
        assert parse_config(folder, {"handler": handler}, "x").config.handler == handler
    allowed = ModelRepositorySettings(handlers=["mine.handlers:Tabular"])
    entry = parse_config(folder, {"handler": "mine.handlers:Tabular"}, "x", allowed)
    assert entry.config.handler == "mine.handlers:Tabular"
    # The rule holds for the operator's config.yaml too.
    folder_with(tmp_path, "n", "handler: sys:exit\n")
    with pytest.raises(ConfigError, match=r"models\.handlers lists"):
        load_config(tmp_path / "n")


BOUNDS = [
    ({"max_batch_size": 256}, {"max_batch_size": 257}, "max_batch_size"),
    ({"runners": 8}, {"runners": 9}, "max_runners_per_device"),
    # Per device: two GPUs take twice the runners.
    ({"runners": 16, "gpus": [0, 1]}, {"runners": 17, "gpus": [0, 1]}, "max_runners_per_device"),
    # The runners bound is per listed GPU, so the list is bounded too.
    ({"gpus": list(range(16))}, {"gpus": list(range(17)), "runners": 17}, "max_gpus"),
    (
        {"preprocess": {"resize_shorter": 1024, "crop": 1024}},
        {"preprocess": {"resize_shorter": 8000, "crop": 224}},
        "max_image_side",
    ),
    ({"preprocess": {"crop": 1024}}, {"preprocess": {"crop": 1025}}, "max_image_side"),
    # A max batch of a declared tensor, or of the preprocessing's rows (as FP32), within 1 GiB.
    (
        {"max_batch_size": 256, "inputs": [{"name": "x", "datatype": "FP32", "shape": [2**20]}]},
        {
            "max_batch_size": 256,
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [2**20 + 1]}],
        },
        "max_batch_bytes",
    ),
    (
        {"outputs": [{"name": "y", "datatype": "UINT8", "shape": [-1, 2**30]}]},
        {"outputs": [{"name": "y", "datatype": "FP64", "shape": [1000, 1000, 1000]}]},
        "max_batch_bytes",
    ),
    # All the declared tensors together: each runner holds a max batch of every one.
    (
        {"inputs": [{"name": f"x{i}", "datatype": "UINT8", "shape": [2**28]} for i in range(4)]},
        {"inputs": [{"name": f"x{i}", "datatype": "UINT8", "shape": [2**28]} for i in range(5)]},
        "max_batch_bytes",
    ),
    (
        {"max_batch_size": 256, "preprocess": {"resize_shorter": 512, "crop": 512}},
        {"max_batch_size": 256, "preprocess": {"resize_shorter": 1024, "crop": 1024}},
        "max_batch_bytes",
    ),
    (
        {"dynamic_batching": {"max_queue_size": 65536}},
        {"dynamic_batching": {"max_queue_size": 65537}},
        "max_queue_size",
    ),
    (
        {"dynamic_batching": {"priority_levels": 16}},
        {"dynamic_batching": {"priority_levels": 10**8}},
        "max_priority_levels",
    ),
    (
        {"int8": {"samples": 9800}, "accuracy": {"evaluation_samples": 200}},
        {"int8": {"samples": 9801}, "accuracy": {"evaluation_samples": 200}},
        "max_samples",
    ),
]


@pytest.mark.parametrize("at, past, setting", BOUNDS)
def test_numbers_are_bounded_by_settings(
    tmp_path: Path, at: dict[str, object], past: dict[str, object], setting: str
) -> None:
    folder = folder_with(tmp_path, "m", "")
    parse_config(folder, at, "the config")
    message = refused(folder, past)
    assert f"(models.bounds.{setting})" in message and message.startswith("the config: ")
    # The operator may raise a bound.
    raised = ModelRepositorySettings(bounds={setting: 10**12})  # type: ignore[arg-type]
    parse_config(folder, past, "the config", raised)


def test_every_problem_is_said_at_once(tmp_path: Path) -> None:
    folder = folder_with(tmp_path, "m", "")
    message = refused(folder, {"max_batch_size": 10**6, "labels": "/etc/shadow", "handler": "a:b"})
    assert "max_batch_size: 1000000 is more than 256" in message
    assert "labels:" in message and "handler:" in message


def test_config_yaml_has_a_size_limit_and_no_aliases_or_deep_nesting(tmp_path: Path) -> None:
    large = folder_with(tmp_path, "large", "# padding\n" * 7000)
    with pytest.raises(ConfigError, match=r"larger than 65536 bytes \(models.max_config_bytes\)"):
        load_config(large)
    load_config(large, ModelRepositorySettings(max_config_bytes=70_001))
    bomb = "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
        f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n"
        for p, c in zip("abcdefgh", "bcdefghi", strict=True)
    )
    with pytest.raises(ConfigError, match=r"^model 'bomb': config.yaml: not valid YAML.*aliases"):
        load_config(folder_with(tmp_path, "bomb", bomb))
    deep = folder_with(tmp_path, "deep", "[" * 30_000 + "]" * 30_000)
    with pytest.raises(ConfigError, match=r"^model 'deep': config.yaml: nested too deeply$"):
        load_config(deep)
    latin = folder_with(tmp_path, "latin", "")
    (latin / "config.yaml").write_bytes("name: café\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(latin)


def test_a_config_given_with_a_load_may_not_rename_the_model(tmp_path: Path) -> None:
    repository = tmp_path / "repository"
    folder_with(repository, "m", "")
    registry = Registry(
        Settings(
            models={"repository": repository, "control": "explicit", "startup": []},  # type: ignore[arg-type]
            store={"path": tmp_path / "store"},  # type: ignore[arg-type]
        )
    )

    async def scenario() -> None:
        with pytest.raises(BadRequest, match="name 'other' is not the model's"):
            await registry.load("m", {"name": "other"})
        with pytest.raises(BadRequest, match=r"models\.bounds\.max_batch_size"):
            await registry.load("m", {"max_batch_size": 100_000})

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "name", ["a" * 256, "é" * 128, "a\x00b", "a/b", "..", ".hidden", "", "\ud800" * 100]
)
def test_a_name_no_file_system_takes_is_no_model(tmp_path: Path, name: str) -> None:
    folder_with(tmp_path, "a" * 255, "")
    assert model_folder(tmp_path, "a" * 255) == tmp_path / ("a" * 255)
    assert model_folder(tmp_path, name) is None


def test_a_yaml_written_config_round_trips(tmp_path: Path) -> None:
    """What ``yaml.safe_dump`` writes (the tools' configs) is read back without aliases."""
    config = {"max_batch_size": 8, "dynamic_batching": {"preferred_batch_size": [4, 8]}}
    folder = folder_with(tmp_path, "m", yaml.safe_dump(config))
    assert load_config(folder).config.dynamic_batching.preferred_batch_size == [4, 8]


def test_a_path_with_a_name_longer_than_a_file_system_takes_is_refused(tmp_path: Path) -> None:
    """A 300-byte name was an OSError from the file system (a 500 with a traceback)."""
    folder = folder_with(tmp_path, "m", "")
    assert "longer than 255 bytes" in refused(folder, {"onnx": "a" * 300})
    assert "longer than 255 bytes" in refused(folder, {"labels": "x/" + "b" * 256})


def refusal_of(read: Callable[[], object]) -> BaseException:
    try:
        read()
    except Exception as error:  # what the test looks at
        return error
    raise AssertionError("read without a refusal")


def in_a_thread(read: Callable[[], object]) -> BaseException:
    """The refusal of ``read``, run in a thread that must end within a minute."""
    done: list[BaseException] = []
    reader = threading.Thread(target=lambda: done.append(refusal_of(read)), daemon=True)
    reader.start()
    reader.join(60)
    assert not reader.is_alive(), "the read blocked"
    return done[0]


def test_labels_are_read_only_from_a_regular_file_of_bounded_size(tmp_path: Path) -> None:
    """A FIFO named as labels held the loading thread until someone wrote to it; any file in
    the folder (the ONNX file itself) was read whole."""
    folder = folder_with(tmp_path, "m", "")
    os.mkfifo(folder / "pipe")
    entry = parse_config(folder, {"labels": "pipe"}, "the config")
    assert "not a regular file" in str(in_a_thread(entry.labels))
    (folder / "big.txt").write_bytes(b"x\n" * (2 * 1024 * 1024 + 1))  # 4 MiB and 2 bytes
    with pytest.raises(ConfigError, match="larger than a labels file's"):
        parse_config(folder, {"labels": "big.txt"}, "the config").labels()
    (folder / "labels.txt").write_text("cat\ndog\n")
    assert parse_config(folder, {"labels": "labels.txt"}, "the config").labels() == ["cat", "dog"]


def test_a_fifo_config_yaml_is_refused_without_blocking(tmp_path: Path) -> None:
    """A FIFO config.yaml held poll mode's thread (and the server's stop) for good."""
    folder = tmp_path / "f"
    folder.mkdir()
    os.mkfifo(folder / "config.yaml")
    refusal = in_a_thread(lambda: load_config(folder))
    assert isinstance(refusal, ConfigError) and "cannot read it" in str(refusal)


def test_a_load_may_not_choose_a_generator_and_none_replaces_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load's config naming a generator had it write its ONNX over the operator's
    model.onnx (a 280-byte model became 102 MB of random ResNet-50)."""
    repository = tmp_path / "repository"
    folder = folder_with(repository, "m", "")
    (folder / "model.onnx").write_bytes(b"the operator's model")
    registry = Registry(
        Settings(
            models={"repository": repository, "control": "explicit", "startup": []},  # type: ignore[arg-type]
            store={"path": tmp_path / "store"},  # type: ignore[arg-type]
        )
    )

    async def scenario() -> None:
        with pytest.raises(BadRequest, match="generator 'resnet50' is not the one its config"):
            await registry.load("m", {"generator": "resnet50", "onnx": "missing.onnx"})

    asyncio.run(scenario())
    assert (folder / "model.onnx").read_bytes() == b"the operator's model"

    # A generator the operator names writes only what is missing, never over a file (a
    # stand-in generator: what is tested is how its files are put in place).
    def generate(scratch: Path) -> None:
        (scratch / "model.onnx").write_bytes(b"generated")
        (scratch / "labels.txt").write_text("generated\n")

    monkeypatch.setitem(zoo.GENERATORS, "stand-in", generate)
    entry = load_config(folder_with(repository, "g", "generator: stand-in\n"))
    (entry.folder / "model.onnx").write_bytes(b"kept")
    prepare(entry)
    assert (entry.folder / "model.onnx").read_bytes() == b"kept"
    assert (entry.folder / "labels.txt").read_text() == "generated\n"
    files = sorted(p.name for p in entry.folder.iterdir())
    assert files == ["config.yaml", "labels.txt", "model.onnx"]
