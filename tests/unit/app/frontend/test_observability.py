"""``TraceRequests``: a traced request's span starts when its first bytes were read."""

from __future__ import annotations

import asyncio
import time

from starlette.types import Receive, Scope, Send

from app import tracing
from app.frontend.http_limits import BEGAN
from app.frontend.observability import TraceRequests


def test_a_request_span_starts_at_its_first_bytes_not_at_the_application() -> None:
    """The protocol stamps a request's first bytes (``BEGAN``); the time from there to the
    application's first turn (the parse, the task's wait for the loop) is in the request's
    span. Without the stamp (another server), the span starts at the call."""
    started: list[int] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        incoming = tracing.INCOMING.get()
        assert incoming is not None
        started.append(incoming.started_ns)

    async def call(scope: Scope) -> int:
        before = time.time_ns()
        await TraceRequests(app)(scope, None, None)  # type: ignore[arg-type]
        return before

    scope = {"type": "http", "method": "POST", "path": "/v2/models/m/infer", "headers": []}
    stamped = asyncio.run(call({**scope, BEGAN: time.monotonic() - 0.25}))
    assert stamped - started[-1] >= 200_000_000  # a quarter second before the call
    unstamped = asyncio.run(call(scope))
    assert 0 <= started[-1] - unstamped < 1_000_000_000
