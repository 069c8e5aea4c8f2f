"""The collector's view of a server process's heap: frozen once it is set up (the engine's
models loaded, a front end's app made), thawed to free what an unload left."""

from __future__ import annotations

import asyncio
import gc
import weakref
from pathlib import Path

from app.engine import models
from app.frontend.server import create_app
from engines.heap import freeze_heap
from tests.unit.app.engine.test_models import settings_for, write_tiny


class Cycle:
    """An object that refers to itself: freed only by the collector, as an engine is."""

    def __init__(self) -> None:
        self.me = self


def test_the_heap_frozen_at_load_is_thawed_to_free_what_an_unload_left() -> None:
    """Once loaded, what lives is out of the collector's sight (a full collection skips it);
    ``release_memory`` after an unload thaws it, collects the cycles that went, and freezes
    the rest again."""
    held = Cycle()
    alive = weakref.ref(held)
    freeze_heap()
    assert gc.get_freeze_count() > 0 and gc.get_count()[2] == 0
    del held  # the version is unloaded: its cycle is garbage, but frozen
    gc.collect()
    assert alive() is not None  # a full collection did not scan it
    models.release_memory()
    assert alive() is None
    assert gc.get_freeze_count() > 0  # what is left is frozen again


def test_a_front_end_freezes_its_heap_once_its_app_is_made(tmp_path: Path) -> None:
    write_tiny(tmp_path / "repo" / "tiny")
    app = create_app(settings_for(tmp_path / "repo", tmp_path))
    gc.unfreeze()

    async def scenario() -> int:
        async with app.router.lifespan_context(app):
            return gc.get_freeze_count()

    assert asyncio.run(scenario()) > 0
