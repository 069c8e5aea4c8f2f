"""A front end's shared-memory arena and where it puts a decoded request's tensors.

The arena is real POSIX shared memory (``multiprocessing.shared_memory``); inputs are
decoded by the real V2 codec from bodies read into a lent slot, as a front end reads them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import onnx
import orjson
import pytest
import yaml

from app import wire
from app.contract import Contract, Frame, Part, Uploads, decode_infer
from app.engine.local import CONTROL, LocalEngine, operation
from app.engine.process import EngineServer
from app.errors import BadRequest, NotImplementedHere, Unavailable
from app.frontend.arena import PAGE, Arena, ArenaShare, address, place_inputs
from app.frontend.links import EngineLink
from app.frontend.plane import ENGINE_REGIONS, DataPlane, ForwardToEngine
from app.frontend.remote import RemoteEngine
from app.protocol import RequestedOutput
from app.settings import Settings
from app.tensor_data import unpack_tensor
from engines.preprocess import ImagePreprocess
from engines.spec import ModelSpec, TensorSpec
from tests.conftest import TINY_BIAS, TINY_WEIGHTS, tiny_onnx

SPEC = ModelSpec(
    "two",
    (TensorSpec("a", "FP32", (4,)), TensorSpec("b", "INT64", (2,))),
    (TensorSpec("y", "FP32", (1,)),),
    max_batch_size=8,
)
CONTRACT = Contract("two", "fp32", SPEC, None, 1)


@pytest.fixture
def arena() -> Iterator[Arena]:
    made = Arena(slots=4, slot_bytes=4 * PAGE)  # 16 pages, at most 4 to one body
    yield made
    made.close()


def test_small_bodies_share_the_arena_and_large_ones_get_contiguous_pages(arena: Arena) -> None:
    small = [arena.lend(100) for _ in range(8)]
    assert all(s is not None and len(s.view) == PAGE for s in small)
    offsets = [s.offset for s in small if s is not None]
    assert len(set(offsets)) == 8
    assert arena.lend(4 * PAGE + 1) is None  # larger than a slot, whatever is free
    big = arena.lend(3 * PAGE + 5)
    assert big is not None and len(big.view) == 4 * PAGE
    assert arena.free_bytes == 4 * PAGE


def test_a_body_waits_for_pages_in_a_full_arena_then_gets_them(arena: Arena) -> None:
    """Back-pressure: with every page lent, a body waits; the pages given back go to the
    waiters in order of arrival; one whose bound passes gets 503; a waiter whose client
    leaves takes nothing; every page comes back."""

    async def scenario() -> None:
        held = [arena.lend(4 * PAGE) for _ in range(4)]
        assert all(h is not None for h in held) and arena.free_bytes == 0
        first = asyncio.create_task(arena.lend_within(3 * PAGE, 30))
        second = asyncio.create_task(arena.lend_within(PAGE, 30))
        late = asyncio.create_task(arena.lend_within(4 * PAGE, 0.05))
        await asyncio.sleep(0)
        assert not first.done() and not second.done()
        with pytest.raises(Unavailable, match=r"had no room for a 16384-byte body for 0\.05 s"):
            await late
        assert held[0] is not None
        arena.give_back(held[0])  # 4 pages: the first waiter's 3, then the second's 1
        got = [await first, await second]
        assert [len(s.view) if s else 0 for s in got] == [3 * PAGE, PAGE]
        assert await arena.lend_within(5 * PAGE, 1) is None  # larger than a slot: no wait
        gone = asyncio.create_task(arena.lend_within(2 * PAGE, 30))
        await asyncio.sleep(0)
        gone.cancel()  # its client left while it waited
        with pytest.raises(asyncio.CancelledError):
            await gone
        for slot in [*held[1:], *got]:
            assert slot is not None
            arena.give_back(slot)
        assert arena.free_bytes == 16 * PAGE

    asyncio.run(scenario())


def test_a_waiting_body_does_not_let_later_ones_overtake_it(arena: Arena) -> None:
    """While a body waits, a new one that would fit the pages left does not take them from
    it: it queues behind (a stream of small bodies cannot starve a large one)."""

    async def scenario() -> None:
        held = [arena.lend(4 * PAGE) for _ in range(3)] + [arena.lend(2 * PAGE)]
        big = asyncio.create_task(arena.lend_within(4 * PAGE, 30))
        await asyncio.sleep(0)
        small = asyncio.create_task(arena.lend_within(PAGE, 30))  # 2 pages free, but queued
        await asyncio.sleep(0)
        assert not big.done() and not small.done()
        last = held[3]
        assert last is not None
        arena.give_back(last)  # 4 free: the big one's
        lent = await big
        assert lent is not None and len(lent.view) == 4 * PAGE
        assert not small.done()
        first = held[0]
        assert first is not None
        arena.give_back(first)
        lent = await small
        assert lent is not None and len(lent.view) == PAGE

    asyncio.run(scenario())


def test_one_address_holds_at_most_its_share_of_the_arena(arena: Arena) -> None:
    """With a share of 0.5, an address holding 8 of the 16 pages waits for its own pages for
    its next body, holding up no one: another address's bodies, queued behind it, are lent
    pages at once; the first address's waiting body gets pages when it gives some back, and
    one whose wait runs out is told its share."""

    async def scenario() -> None:
        first = [await arena.lend_within(4 * PAGE, 30, "10.0.0.1", 0.5) for _ in range(2)]
        third = asyncio.create_task(arena.lend_within(PAGE, 30, "10.0.0.1", 0.5))
        await asyncio.sleep(0)
        assert not third.done()  # 8 pages are free, but not for this address
        other = await arena.lend_within(4 * PAGE, 30, "10.0.0.2", 0.5)  # not held up
        assert other is not None
        with pytest.raises(ArenaShare, match=r"past its share \(0\.5\) for 0\.05 s"):
            await arena.lend_within(PAGE, 0.05, "10.0.0.1", 0.5)
        assert first[0] is not None
        arena.give_back(first[0])
        again = await third
        assert again is not None and len(again.view) == PAGE
        for slot in (first[1], other, again):
            assert slot is not None
            arena.give_back(slot)
        assert arena.free_bytes == 16 * PAGE
        assert arena._by_client == {} and arena._owners == {}  # nothing left counted

    asyncio.run(scenario())


def test_a_body_lent_in_its_turn_keeps_the_rules_of_one_that_waits(arena: Arena) -> None:
    """``lend_now`` (an upload call sent in its own turn) lends at once only what
    ``lend_within`` would lend at once: not while another body waits (no overtaking), not
    past the address's share, not more than a slot; it counts the address's pages as the
    other does, and gives None (the caller then waits in a task) instead of waiting."""

    async def scenario() -> None:
        mine = arena.lend_now(4 * PAGE, "10.0.0.1", 0.5)
        assert mine is not None and arena._by_client == {"10.0.0.1": 4}
        assert arena.lend_now(5 * PAGE) is None  # larger than a slot
        more = arena.lend_now(4 * PAGE, "10.0.0.1", 0.5)
        assert more is not None
        assert arena.lend_now(PAGE, "10.0.0.1", 0.5) is None  # 8 of 16 pages: its share
        other = arena.lend_now(4 * PAGE, "10.0.0.2", 0.5)
        assert other is not None  # another address is not held up
        waiting = asyncio.create_task(arena.lend_within(4 * PAGE, 30))  # 4 pages free, 4+ wanted
        lent = arena.lend(3 * PAGE)  # 1 page left, and a body waits for 4
        await asyncio.sleep(0)
        assert not waiting.done() and lent is not None
        assert arena.lend_now(PAGE) is None  # it would overtake the waiting body
        arena.give_back(lent)
        assert await waiting is not None
        for slot in (mine, more, other, waiting.result()):
            assert slot is not None
            arena.give_back(slot)
        assert arena.free_bytes == 16 * PAGE and arena._by_client == {}

    asyncio.run(scenario())


def test_files_a_reload_refused_go_once_more_only_while_someone_waits() -> None:
    """An upload call's reply, for its requests (``Gatherer._uploads_answered``): files a
    reload refused are sent once more as they are (its answer reaches the requests);
    rows made with the replaced preprocessing get the refusal (the data plane makes them
    again); and when every request has gone away nothing is sent again."""
    from app.contract import Classified
    from app.errors import Reloaded
    from app.frontend.gathering import Callers, Gatherer

    async def scenario() -> tuple[list[int], Any, Any]:
        sent: list[int] = []
        answer = Classified("m", "fp32", [[{"label": "espresso"}]])

        async def again() -> Classified:
            sent.append(1)
            return answer

        refused = Reloaded("model 'm' was reloaded")
        files: Callers[Classified] = Callers()
        waiter = asyncio.ensure_future(files.wait())
        await asyncio.sleep(0)
        Gatherer._uploads_answered(files, again, False, refused)
        got_files = await asyncio.wait_for(waiter, 10)
        rows: Callers[Classified] = Callers()
        row_waiter = asyncio.ensure_future(rows.wait())
        await asyncio.sleep(0)
        Gatherer._uploads_answered(rows, again, True, refused)
        with pytest.raises(Reloaded):
            await asyncio.wait_for(row_waiter, 10)
        gone: Callers[Classified] = Callers()
        left = asyncio.ensure_future(gone.wait())
        await asyncio.sleep(0)
        left.cancel()
        await asyncio.sleep(0)
        assert gone.waiting == 0
        Gatherer._uploads_answered(gone, again, False, refused)
        await asyncio.sleep(0.05)
        return sent, got_files, gone.stop

    sent, got_files, stop = asyncio.run(scenario())
    assert sent == [1]  # once, for the files someone waited for
    assert got_files == (0, Classified("m", "fp32", [[{"label": "espresso"}]]))
    assert stop is None  # nothing sent for the call nobody waits for


def test_returned_pages_join_their_neighbours_and_a_second_return_is_a_no_op(
    arena: Arena,
) -> None:
    slots = [arena.lend(PAGE) for _ in range(16)]
    assert arena.lend(1) is None  # full
    for i in (1, 3, 2):  # pages 1..3 come back out of order
        slot = slots[i]
        assert slot is not None
        arena.give_back(slot)
    again = slots[2]
    assert again is not None
    arena.give_back(again)  # no-op: not counted twice
    assert arena.free_bytes == 3 * PAGE
    joined = arena.lend(3 * PAGE)
    assert joined is not None and joined.offset == PAGE  # one run of three pages


def test_what_a_slot_holds_is_shared_with_whoever_maps_the_arena(arena: Arena) -> None:
    from multiprocessing import shared_memory

    slot = arena.lend(10)
    assert slot is not None
    slot.view[:5] = b"hello"
    other = shared_memory.SharedMemory(name=arena.name)
    try:
        assert other.buf is not None
        assert bytes(other.buf[slot.offset : slot.offset + 5]) == b"hello"
    finally:
        other.close()


def binary_body(a: np.ndarray, b: np.ndarray) -> tuple[bytes, int]:
    header = orjson.dumps(
        {
            "inputs": [
                {"name": "a", "datatype": "FP32", "shape": list(a.shape),
                 "parameters": {"binary_data_size": a.nbytes}},
                {"name": "b", "datatype": "INT64", "shape": list(b.shape),
                 "parameters": {"binary_data_size": b.nbytes}},
            ]
        }
    )  # fmt: skip
    return header + a.tobytes() + b.tobytes(), len(header)


def engine_reads(described: list[wire.TensorRef], source: memoryview) -> dict[str, np.ndarray]:
    """What the engine rebuilds from the descriptors (``app.engine.process``)."""
    return {
        t.name: unpack_tensor(
            t.name, t.datatype, list(t.shape), source[t.offset : t.offset + t.size]
        )
        for t in described
    }


def test_binary_inputs_stay_where_the_body_put_them(arena: Arena) -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.arange(6, dtype=np.int64).reshape(3, 2)
    body, length = binary_body(a, b)
    slot = arena.lend(len(body))
    assert slot is not None
    slot.view[: len(body)] = body
    decoded = decode_infer(CONTRACT, slot.view[: len(body)], length, 64, ENGINE_REGIONS)
    described, payload = place_inputs(decoded.request.inputs, slot, len(body))
    assert payload == b""
    assert [d.offset for d in described] == [length, length + a.nbytes]  # no copy: in the body
    got = engine_reads(described, slot.view)
    np.testing.assert_array_equal(got["a"], a)
    np.testing.assert_array_equal(got["b"], b)


def test_an_address_is_where_numpy_sees_the_first_byte_writable_or_not(arena: Arena) -> None:
    slot = arena.lend(4096)
    assert slot is not None
    frozen = bytes(64)
    for buffer in (slot.view, slot.view[100:200], memoryview(frozen), memoryview(frozen)[8:]):
        assert address(buffer) == np.frombuffer(buffer, np.uint8).__array_interface__["data"][0]
    assert address(slot.view[100:]) == address(slot.view) + 100
    assert address(np.frombuffer(slot.view, np.float32, 4, 64).data) == address(slot.view) + 64


def test_json_inputs_are_copied_into_the_slot_over_the_body(arena: Arena) -> None:
    body = orjson.dumps(
        {
            "inputs": [
                {"name": "a", "datatype": "FP32", "shape": [1, 4], "data": [1.5, 2, 3, 4]},
                {"name": "b", "datatype": "INT64", "shape": [1, 2], "data": [7, -8]},
            ]
        }
    )
    slot = arena.lend(len(body))
    assert slot is not None
    slot.view[: len(body)] = body
    decoded = decode_infer(CONTRACT, slot.view[: len(body)], None, 64, ENGINE_REGIONS)
    described, payload = place_inputs(decoded.request.inputs, slot, len(body))
    assert payload == b"" and described[0].offset == 0
    got = engine_reads(described, slot.view)
    np.testing.assert_array_equal(got["a"], [[1.5, 2, 3, 4]])
    np.testing.assert_array_equal(got["b"], [[7, -8]])


def test_mixed_inputs_are_copied_after_the_body_and_too_many_bytes_go_in_the_payload(
    arena: Arena,
) -> None:
    a = np.full((2, 4), 0.25, np.float32)
    header = orjson.dumps(
        {
            "inputs": [
                {"name": "a", "datatype": "FP32", "shape": [2, 4],
                 "parameters": {"binary_data_size": a.nbytes}},
                {"name": "b", "datatype": "INT64", "shape": [2, 2], "data": [1, 2, 3, 4]},
            ]
        }
    )  # fmt: skip
    body = header + a.tobytes()
    slot = arena.lend(len(body))
    assert slot is not None
    slot.view[: len(body)] = body
    decoded = decode_infer(CONTRACT, slot.view[: len(body)], len(header), 64, ENGINE_REGIONS)
    described, payload = place_inputs(decoded.request.inputs, slot, len(body))
    assert payload == b""
    assert described[0].offset == len(header) and described[1].offset >= len(body)  # after the body
    got = engine_reads(described, slot.view)
    np.testing.assert_array_equal(got["b"], [[1, 2], [3, 4]])
    np.testing.assert_array_equal(got["a"], a)

    # Without a slot (the arena was full) every input travels in the payload.
    described, payload = place_inputs(decoded.request.inputs, None, len(body))
    got = engine_reads(described, memoryview(payload))
    np.testing.assert_array_equal(got["a"], a)
    np.testing.assert_array_equal(got["b"], [[1, 2], [3, 4]])


def test_a_request_naming_a_shared_memory_region_goes_to_the_engine() -> None:
    body = orjson.dumps(
        {
            "inputs": [
                {"name": "a", "datatype": "FP32", "shape": [1, 4],
                 "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 16}},
                {"name": "b", "datatype": "INT64", "shape": [1, 2], "data": [1, 2]},
            ]
        }
    )  # fmt: skip
    with pytest.raises(ForwardToEngine):
        decode_infer(CONTRACT, body, None, 64, ENGINE_REGIONS)


def test_a_contract_survives_the_trip_to_a_front_end() -> None:
    again = Contract.from_json(orjson.loads(orjson.dumps(CONTRACT.as_json())))
    assert again == CONTRACT
    prep = ImagePreprocess(resize_shorter=300, crop=240, layout="NHWC", datatype="UINT8")
    with_rows = dataclasses.replace(CONTRACT, row_preprocess=prep)
    again = Contract.from_json(orjson.loads(orjson.dumps(with_rows.as_json())))
    assert again == with_rows and again.row_preprocess == prep


def test_slot_copies_that_do_not_fit_go_in_the_payload() -> None:
    arena = Arena(slots=1, slot_bytes=PAGE)
    try:
        body = orjson.dumps(
            {
                "inputs": [
                    {"name": "a", "datatype": "FP32", "shape": [300, 4], "data": [0.5] * 1200},
                    {"name": "b", "datatype": "INT64", "shape": [300, 2], "data": [3] * 600},
                ]
            }
        )
        slot = arena.lend(PAGE)  # a page: the body fits, its 9,600 bytes of tensors do not
        assert slot is not None
        contract = Contract(
            "two", "fp32", ModelSpec("two", SPEC.inputs, SPEC.outputs, 512), None, 1
        )
        decoded = decode_infer(contract, body, None, 64, ENGINE_REGIONS)
        described, payload = place_inputs(decoded.request.inputs, slot, len(body))
        assert len(payload) == 300 * 4 * 4 + 300 * 2 * 8
        got = engine_reads(described, memoryview(payload))
        np.testing.assert_array_equal(got["a"], np.full((300, 4), 0.5, np.float32))
        np.testing.assert_array_equal(got["b"], np.full((300, 2), 3))
        arena.give_back(slot)
    finally:
        arena.close()


def tiny_repository(tmp_path: Path, max_batch: int, **sections: Any) -> Settings:
    """Settings serving the tiny model from ``tmp_path`` (no batching delay)."""
    folder = tmp_path / "repo" / "tiny"
    folder.mkdir(parents=True)
    onnx.save(tiny_onnx(), str(folder / "model.onnx"))
    config = {"max_batch_size": max_batch, "dynamic_batching": {"max_queue_delay_us": 0}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return Settings(
        models={"repository": tmp_path / "repo"},  # type: ignore[arg-type]
        store={"path": tmp_path / "store"},  # type: ignore[arg-type]
        **sections,
    )


@contextlib.asynccontextmanager
async def plane_before_engine(
    settings: Settings, control: Path, server_class: type[EngineServer] = EngineServer
) -> AsyncIterator[tuple[RemoteEngine, DataPlane]]:
    """A real engine (``server_class`` serving a ``LocalEngine`` on the socket ``control``),
    a ``RemoteEngine`` to it and a ``DataPlane`` over that; all stopped at the end."""
    engine = LocalEngine(settings)
    await engine.start()
    server = await server_class(engine).listen(str(control))
    remote = RemoteEngine(settings, [("", control)])
    front = DataPlane(settings, remote, across=True)
    try:
        await front.start()
        yield remote, front
    finally:
        await front.stop()
        server.close()
        await engine.stop()


def watch_sending(remote: RemoteEngine, front: DataPlane, written: list[bool]) -> None:
    """Note in ``written``, at each send of what the gatherer holds, whether bytes reached
    the engine link's transport during it (sent in that turn, not by a task after it)."""
    link = remote._links[0]
    assert link.writer is not None
    writes: list[int] = []
    transport_write = link.writer.writer.write

    def write(data: Any) -> None:
        writes.append(len(data))
        transport_write(data)

    link.writer.writer.write = write  # type: ignore[method-assign]
    send_all = front.gatherer._send_all

    def sending() -> None:
        before = len(writes)
        send_all()
        written.append(len(writes) > before)

    front.gatherer._send_all = sending  # type: ignore[method-assign]


