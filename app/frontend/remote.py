"""A front-end process's plane: the routes' calls forwarded to the engine process.

A front end accepts HTTP, authenticates, applies the limits and reads request bodies; it holds
no model. Each front end owns a shared-memory arena cut into slots: a V2 body whose declared
length fits a slot is read from the socket straight into one, and the engine reads it there
and writes its answer back into the same slot, so tensor bytes never cross the control
channel (``app.channel``). A body that does not fit, or arrives while every slot is lent,
travels in the frame instead: slower, never refused for it.

Health comes from the engine: a background task asks for its state every ``POLL_S``, and a
front end that cannot reach it answers not live and not ready. A front end's drain stops new
requests at once and waits for its own in-flight ones; the engine drains its queues itself.
With one engine process per GPU (``server.engine_gpus``) a front end holds a channel to each,
sends each request to the ready one with the least work ahead of it, and labels their
metrics by GPU (``labelled_metrics``).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from functools import partial
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from app.channel import ChannelClosed, Sender, receive
from app.frontend.plane import (
    THREADED_DECODE_BYTES,
    Answer,
    Contract,
    PlaneState,
    Slot,
    decode_infer,
)
from app.errors import EngineError, StokerError, Unavailable
from app.metrics import (
    CountedSeries,
    http_refusal_counts,
    labelled_metrics,
    merged_statistics,
    request_durations,
)
from app.protocol import encode_response, pack_tensor, unpack_tensor
from app.settings import Settings

log = logging.getLogger(__name__)
POLL_S = 0.25
CONNECT_TIMEOUT_S = 600.0


class RemoteError(StokerError):
    """An error the engine answered with: its status and reason, as the engine gave them."""

    def __init__(self, message: str, status: int, reason: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


PAGE = 4096


class Arena:
    """Shared memory this front end lends to request bodies: ``slots x slot_bytes`` bytes in
    4 KiB pages; a body takes the pages it needs (at most ``slot_bytes``), so many small
    bodies share the arena and a few large ones still fit."""

    def __init__(
        self, slots: int, slot_bytes: int, share: int = 1, name: str | None = None
    ) -> None:
        # /dev/shm is a tmpfs with a size (64 MB in a default Docker container): writing past
        # it kills the process with SIGBUS, so the arena takes at most half of what is free,
        # split over the ``share`` front ends.
        wanted = slots * slot_bytes
        fits = shm_bytes_free() // (2 * max(1, share))
        if fits < wanted:
            log.warning(
                "/dev/shm has room for %d of the %d bytes of this front end's shared-memory "
                "arena; bodies that find no room travel over the control socket (give the "
                "container a larger /dev/shm: docker --shm-size, or a memory-backed emptyDir)",
                fits,
                wanted,
            )
            wanted = int(fits)
        pages = wanted // PAGE
        # Whole pages: a body lent the pages it needs never exceeds what the engine allows.
        self.slot_bytes = min(slot_bytes, pages * PAGE) // PAGE * PAGE
        if name is not None:
            # A fixed name: what a crashed predecessor left is replaced, not leaked.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")
        self.memory = shared_memory.SharedMemory(
            name=name, create=True, size=max(PAGE, pages * PAGE)
        )
        # Free runs of pages, (first page, count), sorted and never adjacent.
        self._free: list[tuple[int, int]] = [(0, pages)] if pages else []

    @property
    def name(self) -> str:
        return self.memory.name

    @property
    def free_bytes(self) -> int:
        return sum(count for _, count in self._free) * PAGE

    def lend(self, size: int) -> Slot | None:
        """Room for ``size`` bytes (first fit), or None when it is larger than a slot or no
        run of free pages is long enough."""
        if size > self.slot_bytes:
            return None
        need = max(1, -(-size // PAGE))
        for i, (first, count) in enumerate(self._free):
            if count >= need:
                if count == need:
                    del self._free[i]
                else:
                    self._free[i] = (first + need, count - need)
                start, length = first * PAGE, need * PAGE
                assert self.memory.buf is not None
                return Slot(start, self.memory.buf[start : start + length])
        return None

    def give_back(self, slot: Slot) -> None:
        """Make a slot's pages lendable again (once: a second call is a no-op)."""
        if slot.returned:
            return
        slot.returned = True
        first, count = slot.offset // PAGE, len(slot.view) // PAGE
        slot.view.release()
        at = bisect.bisect(self._free, (first, 0))
        if at < len(self._free) and self._free[at][0] == first + count:  # joins the next run
            count += self._free.pop(at)[1]
        if at > 0 and sum(self._free[at - 1]) == first:  # and the previous one
            first, before = self._free[at - 1]
            self._free[at - 1] = (first, before + count)
        else:
            self._free.insert(at, (first, count))

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self.memory.close()
        with contextlib.suppress(FileNotFoundError):
            self.memory.unlink()


