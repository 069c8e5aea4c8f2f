"""The drain's clock, its door and the count of unanswered requests: what a data plane and
an engine each keep the same way, so a SIGTERM waits for exactly what was accepted.

A drain begins (readiness turns false) before its door closes (new requests refused): the
requests that arrived before the signal are still being read when it comes, and are owed an
answer."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator


class Drain:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.draining = False
        self.closed_at: float | None = None
        """Since when (``time.monotonic``) new requests are refused; None: not yet."""
        self._closed = asyncio.Event()
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
        """The drain timeout starts (``draining``: readiness is false); requests are taken
        until ``close``. Sets plain attributes only, so a signal handler may call it."""
        if not self.draining:
            self.draining = True
            self._deadline = time.monotonic() + self.timeout_s

    def close(self) -> None:
        """From now on new requests are refused (``refuses``); begins the drain if it has
        not begun."""
        self.begin()
        if self.closed_at is None:
            self.closed_at = time.monotonic()
            self._closed.set()

    async def door_closed(self) -> None:
        """Returns once ``close`` has been called."""
        await self._closed.wait()

    def refuses(self, began: float | None = None) -> bool:
        """Whether a request that began at ``began`` (``time.monotonic`` when its first bytes
        were read; None: now) is refused: it began after the door closed."""
        closed = self.closed_at
        return closed is not None and (began is None or began >= closed)

    def time_left(self) -> float:
        """Seconds left of the drain timeout (0 before a drain begins)."""
        return max(0.0, self._deadline - time.monotonic())
