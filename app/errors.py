"""One error family; each member carries its HTTP status and a failure reason for metrics.

Routes never build error responses themselves: they raise, and the single handler in
``app.frontend.server`` turns any ``StokerError`` into ``{"error": message}`` with its status.
"""

from __future__ import annotations


class StokerError(Exception):
    status: int = 500
    reason: str = "other"
    counted: bool = False
    """Set once the engine counted it as its model's failure: the data plane counts only
    what no engine did (a request it could not decode, one no engine could take)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(StokerError):
    status = 400
    reason = "invalid"


class Forbidden(StokerError):
    status = 403
    reason = "forbidden"


class NotImplementedHere(StokerError):
    """A Triton extension Stoker does not implement (gRPC's UNIMPLEMENTED)."""

    status = 501
    reason = "unsupported"


class NotFound(StokerError):
    status = 404
    reason = "not_found"


class RequestTimeout(StokerError):
    status = 408
    reason = "timeout"


class PayloadTooLarge(StokerError):
    status = 413
    reason = "too_large"


class QueueFull(StokerError):
    status = 429
    reason = "rejected"


class Unavailable(StokerError):
    status = 503
    reason = "unavailable"


class Reloaded(Unavailable):
    """The model version was reloaded with another contract (inputs, outputs, max batch)
    after a request was decoded against the old one: the data plane decodes it again."""

    reason = "reloaded"


class DeadlineExceeded(StokerError):
    status = 504
    reason = "timeout"


class EngineError(StokerError):
    status = 500
    reason = "backend"


def client_text(value: str, limit: int = 80) -> str:
    """A client-controlled string as it may appear in an error body or a log line: at most
    ``limit`` characters, with newlines, ANSI escapes and every other non-printable or
    non-ASCII character escaped, so it can neither forge a log line nor echo megabytes."""
    escaped = value[:limit].encode("unicode_escape").decode("ascii")
    return escaped + (f"... ({len(value)} characters)" if len(value) > limit else "")
