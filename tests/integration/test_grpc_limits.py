"""What a gRPC client may hold of a real server, with tritonclient.grpc as published: calls in
flight per address and per process, request bytes in flight per address and per process,
connections per process, a unary message that does not arrive in time, and silent and idle
connections. A second client address is 127.0.0.2 (all of 127.0.0.0/8 is this host's),
reached through a relay that connects from it."""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import numpy as np
import onnx
import pytest
import tritonclient.grpc.aio as tgrpc_aio
from grpc_health.v1 import health_pb2
from onnx import TensorProto, helper
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.conftest import TINY_CONFIG, tiny_onnx
from tests.integration.conftest import metric_samples, stop_server
from tests.integration.test_grpc import (
    GrpcServer,
    add_model,
    grpc_input,
    health_stub,
    start_grpc,
)

MAX_CALLS = 8  # 6 per address, at the default share of 0.75
MAX_CONNECTIONS = 6
MiB = 1024 * 1024
MAX_BYTES = 4 * MiB  # 3 MiB per address
MAX_WATCHES = 4  # 3 per address
MAX_PROBES = 8  # 6 per address
MAX_CONTROL_BYTES = 1024
# A request to "hold" waits a minute for a fuller batch: its bytes stay in flight until then,
# or until its client cancels it.
HOLD_CONFIG = """\
max_batch_size: 8
runners: 1
dynamic_batching:
  max_queue_delay_us: 60000000
  max_queue_work_s: 0
  default_timeout_us: 0
"""


def echo_onnx() -> onnx.ModelProto:
    """y = x for FP32 rows of any length."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "echo",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "n"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrpcServer]:
    repo = tmp_path_factory.mktemp("grpc-limits") / "repository"
    add_model(repo, "tiny", tiny_onnx(), TINY_CONFIG)
    add_model(repo, "echo", echo_onnx(), "max_batch_size: 8\nrunners: 1\n")
    add_model(repo, "hold", echo_onnx(), HOLD_CONFIG)
    env = {
        "STOKER_LIMITS__MAX_GRPC_CALLS": str(MAX_CALLS),
        "STOKER_LIMITS__MAX_CONNECTIONS": str(MAX_CONNECTIONS),
        "STOKER_LIMITS__MAX_INFLIGHT_BODY_BYTES": str(MAX_BYTES),
        "STOKER_LIMITS__BODY_TIMEOUT_S": "1.5",
        "STOKER_LIMITS__HEADER_TIMEOUT_S": "1.5",
        "STOKER_SERVER__KEEP_ALIVE_S": "2",
        "STOKER_LIMITS__MAX_GRPC_WATCHES": str(MAX_WATCHES),
        "STOKER_LIMITS__MAX_GRPC_PROBES": str(MAX_PROBES),
        "STOKER_LIMITS__MAX_CONTROL_BODY_BYTES": str(MAX_CONTROL_BYTES),
    }
    running = start_grpc(repo, repo.parent / "server.log", env)
    yield running
    assert stop_server(running.http) == 0, running.http.log.read_text()[-3000:]


@contextlib.contextmanager
def relay(target: str, source: str) -> Iterator[str]:
    """A TCP relay on 127.0.0.1 whose connections reach ``target`` from the address
    ``source``: what a client on another host looks like to the server."""
    host, port = target.rsplit(":", 1)
    listener = socket.create_server(("127.0.0.1", 0))
    opened: list[socket.socket] = []

    def pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def accept() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.socket()
            upstream.bind((source, 0))
            upstream.settimeout(2)  # a connection the server's kernel holds back: the next
            try:
                upstream.connect((host, int(port)))
            except OSError:
                client.close()
                upstream.close()
                continue
            upstream.settimeout(None)
            opened.extend([client, upstream])
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=pump, args=(src, dst), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
        for sock in opened:
            sock.close()


X = np.ones((1, 4), np.float32)


async def hold_a_call(client: tgrpc_aio.InferenceServerClient, release: asyncio.Event) -> Any:
    """A stream that stays open until ``release``, once its first request is answered (so
    the server has taken it as a call in flight); its answers' iterator."""

    async def requests() -> AsyncIterator[dict[str, Any]]:
        yield {"model_name": "tiny", "inputs": [grpc_input("x", X, "FP32")]}
        await release.wait()

    answers = client.stream_infer(requests())
    result, error = await asyncio.wait_for(anext(answers), 30)
    assert error is None and result.as_numpy("y").shape == (1, 3)
    return answers


