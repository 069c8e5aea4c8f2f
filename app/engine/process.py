"""The engine process: the data plane (registry, batchers, runners) behind a control socket.

Front ends (``app.frontend.remote``) connect over a Unix socket (``app.channel``), say which
shared-memory arena they lend bodies in, and send one frame per call. An inference request's
body is read where the front end wrote it, decoded and run exactly as in one process
(``DataPlane.infer``), and the encoded answer is written back into the same slot. The engine
is the one source of metrics, readiness and liveness.

SIGTERM drains: new requests get 503 at once, accepted ones run to their answer within
``server.drain_timeout_s``, then the process waits for its front ends to hang up and stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import signal
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import orjson

from app.channel import ChannelClosed, Sender, receive
from app.frontend.plane import DataPlane, Part
from app.errors import StokerError
from app.metrics import http_refused
from app.protocol import RequestedOutput, pack_tensor, unpack_tensor
from app.settings import Settings
from app.engine.shared_memory import SHM_ROOT

log = logging.getLogger(__name__)


class Connection:
    """One front end: its arena, its requests in progress."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = Sender(writer)
        self.arena: mmap.mmap | None = None
        self.slot_bytes = 0
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.answered: set[int] = set()

    def attach(self, name: str, slot_bytes: int) -> None:
        """Map the front end's arena (``/dev/shm/<name>``) without owning it: the front end
        created it and unlinks it (a ``SharedMemory`` here would hand it to this process's
        resource tracker, which unlinks what it tracks at exit)."""
        if "/" in name or name.startswith("."):
            raise ValueError(f"arena name {name!r} is not a /dev/shm name")
        with open(SHM_ROOT / name, "r+b") as file:
            self.arena = mmap.mmap(file.fileno(), 0)
        self.slot_bytes = slot_bytes

    def slot(self, place: list[int], length: int | None = None) -> memoryview:
        """The piece of the arena a front end lent a request, ``[offset, capacity]``, or its
        first ``length`` bytes."""
        if self.arena is None:
            raise ValueError("no arena: the front end did not say hello")
        offset, capacity = (int(n) for n in place)
        size = capacity if length is None else length
        if not 0 <= size <= capacity <= self.slot_bytes:
            raise ValueError(f"{size} bytes do not fit a slot of {capacity}")
        if offset < 0 or offset + capacity > len(self.arena):
            raise ValueError(f"slot at {offset} is outside the arena")
        return memoryview(self.arena)[offset : offset + size]

    def close(self) -> None:
        if self.arena is not None:
            # A view still held (a request being torn down) keeps the mapping until it goes.
            with contextlib.suppress(BufferError):
                self.arena.close()
            self.arena = None


CANCELLED = {"error": "cancelled", "status": 499, "reason": "cancelled"}


def send_reply(writer: Sender, number: int, header: dict[str, Any], data: bytes) -> None:
    """Send one answer; one that cannot be encoded is answered 500, never left unanswered."""
    if writer.is_closing():
        return
    try:
        writer.send({**header, "id": number}, data)
    except (TypeError, ValueError) as error:  # orjson: something not JSON in the header
        log.error("engine answer %d could not be encoded: %r", number, error)
        writer.send({"error": "internal server error", "status": 500, "id": number})


def finished(connection: Connection, number: int, task: asyncio.Task[None]) -> None:
    """A request's task is done. One cancelled before it ever ran (its cancel frame was
    read in the same turn) has sent nothing: answer it here, so the front end frees its
    slot."""
    connection.tasks.pop(number, None)
    if task.cancelled() and number not in connection.answered:
        send_reply(connection.writer, number, CANCELLED, b"")
    connection.answered.discard(number)


