"""The collector's view of a long-lived process's heap (engine, front end, decode process):
here, beside the engines, so that both rooms and the decode processes use it (it imports
nothing of either).

A server process keeps what it made at start for its whole life: the imports, the app, the
loaded engines, torch's compiled graphs. Python's full collections scan all of it, every
thread of the process stopped meanwhile, although none of it will ever be garbage.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_heap() -> None:
    """Take every object alive now (the imports, the loaded engines, torch's compiled graphs)
    out of the collector's sight (``gc.freeze``), once a process is set up. A full
    collection, which the garbage of requests triggers now and then under load, then scans
    what requests made instead of the hundreds of thousands of objects torch and Inductor
    keep: on a 2-core CPU 36 ms a collection with torch imported, 189 ms after a small
    compile, 0 ms frozen (``scripts/gc_pause.py``), every thread of the process stopped
    meanwhile (the likely cause of
    the half-second stalls of compiled models on the H200, BENCHMARKS.md, runs 46-47; not
    measured there). Garbage in flight
    at that moment (a request's reference cycles) stays until the next thaw:
    ``app.engine.models.release_memory`` thaws all, collects what an unload freed, and
    freezes again."""
    started = time.perf_counter()
    gc.collect()
    took = time.perf_counter() - started
    gc.freeze()
    log.info(
        "%d objects frozen out of the collector's sight (a full collection took %.0f ms)",
        gc.get_freeze_count(),
        took * 1000,
    )
