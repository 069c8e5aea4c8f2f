"""The budget the gRPC limits keep per process and per address, without a server."""

from __future__ import annotations

from app.frontend.grpc.limits import Budget


def test_an_address_gets_its_share_and_the_others_the_rest() -> None:
    calls = Budget(8, 0.75, "gRPC calls", "max_grpc_calls")
    assert all(calls.take("10.0.0.1", 1) is None for _ in range(6))
    assert calls.take("10.0.0.1", 1) == (
        "6 gRPC calls in flight from this address, 1 more would pass its share of "
        "limits.max_grpc_calls (6 of 8); retry later"
    )
    assert calls.take("10.0.0.2", 2) is None
    assert calls.take("10.0.0.3", 1) == (
        "8 gRPC calls in flight, 1 more would pass limits.max_grpc_calls (8); retry later"
    )
    assert (calls.held, calls.by_address) == (8, {"10.0.0.1": 6, "10.0.0.2": 2})


def test_what_is_given_back_can_be_taken_again_and_a_refusal_holds_nothing() -> None:
    message_bytes = Budget(100, 0.5, "request bytes", "max_inflight_body_bytes")
    assert message_bytes.take("a", 50) is None
    refusal = message_bytes.take("a", 1)
    assert refusal is not None and "(50 of 100)" in refusal
    assert message_bytes.by_address == {"a": 50}
    message_bytes.give("a", 50)
    assert (message_bytes.held, message_bytes.by_address) == (0, {})
    assert message_bytes.take("a", 50) is None


def test_a_tiny_share_still_admits_one() -> None:
    calls = Budget(1, 0.75, "gRPC calls", "max_grpc_calls")
    assert calls.per_address == 1 and calls.take("a", 1) is None


def test_empty_messages_hold_nothing_however_many_end_at_once() -> None:
    """Probes' and watches' messages are empty: taking and giving back nothing, in any
    order, leaves no entry behind and never fails (it was a KeyError)."""
    message_bytes = Budget(100, 0.5, "request bytes", "max_inflight_body_bytes")
    assert message_bytes.take("a", 0) is None and message_bytes.take("a", 0) is None
    message_bytes.give("a", 0)
    message_bytes.give("a", 0)
    assert (message_bytes.held, message_bytes.by_address) == (0, {})
