"""Poll mode (``models.control: poll``), Triton's ``--model-control-mode=poll``: every
``models.poll_s`` the repository's folders are compared with what each model was loaded from
(``app.engine.folders.fingerprint``: file names, sizes and modification times).

A model whose files changed is reloaded (its old version serves until the new one is warm; a
change that does not load leaves it serving and says why), a new folder is loaded when its
config autoloads or ``models.models`` names it, and a model whose folder is gone is unloaded
and forgotten (404, absent from the index; put back, it is a new folder). A change is tried
once: a load that failed is tried again when the files change again, not at every poll.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path

from app.engine.folders import ConfigError, Files, fingerprint
from app.engine.registry import Registry
from app.engine.repository import load_config
from app.errors import StokerError
from app.settings import Settings

log = logging.getLogger(__name__)


def changes(settings: Settings, known: Mapping[str, Files | None]) -> list[tuple[str, bool]]:
    """What to do after a look at the repository, in order: (model, True) to load or
    reload it, (model, False) to remove it (its folder is gone). ``known``: per model the
    registry knows, the files it was last loaded from."""
    repository, named = settings.models.repository, settings.models.models
    found: dict[str, Files] = {}
    todo: list[tuple[str, bool]] = []
    for path in sorted(repository.glob("*/config.yaml")):
        folder = path.parent
        if folder.name.startswith(".") or (named and folder.name not in named):
            continue
        files = found[folder.name] = fingerprint(folder)
        if folder.name in known:
            if files != known[folder.name]:
                todo.append((folder.name, True))
        elif named or autoloads(folder, settings):
            todo.append((folder.name, True))
    todo.extend((name, False) for name in known if name not in found)
    return todo


def autoloads(folder: Path, settings: Settings) -> bool:
    """Whether a new folder's config asks to be loaded (one that does not parse is loaded,
    so that its error is reported)."""
    try:
        return load_config(folder, settings.models).config.autoload
    except ConfigError:
        return True


async def watch(registry: Registry, every_s: float) -> None:
    """Apply the repository's changes every ``every_s``, until cancelled."""
    while True:
        await asyncio.sleep(every_s)
        todo = await asyncio.to_thread(changes, registry.settings, registry.known_files())
        for name, load in todo:
            log.info(
                "poll: model %s %s", name, "changed: loading" if load else "removed: unloading"
            )
            try:
                if load:
                    await registry.load(name)
                else:
                    await registry.remove(name)
            except StokerError as error:
                log.warning("poll: model %s: %s", name, error.message)
            except Exception as error:
                log.error("poll: model %s: %r", name, error, exc_info=error)