def shm_bytes_free(root: str = "/dev/shm") -> int:
    """Bytes free in the shared-memory file system (a large number where it cannot be read)."""
    try:
        stats = os.statvfs(root)
    except OSError:
        return 1 << 40
    return stats.f_bavail * stats.f_frsize


class ForwardToEngine(Exception):
    """A request only the engine can decode: it names shared-memory regions."""


class EngineRegions:
    """Stands for the engine's registered shared-memory regions while a front end decodes:
    a request that names one is sent to the engine as it came (``ForwardToEngine``)."""

    def view(self, name: str, offset: int, size: int, what: str) -> memoryview:
        raise ForwardToEngine


ENGINE_REGIONS = EngineRegions()


def address(buffer: bytes | memoryview) -> int:
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


def place_inputs(
    inputs: dict[str, np.ndarray], slot: Slot | None, body_length: int
) -> tuple[list[list[Any]], bytes]:
    """Where the engine finds each input: ``[name, datatype, shape, offset, size]`` in the
    slot, and the payload (empty when every input is in the slot). Inputs decoded from binary
    data are views of the slot already and stay where they are; others (JSON) are copied in
    after the body, or over it when no input lies in it; all go in the payload when they do
    not fit."""
    packed = [
        (name, *pack_tensor(name, array), list(array.shape)) for name, array in inputs.items()
    ]
    if slot is not None:
        capacity = len(slot.view)
        base = address(slot.view)

        def inside(chunk: bytes | memoryview) -> int | None:
            at = address(chunk) - base if len(chunk) else 0
            return at if at >= 0 and at + len(chunk) <= capacity else None

        where = [inside(chunk) for _, _, chunk, _ in packed]
        cursor = -(-body_length // 64) * 64 if any(at is not None for at in where) else 0
        copies = [
            len(chunk) for (_, _, chunk, _), at in zip(packed, where, strict=True) if at is None
        ]
        if cursor + sum(copies) <= capacity:
            described = []
            for (name, datatype, chunk, shape), at in zip(packed, where, strict=True):
                if at is None:
                    slot.view[cursor : cursor + len(chunk)] = chunk
                    at, cursor = cursor, cursor + len(chunk)
                described.append([name, datatype, shape, at, len(chunk)])
            return described, b""
    described, at = [], 0
    for name, datatype, chunk, shape in packed:
        described.append([name, datatype, shape, at, len(chunk)])
        at += len(chunk)
    return described, b"".join(chunk for _, _, chunk, _ in packed)


Reply = asyncio.Future[tuple[dict[str, Any], bytes]]
CANCELLED_REPLY = {"error": "cancelled", "status": 499, "reason": "cancelled"}


@dataclass(eq=False)
class EngineLink:
    """One engine process as a front end sees it: its control channel, the calls waiting
    for its answers and the state it reported at the last poll."""

    label: str
    """What metrics and readiness call it: its GPU (``server.engine_gpus``), or "" alone."""
    control: Path
    state: dict[str, Any] = field(default_factory=lambda: dict(GONE))
    writer: Sender | None = None
    waiting: dict[int, Reply] = field(default_factory=dict)
    ids: int = 0
    in_flight: int = 0
    """Requests this front end sent it that are not answered yet (a frame counts its
    requests)."""
    durations: dict[tuple[str, str], CountedSeries] = field(default_factory=dict)
    """Per model version, how long the requests it answered took here since the last poll:
    sent to it with the poll, so each engine's histogram holds the requests it served."""
    reconnecting: bool = False

    @property
    def connected(self) -> bool:
        return self.writer is not None and not self.writer.is_closing()

    @property
    def ready(self) -> bool:
        return self.connected and bool(self.state.get("ready"))

    @property
    def load(self) -> int:
        """The work ahead of a request sent to it now, in requests: what it had queued or
        running at the last poll, and this front end's unanswered requests to it."""
        return int(self.state.get("queued", 0)) + self.in_flight

    def serves(self, name: str | None, version: str | None, rows: int = 0) -> bool:
        """Whether it answered for this model version at the last poll (``None``: any
        version; no name: any model) and takes ``rows`` in one request there."""
        if name is None:
            return True
        return any(
            n == name and version in (None, v) and (rows <= most or most == 0)
            for n, v, most in self.state.get("serving", ())
        )

    def max_batch(self, name: str, version: str) -> int:
        """The most rows it takes in one request of this model version (0: unbatched, or
        not served here)."""
        return max(
            (most for n, v, most in self.state.get("serving", ()) if (n, v) == (name, version)),
            default=0,
        )

    def track(self, future: Reply, requests: int) -> None:
        """Count ``requests`` in flight to it until ``future`` is answered."""
        self.in_flight += requests

        def answered(_: Reply) -> None:
            self.in_flight -= requests

        future.add_done_callback(answered)

    def request(
        self, header: dict[str, Any], payload: bytes = b"", future: Reply | None = None
    ) -> int:
        """Send one call; its answer resolves ``future`` (a new one in ``waiting``). What
        cannot be sent raises, and then nothing waits for an answer."""
        writer = self.writer
        if writer is None or not self.connected:
            raise Unavailable(f"the engine process{self.named} is not connected")
        self.ids += 1
        writer.send({**header, "id": self.ids}, payload)
        self.waiting[self.ids] = future or asyncio.get_running_loop().create_future()
        return self.ids

    def cancel(self, number: int) -> None:
        if self.writer is not None and self.connected:
            self.writer.send({"op": "cancel", "of": number})

    @property
    def named(self) -> str:
        return f" for GPU {self.label}" if self.label else ""


GONE: dict[str, Any] = {"alive": False, "ready": False}
RECONNECT_S = 0.5


@dataclass
class Gathering:
    """Decoded requests of one turn of the loop that go to the engine in one frame."""

    shared: dict[str, Any]
    future: Reply
    link: EngineLink
    """The engine it goes to, chosen when its first request came."""
    limit: int
    """The most rows it may gather: the model's max batch on that engine."""
    items: list[dict[str, Any]] = field(default_factory=list)
    payloads: list[bytes] = field(default_factory=list)
    payload_bytes: int = 0
    rows: int = 0
    waiting: int = 0
    """Requests of it whose callers still wait: when none does, the engine may drop it."""
    number: int | None = None
    """Its call number, once sent."""


class RemotePlane(PlaneState):
    """The ``Plane`` of a front end (see ``app.frontend.plane.Plane``), in front of one engine
    process or of one per GPU (``engines``: each one's label and control socket). A request
    goes to the ready engine with the least work ahead of it; an engine that goes away is
    out of that choice until it is back (the supervisor restarts it), while the others
    serve. With a single engine, losing it ends this front end, as the engine's end ends
    the server."""

    def __init__(
        self,
        settings: Settings,
        engines: Sequence[tuple[str, str | Path]],
        arena: str | None = None,
    ) -> None:
        super().__init__(settings)
        self._links = [EngineLink(label, Path(control)) for label, control in engines]
        front = settings.server
        self.arena = Arena(front.shm_slots, front.shm_slot_bytes, front.front_ends, arena)
        self._stopping = False
        self._gatherings: dict[tuple[Any, ...], Gathering] = {}
        self._flush_scheduled = False
        self._contracts: dict[tuple[str, str | None], tuple[Contract, frozenset[int]]] = {}
        """Per model version asked for, its contract and the engines ready when it was
        asked (by index): an engine ready since may take more rows."""
        self._failed: dict[tuple[str, str, str], list[float]] = {}
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle

    async def start(self) -> None:
        await asyncio.gather(
            *(self._connect(link, time.monotonic() + CONNECT_TIMEOUT_S) for link in self._links)
        )
        self._tasks.append(asyncio.create_task(self._poll(), name="engine-state"))

    async def _connect(self, link: EngineLink, deadline: float) -> None:
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(link.control))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        link.writer = Sender(writer)
        self._spawn(self._read(link, reader), "engine-replies")
        try:
            await self._call(
                link, {"op": "hello", "arena": self.arena.name, "slot": self.arena.slot_bytes}
            )
        except BaseException:
            link.writer.close()  # its reader ends and fails what waits on it
            raise

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """A background task, kept until it ends (reconnects come and go for the process's
        life)."""
        self._tasks = [task for task in self._tasks if not task.done()]
        self._tasks.append(asyncio.create_task(work, name=name))

    async def _read(self, link: EngineLink, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                header, payload = await receive(reader)
                future = link.waiting.pop(header.get("id", -1), None)
                if future is not None and not future.done():
                    future.set_result((header, payload))
        except ChannelClosed as gone:
            if not self._stopping:
                log.error("the engine process%s closed the control channel: %s", link.named, gone)
        finally:
            link.state = dict(GONE)
            if link.writer is not None:
                link.writer.close()  # no request is sent into a channel nobody reads
            for future in link.waiting.values():
                if not future.done():
                    future.set_exception(Unavailable(f"the engine process{link.named} is gone"))
            link.waiting.clear()
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
            reply, _ = await self._call(other, {"op": "shm_status", "name": None})
        except StokerError:
            return
        regions: list[dict[str, Any]] = reply["value"]
        for region in regions:
            header = {"op": "shm_register", "name": region["name"], "key": region["key"]}
            with contextlib.suppress(StokerError):
                await self._call(
                    link, header | {"offset": region["offset"], "size": region["byte_size"]}
                )

    async def _poll(self) -> None:
        """Every engine's state every ``POLL_S`` (all at once: one that hangs delays no
        other's), sending each the durations of the requests it answered since the last
        poll and the first connected one what this front end refused meanwhile, which the
        engines add to their ``/metrics``."""
        sent: dict[tuple[str, str], float] = {}

        async def poll(link: EngineLink, primary: bool) -> None:
            nonlocal sent
            if not link.connected:
                link.state = dict(GONE)
                return
            # Request durations since the last poll: a fresh series takes the next ones.
            timed, link.durations = link.durations, {}
            header: dict[str, Any] = {
                "op": "state",
                "durations": [[*key, *series.snapshot()] for key, series in timed.items()],
            }
            if primary:
                counts = http_refusal_counts()
                refused = [[s, r, n - sent.get((s, r), 0.0)] for (s, r), n in counts.items()]
                failed = [(key, int(n), total / n) for key, (n, total) in self._failed.items() if n]
                header |= {
                    "refused": [item for item in refused if item[2]],
                    "failed": [[*key, n, mean] for key, n, mean in failed],
                }
            try:
                link.state, _ = await asyncio.wait_for(self._call(link, header), 2.0)
            except (StokerError, TimeoutError):
                link.state = dict(GONE)
                for which, series in timed.items():  # not delivered: the next poll's
                    buckets, total = series.snapshot()
                    link.durations.setdefault(which, request_durations()).merge(buckets, total)
                return
            if primary:
                sent = counts
                for key, n, mean in failed:
                    entry = self._failed[key]
                    entry[0] -= n
                    entry[1] -= n * mean

        while True:
            first = next((link for link in self._links if link.connected), None)
            await asyncio.gather(*(poll(link, link is first) for link in self._links))
            await asyncio.sleep(POLL_S)

    def _choose(
        self, name: str | None = None, version: str | None = None, rows: int = 0
    ) -> EngineLink:
        """The engine a request for ``name`` (and ``version``, of ``rows`` rows) goes to: of
        the ready ones that serve it and take that many rows, the one with the least work
        ahead of it; of the ready ones, if none does (it answers why); any connected one
        while none is ready; none: 503 here."""
        ready = [link for link in self._links if link.ready]
        serving = [link for link in ready if link.serves(name, version, rows)]
        if not serving and rows and any(link.serves(name, version) for link in ready):
            # The engines that took this many rows (a GPU with more memory) are not back.
            raise Unavailable(
                f"no engine that takes {rows} rows of {name} in one request is ready; retry"
            )
        if serving or ready:
            return min(serving or ready, key=lambda link: link.load)
        return self._connected()[0]

    async def _call(
        self, link: EngineLink, header: dict[str, Any], payload: bytes = b""
    ) -> tuple[dict[str, Any], bytes]:
        number = link.request(header, payload)
        try:
            reply, data = await link.waiting[number]
        finally:
            link.waiting.pop(number, None)  # answered, or given up on (a poll's timeout)
        if "error" in reply:
            raise RemoteError(reply["error"], reply["status"], reply.get("reason", "other"))
        return reply, data

    async def _value(self, op: str, **fields: Any) -> Any:
        link = self._choose(fields.get("name"), fields.get("version"))
        reply, _ = await self._call(link, {"op": op, **fields})
        return reply["value"]

    async def drain(self) -> None:
        """Refuse new requests; wait for this front end's in-flight ones (the engine answers
        or fails them within its own drain timeout)."""
        self.begin_drain()
        await self.all_answered(self.drain_time_left() + 1.0)

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for link in self._links:
            if link.writer is not None:
                link.writer.close()
        self.arena.close()

    # -- state

    @property
    def alive(self) -> bool:
        return any(link.state.get("alive") for link in self._links)

    @property
    def is_ready(self) -> bool:
        return any(link.ready for link in self._links) and not self.draining

    def engines(self) -> list[dict[str, object]]:
        if len(self._links) == 1:
            return []
        return [{"gpu": link.label, "ready": link.ready} for link in self._links]

    async def check(self, name: str, version: str | None = None) -> None:
        """Nothing up front: the engine answers 404 or 503 once the body is read (a round
        trip per request would cost more than reading a refused body)."""

    async def metadata(self, name: str, version: str | None = None) -> dict[str, object]:
        value: dict[str, object] = await self._value("metadata", name=name, version=version)
        return value

    async def version_ready(self, name: str, version: str | None = None) -> dict[str, object]:
        value: dict[str, object] = await self._value("version_ready", name=name, version=version)
        return value

    async def model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        value: dict[str, Any] = await self._value("model_config", name=name, version=version)
        return value

    async def _ask_every(
        self, header: dict[str, Any]
    ) -> list[tuple[EngineLink, dict[str, Any], bytes]]:
        """``header`` asked of every connected engine: each one's answer; if none answers,
        the first refusal (an unknown model is each engine's 404: the client's, too)."""
        answers, refused = [], []
        for link in self._connected():
            try:
                answers.append((link, *await self._call(link, header)))
            except StokerError as error:
                refused.append(error)
        if not answers and refused:
            raise refused[0]
        return answers

    def _connected(self) -> list[EngineLink]:
        connected = [link for link in self._links if link.connected]
        if not connected:
            raise Unavailable("no engine process is connected; retry")
        return connected

    async def statistics(self, name: str | None = None, version: str | None = None) -> list[object]:
        # Every engine's share of the model's requests, added up.
        header = {"op": "statistics", "name": name, "version": version}
        answers = await self._ask_every(header)
        return list(merged_statistics([reply["value"] for _, reply, _ in answers]))

    async def repository_index(self) -> list[dict[str, str]]:
        value: list[dict[str, str]] = await self._value("repository_index")
        return value

    async def metrics_text(self) -> bytes:
        if len(self._links) == 1:
            _, text = await self._call(self._links[0], {"op": "metrics"})
            return text
        answers = await self._ask_every({"op": "metrics"})
        return labelled_metrics([(link.label, text) for link, _, text in answers])

    async def shm_register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Registered with every connected engine, or with none: any of them may get the
        requests that name it (an engine that comes back copies the others' regions)."""
        header = {"op": "shm_register", "name": name, "key": key, "offset": offset}
        done: list[EngineLink] = []
        try:
            for link in self._connected():
                await self._call(link, header | {"size": byte_size})
                done.append(link)
        except BaseException:
            for link in done:
                with contextlib.suppress(StokerError):
                    await self._call(link, {"op": "shm_unregister", "name": name})
            raise

    async def shm_unregister(self, name: str | None = None) -> None:
        for link in self._connected():
            await self._call(link, {"op": "shm_unregister", "name": name})

    async def shm_status(self, name: str | None = None) -> list[dict[str, object]]:
        value: list[dict[str, object]] = await self._value("shm_status", name=name)
        return value

    # -- inference

    @contextlib.asynccontextmanager
    async def body_buffer(self, declared: int | None) -> AsyncIterator[Slot | None]:
        slot = self.arena.lend(declared) if declared is not None else None
        try:
            yield slot
        finally:
            if slot is not None and not slot.engine_holds:
                self.arena.give_back(slot)

    async def _tracked(
        self, header: dict[str, Any], payload: bytes, slot: Slot | None
    ) -> tuple[dict[str, Any], bytes]:
        """One request to the engine, answered alone (uploads; requests the engine decodes)."""
        if self.draining:
            raise Unavailable("server is shutting down; retry on another replica")
        link = self._choose(header.get("name"), header.get("version"))
        number = link.request(header, payload)
        link.track(link.waiting[number], 1)
        return await self._held(link.waiting[number], slot, lambda: link.cancel(number))

    async def _held(
        self, future: Reply, slot: Slot | None, leave: Callable[[], None]
    ) -> tuple[dict[str, Any], bytes]:
        """Wait for the engine's answer to a call, counted for the drain. ``slot`` stays lent
        until the engine's last word, even when the caller goes away first (``leave`` then
        tells the engine, if it may drop the call)."""
        with self.in_flight():
            if slot is not None:
                slot.engine_holds = True  # the engine may read it until the answer arrives
            try:
                reply, data = await asyncio.shield(future)
                if slot is not None:
                    slot.engine_holds = False  # answered: the caller gives it back when done
            except asyncio.CancelledError:
                leave()
                if slot is not None:
                    future.add_done_callback(lambda _: self.arena.give_back(slot))
                raise
            except BaseException:
                if slot is not None:
                    slot.engine_holds = False  # the engine is gone: nothing reads it any more
                raise
        if "error" in reply:
            raise RemoteError(reply["error"], reply["status"], reply.get("reason", "other"))
        return reply, data

    async def _contract(self, name: str, version: str | None) -> Contract:
        """The model version's contract, asked of the engines once (a loaded version's
        tensors never change while the engine lives; refusals are not kept), and again when
        an engine has become ready since."""
        ready = frozenset(i for i, link in enumerate(self._links) if link.ready)
        cached = self._contracts.get((name, version))
        if cached is not None and ready <= cached[1]:
            return cached[0]
        found = Contract.from_json(await self._value("describe", name=name, version=version))
        # Engines may have shrunk the version to different max batches: the contract is that
        # of the one taking the most rows, and a request larger than another's max batch is
        # routed past that one (``_choose``), not refused.
        concrete = found.version
        best = max(
            (self._links[i] for i in ready),
            key=lambda link: link.max_batch(name, concrete),
            default=None,
        )
        if best is not None and best.max_batch(name, concrete) > found.spec.max_batch_size:
            try:
                reply, _ = await self._call(
                    best, {"op": "describe", "name": name, "version": concrete}
                )
                found = Contract.from_json(reply["value"])
            except StokerError:  # gone meanwhile: the first answer holds, not kept
                return found
        self._contracts[(name, version)] = (found, ready)
        return found

    def _count_failure(self, contract: Contract, reason: str, seconds: float) -> None:
        entry = self._failed.setdefault((contract.model, contract.version, reason), [0, 0.0])
        entry[0] += 1
        entry[1] += seconds

    async def infer(
        self,
        name: str,
        version: str | None,
        body: bytes | bytearray | memoryview,
        header_length: int | None,
        slot: Slot | None = None,
        client: str = "",
    ) -> Answer:
        """Decode and validate the request here, send only its tensors (left where the body
        put them in the slot, when it has one), and encode the engine's outputs: the engine
        pays for batching and running, the front ends, in parallel, for the codec."""
        contract = await self._contract(name, version)
        started = time.perf_counter()
        depth = self.settings.limits.max_json_depth
        decode = partial(decode_infer, contract, body, header_length, depth, ENGINE_REGIONS)
        try:
            if len(body) > THREADED_DECODE_BYTES:
                decoded = await asyncio.to_thread(decode)
            else:
                decoded = decode()
            if any(out.shared is not None for out in decoded.wanted):
                raise ForwardToEngine
        except ForwardToEngine:
            return await self._forward(name, version, body, header_length, slot, client)
        except StokerError as error:
            self._count_failure(contract, error.reason, time.perf_counter() - started)
            raise
        request = decoded.request
        described, payload = place_inputs(request.inputs, slot, len(body))
        item: dict[str, Any] = {
            "inputs": described,
            "rows": decoded.rows,
            "outputs": [[out.name, out.classification] for out in decoded.wanted],
        }
        if slot is not None and not payload:
            item["slot"] = [slot.offset, len(slot.view)]
        shared = {
            "op": "run",
            "name": contract.model,
            "version": contract.version,
            "timeout_us": request.timeout_us,
            "priority": request.priority,
            "client": client,
        }
        try:
            reply, data, link = await self._gathered(contract, shared, item, payload, slot)
        except RemoteError:
            raise  # the engine counted it
        except StokerError as error:
            self._count_failure(contract, error.reason, time.perf_counter() - started)
            raise
        source = slot.view if slot is not None and reply["in_slot"] else memoryview(data)
        shaped = [
            (out, unpack_tensor(out.name, datatype, shape, source[at : at + size]))
            for out, (datatype, shape, at, size) in zip(
                decoded.wanted, reply["outputs"], strict=True
            )
        ]
        content, headers = encode_response(contract.model, contract.version, request.id, shaped)
        key = (contract.model, contract.version)
        series = link.durations.get(key)
        if series is None:
            series = link.durations[key] = request_durations()
        series.observe(time.perf_counter() - started)
        return Answer(contract.model, contract.version, request.id, [], headers, content)

    async def _gathered(
        self,
        contract: Contract,
        shared: dict[str, Any],
        item: dict[str, Any],
        payload: bytes,
        slot: Slot | None,
    ) -> tuple[dict[str, Any], bytes, EngineLink]:
        """Send a decoded request with the others of this turn of the loop that can share
        its batch (same model, input row shapes, priority, deadline and client): one frame
        and one queue entry in the engine for all of them, up to the model's batch size.
        Returns this request's part of the answer, the answer's payload and the engine that
        answered."""
        if self.draining:
            raise Unavailable("server is shutting down; retry on another replica")
        rows = int(item["rows"])
        limit = contract.spec.max_batch_size
        # The engine joins gathered inputs by name: the same names, datatypes, row shapes.
        signature = tuple(sorted((d[0], d[1], tuple(d[2][1:])) for d in item["inputs"]))
        key = (
            (contract.model, contract.version, shared["timeout_us"], shared["priority"]),
            shared["client"],
            signature if limit else object(),  # unbatched models: one request a frame
        )
        gathering = self._gatherings.get(key)
        if gathering is not None and gathering.rows + rows > max(gathering.limit, 1):
            self._send_gathering(key)
            gathering = None
        if gathering is None:
            future = asyncio.get_running_loop().create_future()
            link = self._choose(contract.model, contract.version, rows)
            # An engine that shrank the version to fit its GPU takes fewer rows a frame.
            most = link.max_batch(contract.model, contract.version) or limit
            gathering = Gathering(shared, future, link, min(limit, most))
            self._gatherings[key] = gathering
            if not self._flush_scheduled:
                self._flush_scheduled = True
                asyncio.get_running_loop().call_soon(self._send_gatherings)
        index = len(gathering.items)
        if payload:
            base = gathering.payload_bytes
            item["inputs"] = [[*d[:3], d[3] + base, d[4]] for d in item["inputs"]]
            gathering.payloads.append(payload)
            gathering.payload_bytes += len(payload)
        gathering.items.append(item)
        gathering.rows += rows
        gathering.waiting += 1

        def leave() -> None:
            gathering.waiting -= 1
            if gathering.waiting == 0 and gathering.number is not None:
                gathering.link.cancel(gathering.number)  # every request of it went away

        reply, data = await self._held(gathering.future, slot, leave)
        part: dict[str, Any] = reply["items"][index]
        return part, data, gathering.link

    def _send_gatherings(self) -> None:
        self._flush_scheduled = False
        for key in list(self._gatherings):
            self._send_gathering(key)

    def _send_gathering(self, key: tuple[Any, ...]) -> None:
        gathering = self._gatherings.pop(key)
        if gathering.waiting == 0:  # all went away before it was sent: the engine never knew
            shared = gathering.shared
            entry = self._failed.setdefault(
                (shared["name"], shared["version"], "cancelled"), [0, 0.0]
            )
            entry[0] += len(gathering.items)
            gathering.future.set_result((CANCELLED_REPLY, b""))
            return
        header = {**gathering.shared, "items": gathering.items}
        try:
            payload = b"".join(gathering.payloads)
            gathering.number = gathering.link.request(header, payload, gathering.future)
            gathering.link.track(gathering.future, len(gathering.items))
        except StokerError as error:
            gathering.future.set_exception(error)
        except Exception as error:  # a header orjson cannot encode: a bug, answered as one
            log.error("a frame for the engine could not be sent: %r", error)
            gathering.future.set_exception(EngineError("internal server error"))

    async def _forward(
        self,
        name: str,
        version: str | None,
        body: bytes | bytearray | memoryview,
        header_length: int | None,
        slot: Slot | None,
        client: str,
    ) -> Answer:
        """The body as it came, for the engine to decode: requests that name shared-memory
        regions (the engine holds the registered regions)."""
        header: dict[str, Any] = {
            "op": "infer",
            "name": name,
            "version": version,
            "header_length": header_length,
            "client": client,
        }
        payload = b""
        if slot is not None and isinstance(body, memoryview):
            header |= {"slot": [slot.offset, len(slot.view)], "length": len(body)}
        else:
            payload = bytes(body)
        reply, data = await self._tracked(header, payload, slot)
        if "slot_length" in reply:
            assert slot is not None
            data = bytes(slot.view[: reply["slot_length"]])
        return Answer(reply["model"], reply["version"], None, [], reply["headers"], data)

    async def classify_images(
        self,
        name: str | None,
        version: str | None,
        uploads: Sequence[bytes],
        k: int | None,
        client: str = "",
    ) -> tuple[str, str, list[Any]]:
        sizes = [len(u) for u in uploads]
        header: dict[str, Any] = {
            "op": "classify",
            "name": name,
            "version": version,
            "k": k,
            "sizes": sizes,
            "client": client,
        }
        total = sum(sizes)
        slot = self.arena.lend(total) if uploads else None
        payload = b""
        try:
            if slot is not None:
                at = 0
                for data in uploads:
                    slot.view[at : at + len(data)] = data
                    at += len(data)
                header["slot"] = [slot.offset, len(slot.view)]
            else:
                payload = b"".join(uploads)
            reply, data = await self._tracked(header, payload, slot)
        finally:
            if slot is not None and not slot.engine_holds:
                self.arena.give_back(slot)
        predictions: list[Any] = orjson.loads(data)
        return reply["model"], reply["version"], predictions
