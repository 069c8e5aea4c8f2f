"""Optional API keys, checked before anything else reads the request.

With keys configured, every route asks for one (``Authorization: Bearer <key>`` or
``X-API-Key: <key>``) except the health probes, which the orchestrator calls without
credentials, and ``/metrics`` unless ``auth.protect_metrics`` is on. A refusal is 401
``{"error": ...}`` with ``WWW-Authenticate: Bearer``, answered without reading the body.
gRPC asks for the same keys in the same two headers, as call metadata (``KeyRing`` is shared;
``app.frontend.grpc.server``).

Keys are compared as SHA-256 digests with ``hmac.compare_digest`` against every configured
key, so neither the time taken nor an early exit tells a caller how much of a key matched,
which key it was close to, or how long the keys are. Keys are never logged. Refusals are,
at most one line a second per client address (``RefusalLog``): a client guessing keys
cannot fill the disk.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from app.errors import client_text
from app.frontend.refusal import refuse

log = logging.getLogger(__name__)

PROBES = frozenset({"/v2/health/live", "/v2/health/ready"})
METRICS = "/metrics"
CHALLENGE = b'Bearer realm="stoker"'


def digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class KeyRing:
    """The configured keys, as digests; HTTP and gRPC check a presented key with it."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [digest(key) for key in keys]

    def __bool__(self) -> bool:
        """Whether any key is configured (none: the server is open)."""
        return bool(self._digests)

    def accepts(self, key: bytes) -> bool:
        given = digest(key)
        matched = False
        for known in self._digests:
            # No short cut: every key is compared whatever matched before.
            matched |= hmac.compare_digest(given, known)
        return matched


@dataclass
class Refusals:
    """One address's refusals in its current second: when it ends, how many went unlogged."""

    ends: float
    unlogged: int = 0
    timer: asyncio.TimerHandle | None = None


class RefusalLog:
    """401s (or the refusals ``label`` names) as log lines, at most one per ``interval_s``
    per client address: the first is logged at once, the others of that interval are
    counted and logged as one line when it ends, which starts the next interval. Addresses
    whose interval is over are forgotten once more than ``MAX_ADDRESSES`` are remembered."""

    MAX_ADDRESSES = 4096

    def __init__(self, interval_s: float = 1.0, label: str = "401") -> None:
        self.interval_s = interval_s
        self.label = label
        self._by_address: dict[str, Refusals] = {}

    def refused(self, address: str, problem: str, path: str) -> None:
        now = time.monotonic()
        current = self._by_address.get(address)
        if current is not None and current.timer is not None and now >= current.ends:
            current.timer.cancel()  # due, not yet run (a busy loop): its line comes first
            self._report(address, current)
            current = self._by_address[address]
        if current is None or now >= current.ends:
            if len(self._by_address) >= self.MAX_ADDRESSES:
                self._forget(now)
            log.warning("%s %s for %s from %s", self.label, problem, client_text(path), address)
            self._by_address[address] = Refusals(now + self.interval_s)
            return
        current.unlogged += 1
        if current.timer is None:
            loop = asyncio.get_running_loop()
            current.timer = loop.call_later(current.ends - now, self._report, address, current)

    def _report(self, address: str, current: Refusals) -> None:
        if self._by_address.get(address) is not current:
            return
        log.warning(
            "%s for %d more request(s) from %s in the last %g s (one line per interval)",
            self.label,
            current.unlogged,
            address,
            self.interval_s,
        )
        self._by_address[address] = Refusals(time.monotonic() + self.interval_s)

    def _forget(self, now: float) -> None:
        for address, refusals in list(self._by_address.items()):
            if now >= refusals.ends and refusals.timer is None:
                del self._by_address[address]


class ApiKeys:
    """ASGI middleware; with no keys it passes everything through untouched."""

    def __init__(self, app: ASGIApp, keys: Iterable[str], protect_metrics: bool) -> None:
        self.app = app
        self.ring = KeyRing(keys)
        self._open = PROBES if protect_metrics else PROBES | {METRICS}
        self.refusals = RefusalLog()

    @property
    def passes_all(self) -> bool:
        """No keys: every request goes on untouched (``StokerApp.open_door`` leaves it out)."""
        return not self.ring

    def accepts(self, key: bytes) -> bool:
        return self.ring.accepts(key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.ring or scope["path"] in self._open:
            await self.app(scope, receive, send)
            return
        key = presented_key(scope["headers"])
        if key is not None and self.accepts(key):
            await self.app(scope, receive, send)
            return
        problem = "invalid API key" if key is not None else "missing API key"
        client = scope.get("client")
        self.refusals.refused(str(client[0]) if client else "?", problem, scope["path"])
        message = f"{problem}: send Authorization: Bearer <key> or X-API-Key: <key>"
        await refuse(send, 401, message, [(b"www-authenticate", CHALLENGE)])


def presented_key(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The key in ``X-API-Key`` or in a bearer ``Authorization`` header; None if neither."""
    for name, value in headers:
        if name == b"x-api-key" and value.strip():
            return value.strip()
        if name == b"authorization":
            scheme, _, credentials = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and credentials.strip():
                return credentials.strip()
    return None
