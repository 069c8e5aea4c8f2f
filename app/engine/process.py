"""The engine process: the engine (registry, batchers, runners: ``LocalEngine``) behind a
control socket.

Front ends (``app.frontend.remote``) connect over a Unix socket (``app.channel``), say which
shared-memory arena they lend bodies in (answered with the engine's control table), and send
one frame per call. A front end decodes and validates a request itself; what arrives here is
mostly the decoded ``Run`` (tensors as references into the front end's arena), dispatched by
type to the same ``LocalEngine`` methods that one process calls, and the outputs go back into
the same slot, encoded by the front end. A body that names shared-memory regions arrives raw
(``Infer``) and is decoded and encoded here, where the regions are mapped; uploads arrive as
``Classify``; a ``Control`` call is dispatched by its method's name. The
engine is the one source of metrics, readiness and liveness.

SIGTERM drains: readiness turns false at once; the requests the front ends accepted before
their own drains closed their doors are taken until they hang up, within
``server.drain_timeout_s``; then new requests get 503, what is left is answered or failed,
and the process stops.

Kept in one module (~540 lines): the channel's engine end (a connection's arena, the
dispatch table and its handlers, the table's rows) and the process's life (start, drain,
stop) share ``EngineServer``'s state.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import logging
import mmap
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from pathlib import Path
from typing import Any

import orjson

from app import observed, tracing, wire
from app.channel import Frames, FrameTooLarge, Sender, Writable
from app.child import profiled, supervised, watch_loading
from app.contract import Frame, Part, Raw, Uploads
from app.engine.local import CONTROL, LocalEngine
from app.errors import StokerError
from app.metrics import http_refused
from app.protocol import RequestedOutput
from app.settings import Settings
from app.tensor_data import pack_tensor, unpack_tensor
from engines.devices import SHM_ROOT
from engines.preprocess import ImagePreprocess

log = logging.getLogger(__name__)


class Connection:
    """One front end: its arena, its calls in progress."""

    def __init__(self, writer: Writable) -> None:
        self.writer = Sender(writer)
        self.arena: mmap.mmap | None = None
        self.slot_bytes = 0
        self.inode = (0, 0)
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.answered: set[int] = set()
        self.pinned = 0
        """The arena's address where it is registered with CUDA (``pin``), else 0."""

    def attach(self, name: str, slot_bytes: int) -> None:
        """Map the front end's arena (``/dev/shm/<name>``) without owning it: the front end
        created it and unlinks it (a ``SharedMemory`` here would hand it to this process's
        resource tracker, which unlinks what it tracks at exit)."""
        if "/" in name or name.startswith("."):
            raise ValueError(f"arena name {name!r} is not a /dev/shm name")
        with open(SHM_ROOT / name, "r+b") as file:
            self.arena = mmap.mmap(file.fileno(), 0)
            facts = os.fstat(file.fileno())
        self.inode = (facts.st_dev, facts.st_ino)
        self.slot_bytes = slot_bytes

    def pin(self) -> bool:
        """Register the arena with CUDA (``server.pin_arena``), so runners copy request
        tensors from it by DMA; False where there is no GPU or the driver refuses."""
        from engines.devices import cuda

        if self.arena is None or self.pinned:
            return bool(self.pinned)
        holder = ctypes.c_char.from_buffer(self.arena)
        start = ctypes.addressof(holder)
        del holder  # an exported buffer would keep the mapping from closing
        if not cuda.register_host(start, len(self.arena)):
            return False
        self.pinned = start
        return True

    def slot(self, place: wire.SlotRef, length: int | None = None) -> memoryview:
        """The piece of the arena a front end lent a request, or its first ``length``
        bytes."""
        if self.arena is None:
            raise ValueError("no arena: the front end did not say hello")
        offset, capacity = place.offset, place.capacity
        size = capacity if length is None else length
        if not 0 <= size <= capacity <= self.slot_bytes:
            raise ValueError(f"{size} bytes do not fit a slot of {capacity}")
        if offset < 0 or offset + capacity > len(self.arena):
            raise ValueError(f"slot at {offset} is outside the arena")
        return memoryview(self.arena)[offset : offset + size]

    def send(self, number: int, reply: wire.Reply, data: bytes = b"") -> None:
        """Send one answer, once (``answered``: a cancelled call is not answered twice); one
        too large for the channel is answered with why instead."""
        self.answered.add(number)
        if self.writer.is_closing():
            return
        try:
            self.writer.send(wire.encode_answer(number, reply), data)
        except FrameTooLarge as too_large:
            log.error("an answer to a front end was not sent: %s", too_large)
            self.writer.send(wire.encode_answer(number, wire.Failure(too_large.message, 500)))

    def close(self) -> None:
        if self.pinned:
            from engines.devices import cuda

            cuda.unregister_host(self.pinned)  # before the pages are unmapped
            self.pinned = 0
        if self.arena is not None:
            # A view still held (a request being torn down) keeps the mapping until it goes.
            with contextlib.suppress(BufferError):
                self.arena.close()
            self.arena = None


