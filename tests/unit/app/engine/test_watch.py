"""Poll mode's look at the repository: what changed since each model was loaded, which new
folders load, which removed ones go; a folder's files as poll mode sees them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from app.engine.folders import Files, fingerprint
from app.engine.watch import changes
from app.settings import Settings


def folder(repo: Path, name: str, config: str = "max_batch_size: 8\n") -> Path:
    path = repo / name
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(config)
    (path / "model.onnx").write_bytes(b"onnx")
    return path


def settings(repo: Path, **models: Any) -> Settings:
    return Settings(models={"repository": repo, "control": "poll", **models})  # type: ignore[arg-type]


def test_a_changed_file_reloads_and_an_unchanged_folder_does_nothing(tmp_path: Path) -> None:
    same, changed = folder(tmp_path, "same"), folder(tmp_path, "changed")
    known = {"same": fingerprint(same), "changed": fingerprint(changed)}
    assert changes(settings(tmp_path), known) == []
    (changed / "model.onnx").write_bytes(b"a new onnx")  # another size
    (same / ".scratch").write_bytes(b"hidden files are not the model's")
    assert changes(settings(tmp_path), known) == [("changed", True)]
    stamp = (changed / "config.yaml").stat().st_mtime_ns + 10**9
    os.utime(changed / "config.yaml", ns=(stamp, stamp))  # the same size, a new time
    known["changed"] = fingerprint(changed)
    os.utime(changed / "config.yaml", ns=(stamp + 10**9, stamp + 10**9))
    assert changes(settings(tmp_path), known) == [("changed", True)]


def test_new_folders_load_when_they_autoload_and_removed_ones_unload(tmp_path: Path) -> None:
    folder(tmp_path, "new")
    folder(tmp_path, "manual", "autoload: false\n")
    folder(tmp_path, "broken", "max_batch_size: [\n")  # loaded, so that its error is said
    folder(tmp_path, ".hidden")
    known: dict[str, Files | None] = {"gone": fingerprint(tmp_path / "gone"), "failed": ()}
    # Gone, loaded or not (a first load failed): both removed, so that both leave the index.
    assert changes(settings(tmp_path), known) == [
        ("broken", True),
        ("new", True),
        ("gone", False),
        ("failed", False),
    ]
    # With models named, only those are looked at, autoload or not.
    named = settings(tmp_path, models=["manual"])
    assert changes(named, {}) == [("manual", True)]


def test_a_load_that_failed_is_tried_again_only_once_its_files_change(tmp_path: Path) -> None:
    path = folder(tmp_path, "m", "max_batch_size: nope\n")
    known = {"m": fingerprint(path)}  # its load failed with these files
    assert changes(settings(tmp_path), known) == []
    (path / "config.yaml").write_text("max_batch_size: 4\n")
    assert changes(settings(tmp_path), known) == [("m", True)]
