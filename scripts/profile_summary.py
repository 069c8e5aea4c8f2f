"""Summarise the pstats files ``STOKER_PROFILE_DIR`` collects (the engine and each front end):
per process its requests, its busy time (all but the event loop's wait in epoll) and busy
time per request (the engine's asyncio loop; a front end's uvloop waits where cProfile does
not see it, so its idle time reads 0 and its busy time is an upper bound); then the engine's
and one front end's functions by own time.

    python3 scripts/profile_summary.py DIR [--top N]
"""

from __future__ import annotations

import argparse
import io
import pstats
from pathlib import Path

# Plain functions called once per request (a coroutine counts a call per resumption).
REQUEST_MARK = {"engine": "send_reply", "front": "client_of"}


def summary(path: Path) -> tuple[float, float, int]:
    """(total seconds, seconds waiting in epoll, requests) of one profile."""
    stats = pstats.Stats(str(path))
    total = float(stats.total_tt)  # type: ignore[attr-defined]
    idle, requests = 0.0, 0
    mark = REQUEST_MARK["engine" if path.name.startswith("engine") else "front"]
    for (_, _, name), (_, calls, own, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        if name == "<method 'poll' of 'select.epoll' objects>":
            idle += own
        if name == mark:
            requests += calls
    return total, idle, requests


def top(path: Path, count: int) -> str:
    out = io.StringIO()
    stats = pstats.Stats(str(path), stream=out)
    stats.sort_stats("tottime").print_stats(count)
    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("ncalls"))
    return "\n".join(line[:150] for line in lines[start:] if line.strip())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    files = sorted(args.folder.glob("*.pstats"))
    print("| process | requests | total s | idle s | busy ms/request |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for path in files:
        total, idle, requests = summary(path)
        per = (total - idle) / requests * 1000 if requests else float("nan")
        print(f"| {path.stem} | {requests} | {total:.1f} | {idle:.1f} | {per:.3f} |")
    for path in [f for f in files if f.name.startswith("engine")] + [
        f for f in files if f.name.startswith("front")
    ][:1]:
        print(f"\n-- {path.stem}, by own time")
        print(top(path, args.top))


if __name__ == "__main__":
    main()
