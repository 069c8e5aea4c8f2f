"""The remote engine client: engine processes behind the control channel.

A front end holds no model. It owns a shared-memory arena (``app.frontend.arena``): a V2 body
whose declared length fits a slot is read from the socket straight into one, the engine reads
its tensors there and writes its answers back into the same slot, so tensor bytes never cross
the control channel (``app.channel``, messages declared in ``app.wire``). A body that does not
fit, or arrives while every slot is lent, travels in the frame's payload instead.

Health comes from the engines: a background task asks each for its state every ``POLL_S``,
and a front end that reaches none answers not live and not ready. With one engine process per
GPU (``server.engine_gpus``) a front end holds a link to each, sends each frame to the ready
one with the least work ahead of it, and labels their metrics by GPU (``labelled_metrics``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from pathlib import Path
from typing import Any

from app import observed, wire
from app.channel import ChannelClosed
from app.contract import Answer, Classified, Contract, Frame, Ran, Raw, Slot, Uploads
from app.errors import Reloaded, StokerError
from app.frontend.arena import Arena, ArenaShare
from app.frontend.links import (
    EngineLink,
    Epoch,
    Reply,
    answered,
    ask_every,
    choose,
    connected,
    every_engine,
    merged_index,
)
from app.frontend.packing import (
    classified_answers,
    classify_call,
    ran_outputs,
    run_call,
    split_frame,
)
from app.frontend.poll import Poller
from app.frontend.totals import labelled_metrics, merged_statistics
from app.metrics import http_refused
from app.settings import Settings

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 600.0
RECONNECT_S = 0.5


class RemoteEngine:
    """The ``EngineClient`` of a front end, in front of one engine process or of one per GPU
    (``engines``: each one's label and control socket). A frame goes to the ready engine
    with the least work ahead of it; an engine that goes away is out of that choice until it
    is back (the supervisor restarts it), while the others serve. With a single engine,
    losing it ends this front end, as the engine's end ends the server."""

    def __init__(
        self,
        settings: Settings,
        engines: Sequence[tuple[str, str | Path]],
        arena: str | None = None,
    ) -> None:
        self.settings = settings
        self.frames_in_flight = settings.server.frames_in_flight
        self.in_process = False
        self._links = [EngineLink(label, Path(control)) for label, control in engines]
        front = settings.server
        self.arena = Arena(front.shm_slots, front.shm_slot_bytes, front.front_ends, arena)
        self._bypass_logged = False
        self._stopping = False
        self._contracts: dict[
            tuple[str | None, str | None], tuple[Contract, frozenset[int], Epoch]
        ] = {}
        """Per model version asked for, its contract, the engines ready when it was asked
        (by index: an engine ready since may take more rows) and each engine's generation
        then (a load or unload since drops it)."""
        self.poller = Poller(self._links, self._engine_state)
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle

    async def start(self) -> None:
        await asyncio.gather(
            *(self._connect(link, time.monotonic() + CONNECT_TIMEOUT_S) for link in self._links)
        )
        self._tasks.append(asyncio.create_task(self.poller.run(), name="engine-state"))

    def begin_drain(self) -> None:
        """Nothing to tell: each engine process drains on its own SIGTERM."""

    async def drain(self) -> None:
        """Nothing to wait for beyond the data plane's own drain: the engines answer or fail
        what they accepted within their drain timeout, on their own SIGTERM."""

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for link in self._links:
            link.close()
        self.arena.close()

    async def _connect(self, link: EngineLink, deadline: float) -> None:
        reader = await link.open(deadline)
        self._spawn(self._read(link, reader), "engine-replies")
        try:
            await link.call(wire.Hello(self.arena.name, self.arena.slot_bytes), wire.Done)
        except BaseException:
            link.close()  # its reader ends and fails what waits on it
            raise

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """A background task, kept until it ends (reconnects come and go for the process's
        life)."""
        self._tasks = [task for task in self._tasks if not task.done()]
        self._tasks.append(asyncio.create_task(work, name=name))

    async def _read(self, link: EngineLink, reader: asyncio.StreamReader) -> None:
        try:
            await link.read_replies(reader)
        except ChannelClosed as gone:
            if not self._stopping:
                log.error("the engine process%s closed the control channel: %s", link.named, gone)
        finally:
            if not self._stopping:
                if len(self._links) == 1:
                    # This front end cannot serve without the engine: end it (a drain, as on
                    # SIGTERM), so the supervisor starts a fresh one or stops with the engine.
                    os.kill(os.getpid(), signal.SIGTERM)
                elif not link.reconnecting:
                    link.reconnecting = True
                    self._spawn(self._reconnect(link), "engine-reconnect")

    async def _reconnect(self, link: EngineLink) -> None:
        """Back to an engine the supervisor restarted, as soon as its socket answers."""
        while not self._stopping:
            await asyncio.sleep(RECONNECT_S)
            try:
                await self._connect(link, time.monotonic())
            except (OSError, StokerError):
                continue
            if link.connected:  # not gone again already (its reader would not call us back)
                link.reconnecting = False
                log.info("the engine process%s is back", link.named)
                await self._copy_regions(link)
                return

    async def _copy_regions(self, link: EngineLink) -> None:
        """The system shared-memory regions clients registered, as another engine holds
        them, registered with an engine that came back without them (every front end does
        this; a region another one registered first is refused, which is fine)."""
        other = next((o for o in self._links if o is not link and o.ready), None)
        if other is None:
            return
        try:
            status = await other.call(wire.ShmStatus(None), wire.Value)
        except StokerError:
            return
        for region in status.value:
            call = wire.ShmRegister(
                region["name"], region["key"], region["offset"], region["byte_size"]
            )
            with contextlib.suppress(StokerError):
                await link.call(call, wire.Done)

    # -- choosing an engine

    def _choose(
        self, name: str | None = None, version: str | None = None, rows: int = 0
    ) -> EngineLink:
        return choose(self._links, name, version, rows)

    def _connected(self) -> list[EngineLink]:
        return connected(self._links)

    async def _engine_state(self, link: EngineLink, call: wire.State) -> wire.EngineState:
        state = await link.call(call, wire.EngineState)
        observed.STATE.adopt(state.observed)  # a change another front end made
        return state

    async def _value(
        self, call: wire.Call, name: str | None = None, version: str | None = None
    ) -> Any:
        link = self._choose(name, version)
        return (await link.call(call, wire.Value)).value

    # -- state

    @property
    def alive(self) -> bool:
        return any(link.state.alive for link in self._links)

    @property
    def ready(self) -> bool:
        return any(link.ready for link in self._links)

    def engines(self) -> list[dict[str, object]]:
        if len(self._links) == 1:
            return []
        return [{"gpu": link.label, "ready": link.ready} for link in self._links]

    async def check(self, name: str, version: str | None = None) -> None:
        """Nothing up front: the engine answers 404 or 503 once the body is read (a round
        trip per request would cost more than reading a refused body)."""

    def admit(self, contract: Contract, requests: int = 1) -> None:
        """Nothing up front either: the engine's batcher admits a frame when it arrives (the
        last poll's queue depth is a quarter of a second old: refusing on it would turn
        away requests a queue that drained meanwhile could take)."""

    async def metadata(self, name: str, version: str | None = None) -> dict[str, object]:
        value: dict[str, object] = await self._value(
            wire.ModelMetadata(name, version), name, version
        )
        return value

    async def version_ready(self, name: str, version: str | None = None) -> dict[str, object]:
        value: dict[str, object] = await self._value(
            wire.VersionReady(name, version), name, version
        )
        return value

    async def model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        value: dict[str, Any] = await self._value(wire.ModelConfig(name, version), name, version)
        return value

    async def statistics(self, name: str | None = None, version: str | None = None) -> list[object]:
        # Every engine's share of the model's requests, added up.
        answers = await ask_every(self._connected(), wire.Statistics(name, version), wire.Value)
        return list(merged_statistics([reply.value for _, reply, _ in answers]))

    async def repository_index(self) -> list[dict[str, str]]:
        """Every engine's index as one: where they disagree (one is still loading), the
        state of the engine furthest from serving, with its GPU named."""
        answers = await ask_every(self._connected(), wire.RepositoryIndex(), wire.Value)
        return merged_index([(link.label, reply.value) for link, reply, _ in answers])

    async def load(self, name: str, config: dict[str, Any] | None = None) -> None:
        """Loaded (or reloaded) by every engine at once; see ``_on_every``."""
        await self._on_every(wire.Load(name, config), "load")

    async def unload(self, name: str) -> None:
        await self._on_every(wire.Unload(name), "unload")

    async def _on_every(self, call: wire.Load | wire.Unload, what: str) -> None:
        """A load or unload sent to every connected engine at once; this front end's cached
        contracts are dropped (the others' at their next poll, by the engines' generation)."""
        links = self._connected()
        outcomes = await asyncio.gather(
            *(link.call(call, wire.Done) for link in links), return_exceptions=True
        )
        self._contracts.clear()
        every_engine(f"{what} of {call.name!r}", links, outcomes)

    async def metrics_text(self) -> bytes:
        if len(self._links) == 1:
            _, text = await self._links[0].call_with_payload(wire.Metrics(), wire.Done)
            return text
        answers = await ask_every(self._connected(), wire.Metrics(), wire.Done)
        return labelled_metrics([(link.label, text) for link, _, text in answers])

    async def shm_register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Registered with every connected engine, or with none: any of them may get the
        requests that name it (an engine that comes back copies the others' regions)."""
        done: list[EngineLink] = []
        try:
            for link in self._connected():
                await link.call(wire.ShmRegister(name, key, offset, byte_size), wire.Done)
                done.append(link)
        except BaseException:
            for link in done:
                with contextlib.suppress(StokerError):
                    await link.call(wire.ShmUnregister(name), wire.Done)
            raise

    async def shm_unregister(self, name: str | None = None) -> None:
        for link in self._connected():
            await link.call(wire.ShmUnregister(name), wire.Done)

    async def shm_status(self, name: str | None = None) -> list[dict[str, object]]:
        value: list[dict[str, object]] = await self._value(wire.ShmStatus(name))
        return value

    async def trace_settings(
        self, model: str | None = None, update: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Changed by every engine; adopted here at once (by the other front ends with
        their next poll)."""
        await self._observe(wire.TraceSettings(model, update))
        return observed.STATE.trace_settings(model)

    async def log_settings(self, update: dict[str, Any] | None = None) -> dict[str, Any]:
        await self._observe(wire.LogSettings(update))
        return dict(observed.STATE.log)

    async def _observe(self, call: wire.TraceSettings | wire.LogSettings) -> None:
        answers = await ask_every(self._connected(), call, wire.Value)
        for _, reply, _ in answers:
            observed.STATE.adopt(reply.value)

    # -- what the data plane measured: reported with the next poll

    def request_timed(self, model: str, version: str, seconds: float, engine: str = "") -> None:
        self.poller.request_timed(model, version, seconds, engine)

    def count_failures(
        self, name: str, version: str, reason: str, count: int, seconds: float
    ) -> None:
        self.poller.count_failures(name, version, reason, count, seconds)

    # -- inference

    async def contract(self, name: str | None, version: str | None = None) -> Contract:
        """The model version's contract, asked of the engines once (a loaded version's
        tensors never change while the engine lives; refusals are not kept), and again when
        an engine has become ready since."""
        ready = frozenset(i for i, link in enumerate(self._links) if link.ready)
        epoch = tuple(link.state.generation for link in self._links)
        cached = self._contracts.get((name, version))
        if cached is not None and ready <= cached[1] and epoch == cached[2]:
            return cached[0]
        found = Contract.from_json(await self._value(wire.Describe(name, version), name, version))
        # Engines may have shrunk the version to different max batches: the contract is that
        # of the one taking the most rows, and a request larger than another's max batch is
        # routed past that one (``_choose``), not refused.
        model, concrete = found.model, found.version  # named: ``name`` None is the default
        best = max(
            (self._links[i] for i in ready),
            key=lambda link: link.max_batch(model, concrete),
            default=None,
        )
        if best is not None and best.max_batch(model, concrete) > found.spec.max_batch_size:
            try:
                described = await best.call(wire.Describe(model, concrete), wire.Value)
                found = Contract.from_json(described.value)
            except StokerError:  # gone meanwhile: the first answer holds, not kept
                return found
        self._contracts[(name, version)] = (found, ready, epoch)
        return found

    def arena_full_since(self) -> float | None:
        """Since when the arena has had no room for a largest body (readiness)."""
        return self.arena.full_since

    @contextlib.asynccontextmanager
    async def body_buffer(
        self, declared: int | None, client: str = ""
    ) -> AsyncIterator[Slot | None]:
        """A slot of the arena for a body of ``declared`` bytes, waiting (bounded by
        ``server.arena_wait_s``, then 503) while the arena is full; None for a body of no
        declared length or larger than a slot (it crosses over the control socket)."""
        slot = None
        if declared is not None:
            try:
                slot = await self.arena.lend_within(
                    declared,
                    self.settings.server.arena_wait_s,
                    client,
                    self.settings.limits.max_share_per_address,
                )
            except StokerError as error:
                http_refused(503, "arena_share" if isinstance(error, ArenaShare) else "arena_full")
                raise
            if slot is None and not self._bypass_logged:
                self._bypass_logged = True
                log.warning(
                    "a %d-byte body is larger than a shared-memory slot (%d bytes): such bodies "
                    "cross over the control socket, slower (server.shm_slot_bytes)",
                    declared,
                    self.arena.slot_bytes,
                )
        try:
            yield slot
        finally:
            if slot is not None:
                if slot.engine_holds:
                    slot.abandoned = True  # given back at the engine's last word
                else:
                    self.arena.give_back(slot)

    async def _held(
        self,
        link: EngineLink,
        number: int,
        slots: Sequence[Slot],
        requests: int,
    ) -> tuple[wire.Reply, bytes]:
        """Wait for an engine's answer to call ``number``. Its ``slots`` stay lent until the
        engine's last word, even when the caller goes away first (the engine is told it may
        drop the call)."""
        future = link.waiting[number]
        link.track(future, requests)
        for slot in slots:
            slot.engine_holds = True  # the engine may read them until the answer arrives

        def released(answer: Reply) -> None:
            for slot in slots:
                slot.engine_holds = False
                if slot.abandoned:
                    self.arena.give_back(slot)
            if not answer.cancelled() and answer.exception() is None:
                reply = answer.result()[0]
                if isinstance(reply, wire.Failure) and reply.reason == Reloaded.reason:
                    self._contracts.clear()  # decoded again, against the new contract

        future.add_done_callback(released)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            link.cancel(number)
            raise

    async def run(self, frame: Frame) -> Ran:
        """A frame of decoded requests, to the ready engine with the least work ahead that
        takes its largest request; split into frames of at most that engine's max batch (a
        GPU with less memory may have shrunk it). Each request's tensors stay where its body
        put them in its slot, or travel in the payload; its outputs come back the same way
        (``app.frontend.packing``)."""
        link = self._choose(frame.model, frame.version, max(part.rows for part in frame.parts))
        frames = split_frame(frame, link.max_batch(frame.model, frame.version))
        if len(frames) == 1:  # the common case, without a task of its own (a turn less)
            return await self._run_frame(link, frame)
        answers = await asyncio.gather(*(self._run_frame(link, piece) for piece in frames))
        outputs = [one for answer in answers for one in answer.outputs]
        return Ran(answers[0].model, answers[0].version, outputs, link.label)

    async def _run_frame(self, link: EngineLink, frame: Frame) -> Ran:
        call, payload = run_call(frame)
        number = link.request(call, payload)
        slots = [part.slot for part in frame.parts if part.slot is not None]
        reply, data = await self._held(link, number, slots, len(frame.parts))
        ran = answered(reply, wire.Ran)
        return Ran(ran.model, ran.version, ran_outputs(frame.parts, ran, data), link.label)

    async def infer_raw(self, raw: Raw) -> Answer:
        """The body as it came, for the engine to decode: a request that names
        shared-memory regions (the engine holds the registered regions)."""
        body, slot = raw.body, raw.slot
        payload = b""
        place = None
        if slot is not None and isinstance(body, memoryview):
            place = wire.SlotRef(slot.offset, len(slot.view))
        else:
            payload = bytes(body)
        call = wire.Infer(
            raw.name, raw.version, raw.header_length, raw.client, place, len(body), raw.traceparent
        )
        link = self._choose(raw.name, raw.version)
        number = link.request(call, payload)
        reply, data = await self._held(
            link, number, [slot] if place is not None and slot else [], 1
        )
        inferred = answered(reply, wire.Inferred)
        if inferred.slot_length is not None:
            assert slot is not None
            data = bytes(slot.view[: inferred.slot_length])
        return Answer(inferred.model, inferred.version, inferred.headers, data)

    async def classify(self, uploads: Uploads) -> Classified:
        """The uploads one after the other in a slot of the arena (or the payload), for the
        engine's handler; the answers come back as JSON in the payload, per request its
        answers or its failure (counted by the engine)."""
        size = sum(len(image) for image in uploads.images)
        async with self.body_buffer(size if uploads.images else None, uploads.client) as slot:
            call, payload = classify_call(uploads, slot)
            link = self._choose(uploads.name, uploads.version)
            number = link.request(call, payload)
            requests = len(uploads.counts) or 1
            reply, data = await self._held(link, number, [slot] if slot else [], requests)
        classified = answered(reply, wire.Classified)
        return Classified(classified.model, classified.version, classified_answers(data))
