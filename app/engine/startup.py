"""What a model's start spends per phase, and its decode processes started beside its engine.

A load (``app.engine.models.load``) times its phases: what the engine store's users spent
(``EngineStore.phases``: looking artefacts up, building precision variants, compiling, loading
what was found), the rest of making the engine, the runners' CUDA graphs, the warm-up, and the
decode processes, which start while the engine loads. The registry's last start-up line gives
them per version, so a user sees where a slow start went.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from app.engine import images
from app.engine.decoders import close_decoders, gpu_decoders
from app.engine.repository import ModelEntry
from app.settings import Settings


def start_decoders(
    entry: ModelEntry, backend: str, settings: Settings
) -> tuple[list[images.BatchDecode], float]:
    """``gpu_decoders`` started, and the seconds that took."""
    started = time.perf_counter()
    return gpu_decoders(entry, backend, settings), time.perf_counter() - started


async def stop_decoders(decoding: asyncio.Future[tuple[list[images.BatchDecode], float]]) -> None:
    """End the decoders a failed load started beside its engine, once they have started."""
    with contextlib.suppress(Exception):
        decoders, _ = await decoding
        await asyncio.to_thread(close_decoders, decoders)


# The phases of a load, in the order the start-up log gives them: what the engine store's
# users spent (looking up, building variants, compiling, loading what was found), the rest
# of making the engine ("engine": converting, sessions, weights on the device), the runners
# (their buffers and CUDA graphs), the warm-up, and the decode processes started beside.
PHASES = ("store lookup", "build", "compile", "load", "engine", "capture", "warm-up")


def start_phases(
    before: dict[str, float], after: dict[str, float], engine_s: float
) -> dict[str, float]:
    """The store's phases of one load (``after`` less ``before``, ``EngineStore.phases``) and
    the rest of its ``engine_s`` seconds of making the engine as ``engine``."""
    phases = {name: after[name] - before.get(name, 0.0) for name in after}
    phases["engine"] = max(0.0, engine_s - sum(phases.values()))
    return phases


def describe_phases(phases: dict[str, float]) -> str:
    """``store lookup 0.2 s, build 0.0 s, ...; decode processes 6.1 s beside`` for the log."""
    steps = ", ".join(f"{name} {phases.get(name, 0.0):.1f} s" for name in PHASES)
    beside = phases.get("decode processes")
    return steps + ("" if beside is None else f"; decode processes {beside:.1f} s beside")
