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

Kept in one module (~520 lines): it is one class, the multiprocess side of the engine client,
whose methods answer ``LocalEngine``'s one for one; what it stands on (the arena, the links,
the packing of frames) are modules of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from app import observed, wire
from app.channel import ChannelClosed, Frames
from app.contract import Answer, Classified, Contract, Frame, Ran, Raw, Uploads, draining
from app.errors import NotImplementedHere, Reloaded, StokerError
from app.frontend.arena import Arena, ArenaShare, Slot, slot_of
from app.frontend.frames import held_request, send_frame, send_uploads
from app.frontend.links import (
    EngineLink,
    Epoch,
    Reply,
    answered,
    ask_every,
    choose,
    connected,
    every_engine,
    first_link,
    merged_index,
)
from app.frontend.packing import classified_answers, classify_call
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
        self.linked = asyncio.Event()
        """Set once a first link is up or ``start`` gave up: requests wait for it
        (``first_link``) rather than 503 in the moment a front end starts."""
        self._tasks: list[asyncio.Task[None]] = []
        self._draining = False
        self._rules: dict[str, wire.Rule] = {}
        """The engines' control table (``Welcome``): their methods and how each spreads."""
        self._spreads: dict[wire.Spread, Callable[[wire.Control, wire.Rule], Awaitable[Any]]]
        self._spreads = {
            wire.Spread.MODEL: self._on_model,
            wire.Spread.ANY: self._on_any,
            wire.Spread.SUMMED: self._summed,
            wire.Spread.WORST: self._worst,
            wire.Spread.LABELLED: self._labelled,
            wire.Spread.AT_ONCE: self._at_once,
            wire.Spread.ALL_OR_NONE: self._all_or_none,
            wire.Spread.IN_TURN: self._in_turn,
            wire.Spread.ADOPTED: self._adopted,
        }

    # -- lifecycle

    async def start(self) -> None:
        try:
            await asyncio.gather(
                *(self._connect(link, time.monotonic() + CONNECT_TIMEOUT_S) for link in self._links)
            )
        finally:
            self.linked.set()
        self._tasks.append(asyncio.create_task(self.poller.run(), name="engine-state"))

    def begin_drain(self) -> None:
        """Refuse model control from now on (``Spread.AT_ONCE``); nothing to tell the
        engines: each engine process drains on its own SIGTERM."""
        self._draining = True

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
            hello = wire.Hello(self.arena.name, self.arena.slot_bytes)
            self._rules = (await link.call(hello, wire.Welcome)).control
            self.linked.set()
        except BaseException:
            link.close()  # its reader ends and fails what waits on it
            raise

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """A background task, kept until it ends (reconnects come and go for the process's
        life)."""
        self._tasks = [task for task in self._tasks if not task.done()]
        self._tasks.append(asyncio.create_task(work, name=name))

    async def _read(self, link: EngineLink, reader: Frames) -> None:
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
                await self._restore(link)
                return

    async def _restore(self, link: EngineLink) -> None:
        """What another engine reports for each control method with a ``restore`` rule (the
        system shared-memory regions clients registered), given to an engine that came back
        without it (every front end does this; an entry another one gave first is refused,
        which is fine)."""
        other = next((o for o in self._links if o is not link and o.ready), None)
        if other is None:
            return
        for method, rule in self._rules.items():
            if rule.restore is None:
                continue
            try:
                state = await other.call(wire.Control(method, ()), wire.Value)
            except StokerError:
                continue
            for entry in state.value:
                with contextlib.suppress(StokerError):
                    await link.call(wire.Control(rule.restore, tuple(entry.values())), wire.Value)

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
        """Nothing up front but this front end's first link: the engine answers 404 or 503
        once the body is read (a round trip per request would cost more than reading a
        refused body)."""
        await first_link(self.linked)

    def admit(self, contract: Contract, requests: int = 1) -> None:
        """Nothing up front either: the engine's batcher admits a frame when it arrives (the
        last poll's queue depth is a quarter of a second old: refusing on it would turn
        away requests a queue that drained meanwhile could take)."""

    # -- control: by the engine's table, spread as it says (``wire.Spread``)

    async def control(self, method: str, *args: Any) -> Any:
        """The engines' control method ``method`` called with ``args``: on one engine or on
        all of them, their answers made one, as the engines' table says (``Welcome``)."""
        await first_link(self.linked)  # the engines' table comes with the first link
        rule = self._rules.get(method)
        if rule is None:
            raise NotImplementedHere(f"no control operation '{method}' in this engine")
        return await self._spreads[rule.spread](wire.Control(method, args), rule)

    async def _on_model(self, call: wire.Control, rule: wire.Rule) -> Any:
        name, version = (*call.args, None, None)[:2]
        return (await self._choose(name, version).call(call, wire.Value)).value

    async def _on_any(self, call: wire.Control, rule: wire.Rule) -> Any:
        return (await self._choose().call(call, wire.Value)).value

    async def _summed(self, call: wire.Control, rule: wire.Rule) -> Any:
        # Every engine's share of the model's requests, added up.
        answers = await ask_every(self._connected(), call, wire.Value)
        return list(merged_statistics([reply.value for _, reply, _ in answers]))

    async def _worst(self, call: wire.Control, rule: wire.Rule) -> Any:
        """Every engine's index as one: where they disagree (one is still loading), the
        state of the engine furthest from serving, with its GPU named."""
        answers = await ask_every(self._connected(), call, wire.Value)
        return merged_index([(link.label, reply.value) for link, reply, _ in answers])

    async def _labelled(self, call: wire.Control, rule: wire.Rule) -> bytes:
        if len(self._links) == 1:
            _, text = await self._links[0].call_with_payload(call, wire.Done)
            return text
        answers = await ask_every(self._connected(), call, wire.Done)
        return labelled_metrics([(link.label, text) for link, _, text in answers])

    async def _at_once(self, call: wire.Control, rule: wire.Rule) -> None:
        """Sent to every connected engine at once (a load: loaded or reloaded by all); this
        front end's cached contracts are dropped (the others' at their next poll, by the
        engines' generation)."""
        if self._draining:
            raise draining()
        links = self._connected()
        outcomes = await asyncio.gather(
            *(link.call(call, wire.Value) for link in links), return_exceptions=True
        )
        self._contracts.clear()
        every_engine(f"{call.method} of {call.args[0]!r}", links, outcomes)

    async def _all_or_none(self, call: wire.Control, rule: wire.Rule) -> None:
        """Done by every connected engine, or by none: any of them may get the requests that
        name what it did (a region; an engine that comes back copies the others')."""
        done: list[EngineLink] = []
        try:
            for link in self._connected():
                await link.call(call, wire.Value)
                done.append(link)
        except BaseException:
            if rule.undo is not None:
                undo = wire.Control(rule.undo, call.args[:1])
                for link in done:
                    with contextlib.suppress(StokerError):
                        await link.call(undo, wire.Value)
            raise

    async def _in_turn(self, call: wire.Control, rule: wire.Rule) -> None:
        for link in self._connected():
            await link.call(call, wire.Value)

    async def _adopted(self, call: wire.Control, rule: wire.Rule) -> Any:
        """Changed by every engine; the settings adopted here at once (by the other front
        ends with their next poll)."""
        answers = await ask_every(self._connected(), call, wire.Value)
        for _, reply, _ in answers:
            observed.STATE.adopt(reply.value[1])
        return answers[0][1].value[0]

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
        await first_link(self.linked)
        ready = frozenset(i for i, link in enumerate(self._links) if link.ready)
        epoch = tuple(link.state.generation for link in self._links)
        cached = self._contracts.get((name, version))
        if cached is not None and ready <= cached[1] and epoch == cached[2]:
            return cached[0]
        described = await self._choose(name, version).call(wire.Describe(name, version), wire.Value)
        found = Contract.from_json(described.value)
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
        call: wire.Call,
        payload: bytes,
        slots: Sequence[Slot],
        requests: int,
    ) -> tuple[wire.Reply, bytes]:
        """Send a call and wait for the engine's answer. Its ``slots`` stay lent until the
        engine's last word, even when the caller goes away first (the engine is told it may
        drop the call): ``frames.held_request``, as a frame's pieces."""
        answer: Reply = asyncio.get_running_loop().create_future()

        def settle(outcome: tuple[wire.Reply, bytes] | Exception) -> None:
            if answer.done():  # its caller went away
                return
            if isinstance(outcome, Exception):
                answer.set_exception(outcome)
            else:
                answer.set_result(outcome)

        number = held_request(link, call, payload, slots, requests, settle, self._released)
        try:
            return await answer
        except asyncio.CancelledError:
            link.cancel(number)
            raise

    def _released(self, slots: Sequence[Slot], reply: wire.Reply | None) -> None:
        """The engine's last word on a call: its slots are this front end's again (given
        back where their request already went away); a reload's refusal drops the cached
        contracts (the data plane decodes against the new one)."""
        for slot in slots:
            slot.engine_holds = False
            if slot.abandoned:
                self.arena.give_back(slot)
        if isinstance(reply, wire.Failure) and reply.reason == Reloaded.reason:
            self._contracts.clear()

    def submit(
        self, frame: Frame, deliver: Callable[[Ran | Exception], None]
    ) -> Callable[[], object]:
        """A frame of decoded requests, to the ready engine with the least work ahead that
        takes its largest request; split into frames of at most that engine's max batch (a
        GPU with less memory may have shrunk it). Each request's tensors stay where its body
        put them in its slot, or travel in the payload; its outputs come back the same way
        (``app.frontend.packing``).

        No task runs it: its bytes are written in this turn, and ``deliver`` gets the
        answer (or the error) in the turn the engine's last reply to it is read. Under load
        a front end's loop turns in milliseconds, and a task, a flush and a future's
        callbacks were one turn each. Returns what tells the engine it may drop the frame
        (every caller went away); its slots stay lent until the engine's last word."""
        link = self._choose(frame.model, frame.version, max(part.rows for part in frame.parts))
        return send_frame(link, frame, deliver, self._released)

    async def infer_raw(self, raw: Raw) -> Answer:
        """The body as it came, for the engine to decode: a request that names
        shared-memory regions (the engine holds the registered regions)."""
        await first_link(self.linked)
        body, slot = raw.body, slot_of(raw)
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
        slots = [slot] if place is not None and slot else []
        reply, data = await self._held(link, call, payload, slots, 1)
        inferred = answered(reply, wire.Inferred)
        if inferred.slot_length is not None:
            assert slot is not None
            data = bytes(slot.view[: inferred.slot_length])
        return Answer(inferred.model, inferred.version, inferred.headers, data)

    def submit_uploads(
        self, uploads: Uploads, deliver: Callable[[Classified | Exception], None]
    ) -> Callable[[], object] | None:
        """``classify`` without a task, as ``submit`` sends a frame: the uploads written into
        a slot of the arena and the call onto its link in this turn, ``deliver`` given the
        answer (or the error) in the turn the engine's reply is read. Returns what tells the
        engine nobody waits for it any more; None, having sent nothing, where the arena has
        no room for it in this turn (``Arena.lend_now``) or no engine has been linked yet:
        the caller awaits ``classify``, which waits for room or the link. Raises where no
        engine takes it (nothing sent)."""
        if not self.linked.is_set():  # ``classify`` waits for the first link
            return None
        size = sum(len(image) for image in uploads.images)
        slot = None
        if uploads.images and size <= self.arena.slot_bytes:
            share = self.settings.limits.max_share_per_address
            slot = self.arena.lend_now(size, uploads.client, share)
            if slot is None:
                return None
        try:
            link = self._choose(uploads.name, uploads.version)
        except BaseException:
            if slot is not None:
                self.arena.give_back(slot)
            raise
        return send_uploads(link, uploads, slot, deliver, self.arena, self._released)

    async def classify(self, uploads: Uploads) -> Classified:
        """The uploads one after the other in a slot of the arena (or the payload), for the
        engine's handler; the answers come back as JSON in the payload, per request its
        answers or its failure (counted by the engine)."""
        await first_link(self.linked)
        size = sum(len(image) for image in uploads.images)
        async with self.body_buffer(size if uploads.images else None, uploads.client) as slot:
            call, payload = classify_call(uploads, slot)
            link = self._choose(uploads.name, uploads.version)
            requests = len(uploads.counts) or 1
            reply, data = await self._held(link, call, payload, [slot] if slot else [], requests)
        classified = answered(reply, wire.ClassifiedReply)
        return Classified(classified.model, classified.version, classified_answers(data))
