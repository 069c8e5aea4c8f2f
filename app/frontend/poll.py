"""What a front end reports to its engine processes, and what they report back: every
``POLL_S`` each engine's state (alive, ready, queued, the versions it serves) in exchange for
the durations of the requests it answered here, and, to one of them, the requests this front
end refused before any engine saw them. So each engine's ``/metrics`` holds its own requests,
and routing reads a state at most a poll old."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from app import wire
from app.errors import StokerError
from app.frontend.links import EngineLink
from app.metrics import http_refusal_counts, request_durations

POLL_S = 0.25


class Poller:
    def __init__(
        self,
        links: Sequence[EngineLink],
        state: Callable[[EngineLink, wire.State], Awaitable[wire.EngineState]],
    ) -> None:
        self.links = links
        self._state = state
        self.failed: dict[tuple[str, str, str], list[float]] = {}
        """Per model version and reason, requests refused here (count, seconds in all)."""

    def request_timed(self, model: str, version: str, seconds: float, engine: str = "") -> None:
        """One request's duration, sent with the next poll to the engine that answered it."""
        link = next((link for link in self.links if link.label == engine), None)
        if link is None:
            return
        series = link.durations.get((model, version))
        if series is None:
            series = link.durations[(model, version)] = request_durations()
        series.observe(seconds)

    def count_failures(
        self, name: str, version: str, reason: str, count: int, seconds: float
    ) -> None:
        """Requests refused before they reached an engine: sent with the next poll."""
        entry = self.failed.setdefault((name, version, reason), [0, 0.0])
        entry[0] += count
        entry[1] += seconds * count

    async def run(self) -> None:
        """Every engine's state every ``POLL_S`` (all at once: one that hangs delays no
        other's), sending each the durations of the requests it answered since the last
        poll and the first connected one what this front end refused meanwhile, which the
        engines add to their ``/metrics``."""
        sent: dict[tuple[str, str], float] = {}

        async def poll(link: EngineLink, primary: bool) -> None:
            nonlocal sent
            if not link.connected:
                link.state = wire.GONE
                return
            # Request durations since the last poll: a fresh series takes the next ones.
            timed, link.durations = link.durations, {}
            durations = []
            for (model, version), series in timed.items():
                counts, total = series.snapshot()
                durations.append(wire.Durations(model, version, tuple(counts), total))
            refused: list[wire.Refused] = []
            failed: list[wire.Failed] = []
            if primary:
                counts_now = http_refusal_counts()
                refused = [
                    wire.Refused(int(s), r, n - sent.get((s, r), 0.0))
                    for (s, r), n in counts_now.items()
                    if n - sent.get((s, r), 0.0)
                ]
                failed = [
                    wire.Failed(*key, int(n), total / n)
                    for key, (n, total) in self.failed.items()
                    if n
                ]
            call = wire.State(tuple(durations), tuple(refused), tuple(failed))
            try:
                link.state = await asyncio.wait_for(self._state(link, call), 2.0)
            except (StokerError, TimeoutError):
                link.state = wire.GONE
                for which, series in timed.items():  # not delivered: the next poll's
                    counts, total = series.snapshot()
                    link.durations.setdefault(which, request_durations()).merge(counts, total)
                return
            if primary:
                sent = counts_now
                for item in failed:
                    entry = self.failed[(item.model, item.version, item.reason)]
                    entry[0] -= item.count
                    entry[1] -= item.count * item.mean_s

        while True:
            first = next((link for link in self.links if link.connected), None)
            await asyncio.gather(*(poll(link, link is first) for link in self.links))
            await asyncio.sleep(POLL_S)
