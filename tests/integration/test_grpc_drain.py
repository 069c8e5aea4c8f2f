"""SIGTERM answers every gRPC call whose request had reached the server (issue 40 item 11's
gRPC half), in one process and with two front ends, against a real ``stoker serve``.

The calls go through a TCP relay of the test's own that reads the HTTP/2 frames it forwards,
so the test knows when every request has been written to the server whole (its stream
ended by the client) without asking the server: the signal is sent then, before grpc.aio
has handed most of them to Python. A slow request holds the one runner meanwhile, so none
is answered before the signal.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc.aio as tgrpc_aio
from tritonclient.utils import InferenceServerException

from bench.launch import free_port
from tests.conftest import slow_onnx
from tests.integration.conftest import Server, metric_samples, serve_one_model
from tests.integration.test_grpc import (
    DOOR_CLOSED,
    SLOW_CONFIG,
    SLOW_LAYERS,
    SLOW_WIDTH,
    grpc_input,
)

CALLS = 50
CHANNELS = 5  # connections, so that both front ends take some
BLOCKER_SECONDS = 6.0
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
END_STREAM = 0x1
DATA, HEADERS = 0, 1


class Relay:
    """Forwards connections from its port to ``target``'s and counts the client's streams
    that ended (END_STREAM on HEADERS or DATA) once their last frame is written on."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.ended = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _relay(self, client: asyncio.StreamReader, to_client: asyncio.StreamWriter) -> None:
        server, to_server = await asyncio.open_connection("127.0.0.1", self.target)
        for task in (self._requests(client, to_server), self._copy(server, to_client)):
            running = asyncio.create_task(task)
            self._tasks.add(running)

    async def _requests(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        pending = b""
        skip = len(PREFACE)
        while data := await source.read(65536):
            sink.write(data)
            await sink.drain()
            pending += data
            if skip:
                taken = min(skip, len(pending))
                pending, skip = pending[taken:], skip - taken
            while len(pending) >= 9:
                length = int.from_bytes(pending[:3], "big")
                if len(pending) < 9 + length:
                    break
                kind, flags = pending[3], pending[4]
                if kind in (DATA, HEADERS) and flags & END_STREAM:
                    self.ended += 1
                pending = pending[9 + length :]
        sink.close()

    async def _copy(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        while data := await source.read(65536):
            sink.write(data)
            await sink.drain()
        sink.close()


def pending(server: Server) -> float:
    return sum(
        value
        for (name, _), value in metric_samples(server).items()
        if name == "stoker_inference_pending_request_count"
    )


def body(value: float, m: int = 1) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, m, 1], "data": [value] * m}]}


def blocker_size(server: Server) -> int:
    """The ``M`` that keeps the slow model's runner busy for about BLOCKER_SECONDS."""
    probe = 2048
    url = f"{server.url}/v2/models/slow/infer"
    httpx.post(url, json=body(1.0, probe), timeout=60).raise_for_status()
    started = time.perf_counter()
    httpx.post(url, json=body(1.0, probe), timeout=60).raise_for_status()
    return max(probe, int(probe * BLOCKER_SECONDS / (time.perf_counter() - started)))


@pytest.mark.parametrize("front_ends", [1, 2], ids=["one-process", "two-front-ends"])
def test_calls_that_reached_the_server_before_sigterm_are_all_answered(
    tmp_path: Path, front_ends: int
) -> None:
    """50 unary calls written whole to the server while a slow request holds its runner,
    then SIGTERM at once: each is answered with its own number, a call made once they are
    all queued is UNAVAILABLE "shutting down", and the server exits 0. Before, in one
    process, every call grpc.aio had not yet handed to Python at the signal was refused."""
    port = free_port()
    env = {
        "STOKER_SERVER__GRPC_PORT": str(port),
        "STOKER_SERVER__FRONT_ENDS": str(front_ends),
        "STOKER_SERVER__DRAIN_TIMEOUT_S": "60",
    }
    server = serve_one_model(tmp_path, "slow", slow_onnx(SLOW_WIDTH, SLOW_LAYERS), SLOW_CONFIG, env)
    try:
        m = blocker_size(server)

        async def scenario() -> tuple[list[tuple[float, Any]], Any, httpx.Response]:
            relay = Relay(port)
            via = await relay.start()
            clients = [tgrpc_aio.InferenceServerClient(f"127.0.0.1:{via}") for _ in range(CHANNELS)]
            async with httpx.AsyncClient(timeout=120) as http:
                blocker = asyncio.create_task(
                    http.post(f"{server.url}/v2/models/slow/infer", json=body(1.0, m))
                )
                deadline = time.monotonic() + 60
                while await asyncio.to_thread(pending, server) < 1:
                    assert time.monotonic() < deadline, "the slow request never reached the server"
                    await asyncio.sleep(0.02)

                async def one(value: float) -> tuple[float, Any]:
                    x = np.full((1, 1, 1), value, np.float32)
                    client = clients[int(value) % CHANNELS]
                    try:
                        return value, await client.infer("slow", [grpc_input("x", x, "FP32")])
                    except InferenceServerException as error:
                        return value, error

                calls = [asyncio.create_task(one(float(i + 2))) for i in range(CALLS)]
                deadline = time.monotonic() + 60
                while relay.ended < CALLS:
                    assert time.monotonic() < deadline, f"{relay.ended} requests written"
                    await asyncio.sleep(0.001)
                server.process.send_signal(signal.SIGTERM)
                # Each call queued (or, refused, ended) before the late one is made.
                while (
                    await asyncio.to_thread(pending, server) + sum(call.done() for call in calls)
                    < CALLS + 1
                ):
                    assert time.monotonic() < deadline, "the calls never all reached the queue"
                    assert not blocker.done(), "the slow request finished before all were queued"
                    await asyncio.sleep(0.02)
                # Every front end has closed its drain's door (with two, the supervisor passes
                # the signal on a moment later).
                while server.log.read_text().count(DOOR_CLOSED) < front_ends:
                    assert time.monotonic() < deadline, "the drain's door never closed"
                    await asyncio.sleep(0.02)
                late = (await one(7.0))[1]
                answered = await asyncio.gather(*calls)
                slow = await blocker
            for client in clients:
                await client.close()
            await relay.close()
            return answered, late, slow

        answered, late, slow = asyncio.run(scenario())
        code = server.process.wait(90)
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()
    refused = [
        (value, result.status(), result.message())
        for value, result in answered
        if isinstance(result, InferenceServerException)
    ]
    assert refused == [], f"{len(refused)} of {CALLS} not answered: {refused[:3]}"
    for value, result in answered:
        assert float(result.as_numpy("y").ravel()[0]) == pytest.approx(value * SLOW_WIDTH)
    assert slow.status_code == 200
    assert isinstance(late, InferenceServerException), late
    assert late.status() == "StatusCode.UNAVAILABLE" and "shutting down" in late.message()
    assert code == 0, server.log.read_text()[-3000:]
    assert "Traceback" not in server.log.read_text()
