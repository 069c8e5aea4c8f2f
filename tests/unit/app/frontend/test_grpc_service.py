"""The gRPC servicers without a network: called as grpc.aio calls them, with a stand-in for
the call's context, over a real data plane of the tiny model (or a stand-in plane where the
test is about what the servicer hands it). Status codes, the arena slot a request is written
into, the stream, health, and the API-key interceptor."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from app.contract import Answer
from app.errors import (
    BadRequest,
    DeadlineExceeded,
    EngineError,
    NotFound,
    PayloadTooLarge,
    QueueFull,
    RequestTimeout,
    StokerError,
    Unavailable,
)
from app.frontend.arena import Slot
from app.frontend.auth import KeyRing
from app.frontend.grpc.ending import Ended
from app.frontend.grpc.generated import grpc_service_pb2 as pb
from app.frontend.grpc.limits import CallLimits, peer_host
from app.frontend.grpc.server import KeyCheck, handlers
from app.frontend.grpc.service import (
    SERVICE,
    STREAM_WINDOW,
    Health,
    InferenceService,
    code_of,
)
from app.frontend.plane import DataPlane
from app.frontend.server import embedded
from app.protocol import RequestedOutput, encode_response
from app.settings import LimitSettings, ServerSettings, Settings
from tests.conftest import TINY_BIAS, TINY_WEIGHTS, tiny_model

T = TypeVar("T")
LIMIT = 1 << 20


class Context:
    """What the servicers ask of a call's context."""

    def __init__(self, remaining: float | None = None, peer: str = "ipv4:10.0.0.7:50312") -> None:
        self.remaining = remaining
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        return self.remaining

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


def with_service(tmp_path: Path, scenario: Callable[[InferenceService], Awaitable[T]]) -> T:
    folder = tmp_path / "repo" / "tiny"
    tiny_model(folder)
    settings = Settings(
        models={"repository": tmp_path / "repo"},  # type: ignore[arg-type]
        store={"path": tmp_path / "store"},  # type: ignore[arg-type]
    )

    async def run() -> T:
        plane = embedded(settings)
        await plane.start()
        try:
            return await scenario(InferenceService(plane, LIMIT, CallLimits(LimitSettings())))
        finally:
            await plane.stop()

    return asyncio.run(run())


def tiny_request(x: np.ndarray, request_id: str = "") -> bytes:
    """A serialized ModelInferRequest for the tiny model: what the inference methods take."""
    request = pb.ModelInferRequest(model_name="tiny", id=request_id)
    request.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    return request.SerializeToString()


def y_of(response: pb.ModelInferResponse) -> np.ndarray:
    assert response.outputs[0].name == "y"
    shape = list(response.outputs[0].shape)
    return np.frombuffer(response.raw_output_contents[0], np.float32).reshape(shape)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (BadRequest, grpc.StatusCode.INVALID_ARGUMENT),
        (NotFound, grpc.StatusCode.NOT_FOUND),
        (RequestTimeout, grpc.StatusCode.DEADLINE_EXCEEDED),
        (PayloadTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (QueueFull, grpc.StatusCode.UNAVAILABLE),  # Triton's code for a full queue: retry
        (Unavailable, grpc.StatusCode.UNAVAILABLE),
        (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
        (EngineError, grpc.StatusCode.INTERNAL),
        (StokerError, grpc.StatusCode.INTERNAL),
    ],
)
def test_errors_take_the_code_triton_gives_them(
    error: type[StokerError], code: grpc.StatusCode
) -> None:
    assert code_of(error("why")) == code


@pytest.mark.parametrize(
    ("peer", "host"),
    [("ipv4:10.0.0.7:50312", "10.0.0.7"), ("ipv6:[::1]:50312", "::1"), ("unix:/tmp/s", "/tmp/s")],
)
def test_the_batcher_is_fair_to_the_peers_address(peer: str, host: str) -> None:
    assert peer_host(cast(Any, Context(peer=peer))) == host


