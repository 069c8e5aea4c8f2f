"""How ``stoker serve`` runs: one process, or front ends in front of engine processes.

With ``server.front_ends`` = 1 the one process serves HTTP and runs the models (``run_server``
with a ``DataPlane``). With N > 1 (or several ``server.engine_gpus``), this process becomes a
supervisor: it binds the port once, spawns the engine process (``app.engine.process``; one per
GPU of ``server.engine_gpus``) and N front-end processes that accept on that one socket
(``app.frontend.remote``), and restarts a front end that dies. With one engine, it stops everything
(exit 1) if the engine dies, which the orchestrator then restarts; with several, it restarts
the one that died while the others serve. SIGTERM drains every process: the front ends stop
taking requests once they have read what arrived before it, and wait for theirs; the engines
take what the front ends accepted until they hang up and answer it within
``server.drain_timeout_s``; the supervisor exits 0 once all have.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType

from fastapi import FastAPI

from app.child import profiled, supervised
from app.frontend.http_limits import guarded, unread
from app.settings import Settings
from engines.devices import SHM_ROOT

log = logging.getLogger(__name__)
# A front end that dies this soon after its start is failing to start, not crashing: the
# supervisor backs off instead of spinning.
RESTART_BACKOFF_S = 1.0
# An engine of several that keeps dying soon after its start (it cannot load, its GPU is
# broken) is restarted after 1, 2, 4, 8 s, then left out; one that served this long before
# it died starts the count again. When every engine is dead and left out, the server stops.
ENGINE_RESTARTS = 5
# A front end that ends this many times in a row, each soon after its start, stops the server.
FRONT_END_RESTARTS = 5
ENGINE_STEADY_S = 60.0


def run_server(
    settings: Settings,
    make_app: Callable[[Callable[[], None]], FastAPI],
    sockets: list[socket.socket] | None = None,
) -> int:
    """uvicorn with a drain before its own shutdown, serving ``make_app(on_fatal)``.

    On the first SIGTERM (or SIGINT) the plane starts draining at once: readiness answers 503;
    once the process has read what the kernel held for it at the signal (``unread``), new
    inference requests get 503, on new and on kept-alive connections alike, because the
    listener stays open; requests that arrived before run to their answer until
    ``server.drain_timeout_s``. Only then does uvicorn close the listener and the connections
    and run the lifespan shutdown. A second signal skips the rest of the drain.
    """
    import uvicorn

    sys.setswitchinterval(settings.server.gil_switch_ms / 1000)

    class Server(uvicorn.Server):
        drain: asyncio.Task[None] | None = None
        drain_requested = False

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            plane = getattr(app.state, "plane", None)
            if self.drain_requested or plane is None or self.should_exit:
                super().handle_exit(sig, frame)
                return
            # A signal handler: only plain attributes here; the waiting starts on the loop.
            self.drain_requested = True
            plane.begin_drain(self.unread_bytes)

        def unread_bytes(self) -> bool:
            # A signal during the start (the lifespan has run, the listener is not served
            # yet) comes before uvicorn has its servers: nothing of theirs to read then.
            servers = getattr(self, "servers", [])
            listeners = [sock for server in servers for sock in server.sockets]
            return unread(listeners, self.server_state.connections)

        async def on_tick(self, counter: int) -> bool:
            if self.drain_requested and self.drain is None:
                self.drain = asyncio.create_task(app.state.plane.drain(), name="drain")
            if self.drain is not None and self.drain.done():
                # uvicorn's own wait for open connections gets what is left of the timeout.
                left = app.state.plane.drain_time_left()
                self.config.timeout_graceful_shutdown = max(1, math.ceil(left))
                self.should_exit = True
            return await super().on_tick(counter)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn re-raises SIGTERM after a graceful shutdown, so the process would end
            # "killed by signal"; for an orchestrator a drained shutdown is a success: exit 0.
            signals = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    server: Server | None = None
    failed = False

    def stop_on_fatal() -> None:
        nonlocal failed
        failed = True
        if server is not None:
            server.should_exit = True

    app = make_app(stop_on_fatal)
    config = uvicorn.Config(
        app,
        host=settings.server.host,
        port=settings.server.port,
        log_level=settings.server.log_level,
        access_log=False,
        timeout_keep_alive=settings.server.keep_alive_s,
        timeout_graceful_shutdown=int(settings.server.drain_timeout_s) or None,
        limit_concurrency=None,
        http=guarded(settings.limits, app.state.saturation),
    )
    server = Server(config)
    server.run(sockets=sockets)
    return 1 if failed else 0


def arena_name(supervisor: int, number: int) -> str:
    """The /dev/shm name of front end ``number``'s arena: fixed, so a restart replaces what a
    crashed predecessor left instead of leaking it."""
    return f"stoker-{supervisor}-{number}"


def front_end_main(
    settings: Settings,
    controls: list[tuple[str, str]],
    listener: socket.socket,
    number: int,
    arena: str,
) -> None:
    """A front-end process: the routes over a data plane with a ``RemoteEngine``
    (``controls``: each engine's label and control socket), on the shared listener."""
    supervised()
    from app.frontend.plane import DataPlane
    from app.frontend.remote import RemoteEngine
    from app.frontend.server import create_app

    logging.basicConfig(
        level=settings.server.log_level.upper(),
        format=f"%(asctime)s %(levelname)s front-end-{number} %(name)s: %(message)s",
    )

    def make_app(on_fatal: Callable[[], None]) -> FastAPI:
        return create_app(
            settings,
            on_fatal=on_fatal,
            make_plane=lambda: DataPlane(
                settings, RemoteEngine(settings, controls, arena), across=True
            ),
        )

    folder = os.environ.get("STOKER_PROFILE_DIR")
    profile = str(Path(folder) / f"front-end-{number}-{os.getpid()}.pstats") if folder else None
    raise SystemExit(
        profiled(profile, f"front-end-{number}", run_server, settings, make_app, [listener])
    )


def bind(settings: Settings) -> socket.socket:
    """The one listening socket every front end accepts on."""
    family = socket.AF_INET6 if ":" in settings.server.host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((settings.server.host, settings.server.port))
    listener.listen(2048)
    listener.set_inheritable(True)
    return listener


def serve_processes(settings: Settings) -> int:
    """Supervise the engine processes and ``server.front_ends`` front ends on one port."""
    from app.engine import process as engine_process

    context = multiprocessing.get_context("spawn")
    listener = bind(settings)
    host, port = listener.getsockname()[:2]
    scratch = tempfile.TemporaryDirectory(prefix="stoker-")
    gpus: list[int | None] = list(settings.server.engine_gpus) or [None]
    # label (what the front ends and metrics call the engine) -> its control socket
    controls = [
        ("" if gpu is None else str(gpu), str(Path(scratch.name) / f"engine-{i}.sock"))
        for i, gpu in enumerate(gpus)
    ]
    stopping = False

    def on_signal(sig: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    def start_engine(index: int) -> BaseProcess:
        gpu = gpus[index]
        process = context.Process(
            target=engine_process.main,
            args=(settings, controls[index][1], gpu),
            name="stoker-engine" if gpu is None else f"stoker-engine-gpu{gpu}",
        )
        process.start()
        log.info(
            "engine process%s started (pid %s)",
            "" if gpu is None else f" for GPU {gpu}",
            process.pid,
        )
        return process

    engines = {i: start_engine(i) for i in range(len(gpus))}
    engine_started = {i: time.monotonic() for i in engines}
    failures = dict.fromkeys(engines, 0)  # deaths in a row, each soon after its start
    ended: dict[int, float] = {}  # engine -> when its death was seen

    def start_front_end(number: int) -> BaseProcess:
        process = context.Process(
            target=front_end_main,
            args=(settings, controls, listener, number, arena_name(os.getpid(), number)),
            name=f"stoker-front-end-{number}",
        )
        process.start()
        log.info("front end %d started (pid %s)", number, process.pid)
        return process

    count = settings.server.front_ends
    fronts = {n: start_front_end(n) for n in range(count)}
    front_failures: dict[int, int] = {}  # deaths in a row, each soon after its start
    started = {n: time.monotonic() for n in fronts}
    log.info(
        "serving on http://%s:%d with %d front-end processes and %d engine process(es)",
        host,
        port,
        count,
        len(engines),
    )
    code = 0
    try:
        while not stopping:
            time.sleep(0.2)
            if len(engines) == 1 and not engines[0].is_alive():
                log.error("the engine process ended (exit code %s): stopping", engines[0].exitcode)
                code = 1
                break
            now = time.monotonic()
            for index, process in list(engines.items()):
                if process.is_alive() or failures[index] >= ENGINE_RESTARTS:
                    continue
                if index not in ended:
                    ended[index] = now
                    steady = now - engine_started[index] >= ENGINE_STEADY_S
                    failures[index] = 0 if steady else failures[index] + 1
                    if failures[index] >= ENGINE_RESTARTS:
                        log.error(
                            "the engine process for GPU %s ended %d times in a row soon after "
                            "its start (exit code %s): not restarted again",
                            gpus[index],
                            failures[index],
                            process.exitcode,
                        )
                        continue
                    log.warning(
                        "the engine process for GPU %s ended (exit code %s): restarting it "
                        "while the others serve",
                        gpus[index],
                        process.exitcode,
                    )
                if now - ended[index] < RESTART_BACKOFF_S * 2 ** max(0, failures[index] - 1):
                    continue
                del ended[index]
                engines[index] = start_engine(index)
                engine_started[index] = now
            if all(not p.is_alive() and failures[i] >= ENGINE_RESTARTS for i, p in engines.items()):
                log.error("no engine process is left to serve: stopping")
                code = 1
                break
            for number, process in list(fronts.items()):
                if process.is_alive():
                    continue
                if time.monotonic() - started[number] < RESTART_BACKOFF_S:
                    continue
                # Front ends are alike: one that cannot start (an import, a port taken) fails
                # in every one, and restarting it for ever would only hide that.
                soon = time.monotonic() - started[number] < ENGINE_STEADY_S
                front_failures[number] = front_failures.get(number, 0) + 1 if soon else 0
                if front_failures[number] >= FRONT_END_RESTARTS:
                    log.error(
                        "front end %d ended %d times in a row soon after its start (exit code "
                        "%s; its error is above): stopping",
                        number,
                        front_failures[number],
                        process.exitcode,
                    )
                    code = 1
                    stopping = True
                    break
                log.warning(
                    "front end %d ended (exit code %s): restarting it", number, process.exitcode
                )
                fronts[number] = start_front_end(number)
                started[number] = time.monotonic()
    finally:
        for process in (*fronts.values(), *engines.values()):
            if process.is_alive() and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)
        limit = settings.server.drain_timeout_s + 15.0
        deadline = time.monotonic() + limit
        for process in (*fronts.values(), *engines.values()):
            process.join(max(0.1, deadline - time.monotonic()))
            if process.is_alive():
                log.error("%s did not stop within %.0f s: killing it", process.name, limit)
                process.kill()
                process.join(5)
        if any(e.exitcode not in (0, None) for e in engines.values()) and code == 0:
            code = 1
        listener.close()
        scratch.cleanup()
        for number in fronts:  # what a killed front end could not unlink
            with contextlib.suppress(FileNotFoundError):
                os.unlink(SHM_ROOT / arena_name(os.getpid(), number))
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code
