"""The browser guard's policy, by bind address, settings and keys; in process, through
ASGI (the real server's behaviour: tests/integration/test_browser_guard.py)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from app.frontend.browser import BrowserGuard, HostPolicy, host_name
from app.frontend.http_limits import Saturation


async def ok(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def status(guard: BrowserGuard, method: str, path: str, headers: dict[str, str]) -> int:
    async def go() -> int:
        transport = httpx.ASGITransport(app=guard)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            answer = await client.request(method, path, headers=headers, content=b"{}")
            return answer.status_code

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("value", "name"),
    [("LocalHost:8000", "localhost"), ("[::1]:8000", "::1"), ("::1", "::1"), ("a.b.", "a.b")],
)
def test_host_names_lose_their_port(value: str, name: str) -> None:
    assert host_name(value) == name


@pytest.mark.parametrize(
    ("allowed", "bind", "keys", "host", "answered"),
    [
        ([], "127.0.0.1", False, "evil.example:8000", False),  # rebinding on a laptop
        ([], "127.0.0.1", False, "localhost:8000", True),
        ([], "127.0.0.1", False, "[::1]:8000", True),
        ([], "127.0.0.1", False, "127.0.0.2", True),
        ([], "::1", False, "evil.example", False),
        ([], "0.0.0.0", False, "10.1.2.3:8000", True),  # a pod IP, a Service name: any
        ([], "0.0.0.0", False, "stoker.default.svc", True),
        ([], "127.0.0.1", True, "evil.example", True),  # keys: a rebound page has none
        (["api.example"], "0.0.0.0", False, "api.example:443", True),
        (["api.example"], "0.0.0.0", False, "evil.example", False),
        (["api.example"], "127.0.0.1", True, "evil.example", False),  # listed: always checked
        (["*"], "127.0.0.1", False, "evil.example", True),
    ],
)
def test_which_hosts_are_answered(
    allowed: list[str], bind: str, keys: bool, host: str, answered: bool
) -> None:
    guard = BrowserGuard(ok, HostPolicy.of(allowed, bind, keys), None if keys else [])
    assert status(guard, "GET", "/v2/models/m", {"Host": host}) == (200 if answered else 403)
    assert status(guard, "GET", "/v2/health/ready", {"Host": host}) == 200


@pytest.mark.parametrize(
    ("path", "headers", "answered"),
    [
        ("/v2/models/m/infer", {"Content-Type": "application/json"}, True),
        ("/v2/models/m/infer", {"Content-Type": "application/octet-stream"}, True),
        ("/v2/models/m/infer", {}, True),
        ("/v2/models/m/infer", {"Origin": "http://127.0.0.1"}, True),
        ("/v2/models/m/infer", {"Origin": "https://app.example/"}, True),  # listed
        ("/v2/models/m/infer", {"Origin": "http://127.0.0.1:9"}, False),  # another port
        ("/v2/models/m/infer", {"Origin": "http://evil.example"}, False),
        ("/v2/models/m/infer", {"Content-Type": "Text/Plain; charset=utf-8"}, False),
        ("/v2/models/m/infer", {"Content-Type": "multipart/form-data; boundary=b"}, False),
        ("/infer", {"Content-Type": "multipart/form-data; boundary=b"}, True),
        ("/v2/models/m/versions/1/classify", {"Content-Type": "multipart/form-data"}, True),
        ("/infer", {"Content-Type": "text/plain"}, False),
        ("/infer", {"Origin": "http://evil.example"}, False),
    ],
)
def test_which_posts_are_answered_without_keys(
    path: str, headers: dict[str, str], answered: bool
) -> None:
    guard = BrowserGuard(ok, HostPolicy.of([], "127.0.0.1", False), ["https://app.example"])
    assert status(guard, "POST", path, headers) == (200 if answered else 403)
    keyed = BrowserGuard(ok, HostPolicy.of([], "127.0.0.1", True), None)
    assert status(keyed, "POST", path, headers) == 200  # keys: the key check decides


def test_any_origin_when_listed() -> None:
    guard = BrowserGuard(ok, HostPolicy.of([], "127.0.0.1", False), ["*"])
    assert status(guard, "POST", "/v2/models/m/infer", {"Origin": "http://evil.example"}) == 200


def test_a_cap_saturates_after_its_time_and_not_before() -> None:
    soon, later = Saturation(0.0), Saturation(3600.0)
    for saturation in (soon, later):
        saturation.note("connection", True)
        saturation.note("connection", True)  # still full: the time counts from the first
    assert "connection cap has been full" in str(soon.reason())
    assert later.reason() is None
    soon.note("connection", False)
    assert soon.reason() is None
