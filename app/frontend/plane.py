"""The data plane: requests in, answers out, above one engine client.

Routes parse HTTP and serialise what a method here returns. This decodes a V2 request and
validates it against the model's contract (asked of the engine once), gathers the decoded
requests of one turn of the loop that may share a batch into one frame (``app.contract.
batch_key``), hands the frame to its ``EngineClient`` and encodes each request's answer. In
one process the client is the registry itself (``app.engine.local.LocalEngine``); in a
front-end process it is the engine processes behind the control channel (``app.frontend.
remote.RemoteEngine``): the same path, the same refusals in the same order, the same timing.
Created in the lifespan (never at import); lives in ``app.state.plane``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generic, TypeVar

import numpy as np

from app.contract import (
    ENGINE_REGIONS,
    Answer,
    Classified,
    Contract,
    ForwardToEngine,
    Frame,
    Part,
    Ran,
    Raw,
    Slot,
    Uploads,
    batch_key,
    check_window,
    checked,
    decode_infer_async,
    draining,
)
from app.drain import Drain
from app.errors import Reloaded, StokerError
from app.frontend.client import EngineClient
from app.image_header import screen_upload
from app.metrics import http_refused
from app.protocol import RequestedOutput, encode_response
from app.settings import Settings

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
    task: asyncio.Task[None] | None = None

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
            if self.waiting == 0 and self.task is not None:
                self.task.cancel()  # every request of it went away
            raise

    def send(self, call: Callable[[], Awaitable[T]]) -> None:
        """Make the call, and hand its answer, or its error, to each request still waiting."""
        self.task = asyncio.create_task(self._deliver(call))

    async def _deliver(self, call: Callable[[], Awaitable[T]]) -> None:
        try:
            answer = await call()
        except asyncio.CancelledError:
            for mine in self.answers:  # cancelled only once every caller left: no-ops
                mine.cancel()
            raise
        except Exception as error:
            for mine in self.answers:
                if not mine.done():
                    mine.set_exception(error)
            return
        for mine in self.answers:
            if not mine.done():  # a caller that left cancelled its own
                mine.set_result(answer)


DEADLINE_STEP = math.log(1.01)
"""Timeouts within about 1% of each other share a frame (``deadline_class``)."""
MAX_HOLD_S = 0.005
"""The longest a front end holds requests back to gather while frames of their key are in
flight: under load a frame comes back sooner; when the engine is stuck on a long batch, the
held ones still reach its queue (where its metrics count them, and its limits apply) within
this. A held request's deadline runs from its arrival, as any request's does."""


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
    """Decoded requests of one turn of the loop that go to the engine as one frame."""

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
    """Upload requests of one turn of the loop that go to the engine as one call."""

    name: str | None
    version: str | None
    k: int | None
    client: str
    images: list[bytes] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    callers: Callers[Classified] = field(default_factory=Callers)


class DataPlane:
    def __init__(self, settings: Settings, client: EngineClient) -> None:
        self.settings = settings
        self.client = client
        self.failed: BaseException | None = None
        self.drain_state = Drain(settings.server.drain_timeout_s)
        self._gatherings: dict[tuple[Any, ...], Gathering] = {}
        self._uploads: dict[tuple[Any, ...], UploadGathering] = {}
        self._flush_scheduled = False
        self._in_flight: dict[tuple[Any, ...], int] = {}
        """Frames sent and not yet answered, by batch key (kept only where the engine
        client limits them: ``frames_in_flight``)."""
        self.frames_sent = 0
        """Frames (and upload calls) sent to the engine client, and the requests in them:
        their ratio is how well requests gather (logged at drain)."""
        self.requests_sent = 0
        self._window = (0, 0, time.monotonic())  # frames, requests, when: the last log

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine client (in one process: load every model); readiness follows."""
        await self.client.start()

    @property
    def draining(self) -> bool:
        return self.drain_state.draining

    def begin_drain(self) -> None:
        """From now on readiness is false and new requests get 503; the drain timeout
        starts. Plain attributes only: a signal handler may call it."""
        self.drain_state.begin()
        self.client.begin_drain()

    def drain_time_left(self) -> float:
        return self.drain_state.time_left()

    async def drain(self) -> None:
        """Begin draining, wait until every accepted request has its answer or the drain
        timeout passes, then let the engine client drain (in one process: fail what is
        still queued with 503; an engine process drains itself on its own SIGTERM)."""
        self.begin_drain()
        if not await self.drain_state.all_answered(self.drain_time_left()):
            log.warning("drain timeout: %d request(s) still in flight", self.drain_state.active)
        if self.frames_sent:
            log.info(
                "sent %d request(s) to the engine in %d frame(s), %.2f a frame",
                self.requests_sent,
                self.frames_sent,
                self.requests_sent / self.frames_sent,
            )
        await self.client.drain()

    async def stop(self) -> None:
        self.begin_drain()
        await self.client.stop()

    # -- state --------------------------------------------------------------------------

    @property
    def is_ready(self) -> bool:
        """The engine is ready (every runner warm) and no drain has begun."""
        return self.client.ready and not self.draining

    @property
    def alive(self) -> bool:
        """False once loading failed or an engine stopped on an unrecoverable fault: the
        process cannot heal itself, so liveness fails and the orchestrator restarts it."""
        return self.failed is None and self.client.alive

    @property
    def max_images(self) -> int:
        """Most images one upload request may carry (the form parser stops past it)."""
        return self.settings.limits.max_images_per_request

    def engines(self) -> list[dict[str, object]]:
        """Each engine process and whether it is ready, where there are several (one per
        GPU); empty where there is one."""
        return self.client.engines()

    async def check(self, name: str, version: str | None = None) -> None:
        """Raise what a request to this model would get (404, 503) before its body is read,
        where the engine client can tell without a round trip."""
        await self.client.check(name, version)

    async def metadata(self, name: str, version: str | None = None) -> dict[str, object]:
        return await self.client.metadata(name, version)

    async def version_ready(self, name: str, version: str | None = None) -> dict[str, object]:
        return await self.client.version_ready(name, version)

    async def model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        return await self.client.model_config(name, version)

    async def statistics(self, name: str | None = None, version: str | None = None) -> list[object]:
        return await self.client.statistics(name, version)

    async def repository_index(self) -> list[dict[str, str]]:
        return await self.client.repository_index()

    async def load_model(self, name: str, config: dict[str, Any] | None = None) -> None:
        """Load or reload a model on every engine (``config``: in place of its config.yaml);
        refused while draining, and where ``models.control`` does not take it."""
        if self.draining:
            raise draining()
        await self.client.load(name, config)

    async def unload_model(self, name: str) -> None:
        if self.draining:
            raise draining()
        await self.client.unload(name)

    async def metrics_text(self) -> bytes:
        return await self.client.metrics_text()

    async def shm_register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        check_window(offset, byte_size)  # here: 2^64 would not cross to an engine process
        await self.client.shm_register(name, key, offset, byte_size)

    async def shm_unregister(self, name: str | None = None) -> None:
        await self.client.shm_unregister(name)

    async def shm_status(self, name: str | None = None) -> list[dict[str, object]]:
        return await self.client.shm_status(name)

    def body_buffer(
        self, declared: int | None, client: str = ""
    ) -> AbstractAsyncContextManager[Slot | None]:
        """Where a request body of ``declared`` bytes is read into: a slot of a remote
        client's arena, or None (``read_body`` allocates)."""
        return self.client.body_buffer(declared, client)

    def arena_full_since(self) -> float | None:
        """Since when the engine client's shared-memory arena has had no room for a largest
        body (None: room, or no arena): with front ends, what bodies in flight may hold
        before ``max_inflight_body_bytes`` is reached."""
        return self.client.arena_full_since()

    # -- inference ----------------------------------------------------------------------

    async def infer(
        self,
        name: str,
        version: str | None,
        body: bytes | bytearray | memoryview,
        header_length: int | None,
        slot: Slot | None = None,
        client: str = "",
    ) -> Answer:
        """Decode a V2 request, validate it against the model's contract, run it (gathered
        with others of this turn that may share its batch) and encode its answer. ``slot``:
        the piece of the engine client's arena the body was read into, if any. A request
        decoded against a contract that a reload replaced meanwhile is checked against the
        new one and sent again, once."""
        arrived = time.monotonic()
        contract = await self.client.contract(name, version)
        started = time.perf_counter()
        with self.drain_state.in_flight():
            try:
                if self.draining:
                    raise draining()
                # Under overload most requests are refused: refuse before decoding, not after.
                self.client.admit(contract)
                limits = self.settings.limits
                decoded = await decode_infer_async(
                    contract,
                    body,
                    header_length,
                    limits.max_json_depth,
                    ENGINE_REGIONS,
                    limits.max_json_decodes,
                )
                if any(out.shared is not None for out in decoded.wanted):
                    raise ForwardToEngine
            except ForwardToEngine:
                # It names shared-memory regions, which the engine holds: the body as it came.
                raw = Raw(name, version, body, header_length, client, slot)
                return await again_if_reloaded(partial(self.client.infer_raw, raw))
            except StokerError as error:
                self._count(contract, error, started)
                raise
            request = decoded.request
            part = Part(request.inputs, decoded.rows, decoded.wanted, slot, len(body), arrived)
            schedule = (request.timeout_us, request.priority, client)
            try:
                try:
                    ran, shaped = await self._gathered(contract, part, *schedule)
                except StokerError as error:
                    if error.reason != Reloaded.reason:
                        raise
                    # Nothing ran. Checked again from what was decoded, not from the body: a
                    # remote client may have copied its tensors over it in its slot.
                    contract = await self.client.contract(name, version)
                    again = checked(contract, request)
                    part = Part(request.inputs, again.rows, again.wanted, slot, len(body), arrived)
                    ran, shaped = await self._gathered(contract, part, *schedule)
            except StokerError as error:
                self._count(contract, error, started)
                raise
            content, headers = encode_response(ran.model, ran.version, request.id, shaped)
            self.client.request_timed(
                ran.model, ran.version, time.perf_counter() - started, ran.engine
            )
            return Answer(ran.model, ran.version, headers, content)

    def _count(self, contract: Contract, error: StokerError, started: float) -> None:
        """A request's failure that no engine counted (its own counts the rest); one to be
        decoded again after a reload is no failure."""
        if not error.counted and error.reason != Reloaded.reason:
            seconds = time.perf_counter() - started
            self.client.count_failures(contract.model, contract.version, error.reason, 1, seconds)

    async def _gathered(
        self,
        contract: Contract,
        part: Part,
        timeout_us: int | None,
        priority: int,
        client: str,
    ) -> tuple[Ran, list[tuple[RequestedOutput, np.ndarray]]]:
        """Run a decoded request with the others of this turn of the loop that may share its
        batch (same model version, deadline class, priority, client and ``batch_key``): one frame
        and one queue entry in the engine for all of them, up to the model's max batch. Where
        the engine client already has ``frames_in_flight`` frames of that key in flight, they
        gather on until one of those is answered. Returns the frame's answer and this
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
        gathering.parts.append(part)
        gathering.rows += part.rows
        if gathering.held is not None and gathering.rows >= held_rows(spec.max_batch_size):
            self._flush_soon()  # held, and now enough rows to go
        index, ran = await gathering.callers.wait()
        return ran, ran.outputs[index]

    def _flush_soon(self) -> None:
        """Send what this turn of the loop gathered once it ends."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._send_all)

    def _send_all(self) -> None:
        self._flush_scheduled = False
        limit = self.client.frames_in_flight
        for key, gathering in list(self._gatherings.items()):
            if (
                not limit
                or self._in_flight.get(key, 0) < limit
                or gathering.rows >= held_rows(gathering.contract.spec.max_batch_size)
            ):
                self._send(key)
            elif gathering.held is None:
                # It gathers on until a frame of its key is answered (``_run``), it holds
                # enough rows, or MAX_HOLD_S has passed.
                gathering.held = asyncio.get_running_loop().call_later(
                    MAX_HOLD_S, self._send_held, key, gathering
                )
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
        if not self.client.frames_in_flight:
            gathering.callers.send(partial(self.client.run, frame))
            return
        gathering.callers.send(partial(self._run, key, frame))

    async def _run(self, key: tuple[Any, ...], frame: Frame) -> Ran:
        """The engine client's run of ``frame``, counted in flight while it runs (from here:
        a call cancelled before it starts never ran this, and counts nothing); once it is
        answered (or fails), the frame held back for its key, if any, goes at the end of
        this turn."""
        self._in_flight[key] = self._in_flight.get(key, 0) + 1
        try:
            return await self.client.run(frame)
        finally:
            left = self._in_flight[key] - 1
            if left:
                self._in_flight[key] = left
            else:
                del self._in_flight[key]
            if key in self._gatherings:
                self._flush_soon()

    async def classify_images(
        self,
        name: str | None,
        version: str | None,
        uploads: Sequence[bytes],
        k: int | None,
        client: str = "",
    ) -> tuple[str, str, list[Any]]:
        """Uploads through the model's handler and batcher: one answer per upload (top-k
        labels for the image classifier). ``name`` None: the default model. The uploads of
        one turn of the loop for the same model, ``k`` and client go to the engine as one
        call; the engine's handler reads them (only it knows what an upload must be)."""
        with self.drain_state.in_flight():
            if self.draining:
                raise draining()
            limits = self.settings.limits
            for data in uploads:  # a bomb or broken header never crosses to the engine
                try:
                    screen_upload(data, limits.max_image_pixels, limits.max_image_aspect_ratio)
                except StokerError as error:
                    http_refused(error.status, "image_header")
                    raise
            key = (name, version, k, client)
            gathering = self._uploads.get(key)
            bound = max(self.settings.models.decode_batch, len(uploads))
            if gathering is not None and len(gathering.images) + len(uploads) > bound:
                self._send_uploads(key)
                gathering = None
            if gathering is None:
                gathering = UploadGathering(name, version, k, client)
                self._uploads[key] = gathering
                self._flush_soon()
            gathering.images.extend(uploads)
            gathering.counts.append(len(uploads))
            index, classified = await gathering.callers.wait()
            answer = classified.answers[index]
            if isinstance(answer, StokerError):
                raise answer
            return classified.model, classified.version, answer

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
        )
        self._sent(len(gathering.counts))
        gathering.callers.send(partial(again_if_reloaded, partial(self.client.classify, uploads)))


def held_rows(max_batch_size: int) -> int:
    """The rows past which a gathering is sent whatever is in flight: an eighth of the max
    batch. Large requests (32 images of a max batch of 256) gain nothing from waiting, as
    the engine's cost per frame is already spread over many rows; single rows do."""
    return max(1, max_batch_size // 8)


async def again_if_reloaded(attempt: Callable[[], Awaitable[T]]) -> T:
    """``attempt()``, and once more if a reload switched the model's contract under it
    (``app.errors.Reloaded``: nothing ran, the client's cached contract is dropped)."""
    try:
        return await attempt()
    except StokerError as error:
        if error.reason != Reloaded.reason:
            raise
    return await attempt()