def test_requests_of_one_turn_cross_as_one_frame_and_each_gets_its_own_rows(
    tmp_path: Path,
) -> None:
    """A real data plane over a real remote engine client before a real engine server (the
    tiny model): five requests started in one turn of the loop, three binary in the arena
    and two JSON too large for a slot (over the socket, their tensors in the frame's
    payload), reach the engine as one frame of five items; each gets its own rows; one whose
    caller leaves while the frame is in the engine leaves the others answered, and every
    page of the arena is free again."""
    settings = tiny_repository(tmp_path, 64, server={"shm_slots": 2, "shm_slot_bytes": 16 * PAGE})
    control = tmp_path / "engine.sock"
    frames: list[int] = []

    def binary(x: np.ndarray) -> bytes:
        header = orjson.dumps(
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                         "parameters": {"binary_data_size": x.nbytes}}]}
        )  # fmt: skip
        return header + x.tobytes()

    def json_body(x: np.ndarray) -> bytes:
        tensor = {"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.tolist()}
        # An id longer than a slot: the body travels over the socket.
        return orjson.dumps({"id": "j" * (20 * PAGE), "inputs": [tensor]})

    xs = [np.full((n, 4), float(n), np.float32) for n in (1, 2, 3, 20, 30)]

    async def main() -> list[np.ndarray | None]:
        release, arrived = asyncio.Event(), asyncio.Event()

        class Held(EngineServer):
            """Holds each frame until the test lets it go."""

            async def _run(self, connection: Any, call: wire.Run, payload: bytes) -> Any:
                frames.append(len(call.items))
                arrived.set()
                await release.wait()
                return await super()._run(connection, call, payload)

        async with plane_before_engine(settings, control, Held) as (remote, front):
            await remote.contract("tiny", None)  # asked once, before the five

            async def one(i: int) -> np.ndarray:
                x = xs[i]
                body = binary(x) if i < 3 else json_body(x)
                async with front.body_buffer(len(body)) as slot:
                    view: bytes | memoryview = body
                    if slot is not None:
                        slot.view[: len(body)] = body
                        view = slot.view[: len(body)]
                    assert (slot is None) == (i >= 3)
                    length = len(body) - x.nbytes if i < 3 else None
                    answer = await front.infer("tiny", None, view, length, slot)
                document = orjson.loads(answer.content)
                return np.array(document["outputs"][0]["data"], np.float32).reshape(-1, 3)

            tasks = [asyncio.ensure_future(one(i)) for i in range(5)]
            await arrived.wait()
            tasks[1].cancel()  # its caller leaves while the frame is in the engine
            await asyncio.sleep(0.01)
            release.set()
            answers: list[np.ndarray | None] = []
            for task in tasks:
                try:
                    answers.append(await task)
                except asyncio.CancelledError:
                    answers.append(None)
            for _ in range(200):  # the cancelled one's slot comes back with the answer
                if remote.arena.free_bytes == 2 * 16 * PAGE:
                    break
                await asyncio.sleep(0.01)
            assert remote.arena.free_bytes == 2 * 16 * PAGE
            return answers

    answers = asyncio.run(main())
    assert frames == [5]
    assert answers[1] is None
    for x, y in zip(xs, answers, strict=True):
        if y is not None:
            np.testing.assert_allclose(y, x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5)


def test_a_frame_leaves_in_its_sending_turn_and_its_requests_go_on_the_turn_after_its_reply(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A front end's loop under load turns in milliseconds, so each turn between a request
    and the engine is latency. Three requests of one turn, gathered, reach the socket in
    the turn their frame is sent (not after a task and a flush of their own), and resume
    in the turn after the front end reads the engine's reply (not after a shield's and a
    task's callbacks); each gets its own rows (the tiny model, a real engine server)."""
    settings = tiny_repository(tmp_path, 64)
    control = tmp_path / "engine.sock"
    written_while_sending: list[bool] = []
    turns_after_reply: list[int] = []
    since_reply = [0]
    decode_answer = wire.decode_answer

    def count_turns() -> None:  # one a turn of the loop, from the reply's turn on
        since_reply[0] += 1
        if since_reply[0] < 10:
            asyncio.get_running_loop().call_soon(count_turns)

    def decoded(header: bytes) -> Any:
        answer = decode_answer(header)
        if isinstance(answer.reply, wire.RanReply):
            since_reply[0] = 0
            asyncio.get_running_loop().call_soon(count_turns)
        return answer

    monkeypatch.setattr(wire, "decode_answer", decoded)  # the front end's reading of a reply

    async def main() -> list[np.ndarray]:
        async with plane_before_engine(settings, control) as (remote, front):
            contract = await remote.contract("tiny", None)
            watch_sending(remote, front, written_while_sending)

            async def one(rows: int) -> np.ndarray:
                x = np.full((rows, 4), float(rows), np.float32)
                part = Part({"x": x}, rows, [RequestedOutput("y", True)])
                _, outputs = await front.gatherer.run(contract, part, None, 0, "c")
                turns_after_reply.append(since_reply[0])
                return outputs[0][1]

            return list(await asyncio.gather(*(one(rows) for rows in (1, 2, 3))))

    answers = asyncio.run(main())
    assert written_while_sending == [True]  # one frame, on the socket as it was sent
    assert turns_after_reply == [1, 1, 1]
    for rows, y in zip((1, 2, 3), answers, strict=True):
        x = np.full((rows, 4), float(rows), np.float32)
        np.testing.assert_allclose(y, x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5)


def test_timeouts_within_a_percent_share_a_frame_under_the_shortest(tmp_path: Path) -> None:
    """gRPC deadlines reach the plane as what is left of them, a different figure for each
    call: requests of one turn whose timeouts fall in one class (classes a factor of 1.01
    wide; these four are 0.08% apart and in one) still cross as one frame, which carries the
    shortest of them; a much shorter timeout, and none at all, go in frames of their own.
    Every request is answered with its own rows."""
    settings = tiny_repository(tmp_path, 64)
    control = tmp_path / "engine.sock"
    frames: list[tuple[int, int | None]] = []
    timeouts = [60_000_000, 60_000_400, 59_999_000, 59_950_000, 1_000_000, None]

    def body(x: np.ndarray, timeout: int | None) -> bytes:
        tensor = {"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.tolist()}
        document: dict[str, Any] = {"inputs": [tensor]}
        if timeout is not None:
            document["parameters"] = {"timeout": timeout}
        return orjson.dumps(document)

    xs = [np.full((i + 1, 4), float(i), np.float32) for i in range(len(timeouts))]

    async def main() -> list[np.ndarray]:
        class Recorded(EngineServer):
            async def _run(self, connection: Any, call: wire.Run, payload: bytes) -> Any:
                frames.append((len(call.items), call.timeout_us))
                return await super()._run(connection, call, payload)

        async with plane_before_engine(settings, control, Recorded) as (remote, front):
            await remote.contract("tiny", None)

            async def one(i: int) -> np.ndarray:
                answer = await front.infer("tiny", None, body(xs[i], timeouts[i]), None, None)
                document = orjson.loads(answer.content)
                return np.array(document["outputs"][0]["data"], np.float32).reshape(-1, 3)

            return list(await asyncio.gather(*(one(i) for i in range(len(timeouts)))))

    answers = asyncio.run(main())
    assert sorted(frames, key=str) == sorted([(4, 59_950_000), (1, 1_000_000), (1, None)], key=str)
    for x, y in zip(xs, answers, strict=True):
        np.testing.assert_allclose(y, x @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5)


def test_a_request_goes_to_the_engine_with_the_least_work_ahead(tmp_path: Path) -> None:
    """Two engines behind one front end; the first holds its frames. Requests sent while it
    holds one go to the other, which answers them, instead of queueing behind the held one
    as a round-robin would send half of them (``RemoteEngine._choose``)."""
    settings = tiny_repository(tmp_path, 8)
    runs: dict[str, int] = {"0": 0, "1": 0}

    def body(x: np.ndarray) -> bytes:
        tensor = {"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.tolist()}
        return orjson.dumps({"inputs": [tensor]})

    async def main() -> list[np.ndarray]:
        release, arrived = asyncio.Event(), asyncio.Event()

        class Counted(EngineServer):
            def __init__(self, engine: LocalEngine, label: str, hold: bool) -> None:
                super().__init__(engine)
                self.label, self.hold = label, hold

            async def _run(self, connection: Any, call: wire.Run, payload: bytes) -> Any:
                runs[self.label] += len(call.items)
                if self.hold:
                    arrived.set()
                    await release.wait()
                return await super()._run(connection, call, payload)

        engines = [LocalEngine(settings), LocalEngine(settings)]
        servers = []
        for label, engine in zip(("0", "1"), engines, strict=True):
            await engine.start()
            path = str(tmp_path / f"engine-{label}.sock")
            channel = Counted(engine, label, hold=label == "0")
            servers.append(await channel.listen(path))
        links = [("0", tmp_path / "engine-0.sock"), ("1", tmp_path / "engine-1.sock")]
        front = DataPlane(settings, RemoteEngine(settings, links), across=True)
        await front.start()
        try:
            for _ in range(200):  # both polled ready (the poll runs every 0.25 s)
                if all(e["ready"] for e in front.engines()):
                    break
                await asyncio.sleep(0.05)

            async def one(i: int) -> np.ndarray:
                x = np.full((1, 4), float(i), np.float32)
                answer = await front.infer("tiny", None, body(x), None)
                document = orjson.loads(answer.content)
                return np.array(document["outputs"][0]["data"], np.float32).reshape(-1, 3)

            held = asyncio.ensure_future(one(0))  # both idle: the first engine takes it
            await arrived.wait()
            # One at a time, while the first engine holds its frame (a request sent there
            # would wait for the release: the timeout fails the test instead of hanging it).
            answers = [await asyncio.wait_for(one(i), 10) for i in range(1, 11)]
            assert runs == {"0": 1, "1": 10}
            release.set()
            return [await held, *answers]
        finally:
            await front.stop()
            for server in servers:
                server.close()
            for engine in engines:
                await engine.stop()

    answers = asyncio.run(main())
    for i, y in enumerate(answers):
        np.testing.assert_allclose(
            y, np.full((1, 4), float(i)) @ TINY_WEIGHTS + TINY_BIAS, rtol=1e-5
        )


class Open:
    """A writer that is never closing: a link that counts as connected."""

    def is_closing(self) -> bool:
        return False

    def flush(self) -> None:
        pass


def state(queued: int, *serving: tuple[str, str, int]) -> wire.EngineState:
    return wire.EngineState(True, True, queued, tuple(wire.Serving(*s) for s in serving))


def not_ready(link: EngineLink) -> None:
    link.state = msgspec.structs.replace(link.state, ready=False)


def test_requests_go_only_to_engines_that_serve_their_version(tmp_path: Path) -> None:
    """The engine of one GPU refused a version (it did not fit there) or lost it to a fault:
    requests for it go to the engine that serves it, whatever the load; other versions, and
    requests naming no version, still go by load; a version no engine serves goes by load
    too, to be answered with the reason."""
    front = RemoteEngine(Settings(), [("0", tmp_path / "a.sock"), ("1", tmp_path / "b.sock")])
    first, second = front._links
    first.state = state(0, ("m", "fp32", 8))
    second.state = state(5, ("m", "fp32", 8), ("m", "int8", 8))
    for link in (first, second):
        link.writer = Open()  # type: ignore[assignment]
    try:
        assert front._choose("m", "int8") is second  # the only one serving it, though busier
        assert front._choose("m", "fp32") is first  # both serve it: the less loaded
        assert front._choose("m", None) is first
        assert front._choose(None, None) is first
        assert front._choose("gone", None) is first  # nobody serves it: it answers why
        not_ready(first)
        assert front._choose("m", "fp32") is second
    finally:
        front.arena.close()


def shrunk_engines(tmp_path: Path) -> tuple[RemoteEngine, EngineLink, EngineLink]:
    """A front end before two engines that shrank version fp16 of model m to different max
    batches (GPUs of different memory, ``gpu.on_out_of_memory: shrink``): 64 on the idle
    one, 256 on the busy one. Each answers ``Describe`` with its own contract."""
    front = RemoteEngine(Settings(), [("0", tmp_path / "a.sock"), ("1", tmp_path / "b.sock")])
    front.linked.set()  # as its start would, once an engine welcomed it
    small, large = front._links
    for link, queued, most in ((small, 0, 64), (large, 9, 256)):
        link.writer = Open()  # type: ignore[assignment]
        link.state = state(queued, ("m", "fp16", most))

    def describer(link: EngineLink) -> Any:
        async def describe(call: wire.Call, expected: Any, payload: bytes = b"") -> Any:
            assert isinstance(call, wire.Describe)
            most = link.max_batch("m", "fp16")
            spec = ModelSpec("m", SPEC.inputs, SPEC.outputs, most)
            return wire.Value(Contract("m", "fp16", spec, None, 1).as_json())

        return describe

    for link in (small, large):
        link.call = describer(link)  # type: ignore[method-assign]
    return front, small, large


def test_a_request_larger_than_one_engines_max_batch_goes_to_one_that_takes_it(
    tmp_path: Path,
) -> None:
    """A request of more rows than the smaller engine takes goes to the larger, however
    busy; one both take goes by load; with the larger one down it is a 503 to retry, not
    the smaller one's 400; each engine says its max."""
    front, small, large = shrunk_engines(tmp_path)
    try:
        assert front._choose("m", "fp16", rows=200) is large
        assert front._choose("m", "fp16", rows=64) is small
        assert front._choose("m", None, rows=65) is large
        assert (small.max_batch("m", "fp16"), large.max_batch("m", "fp16")) == (64, 256)
        assert small.max_batch("m", "int8") == 0
        not_ready(large)
        with pytest.raises(Unavailable, match="no engine that takes 200 rows of m"):
            front._choose("m", "fp16", rows=200)
        assert front._choose("m", "fp16", rows=64) is small
    finally:
        front.arena.close()


def test_the_contract_is_the_largest_engines_and_is_asked_again_when_one_comes_back(
    tmp_path: Path,
) -> None:
    """The contract a front end decodes with (its max batch bounds a request's rows) is that
    of the engine taking the most rows, even when the idle, smaller one answers first; asked
    while only the smaller is ready, it is asked again once the larger is back."""
    front, _, large = shrunk_engines(tmp_path)

    async def max_batch(version: str | None) -> int:
        return (await front.contract("m", version)).spec.max_batch_size

    try:
        assert asyncio.run(max_batch("fp16")) == 256
        assert asyncio.run(max_batch(None)) == 256  # the default version, the same rule
        ready = large.state
        not_ready(large)
        front._contracts.clear()
        assert asyncio.run(max_batch("fp16")) == 64
        assert asyncio.run(max_batch("fp16")) == 64  # kept while the larger is down
        large.state = ready
        assert asyncio.run(max_batch("fp16")) == 256
    finally:
        front.arena.close()


def test_a_frame_gathers_no_more_rows_than_its_engine_takes(tmp_path: Path) -> None:
    """Requests of one loop turn that share a batch gather into one frame of the contract's
    max batch (256, the larger engine's), which the remote client sends as frames of at most
    the chosen engine's max batch (64 on the idle, smaller engine): three requests of 40
    rows cross as frames of 40 rows each, every request answered with its own rows."""
    front, small, large = shrunk_engines(tmp_path)
    plane = DataPlane(Settings(), front, across=True)
    sent: list[tuple[EngineLink, int]] = []

    def capture(link: EngineLink) -> Any:
        def request(call: wire.Call, payload: bytes = b"", then: Any = None) -> int:
            assert isinstance(call, wire.Run)
            rows = [item.rows for item in call.items]
            sent.append((link, sum(rows)))
            data, items = b"", []
            for n in rows:  # each request's output: n rows of the value n
                y = np.full((n, 1), n, np.float32)
                ref = wire.TensorRef("y", "FP32", (n, 1), len(data), y.nbytes)
                items.append(wire.ItemReply((ref,), False))
                data += y.tobytes()
            reply = (wire.RanReply("m", "fp16", tuple(items)), data)
            assert then is not None  # a frame's reply is handed over as it is read
            asyncio.get_running_loop().call_soon(then, reply)  # as the link's reader would
            return len(sent)

        return request

    for link in (small, large):
        link.request = capture(link)  # type: ignore[method-assign]
    contract = Contract("m", "fp16", ModelSpec("m", SPEC.inputs, SPEC.outputs, 256), None, 1)

    def part(rows: int) -> Part:
        inputs: dict[str, np.ndarray] = {
            "a": np.zeros((rows, 4), np.float32),
            "b": np.zeros((rows, 2), np.int64),
        }
        return Part(inputs, rows, [RequestedOutput("y", True)])

    async def three() -> list[Any]:
        return list(
            await asyncio.gather(
                *(plane.gatherer.run(contract, part(rows), 0, 0, "c") for rows in (40, 40, 40))
            )
        )

    try:
        answers = asyncio.run(three())
        assert [outputs[0][1].shape for _, outputs in answers] == [(40, 1)] * 3
        assert sent and all(rows <= 64 for _, rows in sent)
        assert sum(rows for _, rows in sent) == 120
        assert {link for link, _ in sent} == {small}
    finally:
        front.arena.close()


def test_a_frame_whose_second_piece_cannot_be_sent_fails_once_its_first_is_answered(
    tmp_path: Path,
) -> None:
    """A frame of three 40-row requests crosses as three pieces (the engine takes 64 rows).
    The second cannot be sent (a header the channel refuses): the first, already sent, is
    cancelled and still waited for; once the engine answers it, the frame's requests get the
    error, once, and nothing is left counted in flight."""
    from app.channel import FrameTooLarge

    front, small, large = shrunk_engines(tmp_path)
    large.state = state(0, ("m", "fp16", 64))
    sent: list[Any] = []
    cancelled: list[int] = []
    delivered: list[Any] = []

    def request(call: wire.Call, payload: bytes = b"", then: Any = None) -> int:
        if sent:
            raise FrameTooLarge(2 << 20)
        sent.append(then)
        return 7

    for link in (small, large):
        link.request = request  # type: ignore[method-assign]
        link.cancel = cancelled.append  # type: ignore[method-assign,assignment]

    def part() -> Part:
        inputs: dict[str, np.ndarray] = {
            "a": np.zeros((40, 4), np.float32),
            "b": np.zeros((40, 2), np.int64),
        }
        return Part(inputs, 40, [RequestedOutput("y", True)])

    frame = Frame("m", "fp16", [part(), part(), part()], None, 0, "c", 1)
    try:
        front.submit(frame, delivered.append)
        assert len(sent) == 1 and cancelled == [7] and delivered == []
        sent[0]((wire.CANCELLED, b""))  # the engine's word on the first piece
        (error,) = delivered
        assert isinstance(error, FrameTooLarge)
        assert small.in_flight == 0 and large.in_flight == 0
    finally:
        front.arena.close()


def test_every_front_end_learns_of_a_reload_another_one_asked_for(tmp_path: Path) -> None:
    """Two front ends' engine clients before one real engine: one reloads the tiny model with
    a smaller max batch and drops its cached contract at once; the other, which cached the
    old contract, drops it when a poll brings the engine's new generation; a request it
    decoded against the old one meanwhile is refused before it runs and decoded again. An
    unload reaches the engine the same way, and the index is the engine's."""
    settings = tiny_repository(tmp_path, 8, server={"shm_slots": 2, "shm_slot_bytes": 16 * PAGE})
    settings = settings.model_copy(
        update={
            "models": settings.models.model_copy(
                update={"control": "explicit", "control_without_keys": True}
            )
        }
    )
    control = tmp_path / "engine.sock"
    x = np.ones((6, 4), np.float32)
    body = orjson.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [6, 4], "data": x.tolist()}]}
    )

    async def main() -> tuple[int, int, int, list[str]]:
        engine = LocalEngine(settings)
        await engine.start()
        server = await EngineServer(engine).listen(str(control))
        one = RemoteEngine(settings, [("", control)], "stoker-test-one")
        other = RemoteEngine(settings, [("", control)], "stoker-test-other")
        planes = [DataPlane(settings, one, across=True), DataPlane(settings, other, across=True)]
        try:
            for plane in planes:
                await plane.start()
            for _ in range(400):  # their first polls
                if one.ready and other.ready:
                    break
                await asyncio.sleep(0.01)
            cached = (await other.contract("tiny")).spec.max_batch_size
            await planes[0].control("load", "tiny", {"max_batch_size": 4, "runners": 1})
            mine = (await one.contract("tiny")).spec.max_batch_size
            # Six rows fit the contract the other front end cached, not the served one: it
            # is refused as the new contract refuses it, not run on the old terms.
            with pytest.raises(BadRequest, match="1 to 4"):
                await planes[1].infer("tiny", None, body, None)
            for _ in range(400):  # the other front end's next polls: generation moved
                if (await other.contract("tiny")).spec.max_batch_size == 4:
                    break
                await asyncio.sleep(0.01)
            learned = (await other.contract("tiny")).spec.max_batch_size
            await planes[1].control("unload", "tiny")
            states = [item["state"] for item in await other.control("repository_index")]
            return cached, mine, learned, states
        finally:
            for plane in planes:
                await plane.stop()
            server.close()
            await engine.stop()

    assert asyncio.run(main()) == (8, 4, 4, ["UNAVAILABLE"])


