"""API keys: which routes ask for one, how it may be sent, how it is compared, where it comes
from, and that it never reaches a log or an error message. In process, through ASGI."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from app.frontend.auth import ApiKeys, RefusalLog
from app.settings import Settings

KEYS = ["k-alpha-0123456789", "k-beta-9876543210"]


class Recorder:
    """The wrapped application: answers 200 and remembers whether it was reached and whether
    the body was read."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.calls.append(scope["path"])
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def call(
    middleware: ApiKeys, method: str, path: str, headers: dict[str, str] | None = None
) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=middleware)
        async with httpx.AsyncClient(transport=transport, base_url="http://stoker") as client:
            return await client.request(method, path, headers=headers, content=b"{}")

    return asyncio.run(go())


def guarded(protect_metrics: bool = False) -> tuple[ApiKeys, Recorder]:
    inner = Recorder()
    return ApiKeys(inner, KEYS, protect_metrics), inner


PROTECTED = [
    ("POST", "/v2/models/tiny/infer"),
    ("POST", "/v2/models/tiny/versions/fp32/infer"),
    ("GET", "/v2/models/tiny"),
    ("GET", "/v2/models/tiny/config"),
    ("GET", "/v2/models/stats"),
    ("POST", "/v2/repository/index"),
    ("POST", "/v2/repository/models/tiny/load"),
    ("POST", "/v2/repository/models/tiny/unload"),
    ("POST", "/infer"),
    ("GET", "/v2"),
    ("GET", "/openapi.json"),
]


@pytest.mark.parametrize(("method", "path"), PROTECTED)
def test_inference_and_model_endpoints_need_a_key(method: str, path: str) -> None:
    middleware, inner = guarded()
    for headers in (
        None,
        {"Authorization": "Bearer wrong"},
        {"X-API-Key": KEYS[0][:-1]},
        {"Authorization": f"Basic {KEYS[0]}"},
        {"Authorization": "Bearer "},
    ):
        response = call(middleware, method, path, headers)
        assert response.status_code == 401, (path, headers)
        assert set(response.json()) == {"error"}
        assert response.headers["www-authenticate"].startswith("Bearer")
    assert inner.calls == [], "a refused request must not reach the application"


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": f"Bearer {KEYS[0]}"},
        {"authorization": f"bearer {KEYS[1]}"},
        {"Authorization": f"Bearer   {KEYS[1]}  "},
        {"X-API-Key": KEYS[0]},
        {"x-api-key": KEYS[1]},
    ],
)
def test_either_header_carries_the_key(headers: dict[str, str]) -> None:
    middleware, inner = guarded()
    assert call(middleware, "POST", "/v2/models/tiny/infer", headers).status_code == 200
    assert inner.calls == ["/v2/models/tiny/infer"]


def test_probes_stay_open_and_metrics_follow_their_setting() -> None:
    middleware, _ = guarded(protect_metrics=False)
    for path in ("/v2/health/live", "/v2/health/ready", "/metrics"):
        assert call(middleware, "GET", path).status_code == 200, path
    protected, _ = guarded(protect_metrics=True)
    assert call(protected, "GET", "/v2/health/ready").status_code == 200
    assert call(protected, "GET", "/metrics").status_code == 401
    ok = call(protected, "GET", "/metrics", {"Authorization": f"Bearer {KEYS[0]}"})
    assert ok.status_code == 200


def test_without_keys_everything_passes_untouched() -> None:
    inner = Recorder()
    middleware = ApiKeys(inner, [], protect_metrics=True)
    assert call(middleware, "POST", "/v2/models/tiny/infer").status_code == 200
    assert call(middleware, "GET", "/metrics").status_code == 200


