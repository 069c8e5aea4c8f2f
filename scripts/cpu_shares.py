"""Cores each process (and its busiest threads) used over a window, from /proc: run it while a
load is on to see which process is CPU-bound (a thread near 1.0 core is).

    python3 scripts/cpu_shares.py --seconds 4
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _times(stat: Path) -> tuple[str, int, int] | None:
    """(name, parent pid, utime + stime in ticks) of a /proc stat file."""
    try:
        text = stat.read_text()
    except OSError:
        return None
    name = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()
    return name, int(fields[1]), int(fields[11]) + int(fields[12])


def _snapshot() -> dict[int, dict[int, tuple[str, int, int]]]:
    processes: dict[int, dict[int, tuple[str, int, int]]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            threads = {}
            for task in (entry / "task").glob("*"):
                got = _times(task / "stat")
                if got is not None:
                    threads[int(task.name)] = got
            processes[int(entry.name)] = threads
    return processes


def _machine() -> tuple[int, int]:
    fields = [int(f) for f in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def _command(pid: int) -> str:
    try:
        raw = (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:110]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--min-cores", type=float, default=0.05)
    args = parser.parse_args()
    before, busy0, all0 = _snapshot(), *_machine()
    started = time.perf_counter()
    time.sleep(args.seconds)
    after, busy1, all1 = _snapshot(), *_machine()
    seconds = time.perf_counter() - started
    cores = os.cpu_count() or 1
    print(
        f"machine: {cores * (busy1 - busy0) / max(1, all1 - all0):.1f} of {cores} cores busy "
        f"over {seconds:.1f} s"
    )
    rows = []
    for pid, threads in after.items():
        used = {
            tid: (t[2] - before.get(pid, {}).get(tid, (t[0], t[1], t[2]))[2]) / TICK / seconds
            for tid, t in threads.items()
            if tid in before.get(pid, {})
        }
        total = sum(used.values())
        if total >= args.min_cores:
            ppid = threads.get(pid, ("?", 0, 0))[1]
            rows.append((total, pid, ppid, used, threads))
    print("| cores | pid | parent | busiest threads (cores) | command |")
    print("| ---: | ---: | ---: | --- | --- |")
    for total, pid, ppid, used, threads in sorted(rows, reverse=True):
        busiest = sorted(used.items(), key=lambda kv: -kv[1])[:4]
        names = ", ".join(f"{threads[tid][0]} {c:.2f}" for tid, c in busiest if c >= 0.02)
        print(f"| {total:.2f} | {pid} | {ppid} | {names} | {_command(pid)} |")


if __name__ == "__main__":
    main()