def finished(connection: Connection, number: int, task: asyncio.Task[None]) -> None:
    """A call's task is done. One cancelled before it ever ran (its cancel frame was read in
    the same turn) has sent nothing: answer it here, so the front end frees its slot."""
    connection.tasks.pop(number, None)
    if task.cancelled() and number not in connection.answered:
        connection.send(number, wire.CANCELLED)
    connection.answered.discard(number)


Handled = tuple[wire.Reply, bytes]
Handler = Callable[[Connection, Any, bytes], Awaitable[Handled]]


class FrontEndLink(Frames):
    """One front end's control channel as the engine reads it (``EngineServer.listen``)."""

    def __init__(self, server: EngineServer) -> None:
        super().__init__(self._frame, self._refused)
        self._server = server
        self.connection: Connection | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        assert self.transport is not None
        self.connection = Connection(self.transport)
        self._server.opened(self.connection)

    def _frame(self, header: bytes, payload: bytes) -> None:
        assert self.connection is not None
        self._server.dispatch(self.connection, header, payload)

    def _refused(self, too_large: FrameTooLarge) -> None:
        assert self.connection is not None
        log.error("a call from a front end was refused: %s", too_large)
        reply = wire.Failure(too_large.message, too_large.status, too_large.reason)
        self.connection.send(too_large.number, reply)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self.connection is not None:
            gone = self.closed.exception() if self.closed.done() else exc
            self._server.lost(self.connection, gone)


