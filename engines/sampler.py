"""A sampling profiler of every Python thread of a process, for diagnosis (``STOKER_SAMPLE_DIR``):
the engine, the front ends and the decode processes each start one when it is set.

cProfile (``STOKER_PROFILE_DIR``) follows the event loop's thread alone and charges each call
its overhead; the engine's time at load is spread over its loop, its runners' threads and
its decoders' threads. This samples ``sys._current_frames()`` every ``interval_s`` from a
thread of its own and counts each thread's stack, so a share of samples is a share of wall
time, waits included (a loop idle in ``select`` shows as such). It needs the GIL to take a
sample: how late its ticks come (written in the file's first line) says how contended the
GIL was. With ``STOKER_SAMPLE_WHILE`` set to a path, ticks count only while that file exists,
so a benchmark can open the window on its measured load alone (after warm-up, not at load).

The record is one line a stack, ``process NAME;thread NAME;f (file:line);... COUNT``
(outermost first), the collapsed form flame-graph tools and ``scripts/pyspy_summary.py``
read.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType

MAX_DEPTH = 60


def _stack(frame: FrameType | None) -> tuple[str, ...]:
    frames: list[str] = []
    while frame is not None and len(frames) < MAX_DEPTH:
        code = frame.f_code
        frames.append(f"{code.co_name} ({code.co_filename}:{frame.f_lineno})")
        frame = frame.f_back
    return tuple(reversed(frames))


class Sampler:
    """Counts every thread's stack each ``interval_s`` until ``stop``, then writes them to
    ``path``."""

    def __init__(
        self, path: Path, process: str, interval_s: float = 0.002, while_path: Path | None = None
    ) -> None:
        self._path = path
        self._while = while_path
        self._process = process
        self._interval = interval_s
        self._counts: Counter[tuple[str, tuple[str, ...]]] = Counter()
        self._lags: list[float] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stoker-sampler", daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        me = threading.get_ident()
        due = time.perf_counter()
        while not self._stopping.is_set():
            due += self._interval
            pause = due - time.perf_counter()
            if pause > 0:
                self._stopping.wait(pause)
            now = time.perf_counter()
            late = max(0.0, now - due)
            if late > self._interval:  # behind by more than a tick: count from now
                due = now
            if self._while is not None and not self._while.exists():
                continue
            self._lags.append(late)
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    self._counts[(names.get(ident, f"0x{ident:x}"), _stack(frame))] += 1

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()
        self.write()

    def write(self) -> None:
        lags = sorted(self._lags) or [0.0]
        header = (
            f"# {self._process}: {len(self._lags)} ticks of {self._interval * 1e3:g} ms; "
            f"tick lateness median {lags[len(lags) // 2] * 1e3:.2f} ms, "
            f"p99 {lags[int(len(lags) * 0.99)] * 1e3:.2f} ms (the GIL's contention)\n"
        )
        lines = [
            ";".join((f"process {self._process}", f"thread {thread}", *stack)) + f" {count}\n"
            for (thread, stack), count in self._counts.most_common()
        ]
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._path.write_text(header + "".join(lines), encoding="utf-8")


def sampled(process: str) -> Sampler | None:
    """A started sampler writing ``$STOKER_SAMPLE_DIR/<process>-<pid>.txt`` when that is
    set (``STOKER_SAMPLE_INTERVAL_MS``, default 2; ``STOKER_SAMPLE_WHILE``), else None."""
    folder = os.environ.get("STOKER_SAMPLE_DIR")
    if not folder:
        return None
    interval = float(os.environ.get("STOKER_SAMPLE_INTERVAL_MS", "2")) / 1e3
    path = Path(folder) / f"{process}-{os.getpid()}.txt"
    window = os.environ.get("STOKER_SAMPLE_WHILE")
    return Sampler(path, process, interval, Path(window) if window else None).start()