def test_every_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Digests of equal length through hmac.compare_digest, against every key whatever
    matched first: the time taken tells nothing about which key or how much of it matched."""
    compared: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    middleware, _ = guarded()
    for presented in (KEYS[0], KEYS[1], "short", "x" * 4096):
        compared.clear()
        middleware.accepts(presented.encode())
        assert compared == [(32, 32)] * len(KEYS)


def test_keys_come_from_the_environment_as_a_list_or_commas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STOKER_AUTH__API_KEYS", json.dumps(KEYS))
    assert Settings().auth.keys() == KEYS
    monkeypatch.setenv("STOKER_AUTH__API_KEYS", f" {KEYS[0]} ,{KEYS[1]},")
    assert Settings().auth.keys() == KEYS
    monkeypatch.delenv("STOKER_AUTH__API_KEYS")
    assert Settings().auth.keys() == []


@pytest.mark.parametrize("value", ['{"a": "x"}', '"x"', "[1, 2", '["a", 3]'])
def test_a_malformed_key_list_stops_startup(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """JSON that is not a list of strings is never taken as one literal key."""
    monkeypatch.setenv("STOKER_AUTH__API_KEYS", value)
    with pytest.raises(ValidationError) as invalid:
        Settings()
    assert value not in str(invalid.value)


def test_keys_come_from_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# rotated 2025-01\n{KEYS[0]}\n\n  {KEYS[1]}  \n")
    monkeypatch.setenv("STOKER_AUTH__API_KEYS_FILE", str(keys))
    monkeypatch.setenv("STOKER_AUTH__API_KEYS", "k-from-env")
    assert Settings().auth.keys() == ["k-from-env", *KEYS]


@pytest.mark.parametrize("content", [None, "", "# only a comment\n\n"])
def test_a_missing_or_empty_key_file_stops_startup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str | None
) -> None:
    """Configured but empty must not mean open."""
    keys = tmp_path / "keys"
    if content is not None:
        keys.write_text(content)
    monkeypatch.setenv("STOKER_AUTH__API_KEYS_FILE", str(keys))
    with pytest.raises(ValidationError, match="API key file"):
        Settings()


def test_keys_never_reach_the_log_or_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    keys = tmp_path / "keys"
    keys.write_text(KEYS[1] + "\n")
    monkeypatch.setenv("STOKER_AUTH__API_KEYS", json.dumps([KEYS[0]]))
    monkeypatch.setenv("STOKER_AUTH__API_KEYS_FILE", str(keys))
    settings = Settings()
    logged = json.dumps(settings.loggable())
    assert KEYS[0] not in logged and KEYS[1] not in logged
    assert settings.loggable()["auth"]["api_keys"] == "***"

    monkeypatch.setenv("STOKER_AUTH__API_KEYS", json.dumps([KEYS[0], " "]))
    with pytest.raises(ValidationError) as invalid:
        Settings()
    assert KEYS[0] not in str(invalid.value) and "blank" in str(invalid.value)

    middleware, _ = guarded()
    with caplog.at_level(logging.DEBUG):
        response = call(middleware, "GET", "/v2/models/tiny", {"X-API-Key": KEYS[0] + "x"})
    assert response.status_code == 401
    assert KEYS[0] not in caplog.text and KEYS[0] not in response.text
    assert "invalid API key" in caplog.text


def test_a_refused_path_cannot_forge_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    middleware, _ = guarded()
    with caplog.at_level(logging.WARNING):
        response = call(middleware, "GET", "/v2/models/x%0aERROR%20forged%1b[31m", {})
    assert response.status_code == 401
    (record,) = [r for r in caplog.records if "401" in r.getMessage()]
    line = record.getMessage()
    assert "\n" not in line and "\x1b" not in line
    assert "x\\nERROR forged\\x1b[31m" in line


def test_refusal_does_not_read_the_body() -> None:
    """A 401 is sent before the application (or anything) reads the request body."""
    received: list[Any] = []
    middleware, _ = guarded()

    async def go() -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            received.append(1)
            return {"type": "http.request", "body": b"x" * 10, "more_body": True}

        async def send(message: Any) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v2/models/tiny/infer",
            "headers": [(b"content-length", b"1000000000")],
            "client": ("10.0.0.1", 1234),
        }
        await middleware(scope, receive, send)
        return sent

    sent = asyncio.run(go())
    assert sent[0]["status"] == 401
    assert received == []


def test_refusals_are_logged_at_most_once_an_interval_per_address(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """500 refusals from one address in a burst: one line at once, one line with the count
    of the rest when the interval ends; another address gets its own line."""
    log = RefusalLog(interval_s=0.2)

    async def burst() -> None:
        for _ in range(500):
            log.refused("10.0.0.1", "invalid API key", "/v2/models/tiny")
        log.refused("10.0.0.2", "missing API key", "/v2/models/tiny")
        deadline = time.monotonic() + 10
        while len(caplog.records) < 3:  # the count's line comes on a timer as the interval ends
            assert time.monotonic() < deadline, caplog.text
            await asyncio.sleep(0.01)

    with caplog.at_level(logging.WARNING, logger="app.frontend.auth"):
        asyncio.run(burst())
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "401 invalid API key for /v2/models/tiny from 10.0.0.1",
        "401 missing API key for /v2/models/tiny from 10.0.0.2",
        "401 for 499 more request(s) from 10.0.0.1 in the last 0.2 s (one line per interval)",
    ]
