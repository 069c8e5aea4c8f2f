"""The control channel's messages: every call crosses as its own type and comes back equal;
a frame of another wire version, an unknown op, an unknown or mistyped field is refused with
the reason, and the call's number where it can be read."""

from __future__ import annotations

import msgspec
import pytest

from app import wire

V = wire.WIRE_VERSION
TENSOR = wire.TensorRef("x", "FP32", (2, 4), 64, 32)
SLOT = wire.SlotRef(4096, 8192)

CALLS: list[wire.Call] = [
    wire.Hello("stoker-1-0", 8 << 20),
    wire.Cancel(7),
    wire.State(
        (wire.Durations("m", "fp32", (1, 0, 2), 0.25),),
        (wire.Refused(503, "inflight_bytes", 2.0),),
        (wire.Failed("m", "fp32", "invalid", 3, 0.001),),
    ),
    wire.Describe("m", None),
    wire.Run(
        "m",
        "fp32",
        None,
        1,
        "127.0.0.1",
        (
            wire.RunItem((TENSOR,), 2, (wire.Wanted("y", 3),), SLOT),
            wire.RunItem((), 1, (), None, f"00-{'ab' * 16}-{'cd' * 8}-01"),
        ),
        150,
        3,
    ),
    wire.Infer("m", "int8", 120, "c", SLOT, 300),
    wire.Classify(None, None, 5, (100, 200), "c"),
    wire.Classify("m", None, None, (150528,), "c", SLOT, (1,), {"crop": 224, "layout": "NCHW"}),
    wire.Control("metrics_text"),
    wire.Control("metadata", ("m", None)),
    wire.Control(
        "load", ("m", {"max_batch_size": 4, "dynamic_batching": {"max_queue_delay_us": 0}})
    ),
    wire.Control("shm_register", ("r", "/r", 0, 64)),
    wire.Control("log_settings", ({"log_verbose_level": 1},)),
]


def test_every_op_has_one_message_type() -> None:
    tags = {type(call).__struct_config__.tag for call in CALLS}
    assert tags == {op.value for op in wire.Op}


@pytest.mark.parametrize("call", CALLS, ids=lambda call: type(call).__name__)
def test_a_call_crosses_as_its_own_type(call: wire.Call) -> None:
    number, again = wire.decode_call(wire.encode_call(41, call))
    assert number == 41 and type(again) is type(call) and again == call


@pytest.mark.parametrize(
    "reply",
    [
        wire.Failure("queue full", 429, "rejected"),
        wire.Done(),
        wire.Welcome(
            {
                "metadata": wire.Rule(wire.Spread.MODEL),
                "shm_register": wire.Rule(wire.Spread.ALL_OR_NONE, "shm_unregister"),
            }
        ),
        wire.Value({"name": "m", "versions": ["fp32"]}),
        wire.EngineState(True, False, 3, (wire.Serving("m", "fp32", 8),), 12),
        wire.EngineState(True, True, 0, (), 1, {"revision": 2, "trace": {}, "models": {}}),
        wire.RanReply("m", "fp32", (wire.ItemReply((TENSOR,), True),)),
        wire.Inferred("m", "fp32", {"Inference-Header-Content-Length": "12"}, 40),
        wire.ClassifiedReply("m", "fp32"),
    ],
    ids=lambda reply: type(reply).__name__,
)
def test_a_reply_crosses_as_its_own_type(reply: wire.Reply) -> None:
    answer = wire.decode_answer(wire.encode_answer(9, reply))
    assert answer.id == 9 and answer.reply == reply


@pytest.mark.parametrize(
    ("frame", "number", "why"),
    [
        (b"not json", -1, "not a Stoker frame"),
        (b'{"op": "metrics"}', -1, "not a Stoker frame"),
        (b'[5, 99, {"op": "metrics"}]', 5, "wire version 99; this engine speaks"),
        (f'[6, {V}, {{"op": "teleport"}}]'.encode(), 6, "does not know"),
        (f'[7, {V}, {{"op": "describe", "name": "m", "colour": "red"}}]'.encode(), 7, "colour"),
        (f'[8, {V}, {{"op": "describe", "name": 3}}]'.encode(), 8, "$.name"),
        (f'[9, {V}, {{"op": "run", "name": "m"}}]'.encode(), 9, "missing required field"),
    ],
)
def test_a_foreign_frame_is_refused_with_the_reason(frame: bytes, number: int, why: str) -> None:
    with pytest.raises(wire.BadFrame) as refused:
        wire.decode_call(frame)
    assert refused.value.number == number
    assert why in str(refused.value)


def test_messages_are_frozen() -> None:
    call = wire.Describe("m")
    with pytest.raises(AttributeError):
        call.name = "other"  # type: ignore[misc]
    assert msgspec.structs.replace(call, name="other").name == "other"