class EngineServer:
    def __init__(self, plane: DataPlane, on_fault: Callable[[], None] | None = None) -> None:
        """``on_fault``: called when a front end's poll finds the plane no longer alive (an
        unrecoverable engine fault)."""
        self.plane = plane
        self.on_fault = on_fault
        self.connections: set[Connection] = set()
        self.none_connected = asyncio.Event()
        self.none_connected.set()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = Connection(writer)
        self.connections.add(connection)
        self.none_connected.clear()
        try:
            while True:
                header, payload = await receive(reader)
                if header.get("op") == "cancel":
                    task = connection.tasks.get(header.get("of", -1))
                    if task is not None:
                        task.cancel()
                    continue
                number = header.get("id", -1)
                task = asyncio.create_task(self._answer(connection, number, header, payload))
                connection.tasks[number] = task
                task.add_done_callback(partial(finished, connection, number))
        except ChannelClosed:
            pass
        finally:
            self.connections.discard(connection)
            if not self.connections:
                self.none_connected.set()
            for task in list(connection.tasks.values()):
                task.cancel()
            await asyncio.gather(*connection.tasks.values(), return_exceptions=True)
            connection.close()
            writer.close()

    async def _answer(
        self, connection: Connection, number: int, header: dict[str, Any], payload: bytes
    ) -> None:
        reply: dict[str, Any]
        data = b""
        try:
            reply, data = await self._call(connection, header, payload)
        except StokerError as error:
            reply = {"error": error.message, "status": error.status, "reason": error.reason}
        except asyncio.CancelledError:
            reply = CANCELLED
        except Exception as error:
            log.error("engine call %s failed: %r", header.get("op"), error, exc_info=error)
            reply = {"error": "internal server error", "status": 500, "reason": "other"}
        connection.answered.add(number)
        send_reply(connection.writer, number, reply, data)

    async def _call(
        self, connection: Connection, header: dict[str, Any], payload: bytes
    ) -> tuple[dict[str, Any], bytes]:
        plane, op = self.plane, header.get("op")
        name, version = header.get("name"), header.get("version")
        if op == "run":
            return await self._run(connection, header, payload)
        if op == "infer":
            # A request the front end did not decode (it names shared-memory regions, which
            # the engine holds): the body as it came.
            body: bytes | memoryview = payload
            if "slot" in header:
                body = connection.slot(header["slot"], header["length"])
            answer = await plane.infer(
                str(name),
                version,
                body,
                header.get("header_length"),
                client=str(header.get("client", "")),
            )
            content, headers = answer.encode()
            reply: dict[str, Any] = {
                "model": answer.model,
                "version": answer.version,
                "headers": headers,
            }
            if "slot" in header and len(content) <= header["slot"][1]:
                connection.slot(header["slot"], len(content))[:] = content
                return reply | {"slot_length": len(content)}, b""
            return reply, content
        if op == "describe":
            return {"value": plane.contract(str(name), version).as_json()}, b""
        if op == "classify":
            sizes: list[int] = header["sizes"]
            source: bytes | memoryview = payload
            if "slot" in header:
                source = connection.slot(header["slot"], sum(sizes))
            uploads, at = [], 0
            for size in sizes:
                uploads.append(bytes(source[at : at + size]))
                at += size
            model, answered, predictions = await plane.classify_images(
                name, version, uploads, header.get("k"), str(header.get("client", ""))
            )
            # The answers go in the payload: k labels per image can be megabytes.
            return {"model": model, "version": answered}, orjson.dumps(predictions)
        if op == "hello":
            connection.attach(str(header["arena"]), int(header["slot"]))
            return {"value": "hello"}, b""
        if op == "state":
            for status, reason, count in header.get("refused", ()):
                http_refused(int(status), str(reason), float(count))
            for model, answered, reason, count, seconds in header.get("failed", ()):
                plane.count_failures(model, answered, reason, int(count), float(seconds))
            for model, answered, counts, total in header.get("durations", ()):
                plane.add_request_durations(model, answered, counts, float(total))
            if not plane.alive and self.on_fault is not None:
                self.on_fault()
            state = {
                "alive": plane.alive,
                "ready": plane.is_ready,
                "queued": plane.queued_requests(),
                "serving": plane.serving(),
            }
            return state, b""
        if op == "metrics":
            return {}, await plane.metrics_text()
        if op == "metadata":
            return {"value": await plane.metadata(str(name), version)}, b""
        if op == "version_ready":
            return {"value": await plane.version_ready(str(name), version)}, b""
        if op == "model_config":
            return {"value": await plane.model_config(str(name), version)}, b""
        if op == "statistics":
            return {"value": await plane.statistics(name, version)}, b""
        if op == "repository_index":
            return {"value": await plane.repository_index()}, b""
        if op == "shm_register":
            await plane.shm_register(str(name), header["key"], header["offset"], header["size"])
            return {}, b""
        if op == "shm_unregister":
            await plane.shm_unregister(name)
            return {}, b""
        if op == "shm_status":
            return {"value": await plane.shm_status(name)}, b""
        raise ValueError(f"unknown engine call {op!r}")

    async def _run(
        self, connection: Connection, header: dict[str, Any], payload: bytes
    ) -> tuple[dict[str, Any], bytes]:
        """Requests a front end decoded and gathered: each read where it put its tensors
        (its slot, or the payload), run together; each one's outputs written back into its
        slot when they fit, else into the answer's payload."""
        items: list[dict[str, Any]] = header["items"]
        parts = []
        for item in items:
            source = connection.slot(item["slot"]) if "slot" in item else memoryview(payload)
            inputs = {
                name: unpack_tensor(name, datatype, shape, source[at : at + size])
                for name, datatype, shape, at, size in item["inputs"]
            }
            wanted = [RequestedOutput(name, True, int(k)) for name, k in item["outputs"]]
            parts.append(Part(inputs, int(item["rows"]), wanted))
        model, version, answers = await self.plane.run(
            str(header["name"]),
            header.get("version"),
            parts,
            header.get("timeout_us"),
            int(header.get("priority", 0)),
            str(header.get("client", "")),
        )
        replies, chunks, at = [], [], 0
        for item, shaped in zip(items, answers, strict=True):
            packed = [(pack_tensor(out.name, array), array.shape) for out, array in shaped]
            size = sum(len(chunk) for (_, chunk), _ in packed)
            in_slot = "slot" in item and size <= item["slot"][1]
            view = connection.slot(item["slot"]) if in_slot else None
            where, described = 0 if in_slot else at, []
            for (datatype, chunk), shape in packed:
                described.append([datatype, list(shape), where, len(chunk)])
                if view is not None:
                    view[where : where + len(chunk)] = chunk
                else:
                    chunks.append(chunk)
                where += len(chunk)
            if not in_slot:
                at = where
            replies.append({"outputs": described, "in_slot": in_slot})
        return {"model": model, "version": version, "items": replies}, b"".join(chunks)