def test_the_arena_is_full_while_less_than_a_slot_is_free(arena: Arena) -> None:
    """Readiness reads ``full_since``: set once fewer than a largest body's pages are free,
    kept while they stay so, cleared when a slot's worth is back."""
    first = arena.lend(4 * PAGE)
    second = arena.lend(4 * PAGE)
    third = arena.lend(4 * PAGE)
    assert first and second and third and arena.full_since is None  # 4 pages still free
    fourth = arena.lend(PAGE)
    assert fourth is not None and arena.full_since is not None
    since = arena.full_since
    arena.give_back(fourth)
    assert arena.full_since is None  # 4 free again
    fourth = arena.lend(2 * PAGE)
    assert fourth is not None and arena.full_since is not None and arena.full_since >= since
    for slot in (first, second, third, fourth):
        arena.give_back(slot)
    assert arena.full_since is None and arena.free_bytes == 16 * PAGE


def test_a_new_control_operation_is_its_engine_method_alone(tmp_path: Path) -> None:
    """An engine method marked ``@operation`` is a control operation with nothing else
    written for it: called by name in one process and, through the one generic call the
    engine's table allows (learnt at ``Hello``), from a front end; spread to every engine
    and merged where it says so (the statistics, added up); a name the engine's table lacks
    is refused with 501 on either side, and never sent."""
    settings = tiny_repository(tmp_path, 8, server={"shm_slots": 2, "shm_slot_bytes": 16 * PAGE})
    control = tmp_path / "engine.sock"

    class Echoing(LocalEngine):
        @operation(wire.Spread.ANY)
        async def echo(self, text: str, times: int = 1) -> dict[str, str]:
            return {"echo": text * times}

    async def main() -> None:
        engine = Echoing(settings)
        await engine.start()
        server = await EngineServer(engine).listen(str(control))
        front = RemoteEngine(settings, [("", control)], "stoker-test-echo")
        try:
            await front.start()
            assert await engine.control("echo", "ab", 2) == {"echo": "abab"}
            assert await front.control("echo", "ab", 2) == {"echo": "abab"}
            (stats,) = await front.control("statistics", "tiny")
            assert (
                stats["name"] == "tiny" and stats == (await engine.control("statistics", "tiny"))[0]
            )
            for client in (engine, front):
                with pytest.raises(NotImplementedHere, match="no control operation 'nope'"):
                    await client.control("nope")
        finally:
            await front.stop()
            server.close()
            await engine.stop()

    try:
        asyncio.run(main())
    finally:
        CONTROL.pop("echo", None)