def test_infer_answers_the_models_numbers_and_refuses_with_codes(tmp_path: Path) -> None:
    x = np.random.default_rng(2).standard_normal((3, 4)).astype(np.float32)

    async def scenario(service: InferenceService) -> None:
        context = cast(Any, Context(remaining=30.0))
        response = pb.ModelInferResponse.FromString(
            await service.ModelInfer(tiny_request(x, "q-1"), context)
        )
        assert response.id == "q-1" and response.model_version == "fp32"
        np.testing.assert_allclose(
            y_of(response), x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5, atol=1e-5
        )
        for request, code in [
            (
                pb.ModelInferRequest(model_name="nope").SerializeToString(),
                grpc.StatusCode.NOT_FOUND,
            ),
            (b"\x0b", grpc.StatusCode.INVALID_ARGUMENT),
            (tiny_request(np.ones((1, 5), np.float32)), grpc.StatusCode.INVALID_ARGUMENT),
        ]:
            with pytest.raises(Ended) as refused:
                await service.ModelInfer(request, context)
            assert refused.value.code == code and "Traceback" not in refused.value.details
        # Typed contents past the body limit as tensors: refused before anything is decoded.
        big = pb.ModelInferRequest(model_name="tiny")
        tensor = big.inputs.add(name="x", datatype="FP32", shape=[LIMIT // 16 + 1, 4])
        tensor.contents.fp32_contents.extend([0.0] * ((LIMIT // 16 + 1) * 4))
        with pytest.raises(Ended) as too_large:
            await service.ModelInfer(big.SerializeToString(), context)
        assert too_large.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        ready = await service.ModelReady(pb.ModelReadyRequest(name="tiny"), context)
        unknown = await service.ModelReady(pb.ModelReadyRequest(name="nope"), context)
        assert ready.ready and not unknown.ready

    with_service(tmp_path, scenario)


def test_a_stream_answers_every_request_and_errors_in_band(tmp_path: Path) -> None:
    xs = {f"s{i}": np.full((1, 4), float(i), np.float32) for i in range(8)}

    async def scenario(service: InferenceService) -> list[pb.ModelStreamInferResponse]:
        async def requests() -> AsyncIterator[bytes]:
            for request_id, x in xs.items():
                yield tiny_request(x, request_id)
            yield tiny_request(np.ones((1, 3), np.float32), "bad")

        stream = service.ModelStreamInfer(requests(), cast(Any, Context()))
        return [pb.ModelStreamInferResponse.FromString(answer) async for answer in stream]

    answers = with_service(tmp_path, scenario)
    assert len(answers) == len(xs) + 1
    failed = [a for a in answers if a.error_message]
    assert len(failed) == 1 and failed[0].infer_response.id == "bad"
    for answer in answers:
        if not answer.error_message:
            x = xs[answer.infer_response.id]
            np.testing.assert_allclose(
                y_of(answer.infer_response), x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5
            )


class LendingPlane:
    """A data plane whose engine client lends an arena slot of ``slot_bytes``; it answers
    every request with its body's length and remembers what it was handed."""

    def __init__(self, slot_bytes: int) -> None:
        self.arena = bytearray(slot_bytes)
        self.seen: list[tuple[Any, int | None, Slot | None, str]] = []
        self.clients: list[str] = []  # whom each slot was lent to

    @contextlib.asynccontextmanager
    async def body_buffer(self, declared: int | None, client: str = "") -> AsyncIterator[Slot]:
        self.clients.append(client)
        yield Slot(0, memoryview(self.arena))

    async def infer(
        self,
        name: str,
        version: str | None,
        body: Any,
        header_length: int | None,
        slot: Slot | None,
        client: str,
        began: float | None,
    ) -> Answer:
        self.seen.append((body, header_length, slot, client))
        length = np.array([len(body)], np.int64)
        content, headers = encode_response(
            name, "fp32", None, [(RequestedOutput("n", True), length)]
        )
        return Answer(name, "fp32", headers, content)


@pytest.mark.parametrize("slot_bytes", [4096, 16])
def test_a_request_is_written_into_the_slot_the_engine_client_lends(slot_bytes: int) -> None:
    plane = LendingPlane(slot_bytes)
    service = InferenceService(cast(DataPlane, plane), LIMIT, CallLimits(LimitSettings()))
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    response = pb.ModelInferResponse.FromString(
        asyncio.run(service.ModelInfer(tiny_request(x), cast(Any, Context())))
    )
    ((body, header_length, slot, client),) = plane.seen
    assert header_length is not None and bytes(body[header_length:]) == x.tobytes()
    assert client == "10.0.0.7" and plane.clients == ["10.0.0.7"]  # the arena's share too
    assert int(np.frombuffer(response.raw_output_contents[0], np.int64)[0]) == len(body)
    if slot_bytes >= len(body):  # it fits: the body is the slot's memory, the one copy made
        assert slot is not None and isinstance(body, memoryview) and body.obj is plane.arena
    else:  # a slot too small is not used: the body is bytes of its own, as HTTP's would be
        assert slot is None and isinstance(body, bytes)


class ControlledPlane:
    """A data plane that remembers the loads and unloads it is handed."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    async def control(self, method: str, *args: Any) -> None:
        self.calls.append((method, *args))


def test_repository_load_and_unload_reach_the_plane_as_http_hands_them_over() -> None:
    """Triton's parameters: the config as JSON text, ``unload_dependents`` accepted; model
    files in the request are refused with INVALID_ARGUMENT, as an unknown parameter is."""
    plane = ControlledPlane()
    service = InferenceService(cast(DataPlane, plane), LIMIT, CallLimits(LimitSettings()))
    context = cast(Any, Context())
    Parameter = pb.ModelRepositoryParameter
    load = pb.RepositoryModelLoadRequest(
        model_name="tiny", parameters={"config": Parameter(string_param='{"max_batch_size": 4}')}
    )
    unload = pb.RepositoryModelUnloadRequest(
        model_name="tiny", parameters={"unload_dependents": Parameter(bool_param=True)}
    )
    asyncio.run(service.RepositoryModelLoad(load, context))
    asyncio.run(service.RepositoryModelUnload(unload, context))
    assert plane.calls == [("load", "tiny", {"max_batch_size": 4}), ("unload", "tiny")]
    for parameters, why in (
        ({"file:1/model.onnx": Parameter(bytes_param=b"onnx")}, "not supported"),
        ({"colour": Parameter(string_param="red")}, "unknown parameter 'colour'"),
        ({"config": Parameter(string_param="{not json")}, "not JSON"),
    ):
        bad = pb.RepositoryModelLoadRequest(model_name="tiny", parameters=parameters)
        with pytest.raises(Ended) as refused:
            asyncio.run(service.RepositoryModelLoad(bad, context))
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert why in refused.value.details
    assert len(plane.calls) == 2


class ReadyPlane:
    def __init__(self) -> None:
        self.is_ready = True


def test_health_follows_readiness() -> None:
    plane = ReadyPlane()
    health = Health(cast(DataPlane, plane))
    Status = health_pb2.HealthCheckResponse

    async def scenario() -> None:
        context = cast(Any, Context())
        for service in ("", "inference.GRPCInferenceService"):
            check = await health.Check(health_pb2.HealthCheckRequest(service=service), context)
            assert check.status == Status.SERVING
        plane.is_ready = False
        assert (
            await health.Check(health_pb2.HealthCheckRequest(), context)
        ).status == Status.NOT_SERVING
        with pytest.raises(Ended) as unknown:
            await health.Check(health_pb2.HealthCheckRequest(service="other"), context)
        assert unknown.value.code == grpc.StatusCode.NOT_FOUND
        watch = health.Watch(health_pb2.HealthCheckRequest(service="other"), context)
        assert (await anext(watch)).status == Status.SERVICE_UNKNOWN
        await watch.aclose()

    asyncio.run(scenario())


class Details:
    def __init__(self, method: str, metadata: tuple[tuple[str, str | bytes], ...] = ()) -> None:
        self.method = method
        self.invocation_metadata = metadata


async def behaviour(request: Any, context: Any) -> str:
    return "served"


async def streaming(requests: Any, context: Any) -> AsyncIterator[str]:
    yield "served"


@contextlib.contextmanager
def refused_with(problem: str) -> Iterator[Context]:
    context = Context()
    yield context
    assert context.code == grpc.StatusCode.UNAUTHENTICATED and problem in context.details


def test_keys_are_asked_for_in_metadata_as_in_headers() -> None:
    check = KeyCheck(KeyRing(["k-one", "k-two"]))
    unary: Any = grpc.unary_unary_rpc_method_handler(behaviour)
    stream: Any = grpc.stream_stream_rpc_method_handler(streaming)

    async def intercepted(
        method: str, *metadata: tuple[str, str | bytes], handler: Any = unary
    ) -> Any:
        async def continuation(_: Any) -> Any:
            return handler

        return await check.intercept_service(continuation, cast(Any, Details(method, metadata)))

    async def scenario() -> None:
        infer = "/inference.GRPCInferenceService/ModelInfer"
        accepted: list[tuple[str, str | bytes]] = [
            ("authorization", "Bearer k-one"),
            ("x-api-key", "k-two"),
            ("x-api-key", b"k-two"),
        ]
        for pair in accepted:
            assert await intercepted(infer, pair) is unary
        for open_method in (
            "/inference.GRPCInferenceService/ServerLive",
            "/inference.GRPCInferenceService/ServerReady",
            "/grpc.health.v1.Health/Check",
        ):
            assert await intercepted(open_method) is unary
        refused: list[tuple[tuple[tuple[str, str | bytes], ...], str]] = [
            ((), "missing API key"),
            ((("authorization", "Bearer k-three"),), "invalid API key"),
            ((("authorization", "Basic k-one"),), "missing API key"),
        ]
        for metadata, problem in refused:
            refusal = await intercepted(infer, *metadata)
            assert refusal is not unary and not refusal.request_streaming
            with refused_with(problem) as context:
                await refusal.unary_unary(pb.ModelInferRequest(), context)
        refusal = await intercepted(
            "/inference.GRPCInferenceService/ModelStreamInfer", handler=stream
        )
        assert refusal.request_streaming and refusal.response_streaming
        with refused_with("missing API key") as context:
            await refusal.stream_stream(iter(()), context)
        assert await intercepted("/no.Such/Method", handler=None) is None

    asyncio.run(scenario())


def test_the_grpc_port_is_tritons_and_set_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STOKER_SERVER__GRPC_PORT", raising=False)
    assert ServerSettings().grpc_port == 8001 and Settings().server.grpc_port == 8001
    monkeypatch.setenv("STOKER_SERVER__GRPC_PORT", "0")
    assert Settings().server.grpc_port == 0
    with pytest.raises(ValueError, match="grpc_port"):
        ServerSettings(grpc_port=70000)


MiB = 1 << 20


def test_a_refused_call_keeps_nothing_of_its_request_with_the_collector_off(
    tmp_path: Path,
) -> None:
    """Refused calls over a real grpc.aio server of the real servicers, the cyclic collector
    off: what their requests held is freed when each ends (grpc.aio keeps the exception that
    ``context.abort`` raises on the call, and its traceback held the handler's frames)."""

    async def scenario(service: InferenceService) -> int:
        server = grpc.aio.server()
        served = handlers(service, service.limits)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, served),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        infer_request = pb.ModelInferRequest(model_name="nope")
        big = 3 * MiB // 4  # under the servicer's 1 MiB limit
        infer_request.inputs.add(name="x", datatype="FP32", shape=[big // 16, 4])
        infer_request.raw_input_contents.append(bytes(big))
        unparsed = b"\x0b" + bytes(big)  # a ModelMetadataRequest that does not parse
        sent = [
            ("ModelInfer", infer_request.SerializeToString(), grpc.StatusCode.NOT_FOUND),
            (
                "ModelMetadata",
                pb.ModelMetadataRequest(name="n" * big).SerializeToString(),
                grpc.StatusCode.NOT_FOUND,
            ),
            ("ModelMetadata", unparsed, grpc.StatusCode.INVALID_ARGUMENT),
        ]
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:

                async def refuse_all() -> None:
                    for method, request, code in sent:
                        call: Any = channel.unary_unary(f"/{SERVICE}/{method}")
                        with pytest.raises(grpc.aio.AioRpcError) as refused:
                            await call(request)
                        assert refused.value.code() == code
                        assert len(refused.value.details() or "") < 1024

                await refuse_all()  # once first: what a first call sets up stays
                gc.collect()
                gc.disable()
                tracemalloc.start()
                try:
                    before = tracemalloc.get_traced_memory()[0]
                    for _ in range(8):
                        await refuse_all()
                    return tracemalloc.get_traced_memory()[0] - before
                finally:
                    tracemalloc.stop()
                    gc.enable()
        finally:
            await server.stop(0)

    held = with_service(tmp_path, scenario)
    # 24 refused requests of 0.75 MiB each went through: none of them may stay.
    assert held < 2 * MiB, f"{held / MiB:.1f} MiB still held"


async def until(condition: Callable[[], bool]) -> None:
    """Wait, with a generous bound, until ``condition`` holds."""
    deadline = asyncio.get_running_loop().time() + 60
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the state never came"
        await asyncio.sleep(0.01)


def test_a_stream_reads_no_further_while_its_answers_wait() -> None:
    """A client that does not read its answers is not read further than the stream's window:
    each answer it reads lets one more request in, and what was held is given back."""
    plane = LendingPlane(4096)
    service = InferenceService(cast(DataPlane, plane), LIMIT, CallLimits(LimitSettings()))
    pulled = 0

    async def requests() -> AsyncIterator[bytes]:
        nonlocal pulled
        for i in range(3 * STREAM_WINDOW):
            pulled += 1
            yield tiny_request(np.ones((1, 4), np.float32), f"r{i}")

    async def scenario() -> None:
        stream = service.ModelStreamInfer(requests(), cast(Any, Context()))
        await anext(stream)  # one answer read, then none
        await until(lambda: len(plane.seen) == pulled)  # all it took are answered
        assert pulled == STREAM_WINDOW
        await anext(stream)  # one more read: one more request taken, and no other
        await until(lambda: pulled > STREAM_WINDOW and len(plane.seen) == pulled)
        assert pulled == STREAM_WINDOW + 1
        await stream.aclose()
        assert service.limits.message_bytes.held == 0

    asyncio.run(scenario())
