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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Sequence
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import orjson

from app.channel import ChannelClosed, receive, send
from app.dataplane import Answer, PlaneState, Slot
from app.errors import StokerError, Unavailable
from app.metrics import http_refusal_counts
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


class Arena:
    """Shared memory this front end lends to requests, ``slots`` pieces of ``slot_bytes``."""

    def __init__(
        self, slots: int, slot_bytes: int, share: int = 1, name: str | None = None
    ) -> None:
        # /dev/shm is a tmpfs with a size (64 MB in a default Docker container): writing past
        # it kills the process with SIGBUS, so the arena takes at most half of what is free,
        # split over the ``share`` front ends, and fewer slots when that is less.
        fits = shm_bytes_free() // (2 * max(1, share) * slot_bytes)
        if fits < slots:
            log.warning(
                "/dev/shm has room for %d of the %d shared-memory slots of %d bytes; bodies "
                "that find no slot travel over the control socket (give the container a "
                "larger /dev/shm: docker --shm-size, or a memory-backed emptyDir)",
                fits,
                slots,
                slot_bytes,
            )
            slots = int(fits)
        self.slot_bytes = slot_bytes
        if name is not None:
            # A fixed name: what a crashed predecessor left is replaced, not leaked.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")
        self.memory = shared_memory.SharedMemory(
            name=name, create=True, size=max(1, slots * slot_bytes)
        )
        self._free = list(range(slots))

    @property
    def name(self) -> str:
        return self.memory.name

    def lend(self, size: int) -> Slot | None:
        if size > self.slot_bytes or not self._free:
            return None
        index = self._free.pop()
        start = index * self.slot_bytes
        assert self.memory.buf is not None
        return Slot(index, self.memory.buf[start : start + self.slot_bytes])

    def give_back(self, slot: Slot) -> None:
        """Make a slot lendable again (once: a second call is a no-op)."""
        if slot.returned:
            return
        slot.returned = True
        slot.view.release()
        self._free.append(slot.index)

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


