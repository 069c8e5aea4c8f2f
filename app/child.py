"""What every child process of the supervisor does the same way: follow the supervisor's
death (``supervised``), report a failed model load (``watch_loading``), and, as a
diagnostic, profile itself (``profiled``). Light: the engine and the front ends import it,
and it imports neither."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
PR_SET_PDEATHSIG = 1


def supervised() -> None:
    """Called first in a child (the engine, a front end): it gets SIGTERM, and drains, when
    the supervisor dies however it dies (Linux's parent-death signal), so a killed
    supervisor never leaves servers behind holding the port; and it leaves the terminal's
    process group, so a Ctrl-C reaches the supervisor alone, which then stops the children
    once, in order."""
    os.setpgrp()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        os.kill(os.getpid(), signal.SIGTERM)  # the supervisor died before the signal was armed


class Failing(Protocol):
    failed: BaseException | None


def watch_loading(
    task: asyncio.Task[None], owner: Failing, on_failure: Callable[[], None] | None
) -> None:
    """When ``task`` (loading every model) fails: keep the error on ``owner`` (liveness
    reads it), log it once, and call ``on_failure`` (the process then stops non-zero)."""

    def loaded(done: asyncio.Task[None]) -> None:
        if done.cancelled() or done.exception() is None:
            return
        owner.failed = done.exception()
        log.error("model loading failed: %s", owner.failed)
        if on_failure is not None:
            on_failure()

    task.add_done_callback(loaded)


def profiled(path: str | None, process: str, call: Callable[..., T], *args: Any) -> T:
    """``call(*args)``, under cProfile when ``path`` is set (a pstats file written there at
    exit: where the process's loop spent its time), and sampled thread by thread when
    ``STOKER_SAMPLE_DIR`` is set (``engines.sampler``; ``process`` names the record)."""
    from engines.sampler import sampled

    sampler = sampled(process)
    try:
        if not path:
            return call(*args)
        import cProfile

        profiler = cProfile.Profile()
        try:
            return profiler.runcall(call, *args)
        finally:
            profiler.dump_stats(path)
    finally:
        if sampler is not None:
            sampler.stop()