async def run(settings: Settings, control: Path, one_device: bool = False) -> int:
    """Serve the data plane on ``control`` until SIGTERM (then drain) or a loading failure;
    ``one_device``: on the one GPU this process sees (``server.engine_gpus``)."""
    plane = DataPlane(settings, one_device)
    stop = asyncio.Event()
    failed = False

    def fault() -> None:
        # One engine of several: its GPU's fault must not leave it serving nothing while the
        # pod stays live on the others. Exit, so the supervisor restarts it.
        nonlocal failed
        if one_device and not failed:
            log.critical("unrecoverable engine fault: this engine process exits to be restarted")
            failed = True
            stop.set()

    engine = EngineServer(plane, fault)
    await asyncio.to_thread(control.unlink, missing_ok=True)
    server = await asyncio.start_unix_server(engine.serve, path=str(control))
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        plane.begin_drain()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    loading = asyncio.create_task(plane.start(), name="load-models")

    def loaded(task: asyncio.Task[None]) -> None:
        nonlocal failed
        if task.cancelled() or task.exception() is None:
            return
        plane.failed = task.exception()
        log.error("model loading failed: %s", plane.failed)
        failed = True
        stop.set()

    loading.add_done_callback(loaded)
    await stop.wait()
    if not loading.done():
        loading.cancel()
    await asyncio.gather(loading, return_exceptions=True)
    if not failed:
        await plane.drain()
        # The front ends are answering their last requests; wait for them to hang up.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(plane.drain_time_left() + 5.0):
                await engine.none_connected.wait()
    server.close()
    await plane.stop()
    await asyncio.to_thread(control.unlink, missing_ok=True)
    return 1 if failed else 0


def visible_device(gpu: int, inherited: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for the engine of ``gpu``: that GPU alone, counted within
    the mask this process inherited (a scheduler's ``2,3`` makes GPU 1 the physical 3)."""
    if not inherited:
        return str(gpu)
    devices = [d.strip() for d in inherited.split(",") if d.strip()]
    if gpu >= len(devices):
        raise ValueError(
            f"server.engine_gpus names GPU {gpu}, but CUDA_VISIBLE_DEVICES={inherited!r} "
            f"shows {len(devices)}"
        )
    return devices[gpu]


def main(settings: Settings, control: str, gpu: int | None = None) -> None:
    """The engine process's entry point (spawned by ``app.processes``); ``gpu``: the one GPU
    it serves on (``server.engine_gpus``), the only one it sees."""
    from app.processes import supervised

    supervised()
    if gpu is not None:  # before anything imports CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_device(
            gpu, os.environ.get("CUDA_VISIBLE_DEVICES")
        )
    logging.basicConfig(
        level=settings.server.log_level.upper(),
        format=f"%(asctime)s %(levelname)s engine{'' if gpu is None else f'-gpu{gpu}'} "
        "%(name)s: %(message)s",
    )
    one_device = gpu is not None
    profile = os.environ.get("STOKER_ENGINE_PROFILE")
    if os.environ.get("STOKER_PROFILE_DIR"):
        which = "engine.pstats" if gpu is None else f"engine-gpu{gpu}.pstats"
        profile = str(Path(os.environ["STOKER_PROFILE_DIR"]) / which)
    if not profile:
        raise SystemExit(asyncio.run(run(settings, Path(control), one_device)))
    # Where the engine's loop spends its time (a diagnostic: pstats file at exit).
    import cProfile

    profiler = cProfile.Profile()
    code = profiler.runcall(asyncio.run, run(settings, Path(control), one_device))
    profiler.dump_stats(profile)
    raise SystemExit(code)
