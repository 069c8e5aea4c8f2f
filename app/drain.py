"""The drain's clock and the count of unanswered requests: what a data plane and an engine
each keep the same way, so a SIGTERM waits for exactly what was accepted."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator


class Drain:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.draining = False
        self._deadline = 0.0
        # Requests not answered yet: what a drain waits for.
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def in_flight(self) -> Iterator[None]:
        """Count a request as unanswered while the block runs (``all_answered`` waits)."""
        self.active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.active -= 1
            if self.active == 0:
                self._idle.set()

    async def all_answered(self, timeout_s: float) -> bool:
        """Wait until no request is in flight, for at most ``timeout_s``; whether none is."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def begin(self) -> None:
        """From now on new requests are refused; the drain timeout starts. Sets plain
        attributes only, so a signal handler may call it."""
        if not self.draining:
            self.draining = True
            self._deadline = time.monotonic() + self.timeout_s

    def time_left(self) -> float:
        """Seconds left of the drain timeout (0 before a drain begins)."""
        return max(0.0, self._deadline - time.monotonic())
