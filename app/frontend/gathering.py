"""Gathering: the requests that may share a batch go to the engine client as one call.

The data plane (``app.frontend.plane``) decodes and validates each request, then hands it
here. Requests of one turn of the loop that may share a batch (``app.contract.batch_key``,
the deadline class, priority and client) become one frame; uploads for the same model, ``k``
and client one upload call. Where the data plane limits the frames of a key in flight
(``Gatherer.frames_in_flight``, a front end's ``server.frames_in_flight``), small
requests that arrive while it has that many gather on, for ``MAX_HOLD_S`` at most (and a
tenth of their soonest timeout, ``hold_s``): gRPC
calls reach the loop one per wake-up, and without it each crossed alone.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generic, TypeVar

import numpy as np

from app.contract import Classified, Contract, Frame, Part, Ran, Uploads, batch_key
from app.errors import Reloaded, StokerError
from app.frontend.client import EngineClient
from app.protocol import RequestedOutput
from app.settings import Settings
from engines.preprocess import ImagePreprocess

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(eq=False)
class Callers(Generic[T]):
    """The requests gathered into one call to the engine, waiting for its answer. Each has
    its own future: one whose caller left is cancelled alone, and the call's answer reaches
    the others in one step (no shared future to shield)."""

    answers: list[asyncio.Future[T]] = field(default_factory=list)
    waiting: int = 0
    """Those whose callers still wait: when none does, the engine may drop the call."""
    stop: Callable[[], object] | None = None
    """What drops the call once it is made (``send``, or ``EngineClient.submit``)."""

    async def wait(self) -> tuple[int, T]:
        """Join them: this request's index among them, and the call's answer."""
        index = len(self.answers)
        mine: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self.answers.append(mine)
        self.waiting += 1
        try:
            return index, await mine
        except asyncio.CancelledError:
            self.waiting -= 1
            if self.waiting == 0 and self.stop is not None:
                self.stop()  # every request of it went away
            raise

    def send(self, call: Callable[[], Awaitable[T]]) -> None:
        """Make the call in a task, and hand its answer, or its error, to each request
        still waiting."""
        self.stop = asyncio.create_task(self._deliver(call)).cancel

    async def _deliver(self, call: Callable[[], Awaitable[T]]) -> None:
        try:
            answer = await call()
        except asyncio.CancelledError:
            for mine in self.answers:  # cancelled only once every caller left: no-ops
                mine.cancel()
            raise
        except Exception as error:
            self.deliver(error)
            return
        self.deliver(answer)

    def deliver(self, outcome: T | Exception) -> None:
        """The call's answer, or its error, to each request still waiting (a caller that
        left cancelled its own): their tasks go on in the next turn."""
        for mine in self.answers:
            if not mine.done():
                if isinstance(outcome, Exception):
                    mine.set_exception(outcome)
                else:
                    mine.set_result(outcome)


DEADLINE_STEP = math.log(1.01)
"""Timeouts within about 1% of each other share a frame (``deadline_class``)."""
MAX_HOLD_S = 0.005
"""The longest a front end holds requests back to gather while frames of their key are in
flight: under load a frame comes back sooner; when the engine is stuck on a long batch, the
held ones still reach its queue (where its metrics count them, and its limits apply) within
this. A held request's deadline runs from its arrival, as any request's does."""


HOLD_SHARE = 0.1
"""The most of a held request's timeout the hold may take: a request of a 2 ms deadline is
held 0.2 ms, not ``MAX_HOLD_S``."""


def hold_s(timeout_us: int | None) -> float:
    """How long a gathering whose soonest timeout is ``timeout_us`` may be held."""
    if timeout_us is None:
        return MAX_HOLD_S
    return min(MAX_HOLD_S, HOLD_SHARE * max(0, timeout_us) / 1e6)


def deadline_class(timeout_us: int | None) -> int | None:
    """Which requests' timeouts may share a frame: those within about 1% of each other. A
    gRPC call's deadline arrives as what is left of it, a different number of microseconds
    for every call, so gathering by the exact figure put each call in a frame of its own.
    The frame runs under the shortest timeout of its requests: one may be refused up to 1%
    of its timeout early, never late. None (no timeout) and 0 are classes of their own."""
    if timeout_us is None:
        return None
    return 0 if timeout_us <= 0 else 1 + math.floor(math.log(timeout_us) / DEADLINE_STEP)


@dataclass(eq=False)
class Gathering:
    """Decoded requests that go to the engine as one frame."""

    contract: Contract
    timeout_us: int | None
    priority: int
    client: str
    parts: list[Part] = field(default_factory=list)
    rows: int = 0
    callers: Callers[Ran] = field(default_factory=Callers)
    held: asyncio.TimerHandle | None = None
    """Set while it is held back (``frames_in_flight``): sends it after ``MAX_HOLD_S``."""


@dataclass(eq=False)
class UploadGathering:
    """Upload requests that go to the engine as one call."""

    name: str | None
    version: str | None
    k: int | None
    client: str
    row_preprocess: ImagePreprocess | None = None
    """The preprocessing that made each image a row in this front end (None: files)."""
    images: list[bytes] = field(default_factory=list)
    size: int = 0
    """The bytes of ``images``."""
    counts: list[int] = field(default_factory=list)
    traceparents: list[str | None] = field(default_factory=list)
    callers: Callers[Classified] = field(default_factory=Callers)


def held_rows(max_batch_size: int) -> int:
    """The rows past which a gathering is sent whatever is in flight: an eighth of the max
    batch. Large requests (32 images of a max batch of 256) gain nothing from waiting, as
    the engine's cost per frame is already spread over many rows; single rows do."""
    return max(1, max_batch_size // 8)


def held_until(timeout_us: int | None) -> float:
    """When, on the loop's clock, a gathering held from now must go (``hold_s``)."""
    return asyncio.get_running_loop().time() + hold_s(timeout_us)


def hold(gathering: Gathering, send: Callable[[], None]) -> asyncio.TimerHandle:
    """The timer that sends a held gathering (``hold_s`` of its soonest timeout)."""
    return asyncio.get_running_loop().call_at(held_until(gathering.timeout_us), send)


async def again_if_reloaded(
    attempt: Callable[[], Awaitable[T]], again: Callable[[], Awaitable[T]] | None = None
) -> T:
    """``attempt()``; if a reload switched the model's contract under it
    (``app.errors.Reloaded``: nothing ran, the client's cached contract is dropped),
    ``again()`` once (by default the same attempt: what is sent as it came), whose own
    refusal stands. The one retry of a reloaded contract, for every path."""
    try:
        return await attempt()
    except StokerError as error:
        if error.reason != Reloaded.reason:
            raise
    return await (again or attempt)()


class Gatherer:
    """The gatherings of one data plane, and the frames of each key in flight."""

    def __init__(self, settings: Settings, client: EngineClient, frames_in_flight: int) -> None:
        """``frames_in_flight``: of one key in flight before the next are held back to
        gather (0: never)."""
        self.settings = settings
        self.client = client
        self.frames_in_flight = frames_in_flight
        self._gatherings: dict[tuple[Any, ...], Gathering] = {}
        self._uploads: dict[tuple[Any, ...], UploadGathering] = {}
        self._flush_scheduled = False
        self._in_flight: dict[tuple[Any, ...], int] = {}
        """Frames sent to the engine client and not answered yet, by key."""
        self.frames_sent = 0
        """Frames (and upload calls) sent to the engine client, and the requests in them:
        their ratio is how well requests gather (``log_totals``)."""
        self.requests_sent = 0
        self._window = (0, 0, time.monotonic())  # frames, requests, when: the last log

    def log_totals(self) -> None:
        if self.frames_sent:
            log.info(
                "sent %d request(s) to the engine in %d frame(s), %.2f a frame",
                self.requests_sent,
                self.frames_sent,
                self.requests_sent / self.frames_sent,
            )

    async def run(
        self,
        contract: Contract,
        part: Part,
        timeout_us: int | None,
        priority: int,
        client: str,
    ) -> tuple[Ran, list[tuple[RequestedOutput, np.ndarray]]]:
        """Run a decoded request with the others that may share its batch (same model
        version, deadline class, priority, client and ``batch_key``): one frame and one queue
        entry in the engine for all of them, up to the model's max batch. They are those of
        this turn of the loop; where the engine client already has ``frames_in_flight``
        frames of that key in flight, also those that come until one is answered, until
        they hold ``held_rows``, or for ``hold_s`` (``MAX_HOLD_S``, less for a short
        timeout). Returns the frame's answer and this
        request's outputs."""
        spec = contract.spec
        key = (
            contract.model,
            contract.version,
            contract.serial,
            deadline_class(timeout_us),
            priority,
            client,
            batch_key(spec, part.inputs) if spec.max_batch_size else object(),
        )
        gathering = self._gatherings.get(key)
        if gathering is not None and gathering.rows + part.rows > max(spec.max_batch_size, 1):
            self._send(key)
            gathering = None
        if gathering is None:
            gathering = Gathering(contract, timeout_us, priority, client)
            self._gatherings[key] = gathering
            self._flush_soon()
        elif timeout_us is not None and gathering.timeout_us is not None:
            gathering.timeout_us = min(gathering.timeout_us, timeout_us)
            held = gathering.held
            if held is not None and held.when() > held_until(gathering.timeout_us):
                held.cancel()  # the soonest deadline moved up: so does the end of the hold
                gathering.held = hold(gathering, partial(self._send_held, key, gathering))
        gathering.parts.append(part)
        gathering.rows += part.rows
        if gathering.held is not None and gathering.rows >= held_rows(spec.max_batch_size):
            self._flush_soon()  # held, and now enough rows to go
        index, ran = await gathering.callers.wait()
        return ran, ran.outputs[index]

    def _flush_soon(self) -> None:
        """Send what was gathered (and is not held) once this turn of the loop ends."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._send_all)

    def _send_all(self) -> None:
        self._flush_scheduled = False
        limit = self.frames_in_flight
        for key, gathering in list(self._gatherings.items()):
            if (
                not limit
                or self._in_flight.get(key, 0) < limit
                or gathering.rows >= held_rows(gathering.contract.spec.max_batch_size)
            ):
                self._send(key)
            elif gathering.held is None:
                # It gathers on until a frame of its key is answered (``_answered``), it holds
                # enough rows, or MAX_HOLD_S has passed.
                gathering.held = hold(gathering, partial(self._send_held, key, gathering))
        for key in list(self._uploads):
            self._send_uploads(key)

    def _send_held(self, key: tuple[Any, ...], gathering: Gathering) -> None:
        if self._gatherings.get(key) is gathering:
            gathering.held = None
            self._send(key)

    def _sent(self, requests: int) -> None:
        self.frames_sent += 1
        self.requests_sent += requests
        every = self.settings.server.gathering_log_s
        if every and time.monotonic() - self._window[2] >= every:
            frames = self.frames_sent - self._window[0]
            sent = self.requests_sent - self._window[1]
            log.info(
                "last %.0f s: %d request(s) in %d frame(s), %.2f a frame",
                time.monotonic() - self._window[2],
                sent,
                frames,
                sent / frames,
            )
            self._window = (self.frames_sent, self.requests_sent, time.monotonic())

    def _send(self, key: tuple[Any, ...]) -> None:
        gathering = self._gatherings.pop(key)
        if gathering.held is not None:
            gathering.held.cancel()
        contract = gathering.contract
        if gathering.callers.waiting == 0:  # all went away before it was sent: no engine knew of it
            count = len(gathering.parts)
            self.client.count_failures(contract.model, contract.version, "cancelled", count, 0.0)
            return
        frame = Frame(
            contract.model,
            contract.version,
            gathering.parts,
            gathering.timeout_us,
            gathering.priority,
            gathering.client,
            contract.serial,
        )
        self._sent(len(gathering.parts))
        self._in_flight[key] = self._in_flight.get(key, 0) + 1
        callers = gathering.callers
        answered = partial(self._answered, key, callers)
        try:
            # Sent in this turn, answered in the turn its reply is read: no task between.
            callers.stop = self.client.submit(frame, answered)
        except Exception as error:  # no engine to take it: nothing was sent
            answered(error)

    def _answered(
        self, key: tuple[Any, ...], callers: Callers[Ran], outcome: Ran | Exception
    ) -> None:
        """A frame's answer (or error) to its requests. It was counted in flight from its
        sending; the frame held back for its key, if any, goes at the end of this turn."""
        callers.deliver(outcome)
        left = self._in_flight.get(key, 0) - 1
        if left > 0:
            self._in_flight[key] = left
        else:
            self._in_flight.pop(key, None)
        if key in self._gatherings:
            self._flush_soon()

    async def classify(
        self,
        name: str | None,
        version: str | None,
        uploads: Sequence[bytes],
        k: int | None,
        client: str,
        row_preprocess: ImagePreprocess | None = None,
        traceparent: str | None = None,
    ) -> tuple[Classified, int]:
        """Gather uploads with the others for the same model, ``k`` and client (and the same
        ``row_preprocess``: files, or rows made with it) into one engine call, as many bytes
        as one crossing takes (``server.shm_slot_bytes``): the engine's decode queue and
        batcher bound the batches; the call's answer and this request's index in it.
        ``traceparent``: its trace context, where it is traced."""
        key = (name, version, k, client, row_preprocess)
        gathering = self._uploads.get(key)
        size = sum(len(image) for image in uploads)
        if gathering is not None and gathering.size + size > self.settings.server.shm_slot_bytes:
            self._send_uploads(key)
            gathering = None
        if gathering is None:
            gathering = UploadGathering(name, version, k, client, row_preprocess)
            self._uploads[key] = gathering
            self._flush_soon()
        gathering.images.extend(uploads)
        gathering.size += size
        gathering.counts.append(len(uploads))
        gathering.traceparents.append(traceparent)
        index, classified = await gathering.callers.wait()
        return classified, index

    def _send_uploads(self, key: tuple[Any, ...]) -> None:
        gathering = self._uploads.pop(key)
        if gathering.callers.waiting == 0:
            return  # every caller left before it was sent (counted by nobody: no engine saw it)
        uploads = Uploads(
            gathering.name,
            gathering.version,
            gathering.images,
            gathering.k,
            gathering.client,
            tuple(gathering.counts),
            gathering.row_preprocess,
            tuple(gathering.traceparents) if any(gathering.traceparents) else (),
        )
        self._sent(len(gathering.counts))
        callers = gathering.callers
        call = partial(self.client.classify, uploads)
        # Rows made with a preprocessing a reload replaced would be refused again: the data
        # plane makes them anew instead; files are sent once more as they are.
        made = gathering.row_preprocess is not None
        try:
            # Sent in this turn where the arena has room, answered in the turn its reply is
            # read: no task between, as a frame goes (``_send``).
            stop = self.client.submit_uploads(
                uploads, partial(self._uploads_answered, callers, call, made)
            )
        except Exception as error:  # no engine to take it: nothing was sent
            callers.deliver(error)
            return
        if stop is not None:
            callers.stop = stop
        else:  # no room in this turn (or one process): a task waits for it
            callers.send(call if made else partial(again_if_reloaded, call))

    @staticmethod
    def _uploads_answered(
        callers: Callers[Classified],
        call: Callable[[], Awaitable[Classified]],
        made: bool,
        outcome: Classified | Exception,
    ) -> None:
        """An upload call's answer to its requests; files a reload refused are sent once
        more as they are, in a task (``again_if_reloaded``: that refusal stands)."""
        if isinstance(outcome, StokerError) and outcome.reason == Reloaded.reason and not made:
            if callers.waiting:  # nobody left to answer: nothing is sent again
                callers.send(call)
            return
        callers.deliver(outcome)
