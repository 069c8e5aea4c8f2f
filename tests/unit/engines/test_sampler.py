"""The sampling profiler: every thread's stacks, counted, in the collapsed form the summary
script reads."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from engines.sampler import Sampler


def spin_in_a_named_function(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def wait_in_another(stop: threading.Event) -> None:
    stop.wait()


def test_each_thread_is_sampled_with_its_own_stack(tmp_path: Path) -> None:
    stop = threading.Event()
    busy = threading.Thread(target=spin_in_a_named_function, args=(stop,), name="busy-one")
    idle = threading.Thread(target=wait_in_another, args=(stop,), name="idle-one")
    busy.start()
    idle.start()
    path = tmp_path / "record.txt"
    sampler = Sampler(path, "test", interval_s=0.001).start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # until both threads were seen a few times
        time.sleep(0.05)
        seen = {thread for thread, _ in sampler._counts}
        if {"busy-one", "idle-one"} <= seen and sum(sampler._counts.values()) > 40:
            break
    sampler.stop()
    stop.set()
    busy.join()
    idle.join()
    header, *lines = path.read_text().splitlines()
    assert header.startswith("# test: ") and "tick lateness" in header
    counts: dict[str, int] = {}
    for line in lines:
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        assert frames[0] == "process test"
        assert frames[1].startswith("thread ")
        assert "stoker-sampler" not in frames[1]  # it leaves itself out
        counts[stack] = int(count)
    busy_stacks = [s for s in counts if s.split(";")[1] == "thread busy-one"]
    assert busy_stacks and all("spin_in_a_named_function (" in s for s in busy_stacks)
    # outermost first: the thread's bootstrap before the target
    assert all(s.index("_bootstrap") < s.index("spin_in_a_named_function") for s in busy_stacks)
    idle_stacks = [s for s in counts if s.split(";")[1] == "thread idle-one"]
    assert idle_stacks and all("wait_in_another (" in s for s in idle_stacks)
    summary = subprocess.run(
        [sys.executable, "scripts/pyspy_summary.py", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "## process test:" in summary and "thread busy-one" in summary


def test_ticks_count_only_while_the_window_file_exists(tmp_path: Path) -> None:
    window = tmp_path / "open"
    sampler = Sampler(tmp_path / "record.txt", "test", 0.001, while_path=window).start()
    started = time.monotonic()
    while time.monotonic() - started < 0.2:  # 200 ticks' time with the window shut
        time.sleep(0.01)
    shut = len(sampler._lags)
    window.touch()
    deadline = time.monotonic() + 30
    while len(sampler._lags) < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    window.unlink()
    sampler.stop()
    assert shut == 0
    assert len(sampler._lags) >= 20
    assert (tmp_path / "record.txt").read_text().startswith("# test: ")
