"""The data plane: requests in, answers out, above one engine client.

Routes parse HTTP and serialise what a method here returns. This decodes a V2 request and
validates it against the model's contract (asked of the engine once), has the decoded
requests that may share a batch gathered into one frame (``app.frontend.gathering``), which
goes to its ``EngineClient``, and encodes each request's answer. In
one process the client is the registry itself (``app.engine.local.LocalEngine``); in a
front-end process it is the engine processes behind the control channel (``app.frontend.
remote.RemoteEngine``): the same path, the same refusals in the same order, the same timing.
Created in the lifespan (never at import); lives in ``app.state.plane``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from functools import partial
from typing import Any

from app import tracing
from app.contract import (
    Answer,
    Classified,
    Contract,
    Ran,
    checked,
    control_refusal,
    decode_infer_async,
    draining,
)
from app.drain import Drain
from app.errors import NotFound, Reloaded, StokerError, client_text
from app.frontend.arena import InSlot, RawInSlot, Slot
from app.frontend.client import EngineClient
from app.frontend.gathering import Gatherer, again_if_reloaded
from app.frontend.packing import Shaped
from app.frontend.upload_rows import RowMaker
from app.image_header import screen_upload
from app.metrics import http_refused
from app.protocol import encode_response
from app.settings import Settings

log = logging.getLogger(__name__)
DOOR_TURNS = 4
"""Turns of the event loop in a row that find nothing unread before a drain's door closes:
a connection accepted in one turn has its reader added in the next and is read after."""
DOOR_WAIT_S = 0.001
"""How long a drain's door waits before looking again while the kernel holds unread bytes."""
DOOR_MAX_S = 1.0
"""The longest a drain's door stays open: connections whose reading is paused (a body
waiting for the application) stay readable, and a flood must not hold it open."""


class ForwardToEngine(Exception):
    """A request only the engine can decode: it names shared-memory regions."""


class EngineRegions:
    """Stands for the engine's registered shared-memory regions while a front end decodes:
    a request that names one goes to the engine as it came (``ForwardToEngine``)."""

    def view(self, name: str, offset: int, size: int, what: str) -> memoryview:
        raise ForwardToEngine

    def write(self, name: str, offset: int, data: bytes | memoryview, what: str) -> None:
        raise ForwardToEngine


ENGINE_REGIONS = EngineRegions()


