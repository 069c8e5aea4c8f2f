"""A front end's links to its engine processes: each one's channel, the calls waiting for
its answers, the state it reported at its last poll, and the rule that picks the engine a
frame goes to (``choose``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TypeVar

from app import wire
from app.channel import Frames, Sender
from app.errors import StokerError, Unavailable
from app.metrics import CountedSeries

log = logging.getLogger(__name__)
R = TypeVar("R", bound=wire.Reply)


class RemoteError(StokerError):
    """An error an engine answered with: its status and reason, as the engine gave them
    (and counted them)."""

    counted = True

    def __init__(self, message: str, status: int, reason: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


Reply = asyncio.Future[tuple[wire.Reply, bytes]]
Then = Callable[[tuple[wire.Reply, bytes] | Exception], None]
"""What takes a call's reply (or the error that ends it) in the turn the reply is read."""
Epoch = tuple[int, ...]
"""Each engine's generation (``wire.EngineState.generation``), in the order of the links."""


@dataclass(eq=False)
class EngineLink:
    """One engine process as a front end sees it: its control channel, the calls waiting
    for its answers and the state it reported at the last poll."""

    label: str
    """What metrics and readiness call it: its GPU (``server.engine_gpus``), or "" alone."""
    control: Path
    state: wire.EngineState = wire.GONE
    writer: Sender | None = None
    waiting: dict[int, Reply] = field(default_factory=dict)
    then: dict[int, Then] = field(default_factory=dict)
    """Calls answered by a callback instead of a future (``request``'s ``then``)."""
    ids: int = 0
    in_flight: int = 0
    """Requests this front end sent it that are not answered yet (a frame counts its
    requests)."""
    durations: dict[tuple[str, str], CountedSeries] = field(default_factory=dict)
    """Per model version, how long the requests it answered took here since the last poll:
    sent to it with the poll, so each engine's histogram holds the requests it served."""
    reconnecting: bool = False

    async def open(self, deadline: float) -> Frames:
        """Connect to its control socket, trying until ``deadline`` (``time.monotonic``)
        while the engine is not listening yet. Each reply is handled in the turn it is read
        (``reply``); what ``read_replies`` waits on is returned."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                _, frames = await loop.create_unix_connection(
                    partial(Frames, self.reply), str(self.control)
                )
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        assert frames.transport is not None
        self.writer = Sender(frames.transport)
        return frames

    def reply(self, header: bytes, payload: bytes) -> None:
        """One reply read: to its call's handler (``request``'s ``then``), or its future."""
        answer = wire.decode_answer(header)
        then = self.then.pop(answer.id, None)
        if then is not None:
            handed(then, (answer.reply, payload))
            return
        future = self.waiting.pop(answer.id, None)
        if future is not None and not future.done():
            future.set_result((answer.reply, payload))

    async def read_replies(self, frames: Frames) -> None:
        """Until the channel closes (``ChannelClosed``), while its replies are handled as they
        are read; then it is gone, and every call still waiting fails with 503."""
        try:
            await frames.closed
        finally:
            self.state = wire.GONE
            self.close()  # no request is sent into a channel nobody reads
            gone = Unavailable(f"the engine process{self.named} is gone")
            for future in self.waiting.values():
                if not future.done():
                    future.set_exception(gone)
            self.waiting.clear()
            thens, self.then = list(self.then.values()), {}
            for then in thens:
                handed(then, gone)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    @property
    def connected(self) -> bool:
        return self.writer is not None and not self.writer.is_closing()

    @property
    def ready(self) -> bool:
        return self.connected and self.state.ready

    @property
    def work_ahead(self) -> int:
        """The work ahead of a request sent to it now, in requests: what it had queued or
        running at the last poll, and this front end's unanswered requests to it."""
        return self.state.queued + self.in_flight

    def serves(self, name: str | None, version: str | None, rows: int = 0) -> bool:
        """Whether it answered for this model version at the last poll (``None``: any
        version; no name: any model) and takes ``rows`` in one request there."""
        if name is None:
            return True
        return any(
            s.model == name
            and version in (None, s.version)
            and (rows <= s.max_batch or not s.max_batch)
            for s in self.state.serving
        )

    def max_batch(self, name: str, version: str) -> int:
        """The most rows it takes in one request of this model version (0: unbatched, or
        not served here)."""
        return max(
            (s.max_batch for s in self.state.serving if (s.model, s.version) == (name, version)),
            default=0,
        )

    def request(self, call: wire.Call, payload: bytes = b"", then: Then | None = None) -> int:
        """Send one call; its answer resolves a new future in ``waiting``, or is handed to
        ``then`` in the turn it is read (no task wakes up first: a turn less for a frame's
        answer). What cannot be sent raises, and then nothing waits for an answer."""
        writer = self.writer
        if writer is None or not self.connected:
            raise Unavailable(f"the engine process{self.named} is not connected")
        self.ids += 1
        writer.send(wire.encode_call(self.ids, call), payload)
        if then is None:
            self.waiting[self.ids] = asyncio.get_running_loop().create_future()
        else:
            self.then[self.ids] = then
        return self.ids

    async def call(self, call: wire.Call, expected: type[R], payload: bytes = b"") -> R:
        """Send ``call`` and wait for its reply, as ``expected`` (``answered``)."""
        reply, _ = await self.call_with_payload(call, expected, payload)
        return reply

    async def call_with_payload(
        self, call: wire.Call, expected: type[R], payload: bytes = b""
    ) -> tuple[R, bytes]:
        """``call``'s reply and the payload that came with it."""
        number = self.request(call, payload)
        try:
            reply, data = await self.waiting[number]
        finally:
            self.waiting.pop(number, None)  # answered, or given up on (a poll's timeout)
        return answered(reply, expected), data

    def cancel(self, number: int) -> None:
        if self.writer is not None and self.connected:
            self.writer.send(wire.encode_call(0, wire.Cancel(number)))

    @property
    def named(self) -> str:
        return f" for GPU {self.label}" if self.label else ""


