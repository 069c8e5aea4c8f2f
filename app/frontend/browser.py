"""What a web page may make a browser do to a server without API keys (the default).

Any page a browser opens may send this server a "simple" cross-origin request (a POST of
text, a form or multipart, no preflight, the page never reads the answer) and, by DNS
rebinding (its own name resolved to 127.0.0.1), read and drive it as its own origin. With
no keys configured, ``BrowserGuard`` answers 403 ``{"error": ...}``:

- to a state-changing request (POST) whose ``Origin`` is neither the server's own (an
  ``Origin`` naming the request's ``Host``) nor one of ``server.allowed_origins``;
- to a POST of ``text/plain``, ``application/x-www-form-urlencoded`` or ``multipart/form-data``
  to a route that takes JSON or octet-stream (older browsers send no ``Origin`` with a form);
  the upload routes (``/infer``, ``.../classify``) take multipart, so only their ``Origin``
  counts;
- to any request whose ``Host`` is not one the server answers to: ``server.allowed_hosts``,
  or by default on a loopback bind ``localhost``, ``*.localhost`` and loopback addresses
  (what a rebound name is not). Another bind (``0.0.0.0`` in a container, reached by pod IPs
  and Service names) allows any ``Host`` unless ``allowed_hosts`` says otherwise. Health
  probes are never refused.

Keys make the first two moot (a browser adds no ``Authorization`` or ``X-API-Key`` to a
simple request, and a preflight is never answered), so with keys only an explicit
``allowed_hosts`` is checked. Clients that are not browsers (tritonclient, curl, KServe's)
send no ``Origin`` and JSON or no content type: nothing changes for them. gRPC is not
guarded: a browser cannot speak it to this port.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from app.errors import client_text
from app.frontend.refusal import refuse
from app.metrics import http_refused

SIMPLE_TYPES = frozenset({"text/plain", "application/x-www-form-urlencoded", "multipart/form-data"})
UPLOADS = re.compile(r"/infer|/v2/models/[^/]+(?:/versions/[^/]+)?/classify")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
HEALTH = "/v2/health/"


def is_loopback(host: str) -> bool:
    """Whether a bind address or a ``Host`` name can only be this machine."""
    name = host.strip("[]").lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """A ``Host`` header's name, without its port: ``[::1]:8000`` -> ``::1``."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    if value.count(":") == 1:
        value = value.partition(":")[0]
    return value.rstrip(".")


def normal_origin(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


class HostPolicy:
    """Which ``Host`` names are answered: any (``allowed`` None), loopback names only, or
    a list."""

    def __init__(self, allowed: Iterable[str] | None, loopback: bool) -> None:
        self.allowed = None if allowed is None else frozenset(host_name(h) for h in allowed)
        self.loopback = loopback

    @classmethod
    def of(cls, allowed_hosts: list[str], bind: str, keys: bool) -> HostPolicy:
        if "*" in allowed_hosts:
            return cls(None, False)
        if allowed_hosts:
            return cls(allowed_hosts, False)
        if not keys and is_loopback(bind):
            return cls([bind], True)
        return cls(None, False)

    @property
    def checks(self) -> bool:
        return self.allowed is not None

    def accepts(self, host: str) -> bool:
        if self.allowed is None:
            return True
        name = host_name(host)
        return name in self.allowed or (self.loopback and is_loopback(name))


class BrowserGuard:
    """ASGI middleware: the refusals above. ``origins`` None: keys are set, so ``Origin``
    and content types are not checked."""

    def __init__(self, app: ASGIApp, hosts: HostPolicy, origins: Iterable[str] | None) -> None:
        self.app = app
        self.hosts = hosts
        self.origins = None if origins is None else frozenset(map(normal_origin, origins))

    @property
    def passes_all(self) -> bool:
        """Neither hosts nor origins to check (``StokerApp.open_door`` leaves it out)."""
        return self.origins is None and not self.hosts.checks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (self.origins is None and not self.hosts.checks):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1")
        path: str = scope["path"]
        problem: tuple[str, str] | None = None
        if not path.startswith(HEALTH) and not self.hosts.accepts(host):
            problem = (
                "host",
                (
                    f"Host {client_text(host)!r} is not one this server answers to (DNS "
                    "rebinding); list it in STOKER_SERVER__ALLOWED_HOSTS"
                ),
            )
        elif self.origins is not None and scope["method"] not in SAFE_METHODS:
            problem = self._cross_site(headers, host, path)
        if problem is None:
            await self.app(scope, receive, send)
            return
        reason, message = problem
        http_refused(403, reason)
        await refuse(send, 403, message)

    def _cross_site(
        self, headers: dict[bytes, bytes], host: str, path: str
    ) -> tuple[str, str] | None:
        assert self.origins is not None
        origin = headers.get(b"origin")
        if origin is not None:
            text = origin.decode("latin-1").strip()
            try:
                own = text != "null" and urlsplit(text).netloc.lower() == host.strip().lower()
            except ValueError:  # not a URL ("http://[x"): no page's own origin
                own = False
            listed = "*" in self.origins or normal_origin(text) in self.origins
            if not own and not listed:
                return "origin", (
                    f"cross-origin request from {client_text(text)!r} refused; list the origin "
                    "in STOKER_SERVER__ALLOWED_ORIGINS or configure API keys"
                )
        kind = headers.get(b"content-type", b"").decode("latin-1").partition(";")[0]
        kind = kind.strip().lower()
        if kind in SIMPLE_TYPES and not (kind == "multipart/form-data" and UPLOADS.fullmatch(path)):
            return "origin", (
                f"Content-Type {kind} is what a web page can send unasked; send "
                "application/json (or application/octet-stream with binary data)"
            )
        return None