def test_an_upload_call_leaves_in_its_sending_turn_or_waits_in_a_task_for_room(
    tmp_path: Path, efficientnet_dir: Path
) -> None:
    """Uploads cross as a frame does: three requests of one turn (JPEG files, for the
    engine's handler to decode) are written to the engine's socket in the turn their call
    is sent, with no task between, and each gets its own labels. Where the arena has no
    room in that turn, the call waits for room in a task instead, and is answered the same
    once pages come back; every page is free again at the end."""
    import shutil

    from tests.conftest import configure, sample_jpegs

    shutil.copytree(efficientnet_dir, tmp_path / "repo" / "efficientnet_lite0")
    configure(tmp_path / "repo" / "efficientnet_lite0", {"precisions": ["fp32"]})  # no INT8
    settings = Settings(
        models={"repository": tmp_path / "repo"},  # type: ignore[arg-type]
        store={"path": tmp_path / "store"},  # type: ignore[arg-type]
        uploads={"decode_in_front_ends": False},  # type: ignore[arg-type]
        server={"shm_slots": 2, "shm_slot_bytes": 256 * PAGE},  # type: ignore[arg-type]
    )
    control = tmp_path / "engine.sock"
    photos = sample_jpegs()[:3]
    written_while_sending: list[bool] = []

    async def main() -> tuple[list[Any], list[Any], int]:
        async with plane_before_engine(settings, control) as (remote, front):
            await remote.contract(None, None)
            watch_sending(remote, front, written_while_sending)

            async def three() -> list[Any]:
                answered = await asyncio.gather(
                    *(front.classify_images(None, None, [photo], 3) for photo in photos)
                )
                return [labels for _, _, labels in answered]

            sent_now = await three()
            # No room in this turn: every page lent elsewhere, then given back.
            taken = [remote.arena.lend(256 * PAGE) for _ in range(2)]
            assert all(taken) and remote.arena.lend_now(PAGE) is None
            later = asyncio.ensure_future(three())
            for _ in range(100):  # the call's task waits for room
                if remote.arena._waiting:
                    break
                await asyncio.sleep(0.01)
            assert remote.arena._waiting and not later.done()
            for slot in taken:
                remote.arena.give_back(slot)  # type: ignore[arg-type]
            waited = await asyncio.wait_for(later, 60)
            for _ in range(200):  # the last slot comes back with the engine's last word
                if remote.arena.free_bytes == 2 * 256 * PAGE:
                    break
                await asyncio.sleep(0.01)
            return sent_now, waited, remote.arena.free_bytes

    sent_now, waited, free = asyncio.run(main())
    assert written_while_sending[0] is True  # the first call: on the socket as it was sent
    assert written_while_sending[1] is False  # the second: its task waited for room
    assert sent_now == waited and len(sent_now) == 3
    # one answer a request (its one photo), of three labels each
    assert all(len(answers) == 1 and len(answers[0]) == 3 for answers in sent_now)
    assert sent_now[0] != sent_now[1]  # each request its own photo's labels
    assert free == 2 * 256 * PAGE