class EngineServer:
    """The engine's side of the control channel: each call decoded as its ``app.wire`` type
    and dispatched by a table to the ``LocalEngine`` the data plane calls in one process."""

    def __init__(self, engine: LocalEngine, on_fault: Callable[[], None] | None = None) -> None:
        """``on_fault``: called when a front end's poll finds the engine no longer alive (an
        unrecoverable engine fault)."""
        self.engine = engine
        self.on_fault = on_fault
        self.connections: set[Connection] = set()
        self.none_connected = asyncio.Event()
        self.none_connected.set()
        self._ending: set[asyncio.Task[None]] = set()  # closed links' calls being let go
        self.handlers: dict[type[Any], Handler] = {
            wire.Hello: self._hello,
            wire.State: self._state,
            wire.Describe: self._describe,
            wire.Run: self._run,
            wire.Infer: self._infer,
            wire.Classify: self._classify,
            wire.Control: self._control,
        }

    async def listen(self, path: str) -> asyncio.Server:
        """Serve the control channel on the Unix socket ``path``: each front end's calls
        dispatched in the turn they are read (``FrontEndLink``)."""
        loop = asyncio.get_running_loop()
        return await loop.create_unix_server(partial(FrontEndLink, self), path=path)

    def opened(self, connection: Connection) -> None:
        self.connections.add(connection)
        self.none_connected.clear()

    def dispatch(self, connection: Connection, header: bytes, payload: bytes) -> None:
        """One call read: a task answers it (a cancel cancels the task of the call it names)."""
        try:
            number, call = wire.decode_call(header)
        except wire.BadFrame as bad:
            log.error("a call from a front end was refused: %s", bad)
            connection.send(bad.number, wire.Failure(str(bad), 500))
            return
        if isinstance(call, wire.Cancel):
            task = connection.tasks.get(call.of)
            if task is not None:
                task.cancel()
            return
        answer = self._answer(connection, number, call, payload)
        loop = asyncio.get_running_loop()
        if tracing.tracer is None:
            task = loop.create_task(answer)
        else:  # the task's context: its engine spans note when the call was sent and read
            context = contextvars.copy_context()
            context.run(tracing.CROSSED.set, (getattr(call, "sent_ns", 0), time.time_ns()))
            task = loop.create_task(answer, context=context)
        connection.tasks[number] = task
        task.add_done_callback(partial(finished, connection, number))

    def lost(self, connection: Connection, gone: BaseException | None) -> None:
        """A front end's channel ended: its calls still running are cancelled and, once
        they end, its arena let go. A front end that exits hangs up so too; a frame that
        is not a Stoker peer's ends its link here, and either is said once."""
        log.info("a front end's link closed: %s", gone)
        self.connections.discard(connection)
        if not self.connections:
            self.none_connected.set()
        tasks = list(connection.tasks.values())
        for task in tasks:
            task.cancel()

        async def closed() -> None:
            await asyncio.gather(*tasks, return_exceptions=True)
            connection.close()

        ending = asyncio.get_running_loop().create_task(closed())
        self._ending.add(ending)
        ending.add_done_callback(self._ending.discard)

    async def _answer(
        self, connection: Connection, number: int, call: wire.Call, payload: bytes
    ) -> None:
        reply: wire.Reply
        data = b""
        try:
            reply, data = await self.handlers[type(call)](connection, call, payload)
        except StokerError as error:
            reply = wire.Failure(error.message, error.status, error.reason)
        except asyncio.CancelledError:
            reply = wire.CANCELLED
        except Exception as error:
            log.error("engine call %s failed: %r", type(call).__name__, error, exc_info=error)
            reply = wire.Failure("internal server error", 500)
        connection.send(number, reply, data)

    # -- the table's handlers

    async def _hello(self, connection: Connection, call: wire.Hello, _: bytes) -> Handled:
        connection.attach(call.arena, call.slot_bytes)
        if self.engine.settings.server.pin_arena and await asyncio.to_thread(connection.pin):
            log.info(
                "front end arena %s (%d MiB) registered with CUDA",
                call.arena,
                len(connection.arena or b"") >> 20,
            )
        # A client may never register a front end's arena as its region (a hard link to it
        # has another name, not another inode).
        self.engine.regions.private.add(connection.inode)
        return wire.Welcome(CONTROL), b""

    async def _state(self, connection: Connection, call: wire.State, _: bytes) -> Handled:
        engine = self.engine
        for refused in call.refused:
            http_refused(refused.status, refused.reason, refused.count)
        for failed in call.failed:
            engine.count_failures(
                failed.model, failed.version, failed.reason, failed.count, failed.mean_s
            )
        for timed in call.durations:
            engine.add_request_durations(timed.model, timed.version, timed.counts, timed.total)
        if not engine.alive and self.on_fault is not None:
            self.on_fault()
        serving = tuple(wire.Serving(*served) for served in engine.serving())
        state = wire.EngineState(
            engine.alive,
            engine.ready,
            engine.queued_requests(),
            serving,
            engine.generation,
            observed.STATE.snapshot(),
        )
        return state, b""

    async def _describe(self, connection: Connection, call: wire.Describe, _: bytes) -> Handled:
        contract = await self.engine.contract(call.name, call.version)
        return wire.Value(contract.as_json()), b""

    async def _run(self, connection: Connection, call: wire.Run, payload: bytes) -> Handled:
        """Requests a front end decoded and gathered: each read where it put its tensors
        (its slot, or the payload), run together; each one's outputs written back into its
        slot when they fit, else into the answer's payload."""
        parts = []
        arrived = time.monotonic() - call.spent_us / 1e6
        for item in call.items:
            source = connection.slot(item.slot) if item.slot is not None else memoryview(payload)
            inputs = {
                t.name: unpack_tensor(
                    t.name, t.datatype, list(t.shape), source[t.offset : t.offset + t.size]
                )
                for t in item.inputs
            }
            wanted = [RequestedOutput(o.name, True, o.classification) for o in item.outputs]
            parts.append(
                Part(inputs, item.rows, wanted, arrived=arrived, traceparent=item.traceparent)
            )
        frame = Frame(
            call.name, call.version, parts, call.timeout_us, call.priority, call.client, call.serial
        )
        ran = await self.engine.run(frame)
        replies, chunks, at = [], [], 0
        for item, shaped in zip(call.items, ran.outputs, strict=True):
            packed = [(pack_tensor(out.name, array), array.shape) for out, array in shaped]
            size = sum(len(chunk) for (_, chunk), _ in packed)
            in_slot = item.slot is not None and size <= item.slot.capacity
            view = connection.slot(item.slot) if in_slot and item.slot is not None else None
            where, described = 0 if in_slot else at, []
            for out, ((datatype, chunk), shape) in zip(shaped, packed, strict=True):
                described.append(
                    wire.TensorRef(out[0].name, datatype, tuple(shape), where, len(chunk))
                )
                if view is not None:
                    view[where : where + len(chunk)] = chunk
                else:
                    chunks.append(chunk)
                where += len(chunk)
            if not in_slot:
                at = where
            replies.append(wire.ItemReply(tuple(described), in_slot))
        return wire.RanReply(ran.model, ran.version, tuple(replies)), b"".join(chunks)

    async def _infer(self, connection: Connection, call: wire.Infer, payload: bytes) -> Handled:
        """A request the front end did not decode (it names shared-memory regions, which the
        engine holds): the body as it came; the answer back in its slot when it fits."""
        body: bytes | memoryview = payload
        if call.slot is not None:
            body = connection.slot(call.slot, call.length)
        answer = await self.engine.infer_raw(
            Raw(
                call.name,
                call.version,
                body,
                call.header_length,
                call.client,
                call.traceparent,
            )
        )
        content, headers = answer.encode()
        if call.slot is not None and len(content) <= call.slot.capacity:
            connection.slot(call.slot, len(content))[:] = content
            return wire.Inferred(answer.model, answer.version, headers, len(content)), b""
        return wire.Inferred(answer.model, answer.version, headers), content

    async def _classify(
        self, connection: Connection, call: wire.Classify, payload: bytes
    ) -> Handled:
        source: bytes | memoryview = payload
        if call.slot is not None:
            source = connection.slot(call.slot, sum(call.sizes))
        uploads, at = [], 0
        for size in call.sizes:
            uploads.append(source[at : at + size])
            at += size
        made = call.row_preprocess
        rows = None if made is None else ImagePreprocess(**made)
        classified = await self.engine.classify(
            Uploads(
                call.name,
                call.version,
                uploads,
                call.k,
                call.client,
                call.counts,
                rows,
                call.traceparents,
            )
        )
        answers = [
            {"error": a.message, "status": a.status, "reason": a.reason}
            if isinstance(a, StokerError)
            else {"answers": a}
            for a in classified.answers
        ]
        return wire.ClassifiedReply(classified.model, classified.version), orjson.dumps(answers)

    async def _control(self, connection: Connection, call: wire.Control, _: bytes) -> Handled:
        """A control method of the engine's table, called by name; bytes it returns go in
        the payload; a ``Spread.ADOPTED`` one answers with the settings in force too."""
        result = await self.engine.control(call.method, *call.args)
        if isinstance(result, bytes):
            return wire.Done(), result
        if CONTROL[call.method].spread is wire.Spread.ADOPTED:
            return wire.Value([result, observed.STATE.snapshot()]), b""
        return wire.Value(result), b""