def refusals(server: GrpcServer, reason: str) -> float:
    return sum(
        value
        for (name, labels), value in metric_samples(server.http).items()
        if name == "stoker_http_refusals_total" and ("reason", reason) in labels
    )


def test_calls_in_flight_are_bounded_per_address_and_per_process(limited: GrpcServer) -> None:
    """127.0.0.1 holds its share of the calls (6 of 8): its next call is RESOURCE_EXHAUSTED
    while its probes answer and 127.0.0.2 is served; 127.0.0.2 then takes the last two: the
    server's next call is refused too. Once the holders end, 127.0.0.1 is served again."""
    before = refusals(limited, "grpc_calls")

    async def scenario() -> tuple[InferenceServerException, InferenceServerException, Any]:
        release = asyncio.Event()
        near = tgrpc_aio.InferenceServerClient(limited.address)
        with relay(limited.address, "127.0.0.2") as far_address:
            far = tgrpc_aio.InferenceServerClient(far_address)
            held = [await hold_a_call(near, release) for _ in range(6)]
            with pytest.raises(InferenceServerException) as over_share:
                await near.infer("tiny", [grpc_input("x", X, "FP32")])
            assert await near.is_server_live() and await near.is_server_ready()
            channel = grpc.aio.insecure_channel(limited.address)
            health = await health_stub(channel).Check(health_pb2.HealthCheckRequest())
            await channel.close()
            answer = await far.infer("tiny", [grpc_input("x", X, "FP32")])
            assert answer.as_numpy("y").shape == (1, 3)
            held += [await hold_a_call(far, release) for _ in range(2)]
            with pytest.raises(InferenceServerException) as over_cap:
                await far.infer("tiny", [grpc_input("x", X, "FP32")])
            release.set()
            for answers in held:
                assert [item async for item in answers] == []  # ended, nothing more
            again = await near.infer("tiny", [grpc_input("x", X, "FP32")])
            assert again.as_numpy("y").shape == (1, 3)
            await far.close()
        await near.close()
        return over_share.value, over_cap.value, health.status

    over_share, over_cap, health = asyncio.run(scenario())
    assert health == health_pb2.HealthCheckResponse.SERVING
    assert over_share.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert over_share.message() == (
        "6 gRPC calls in flight from this address, 1 more would pass its share of "
        "limits.max_grpc_calls (6 of 8); retry later"
    )
    assert over_cap.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert over_cap.message() == (
        "8 gRPC calls in flight, 1 more would pass limits.max_grpc_calls (8); retry later"
    )
    assert refusals(limited, "grpc_calls") - before == 2


def pending(server: GrpcServer, model: str) -> float:
    return sum(
        value
        for (name, labels), value in metric_samples(server.http).items()
        if name == "stoker_inference_pending_request_count" and ("model", model) in labels
    )