def test_a_request_in_the_moment_a_front_end_starts_waits_for_its_first_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A front end accepts on the shared port from its start, while another one may have
    answered readiness already: a request that reaches it before its link to the engine is
    up (a contract, a check before a body, a control call, which needs the engine's table)
    waits for the link (a real engine's socket, opened after the request came) and is
    served, and an upload is not sent in its turn but left to ``classify``, which waits;
    where no engine comes, it is 503 after ``LINK_WAIT_S``. Before, they were 503 "no
    engine process is connected" (the control call 501) in the request's first turn."""
    from app.frontend import links

    settings = tiny_repository(tmp_path, 8)
    control = tmp_path / "engine.sock"

    async def scenario() -> float:
        engine = LocalEngine(settings)
        await engine.start()
        remote = RemoteEngine(settings, [("", control)])
        front = DataPlane(settings, remote, across=True)
        starting = asyncio.create_task(front.start())
        asked = asyncio.create_task(remote.contract("tiny"))
        checked = asyncio.create_task(remote.check("tiny"))
        described = asyncio.create_task(remote.control("metadata", "tiny", None))
        for _ in range(20):  # the turns in which they were refused before
            await asyncio.sleep(0)
        assert not asked.done() and not checked.done() and not described.done()
        upload = Uploads("tiny", None, [b"\xff\xd8"], 1, "")
        assert remote.submit_uploads(upload, lambda _: None) is None  # nothing sent
        server = await EngineServer(engine).listen(str(control))
        try:
            contract = await asyncio.wait_for(asked, 60)
            await asyncio.wait_for(checked, 60)
            metadata = await asyncio.wait_for(described, 60)
            await asyncio.wait_for(starting, 60)
            assert (contract.model, contract.version) == ("tiny", "fp32")
            assert metadata["name"] == "tiny"
        finally:
            await front.stop()
            server.close()
            await engine.stop()

        monkeypatch.setattr(links, "LINK_WAIT_S", 0.5)
        alone = RemoteEngine(settings, [("", tmp_path / "never.sock")])
        waiting = asyncio.create_task(alone.start())  # tries for CONNECT_TIMEOUT_S
        began = time.monotonic()
        try:
            with pytest.raises(Unavailable, match="no engine process is connected"):
                await alone.contract("tiny")
            return time.monotonic() - began
        finally:
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
            await alone.stop()

    waited = asyncio.run(scenario())
    assert 0.45 < waited < 30
