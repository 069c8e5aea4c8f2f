"""What a model folder may be and what may be read from it, for any config: a folder
inside the repository, paths inside the folder, only regular files read and never blocking,
names a file system takes; and what poll mode compares of a folder (``fingerprint``)."""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

from app.errors import client_text

MAX_NAME_BYTES = 255
"""The longest file name Linux file systems take: a longer model name is no folder's."""
MAX_LABELS_BYTES = 4 * 1024 * 1024
"""Largest labels file read: 4 MiB holds a million class names; ImageNet's 1,000 take 20 KB."""

log = logging.getLogger(__name__)


class ConfigError(Exception):
    """A model config that cannot be served; the message names the file and the field."""


def read_regular(path: Path, limit: int) -> bytes:
    """At most ``limit`` bytes of the regular file ``path``, opened without blocking: a FIFO
    or a device would hold the reading thread (and the model's lock) until someone writes to
    it, or read without end. Symlinks are followed (a ConfigMap's files are links into its
    ``..data``); ``inside`` has checked where they lead. ``OSError`` for anything else."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        return file.read(limit)


def inside(folder: Path, relative: str, field: str) -> Path:
    """The path ``relative`` (a config's ``field``) names in ``folder``; ``ConfigError``
    where it is absolute or leads out of the folder, by ``..`` or by a symlink."""
    if not relative or "\x00" in relative or Path(relative).is_absolute():
        raise ConfigError(
            f"{field}: '{client_text(relative)}' is not a path inside the model's folder "
            "(give one relative to it)"
        )
    parts = Path(relative).parts
    if any(len(part.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES for part in parts):
        raise ConfigError(
            f"{field}: '{client_text(relative)}' has a name longer than {MAX_NAME_BYTES} bytes"
        )
    path = folder / relative
    try:
        out = not path.resolve().is_relative_to(folder.resolve())
    except (OSError, RuntimeError):  # a symlink loop
        out = True
    if out:
        raise ConfigError(f"{field}: '{client_text(relative)}' leads out of the model's folder")
    return path


def valid_name(name: str) -> bool:
    """Whether ``name`` can be a model folder's: one file name, not hidden, that a file
    system takes (at most ``MAX_NAME_BYTES`` bytes, no NUL)."""
    return (
        bool(name)
        and not name.startswith(".")
        and not any(c in name for c in "/\\\x00")
        and len(name.encode("utf-8", "surrogatepass")) <= MAX_NAME_BYTES
    )


def model_folder(repository: Path, name: str) -> Path | None:
    """The folder of model ``name`` in the repository, if it has a config.yaml (a name
    that is not one folder's is none)."""
    if not valid_name(name):
        return None
    folder = repository / name
    try:
        return folder if (folder / "config.yaml").is_file() else None
    except OSError:
        return None


def version_folders(folder: Path) -> list[str]:
    """The Triton-style numbered version folders (``1/``, ``2/``...) of a model folder."""
    try:
        return sorted(p.name for p in folder.iterdir() if p.name.isdigit() and p.is_dir())
    except OSError:
        return []


def triton_layout(name: str, folders: list[str], onnx: str = "model.onnx") -> str:
    """What to say to a model folder laid out as Triton's (``<model>/1/model.onnx``)."""
    listed = ", ".join(f"{f}/" for f in folders)
    return (
        f"model '{client_text(name)}' has numbered version folders ({listed}), Triton's "
        f"layout: here a model's versions are its precisions (/v2/models/<model>/versions/"
        f"<precision>, listed in its config.yaml's precisions), so put the ONNX file at "
        f"{onnx} in the model's folder, beside its config.yaml"
    )


def without_paths(text: str, roots: dict[Path, str]) -> str:
    """``text`` with each of ``roots`` (in every spelling: as given, absolute, resolved)
    replaced by what it maps to: a model's file named as ``<model>/<file>``, not by the
    server's path."""
    for root, shown in roots.items():
        for form in {str(root.resolve()), str(root.absolute()), str(root)}:
            text = text.replace(form.rstrip("/") + "/", shown)
    return text


def check_folder(repository: Path, folder: Path) -> None:
    """``ConfigError`` where a model's folder is a symlink out of the repository (a model
    folder is the operator's, as the repository is)."""
    try:
        out = not folder.resolve().is_relative_to(repository.resolve())
    except (OSError, RuntimeError):
        out = True
    if out:
        log.warning("model folder %s leads out of the repository %s", folder, repository)
        raise ConfigError(
            f"model '{client_text(folder.name)}': its folder is a link out of the repository"
        )


Files = tuple[tuple[str, int, int], ...]


def fingerprint(folder: Path) -> Files:
    """What poll mode compares: every file of a model folder with its modification time
    and size (hidden ones, such as a generator's scratch folder, left out); empty once the
    folder is gone."""
    try:
        paths = sorted(folder.iterdir())
    except OSError:
        return ()
    files = []
    for path in paths:
        if path.name.startswith("."):
            continue
        try:
            facts = path.stat()
        except OSError:  # removed meanwhile: the next poll sees the folder as it is then
            continue
        if path.is_file():
            files.append((path.name, facts.st_mtime_ns, facts.st_size))
    return tuple(files)