class DataPlane:
    def __init__(self, settings: Settings, client: EngineClient, across: bool = False) -> None:
        """``across``: the engine runs in other processes (a front end's), so frames of one
        key are held back while ``server.frames_in_flight`` are in flight (in one process a
        frame costs nothing to cross) and, as configured, uploads are made rows here."""
        self.settings = settings
        self._keyed = bool(settings.auth.keys())  # read once: a key file is read at start
        self.client = client
        self.failed: BaseException | None = None
        self.drain_state = Drain(settings.server.drain_timeout_s)
        self._unread: list[Callable[[], bool]] = []
        """What else a drain's door waits for (``hold_door``): the gRPC server's calls."""
        front = settings.server
        self.gatherer = Gatherer(settings, client, front.frames_in_flight if across else 0)
        self.row_maker = (
            RowMaker(settings) if settings.uploads.decode_in_front_ends and across else None
        )
        """Makes uploads rows here where the engine would decode them on its CPU."""

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine client (in one process: load every model); readiness follows."""
        await self.client.start()

    @property
    def draining(self) -> bool:
        return self.drain_state.draining

    def hold_door(self, unread: Callable[[], bool]) -> None:
        """A drain's door also waits while ``unread()`` says requests arrived that this
        process has not read yet (the gRPC server's calls: ``app.frontend.grpc.arrivals``)."""
        self._unread.append(unread)

    def begin_drain(self, unread: Callable[[], bool] | None = None) -> None:
        """From now on readiness is false and the drain timeout runs; new requests get 503
        once this process has read what had arrived at the call (``_close_door``): a
        request whose bytes arrived before a SIGTERM is answered. ``unread``: whether the
        kernel still holds connections or bytes this process has not read (each
        ``hold_door`` is asked too). A signal handler may call it: it sets plain attributes
        and schedules the rest with ``call_soon_threadsafe``. Once begun, a drain is not
        begun again: its door keeps the watch it was given."""
        if self.drain_state.draining:
            return
        self.drain_state.begin()
        self.client.begin_drain()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop to read anything more: shut at once
            self.drain_state.close()
            return
        until = time.monotonic() + DOOR_MAX_S
        loop.call_soon_threadsafe(self._close_door, 0, unread, until)

    def _close_door(self, quiet: int, unread: Callable[[], bool] | None, until: float) -> None:
        """Close the drain's door after ``DOOR_TURNS`` turns of the loop in a row that found
        nothing unread (a connection is accepted in one turn, read in a later one), or
        ``DOOR_MAX_S`` after its start, whichever comes first."""
        if self.drain_state.closed_at is not None:
            return
        loop = asyncio.get_running_loop()
        try:
            waiting = any(check() for check in (unread, *self._unread) if check is not None)
        except (OSError, ValueError):  # a socket closing under the poll: nothing to wait for
            waiting = False
        if waiting:
            if time.monotonic() < until:
                loop.call_later(DOOR_WAIT_S, self._close_door, 0, unread, until)
                return
        elif quiet + 1 < DOOR_TURNS:
            loop.call_soon(self._close_door, quiet + 1, unread, until)
            return
        self.drain_state.close()
        open_s = DOOR_MAX_S - (until - time.monotonic())
        log.log(
            logging.WARNING if waiting else logging.INFO,
            "drain: new requests refused from now on, %.0f ms after it began%s",
            open_s * 1000,
            ", with requests still unread" if waiting else "",
        )

    def drain_time_left(self) -> float:
        return self.drain_state.time_left()

    async def drain(self) -> None:
        """Begin draining; once the door has closed, wait until every accepted request has
        its answer or the drain timeout passes, then let the engine client drain (in one
        process: fail what is still queued with 503; an engine process drains itself on its
        own SIGTERM)."""
        self.begin_drain()
        await self.drain_state.door_closed()
        if not await self.drain_state.all_answered(self.drain_time_left()):
            log.warning("drain timeout: %d request(s) still in flight", self.drain_state.active)
        self.gatherer.log_totals()
        await self.client.drain()

    async def stop(self) -> None:
        self.begin_drain()
        try:
            await self.client.stop()
        finally:
            if self.row_maker is not None:
                self.row_maker.close()

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

    async def control(self, method: str, *args: Any) -> Any:
        """The engine's control operation ``method`` (metadata, statistics, a load, a
        region's registration...) called with ``args``, on the engines it spreads to."""
        return await self.client.control(method, *args)

    async def check_control(
        self, name: str, index: Callable[[], Awaitable[list[dict[str, str]]]]
    ) -> None:
        """Raise what a load or unload of ``name`` gets whatever its body says, before the
        body is read: model control off or in poll mode (400), without API keys unless
        allowed (403), a drain (503), no model of that name in the repository (404: not in
        what ``index``, the caller's repository index, lists)."""
        refused = control_refusal(self.settings.models, self._keyed)
        if refused is not None:
            raise refused
        if self.draining:
            raise draining()
        if all(entry.get("name") != name for entry in await index()):
            raise NotFound(f"no model '{client_text(name)}' in the repository")

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
        began: float | None = None,
    ) -> Answer:
        """Decode a V2 request, validate it against the model's contract, run it (gathered
        with others that may share its batch: ``app.frontend.gathering``) and encode its
        answer. ``slot``:
        the piece of the engine client's arena the body was read into, if any; ``began``:
        when its first bytes were read (``time.monotonic``; None: now), which a drain's door
        is judged by (``Drain.refuses``). A request
        decoded against a contract that a reload replaced meanwhile is checked against the
        new one and sent again, once."""
        arrived = time.monotonic()
        trace = None if tracing.tracer is None else tracing.tracer.request(name)
        contract = await self.client.contract(name, version)
        started = time.perf_counter()
        with self.drain_state.in_flight():
            try:
                if self.drain_state.refuses(began):
                    raise draining()
                # Under overload most requests are refused: refuse before decoding, not after.
                self.client.admit(contract)
                decoded = await decode_infer_async(
                    contract, body, header_length, self.settings.limits, ENGINE_REGIONS
                )
                if any(out.shared is not None for out in decoded.wanted):
                    raise ForwardToEngine
            except ForwardToEngine:
                # It names shared-memory regions, which the engine holds: the body as it came.
                if trace is not None:
                    trace.stage("engine call")
                traceparent = None if trace is None else trace.traceparent
                raw = RawInSlot(name, version, body, header_length, client, traceparent, slot)
                return await again_if_reloaded(partial(self.client.infer_raw, raw))
            except StokerError as error:
                self._count(contract, error, started)
                raise
            request = decoded.request
            if trace is not None:
                trace.stage("engine call")
            traceparent = None if trace is None else trace.traceparent
            part = InSlot(
                request.inputs, decoded.rows, decoded.wanted, arrived, traceparent, slot, len(body)
            )
            schedule = (request.timeout_us, request.priority, client)

            async def rechecked() -> tuple[Ran, Shaped]:
                # Nothing ran. Checked again from what was decoded, not from the body: a
                # remote client may have copied its tensors over it in its slot.
                nonlocal contract
                contract = await self.client.contract(name, version)
                again = checked(contract, request)
                part = InSlot(
                    request.inputs, again.rows, again.wanted, arrived, traceparent, slot, len(body)
                )
                return await self.gatherer.run(contract, part, *schedule)

            try:
                first = partial(self.gatherer.run, contract, part, *schedule)
                ran, shaped = await again_if_reloaded(first, rechecked)
            except StokerError as error:
                self._count(contract, error, started)
                raise
            if trace is not None:
                if ran.received_ns:
                    trace.note("stoker.received_ns", ran.received_ns)
                trace.stage("encode and write")
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

    async def classify_images(
        self,
        name: str | None,
        version: str | None,
        uploads: Sequence[bytes],
        k: int | None,
        client: str = "",
        began: float | None = None,
    ) -> tuple[str, str, list[Any]]:
        """Uploads through the model's handler and batcher: one answer per upload (top-k
        labels for the image classifier). ``name`` None: the default model. Each upload's
        header is screened here (``screen_upload``); the uploads of one turn of the loop for
        the same model, ``k`` and client go to the engine as one call, whose handler reads
        them (only it knows what an upload must be), or, where the engine publishes the
        model's preprocessing (it would decode on its CPU), as the rows made here of them."""
        trace = None if tracing.tracer is None else tracing.tracer.request(name or "")
        with self.drain_state.in_flight():
            if self.drain_state.refuses(began):
                raise draining()
            limits = self.settings.limits
            for data in uploads:  # a bomb or broken header never crosses to the engine
                try:
                    screen_upload(data, limits.max_image_pixels, limits.max_image_aspect_ratio)
                except StokerError as error:
                    http_refused(error.status, "image_header")
                    raise
            started = time.perf_counter()
            maker, made = self.row_maker, False
            contract = None if maker is None else await self.client.contract(name, version)
            if maker is not None and contract is not None and contract.row_preprocess is not None:
                classified, index, made = await self._as_rows(
                    maker, contract, uploads, k, client, trace
                )
            else:
                if trace is not None:
                    trace.stage("engine call")
                traceparent = None if trace is None else trace.traceparent
                classified, index = await self.gatherer.classify(
                    name, version, uploads, k, client, traceparent=traceparent
                )
            if trace is not None:
                if classified.received_ns:
                    trace.note("stoker.received_ns", classified.received_ns)
                trace.stage("encode and write")
            answer = classified.answers[index]
            if isinstance(answer, StokerError):
                raise answer
            if made:  # the engine timed the rest; the rows were made here, before it saw them
                seconds = time.perf_counter() - started
                self.client.request_timed(classified.model, classified.version, seconds)
            return classified.model, classified.version, answer

    async def _as_rows(
        self,
        maker: RowMaker,
        contract: Contract,
        uploads: Sequence[bytes],
        k: int | None,
        client: str,
        trace: tracing.RequestTrace | None = None,
    ) -> tuple[Classified, int, bool]:
        """The uploads made rows with the contract's preprocessing, gathered into an engine
        call: its answer, this request's index in it, and whether rows went (not files).
        Rows made for a preprocessing a reload replaced are refused by the engine as
        reloaded (nothing ran) and made once more with the contract asked again. A refusal
        here (not an image, too large) is counted here (``_count``): no engine saw it."""
        started = time.perf_counter()

        async def attempt(contract: Contract) -> tuple[Classified, int, bool]:
            model, version, prep = contract.model, contract.version, contract.row_preprocess
            if prep is None:  # the engine decodes this model's uploads itself now
                if trace is not None:
                    trace.stage("engine call")
                traceparent = None if trace is None else trace.traceparent
                gathered = self.gatherer.classify(
                    model, version, uploads, k, client, traceparent=traceparent
                )
                return *await gathered, False
            if trace is not None:
                trace.stage("make rows")
            try:
                rows = await maker.rows(uploads, prep)
            except StokerError as error:  # not an image, or too large
                self._count(contract, error, started)
                raise
            if trace is not None:
                trace.stage("engine call")
            traceparent = None if trace is None else trace.traceparent
            gathered = self.gatherer.classify(model, version, rows, k, client, prep, traceparent)
            return *await gathered, True

        async def made_again() -> tuple[Classified, int, bool]:
            return await attempt(await self.client.contract(contract.model, contract.version))

        return await again_if_reloaded(partial(attempt, contract), made_again)
