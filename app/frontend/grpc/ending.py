"""How a gRPC call ends with an error status: raised as ``Ended`` where the refusal is found,
set on the call where its handler returns (``app.frontend.grpc.limits.limited``).

Not with ``context.abort``: grpc.aio keeps the exception that abort raises on the call (to
check it was not swallowed), and that exception's traceback holds every frame it passed
through, the request among their locals. Call, exception and frames make a cycle that only a
full collection frees, and with the heap frozen those are rare: 40 refused 19 MB calls held
about 730 MB. An ``Ended`` is caught and dropped before the handler returns, so its frames go
as soon as the call ends, collector or not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:
    from typing import TypeAlias

    Context: TypeAlias = grpc.aio.ServicerContext[Any, Any]


class Ended(Exception):
    """The call ends with ``code`` and ``details`` (no answer)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details

    def end(self, context: Context) -> None:
        """Set on ``context``: grpc sends them as the call's status once its handler returns
        (a unary handler's answer is then dropped)."""
        context.set_code(self.code)
        context.set_details(self.details)