def handed(then: Then, outcome: tuple[wire.Reply, bytes] | Exception) -> None:
    """``then(outcome)``; what it raises is a bug of its own, logged, and the link reads on."""
    try:
        then(outcome)
    except Exception as error:
        log.error("a reply's handler failed: %r", error, exc_info=error)


def answered(reply: wire.Reply, expected: type[R]) -> R:
    """The reply as the type its call answers with; a ``Failure`` raised as the engine's."""
    if isinstance(reply, wire.Failure):
        raise RemoteError(reply.error, reply.status, reply.reason)
    if not isinstance(reply, expected):
        raise RemoteError(f"the engine answered {type(reply).__name__}", 500, "other")
    return reply


def choose(
    links: Sequence[EngineLink], name: str | None = None, version: str | None = None, rows: int = 0
) -> EngineLink:
    """The engine a request for ``name`` (and ``version``, of ``rows`` rows) goes to: of
    the ready ones that serve it and take that many rows, the one with the least work
    ahead of it; of the ready ones, if none does (it answers why); any connected one
    while none is ready; none: 503 here."""
    ready = [link for link in links if link.ready]
    serving = [link for link in ready if link.serves(name, version, rows)]
    if not serving and rows and any(link.serves(name, version) for link in ready):
        # The engines that took this many rows (a GPU with more memory) are not back.
        raise Unavailable(
            f"no engine that takes {rows} rows of {name} in one request is ready; retry"
        )
    if serving or ready:
        return min(serving or ready, key=lambda link: link.work_ahead)
    return connected(links)[0]


def every_engine(
    what: str, links: Sequence[EngineLink], outcomes: Sequence[object | BaseException]
) -> None:
    """What a call made of every engine comes to: done if every one did it; refused by
    every one, that refusal (an unknown model is each one's 404, the client's too); by some,
    500 naming each one's refusal (they now disagree, as the index shows)."""
    failed: list[tuple[EngineLink, StokerError]] = []
    for link, outcome in zip(links, outcomes, strict=True):
        if isinstance(outcome, StokerError):
            failed.append((link, outcome))
        elif isinstance(outcome, BaseException):
            raise outcome
    if failed and len(failed) == len(links):
        raise failed[0][1]
    if failed:
        why = "; ".join(f"GPU {link.label}: {error.message}" for link, error in failed)
        raise RemoteError(f"{what} failed on some engines: {why}", 500, "other")


async def ask_every(
    links: Sequence[EngineLink], call: wire.Call, expected: type[R]
) -> list[tuple[EngineLink, R, bytes]]:
    """``call`` asked of each of ``links`` in turn: each one's answer; if none answers, the
    first refusal (an unknown model is each engine's 404: the client's, too)."""
    answers, refused = [], []
    for link in links:
        try:
            answers.append((link, *await link.call_with_payload(call, expected)))
        except StokerError as error:
            refused.append(error)
    if not answers and refused:
        raise refused[0]
    return answers


LINK_WAIT_S = 10.0
"""How long a request waits for its front end's first link to an engine. A front end
accepts on the port it shares with the others from its start, so a client that another
front end told "ready" (or a restarted front end's first clients) may reach it while it is
still connecting: milliseconds, as the engine's socket is up before its models load. Past
this, 503 "no engine process is connected", as before the link."""


async def first_link(linked: asyncio.Event) -> None:
    """Returns once ``linked`` is set (a first link has been welcomed, its engine's control
    table with it, or the start gave up on them), or after ``LINK_WAIT_S``; at once from
    then on. (A link is connected a moment before its welcome: not enough for a control
    call, which needs the table.)"""
    if linked.is_set():
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(LINK_WAIT_S):
            await linked.wait()


def connected(links: Sequence[EngineLink]) -> list[EngineLink]:
    found = [link for link in links if link.connected]
    if not found:
        raise Unavailable("no engine process is connected; retry")
    return found


# How far from serving each state of the repository index is: of engines that disagree, the
# index shows the furthest.
DISTANCE = {"READY": 0, "UNLOADING": 1, "LOADING": 2, "UNAVAILABLE": 3}


def merged_index(answers: Sequence[tuple[str, list[dict[str, str]]]]) -> list[dict[str, str]]:
    """Several engines' repository indexes as one server's: an entry every engine reports
    alike once; where they differ, the state furthest from serving, its reason prefixed with
    the GPU of the engine that reported it."""
    if len(answers) == 1:
        return answers[0][1]
    merged: dict[tuple[str, str], list[tuple[str, dict[str, str]]]] = {}
    for label, entries in answers:
        for entry in entries:
            merged.setdefault((entry["name"], entry.get("version", "")), []).append((label, entry))
    index = []
    for reports in merged.values():
        states = {entry.get("state", "") for _, entry in reports}
        label, worst = max(reports, key=lambda r: DISTANCE.get(r[1].get("state", ""), 3))
        if len(states) > 1 or len(reports) < len(answers):
            reason = worst.get("reason", "")
            worst = {**worst, "reason": f"GPU {label}: {reason}" if reason else f"GPU {label}"}
            if len(reports) < len(answers):
                missing = {lab for lab, _ in answers} - {lab for lab, _ in reports}
                worst["reason"] += f" (unknown to GPU {', '.join(sorted(missing))})"
        index.append(worst)
    return index