def rows(size: int) -> list[Any]:
    """One FP32 row of ``size`` bytes, as the only input of "echo" and "hold"."""
    return [grpc_input("x", np.ones((1, size // 4), np.float32), "FP32")]


def test_request_bytes_in_flight_are_bounded_per_address_and_per_process(
    limited: GrpcServer,
) -> None:
    """127.0.0.1's 2 MiB request waits in the queue: its 1.5 MiB more would pass its share
    (3 of 4 MiB) and is refused; 127.0.0.2's 1.5 MiB is taken beside it, and then 1 MiB more
    from anyone passes the 4 MiB in all. Once the waiting requests are cancelled, their
    bytes are free again."""
    before = refusals(limited, "grpc_inflight_bytes")

    async def wait_pending(count: int) -> None:
        deadline = time.monotonic() + 30
        while await asyncio.to_thread(pending, limited, "hold") < count:
            assert time.monotonic() < deadline, "the held request never reached the queue"
            await asyncio.sleep(0.02)

    async def scenario() -> tuple[InferenceServerException, InferenceServerException]:
        near = tgrpc_aio.InferenceServerClient(limited.address)
        with relay(limited.address, "127.0.0.2") as far_address:
            far = tgrpc_aio.InferenceServerClient(far_address)
            first = asyncio.create_task(near.infer("hold", rows(2 * MiB)))
            await wait_pending(1)
            with pytest.raises(InferenceServerException) as over_share:
                await near.infer("echo", rows(3 * MiB // 2))
            second = asyncio.create_task(far.infer("hold", rows(3 * MiB // 2)))
            await wait_pending(2)
            with pytest.raises(InferenceServerException) as over_all:
                await far.infer("echo", rows(MiB))
            for task in (first, second):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            # The server lets go of a cancelled call soon after, not at once.
            deadline = time.monotonic() + 30
            while True:
                try:
                    answer = await near.infer("echo", rows(3 * MiB - 4096))
                    break
                except InferenceServerException as error:
                    assert error.status() == "StatusCode.RESOURCE_EXHAUSTED", error
                    assert time.monotonic() < deadline, "the cancelled requests' bytes stay held"
                    await asyncio.sleep(0.05)
            assert answer.as_numpy("y").shape == (1, (3 * MiB - 4096) // 4)
            await far.close()
        await near.close()
        return over_share.value, over_all.value

    over_share, over_all = asyncio.run(scenario())
    assert over_share.status() == "StatusCode.RESOURCE_EXHAUSTED"
    message = over_share.message()
    assert message.startswith("2097") and "in flight from this address" in message
    assert "its share of limits.max_inflight_body_bytes (3145728 of 4194304)" in message
    assert over_all.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert "would pass limits.max_inflight_body_bytes (4194304)" in over_all.message()
    assert refusals(limited, "grpc_inflight_bytes") - before >= 2


def test_a_streams_request_past_the_bytes_in_flight_is_answered_with_its_error(
    limited: GrpcServer,
) -> None:
    """On one stream: a 2 MiB request waits in the queue, so the next one's 1.5 MiB would pass
    the address's 3 MiB; that one is answered with the refusal as its error_message, by its
    id, and the stream goes on (a small request after it is answered)."""

    async def scenario() -> list[tuple[Any, Any]]:
        client = tgrpc_aio.InferenceServerClient(limited.address)
        done = asyncio.Event()

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": "hold", "inputs": rows(2 * MiB), "request_id": "held"}
            deadline = time.monotonic() + 30
            while await asyncio.to_thread(pending, limited, "hold") < 1:
                assert time.monotonic() < deadline, "the held request never reached the queue"
                await asyncio.sleep(0.02)
            yield {"model_name": "echo", "inputs": rows(3 * MiB // 2), "request_id": "more"}
            yield {"model_name": "echo", "inputs": rows(1024), "request_id": "small"}
            await done.wait()

        answers = client.stream_infer(requests())
        got = [await asyncio.wait_for(anext(answers), 30) for _ in range(2)]
        answers.cancel()  # and with it the held request
        done.set()
        await client.close()
        return got

    (first, second) = asyncio.run(scenario())
    refused = first if first[1] is not None else second
    answered = second if refused is first else first
    assert refused[0] is None and refused[1] is not None
    assert "in flight from this address" in refused[1].message()
    assert "its share of limits.max_inflight_body_bytes (3145728 of 4194304)" in (
        refused[1].message()
    )
    assert answered[1] is None and answered[0].get_response().id == "small"


def test_a_unary_message_that_does_not_arrive_in_time_is_deadline_exceeded(
    limited: GrpcServer,
) -> None:
    """A ModelInfer call whose message never comes (a client that trickles one looks the same
    to the server: gRPC hands a message over whole) ends at body_timeout_s, with the limit
    and its value; the call it held is free again."""
    before = refusals(limited, "grpc_message_timeout")

    async def scenario() -> tuple[grpc.aio.AioRpcError, float]:
        never = asyncio.Event()

        async def nothing() -> AsyncIterator[bytes]:
            await never.wait()
            yield b""

        async with grpc.aio.insecure_channel(limited.address) as channel:
            call: Any = channel.stream_unary("/inference.GRPCInferenceService/ModelInfer")
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await call(nothing(), timeout=60)
            return late.value, time.monotonic() - started

    late, elapsed = asyncio.run(scenario())
    assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert late.details() == (
        "the request message did not arrive whole within limits.body_timeout_s (1.5 s)"
    )
    assert 1.4 < elapsed < 15
    assert refusals(limited, "grpc_message_timeout") - before == 1


def frames_until_goaway(sock: socket.socket) -> bool:
    """Reads HTTP/2 frames, acknowledging SETTINGS and PINGs as a client must, until the
    server's GOAWAY (True) or a close (False)."""
    buffer = b""

    def read(n: int) -> bytes | None:
        nonlocal buffer
        while len(buffer) < n:
            chunk = sock.recv(65536)
            if not chunk:
                return None
            buffer += chunk
        data, buffer = buffer[:n], buffer[n:]
        return data

    while (head := read(9)) is not None:
        length = int.from_bytes(head[:3], "big")
        kind, flags = head[3], head[4]
        payload = read(length)
        if payload is None:
            return False
        if kind == 0x7:
            return True
        if kind == 0x4 and not flags & 0x1:
            sock.sendall(struct.pack(">I", 0)[1:] + b"\x04\x01" + b"\x00" * 4)
        if kind == 0x6 and not flags & 0x1:
            sock.sendall(struct.pack(">I", 8)[1:] + b"\x06\x01" + b"\x00" * 4 + payload)
    return False


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def test_silent_and_idle_connections_are_closed(limited: GrpcServer) -> None:
    """A connection that never opens HTTP/2 is closed at header_timeout_s; one that opens it
    and makes no call is told GOAWAY at server.keep_alive_s."""
    host, port = limited.address.split(":")
    silent = socket.create_connection((host, int(port)), timeout=30)
    idle = socket.create_connection((host, int(port)), timeout=30)
    idle.sendall(PREFACE)
    started = time.monotonic()
    with silent, idle:
        while silent.recv(65536):  # the server's SETTINGS, then the close
            pass
        silent_for = time.monotonic() - started
        assert frames_until_goaway(idle)
        idle_for = time.monotonic() - started
    assert 1.0 < silent_for < 15
    assert 1.5 < idle_for < 20


def own_connection(address: str) -> tgrpc_aio.InferenceServerClient:
    """A client on a connection of its own (grpc's channels to one target share one)."""
    return tgrpc_aio.InferenceServerClient(
        address, channel_args=[("grpc.use_local_subchannel_pool", 1)]
    )


def established(port: int) -> list[str]:
    """The peers of this host's established TCP connections to ``port`` (``/proc/net/tcp``,
    the server's side of each): what the server's cap and its shares count."""
    peers = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as lines:
            for line in list(lines)[1:]:
                local, remote, state = line.split()[1:4]
                if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:
                    peers.append(remote)
    return peers


async def no_connections_held(address: str) -> None:
    """Waits until nothing holds a connection to the server at ``address``: one an earlier
    test's channel still keeps (closed at ``server.keep_alive_s`` once idle) would take a
    place of the cap, and, the cap near full, keep this test's second address waiting."""
    port = int(address.rsplit(":", 1)[1])
    deadline = time.monotonic() + 60
    while held := established(port):
        assert time.monotonic() < deadline, f"connections never closed: {held}"
        await asyncio.sleep(0.1)


async def hold_on_own_connection(
    address: str, release: asyncio.Event, server: str
) -> tuple[tgrpc_aio.InferenceServerClient, Any]:
    """``hold_a_call`` on a connection of its own, tried again while the server still counts
    connections that earlier tests closed (it counts one out once it has seen its close)."""
    deadline = time.monotonic() + 120  # generous: a loaded 2-core CI sees closes late
    while True:
        client = own_connection(address)
        try:
            return client, await hold_a_call(client, release)
        except grpc.aio.AioRpcError as error:
            await client.close()
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error
            held = established(int(server.rsplit(":", 1)[1]))
            assert time.monotonic() < deadline, (
                f"a closed connection never freed its place; the server's connections: {held}"
            )
            await asyncio.sleep(0.1)


def test_connections_past_the_cap_are_closed(limited: GrpcServer) -> None:
    """Six clients each keep a call open on a connection of its own (6 connections, the
    cap; four from 127.0.0.3, its share, two from 127.0.0.4: addresses of this test alone,
    begun once no connection of an earlier test is held): a seventh client's
    connection is closed as it opens (UNAVAILABLE; its probes' too: use HTTP's), and once
    the six go, a new client is served."""

    async def scenario() -> InferenceServerException:
        release = asyncio.Event()
        await no_connections_held(limited.address)
        server = limited.address
        with relay(server, "127.0.0.3") as one, relay(server, "127.0.0.4") as two:
            holders = [await hold_on_own_connection(one, release, server) for _ in range(4)]
            holders += [await hold_on_own_connection(two, release, server) for _ in range(2)]
            late = own_connection(limited.address)
            with pytest.raises(InferenceServerException) as refused:
                await late.infer("tiny", [grpc_input("x", X, "FP32")], client_timeout=10)
            await late.close()
            release.set()
            for client, answers in holders:
                assert [item async for item in answers] == []
                await client.close()
        # All six are closed now: a seventh gets its place once the server has seen a close.
        later, answers = await hold_on_own_connection(server, release, server)
        assert [item async for item in answers] == []
        await later.close()
        return refused.value

    refused = asyncio.run(scenario())
    assert refused.status() == "StatusCode.UNAVAILABLE", refused.message()


def tiny_request() -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="tiny")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(X.tobytes())
    return request


async def opened(address: str) -> grpc.aio.Channel:
    """A channel on a connection of its own that has been served once, tried again while
    the server still counts connections that earlier tests closed."""
    deadline = time.monotonic() + 60
    while True:
        channel = grpc.aio.insecure_channel(
            address, options=[("grpc.use_local_subchannel_pool", 1)]
        )
        try:
            await service_pb2_grpc.GRPCInferenceServiceStub(channel).ServerLive(
                service_pb2.ServerLiveRequest()
            )
            return channel
        except grpc.aio.AioRpcError:
            await channel.close()
            assert time.monotonic() < deadline, "never served"
            await asyncio.sleep(0.1)


async def served_once(address: str) -> None:
    await (await opened(address)).close()


def test_an_address_at_its_share_of_connections_waits_for_more(limited: GrpcServer) -> None:
    """127.0.0.5 keeps its share of the connections busy (4 of 6), as idle clients kept past
    the idle timeout by a probe now and then: once the server has seen it, a new connection
    from it is not served (it waits in the kernel), the four are never touched, and
    127.0.0.6 is served on the room left. (The addresses are this test's alone, so no
    connection of an earlier test counts against their shares.)"""

    async def served(address: str, within_s: float) -> bool:
        channel = grpc.aio.insecure_channel(
            address, options=[("grpc.use_local_subchannel_pool", 1)]
        )
        try:
            await service_pb2_grpc.GRPCInferenceServiceStub(channel).ServerLive(
                service_pb2.ServerLiveRequest(), timeout=within_s, wait_for_ready=True
            )
            return True
        except grpc.aio.AioRpcError:
            return False
        finally:
            await channel.close()

    async def scenario() -> tuple[list[grpc.aio.Channel], Any]:
        near: list[grpc.aio.Channel] = []
        ended: list[grpc.aio.Channel] = []
        stop = asyncio.Event()

        async def keep(channel: grpc.aio.Channel) -> None:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            last = gap = 0.0
            try:
                while not stop.is_set():
                    now = time.monotonic()
                    gap, last = (now - last if last else 0.0), now
                    await stub.ServerLive(service_pb2.ServerLiveRequest())
                    await asyncio.sleep(0.2)
                return
            except grpc.aio.AioRpcError:
                # Closed under a call. The server may close a connection idle for its
                # keep-alive (2 s): one whose calls began less than that apart was in use.
                if gap < 1.9:
                    ended.append(channel)

        keepers = []
        await no_connections_held(limited.address)
        with relay(limited.address, "127.0.0.5") as near_address:
            for _ in range(4):  # each kept busy from its start: idle ones close after 2 s
                near.append(await opened(near_address))
                keepers.append(asyncio.create_task(keep(near[-1])))
            deadline = time.monotonic() + 60
            while await served(near_address, 3):  # until the server has seen the four
                assert time.monotonic() < deadline, "127.0.0.5 is served past its share"
            # and from then on (a connection closed after it was served would be too)
            assert not any([await served(near_address, 3) for _ in range(3)])
            with relay(limited.address, "127.0.0.6") as far_address:
                far = await opened(far_address)
                answer = await service_pb2_grpc.GRPCInferenceServiceStub(far).ModelInfer(
                    tiny_request()
                )
                await far.close()
            stop.set()
            await asyncio.gather(*keepers)
            for channel in near:
                await channel.close()
        return ended, answer

    ended, answer = asyncio.run(scenario())
    assert (
        ended == []
    )  # the four at its share were never touched in use (on a 2-core CI box the client
    # itself may stall past the keep-alive between two calls: that connection was idle)
    assert list(answer.outputs[0].shape) == [1, 3]


def test_health_watches_are_bounded_per_address_apart_from_calls(limited: GrpcServer) -> None:
    """One address opens as many health watches as it may hold calls: it gets its share of
    the watches (3 of 4), the rest are RESOURCE_EXHAUSTED, and its inference calls are
    served beside them; 127.0.0.2 still gets the last watch."""

    async def scenario() -> tuple[int, list[grpc.aio.AioRpcError], Any, Any]:
        channel = await opened(limited.address)  # once earlier tests' connections are gone
        watches, refused = [], []
        try:
            for _ in range(6):
                watch = health_stub(channel).Watch(health_pb2.HealthCheckRequest())
                try:
                    await asyncio.wait_for(watch.read(), 30)
                    watches.append(watch)
                except grpc.aio.AioRpcError as error:
                    refused.append(error)
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            answer = await stub.ModelInfer(tiny_request())
            with relay(limited.address, "127.0.0.2") as far_address:
                far = await opened(far_address)
                far_watch = health_stub(far).Watch(health_pb2.HealthCheckRequest())
                far_status = (await asyncio.wait_for(far_watch.read(), 30)).status
                far_watch.cancel()
                await far.close()
        finally:
            for watch in watches:
                watch.cancel()
            await channel.close()
        return len(watches), refused, answer, far_status

    held, refused, answer, far_status = asyncio.run(scenario())
    assert held == 3 and len(refused) == 3
    for error in refused:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "its share of limits.max_grpc_watches (3 of 4)" in str(error.details())
    assert list(answer.outputs[0].shape) == [1, 3]
    assert far_status == health_pb2.HealthCheckResponse.SERVING


def test_control_messages_past_their_limit_are_refused_before_they_are_parsed(
    limited: GrpcServer,
) -> None:
    """Load, unload and shared-memory registration messages over
    limits.max_control_body_bytes are RESOURCE_EXHAUSTED, whatever the server would say of
    them; one under it gets its own answer (model control is off here)."""
    asyncio.run(served_once(limited.address))  # once earlier tests' connections are gone
    # A connection past this address's share may still be closed while the server sweeps
    # what earlier tests left: each call waits for a served connection (generous bound).
    ready: dict[str, Any] = {"wait_for_ready": True, "timeout": 60}
    channel = grpc.insecure_channel(limited.address)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    Parameter = service_pb2.ModelRepositoryParameter
    config = Parameter(string_param='{"max_batch_size": 4, "padding": "' + "x" * 2048 + '"}')
    for call in (
        lambda: stub.RepositoryModelLoad(
            service_pb2.RepositoryModelLoadRequest(
                model_name="tiny", parameters={"config": config}
            ),
            **ready,
        ),
        lambda: stub.RepositoryModelUnload(
            service_pb2.RepositoryModelUnloadRequest(model_name="t" * 2048), **ready
        ),
        lambda: stub.SystemSharedMemoryRegister(
            service_pb2.SystemSharedMemoryRegisterRequest(
                name="r" * 2048, key="/k", offset=0, byte_size=8
            ),
            **ready,
        ),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limits.max_control_body_bytes (1024)" in str(refused.value.details())
    with pytest.raises(grpc.RpcError) as small:
        stub.RepositoryModelLoad(service_pb2.RepositoryModelLoadRequest(model_name="tiny"), **ready)
    assert small.value.code() != grpc.StatusCode.RESOURCE_EXHAUSTED
    channel.close()


@contextlib.contextmanager
def reconnecting_flood(address: str, source: str, count: int) -> Iterator[list[int]]:
    """``count`` plain TCP connections to ``address`` from ``source``, each one that closes
    opened again at once, until the block ends; yields a list holding how many were opened."""
    host, port = address.rsplit(":", 1)
    opened = [0]
    stop = threading.Event()

    def flood() -> None:
        socks: set[socket.socket] = set()
        while not stop.is_set():
            while len(socks) < count:
                sock = socket.socket()
                sock.bind((source, 0))
                sock.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    sock.connect((host, int(port)))
                socks.add(sock)
                opened[0] += 1
            readable, _, _ = select.select(list(socks), [], [], 0.02)
            for sock in readable:
                try:
                    data = sock.recv(4096)
                except OSError:
                    data = b""
                if not data:
                    socks.discard(sock)
                    sock.close()
        for sock in socks:
            sock.close()

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    try:
        yield opened
    finally:
        stop.set()
        thread.join(30)


def test_a_reconnecting_flood_from_one_address_does_not_lock_another_out(
    limited: GrpcServer,
) -> None:
    """127.0.0.7 keeps twice the cap of plain TCP connections open and reopens any that
    closes: once it is seen at its share, its new connections wait in the kernel, so
    127.0.0.8's new channels (a connection each) are served while it runs."""

    async def live(address: str) -> bool:
        channel = grpc.aio.insecure_channel(
            address, options=[("grpc.use_local_subchannel_pool", 1)]
        )
        try:
            await service_pb2_grpc.GRPCInferenceServiceStub(channel).ServerLive(
                service_pb2.ServerLiveRequest(), timeout=10
            )
            return True
        except grpc.aio.AioRpcError:
            return False
        finally:
            await channel.close()

    async def scenario(far_address: str, opened: list[int]) -> list[bool]:
        deadline = time.monotonic() + 60
        while opened[0] < 2 * MAX_CONNECTIONS:  # the flood has filled the cap
            assert time.monotonic() < deadline, "the flood never started"
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.5)  # a slow sweep's interval: the flood has been seen
        answered = []
        for _ in range(30):
            answered.append(await live(far_address))
            await asyncio.sleep(0.1)
        return answered

    asyncio.run(served_once(limited.address))  # once earlier tests' connections are gone
    with (
        relay(limited.address, "127.0.0.8") as far_address,
        reconnecting_flood(limited.address, "127.0.0.7", 2 * MAX_CONNECTIONS) as opened,
    ):
        answered = asyncio.run(scenario(far_address, opened))
    assert sum(answered) >= 0.9 * len(answered), answered


def test_probes_that_never_send_their_message_end_soon_and_are_bounded_per_address(
    limited: GrpcServer,
) -> None:
    """ServerLive, ServerReady and health Check calls whose message never comes end within
    seconds (DEADLINE_EXCEEDED), and one address holds at most its share of them at once
    (RESOURCE_EXHAUSTED past it); a probe that sends its message is answered after."""

    async def scenario() -> tuple[list[grpc.aio.AioRpcError], float, bool]:
        never = asyncio.Event()

        async def nothing() -> AsyncIterator[bytes]:
            await never.wait()
            yield b""

        methods = [
            "/inference.GRPCInferenceService/ServerLive",
            "/inference.GRPCInferenceService/ServerReady",
            "/grpc.health.v1.Health/Check",
        ]
        channel = await opened(limited.address)
        started = time.monotonic()
        probes: list[Any] = [channel.stream_unary(method) for method in methods]
        calls = [probes[index % 3](nothing(), timeout=60) for index in range(3 * MAX_PROBES)]
        ended = await asyncio.gather(*calls, return_exceptions=True)
        elapsed = time.monotonic() - started
        live = await service_pb2_grpc.GRPCInferenceServiceStub(channel).ServerLive(
            service_pb2.ServerLiveRequest(), timeout=10
        )
        await channel.close()
        errors = [error for error in ended if isinstance(error, grpc.aio.AioRpcError)]
        assert len(errors) == len(ended), ended
        return errors, elapsed, live.live

    errors, elapsed, live = asyncio.run(scenario())
    codes = [error.code() for error in errors]
    # 6 at once at most (all but those ended late are refused at once)
    assert codes.count(grpc.StatusCode.DEADLINE_EXCEEDED) >= MAX_PROBES * 3 // 4
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1
    assert set(codes) == {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
    late = next(e for e in errors if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED)
    assert late.details() == "the request message did not arrive whole within a probe's 1 s"
    refused = next(e for e in errors if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert "its share of limits.max_grpc_probes (6 of 8)" in str(refused.details())
    assert elapsed < 30  # a second each, not body_timeout_s's 60 (the calls' own timeout)
    assert live
