"""Where the busy time of each server process went, from a py-spy ``--format raw`` record
taken with ``--subprocesses --threads`` (collapsed stacks, one line a stack and its count).

    python3 scripts/pyspy_summary.py pyspy_b1.txt --top 30

py-spy leaves idle threads out unless ``--idle`` is given, so a count is a sample of a thread
running Python or native code. Per process: its busy samples by thread, then the functions
that were on top of a stack (self) and those anywhere in it (inclusive), as a share of that
process's busy samples (of each thread's, with ``--by-thread``). ``engines.sampler``'s records
read the same; they keep idle threads, so a thread's share there is of wall time. Functions
are named without their line, so a function's lines add up.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict

_LINE = re.compile(r" \(([^()]*?):\d+\)$")


def frame_name(frame: str) -> str:
    """``f (path/to/file.py:12)`` → ``f (file.py)``."""
    match = _LINE.search(frame)
    if match is None:
        return frame
    where = match.group(1).rsplit("/", 1)[-1]
    return f"{frame[: match.start()]} ({where})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--by-thread",
        action="store_true",
        help="count each thread as a process of its own (a share is then of that thread's time)",
    )
    args = parser.parse_args()
    threads: dict[str, Counter[str]] = defaultdict(Counter)
    own: dict[str, Counter[str]] = defaultdict(Counter)
    anywhere: dict[str, Counter[str]] = defaultdict(Counter)
    for line in open(args.record, encoding="utf-8", errors="replace"):
        stack, _, count_text = line.rstrip("\n").rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        process = frames.pop(0) if frames[0].startswith("process ") else "process ?"
        process = process[:90]
        thread = frames.pop(0) if frames and frames[0].startswith("thread ") else "thread ?"
        if args.by_thread:
            process = f"{process} {thread}"[:120]
        threads[process][thread] += count
        names = [frame_name(f) for f in frames]
        if names:
            own[process][names[-1]] += count
        for name in set(names):
            anywhere[process][name] += count
    for process in sorted(threads, key=lambda p: -sum(threads[p].values())):
        total = sum(threads[process].values())
        print(f"## {process}: {total} busy samples")
        for thread, n in threads[process].most_common(args.top):
            print(f"   {n:7d} {100 * n / total:5.1f}%  {thread}")
        print("   self:")
        for name, n in own[process].most_common(args.top):
            print(f"   {100 * n / total:5.1f}%  {name}")
        print("   inclusive:")
        for name, n in anywhere[process].most_common(args.top):
            print(f"   {100 * n / total:5.1f}%  {name}")
        print()


if __name__ == "__main__":
    main()