async def run(settings: Settings, control: Path, one_device: bool = False) -> int:
    """Serve the engine on ``control`` until SIGTERM (then drain) or a loading failure;
    ``one_device``: on the one GPU this process sees (``server.engine_gpus``)."""
    engine = LocalEngine(settings, one_device)
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

    channel = EngineServer(engine, fault)
    await asyncio.to_thread(control.unlink, missing_ok=True)
    server = await channel.listen(str(control))
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        engine.begin_drain()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    loading = asyncio.create_task(engine.start(), name="load-models")

    def load_failed() -> None:
        nonlocal failed
        failed = True
        stop.set()

    watch_loading(loading, engine, load_failed)
    await stop.wait()
    if not loading.done():
        loading.cancel()
    await asyncio.gather(loading, return_exceptions=True)
    if not failed:
        # What the front ends accepted before their own doors closed still comes: it is
        # taken until they hang up, their drains done (or this one's timeout passes).
        await hung_up(channel, engine.drain_state.time_left())
        await engine.drain()
        await hung_up(channel, 5.0)  # the front ends are sending their last answers
    server.close()
    await engine.stop()
    await asyncio.to_thread(tracing.shutdown)
    await asyncio.to_thread(control.unlink, missing_ok=True)
    return 1 if failed else 0


async def hung_up(channel: EngineServer, timeout_s: float) -> None:
    """Wait until no front end is connected, for at most ``timeout_s``."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await channel.none_connected.wait()


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


def run_loop(main: Coroutine[Any, Any, int]) -> int:
    """Run the engine's loop on uvloop where it is installed (uvicorn's standard extra brings
    it, and the front ends' loops are uvicorn's uvloop), else on asyncio's own. Every frame
    costs the engine's loop a read and a write on the channel and a few callbacks and task
    steps, each cheaper on uvloop: with two front ends the server's CPU a request fell by
    about a tenth (BENCHMARKS.md, "A request's budget")."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def main(settings: Settings, control: str, gpu: int | None = None) -> None:
    """The engine process's entry point (spawned by ``app.processes``); ``gpu``: the one GPU
    it serves on (``server.engine_gpus``), the only one it sees."""
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
    sys.setswitchinterval(settings.server.gil_switch_ms / 1000)
    tracing.configure("engine", settings.server.log_level)
    profile = os.environ.get("STOKER_ENGINE_PROFILE")
    if os.environ.get("STOKER_PROFILE_DIR"):
        which = "engine.pstats" if gpu is None else f"engine-gpu{gpu}.pstats"
        profile = str(Path(os.environ["STOKER_PROFILE_DIR"]) / which)
    code = profiled(
        profile,
        "engine" if gpu is None else f"engine-gpu{gpu}",
        run_loop,
        run(settings, Path(control), one_device),
    )
    raise SystemExit(code)