class RemotePlane(PlaneState):
    """The ``Plane`` of a front end (see ``app.dataplane.Plane``)."""

    def __init__(self, settings: Settings, control: Path, arena: str | None = None) -> None:
        super().__init__(settings)
        self.control = control
        front = settings.server
        self.arena = Arena(front.shm_slots, front.shm_slot_bytes, front.front_ends, arena)
        self._stopping = False
        self._state: dict[str, Any] = {"alive": False, "ready": False}
        self._writer: asyncio.StreamWriter | None = None
        self._waiting: dict[int, asyncio.Future[tuple[dict[str, Any], bytes]]] = {}
        self._ids = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    # -- lifecycle

    async def start(self) -> None:
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(self.control))
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        self._writer = writer
        self._tasks.append(asyncio.create_task(self._read(reader), name="engine-replies"))
        await self._call({"op": "hello", "arena": self.arena.name, "slot": self.arena.slot_bytes})
        self._tasks.append(asyncio.create_task(self._poll(), name="engine-state"))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                header, payload = await receive(reader)
                future = self._waiting.pop(header.get("id", -1), None)
                if future is not None and not future.done():
                    future.set_result((header, payload))
        except ChannelClosed as gone:
            if not self._stopping:
                log.error("the engine process closed the control channel: %s", gone)
        finally:
            self._state = {"alive": False, "ready": False}
            if self._writer is not None:
                self._writer.close()  # no request is sent into a channel nobody reads
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(Unavailable("the engine process is gone"))
            self._waiting.clear()
            if not self._stopping:
                # This front end cannot serve without the engine: end it (a drain, as on
                # SIGTERM), so the supervisor starts a fresh one or stops with the engine.
                os.kill(os.getpid(), signal.SIGTERM)

    async def _poll(self) -> None:
        """The engine's state every ``POLL_S``; with it, what this front end refused since
        the last poll, which the engine adds to its ``/metrics`` (the one source)."""
        sent: dict[tuple[str, str], float] = {}
        while True:
            counts = http_refusal_counts()
            refused = [[s, r, n - sent.get((s, r), 0.0)] for (s, r), n in counts.items()]
            refused = [item for item in refused if item[2]]
            try:
                self._state, _ = await asyncio.wait_for(
                    self._call({"op": "state", "refused": refused}), 2.0
                )
                sent = counts
            except (StokerError, TimeoutError):
                self._state = {"alive": False, "ready": False}
            await asyncio.sleep(POLL_S)

    def _request(
        self, header: dict[str, Any], payload: bytes = b""
    ) -> tuple[int, asyncio.Future[tuple[dict[str, Any], bytes]]]:
        if self._writer is None or self._writer.is_closing():
            raise Unavailable("the engine process is not connected")
        self._ids += 1
        future: asyncio.Future[tuple[dict[str, Any], bytes]] = (
            asyncio.get_running_loop().create_future()
        )
        self._waiting[self._ids] = future
        send(self._writer, {**header, "id": self._ids}, payload)
        return self._ids, future

    async def _call(
        self, header: dict[str, Any], payload: bytes = b""
    ) -> tuple[dict[str, Any], bytes]:
        _, future = self._request(header, payload)
        reply, data = await future
        if "error" in reply:
            raise RemoteError(reply["error"], reply["status"], reply.get("reason", "other"))
        return reply, data

    async def _value(self, op: str, **fields: Any) -> Any:
        reply, _ = await self._call({"op": op, **fields})
        return reply["value"]

    async def drain(self) -> None:
        """Refuse new requests; wait for this front end's in-flight ones (the engine answers
        or fails them within its own drain timeout)."""
        self.begin_drain()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.drain_time_left() + 1.0):
                await self._idle.wait()

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._writer is not None:
            self._writer.close()
        self.arena.close()

    # -- state

    @property
    def alive(self) -> bool:
        return bool(self._state.get("alive"))

    @property
    def is_ready(self) -> bool:
        return bool(self._state.get("ready")) and not self.draining

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

    async def statistics(self, name: str | None = None, version: str | None = None) -> list[object]:
        value: list[object] = await self._value("statistics", name=name, version=version)
        return value

    async def repository_index(self) -> list[dict[str, str]]:
        value: list[dict[str, str]] = await self._value("repository_index")
        return value

    async def metrics_text(self) -> bytes:
        _, text = await self._call({"op": "metrics"})
        return text

    async def shm_register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        await self._call(
            {"op": "shm_register", "name": name, "key": key, "offset": offset, "size": byte_size}
        )

    async def shm_unregister(self, name: str | None = None) -> None:
        await self._call({"op": "shm_unregister", "name": name})

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
        """One request to the engine, counted for the drain; if the caller goes away, the
        engine is told to drop it, and the slot stays lent until the engine's last word."""
        if self.draining:
            raise Unavailable("server is shutting down; retry on another replica")
        self._active += 1
        self._idle.clear()
        try:
            number, future = self._request(header, payload)
            if slot is not None:
                # The engine may read the slot from now until its answer arrives.
                slot.engine_holds = True
            reply, data = await asyncio.shield(future)
            if slot is not None:
                slot.engine_holds = False  # answered: the caller gives it back when done
        except asyncio.CancelledError:
            if self._writer is not None and not self._writer.is_closing():
                send(self._writer, {"op": "cancel", "of": number})
            if slot is not None:
                future.add_done_callback(lambda _: self.arena.give_back(slot))
            raise
        except BaseException:
            if slot is not None:
                slot.engine_holds = False  # the engine is gone: nothing reads it any more
            raise
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()
        if "error" in reply:
            raise RemoteError(reply["error"], reply["status"], reply.get("reason", "other"))
        return reply, data

    async def infer(
        self,
        name: str,
        version: str | None,
        body: bytes | bytearray | memoryview,
        header_length: int | None,
        slot: Slot | None = None,
        client: str = "",
    ) -> Answer:
        header: dict[str, Any] = {
            "op": "infer",
            "name": name,
            "version": version,
            "header_length": header_length,
            "client": client,
        }
        payload = b""
        if slot is not None and isinstance(body, memoryview):
            header |= {"slot": slot.index, "length": len(body)}
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
                header["slot"] = slot.index
            else:
                payload = b"".join(uploads)
            reply, data = await self._tracked(header, payload, slot)
        finally:
            if slot is not None and not slot.engine_holds:
                self.arena.give_back(slot)
        predictions: list[Any] = orjson.loads(data)
        return reply["model"], reply["version"], predictions
