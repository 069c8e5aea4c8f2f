"""The door of ``StokerApp``: the layers a request passes before FastAPI's stack, and that
the infer path, answered inside them, is refused by them as every other path is."""

from __future__ import annotations

import asyncio

import httpx
from starlette.types import ASGIApp, Receive, Scope, Send

from app.frontend.server import create_app
from app.settings import Settings


def test_the_door_has_the_keys_layer_only_where_keys_are_set() -> None:
    open_app = create_app(Settings())
    keyed = create_app(Settings.model_validate({"auth": {"api_keys": ["k" * 32]}}))
    assert "ApiKeys" not in open_app.layers
    assert keyed.layers[-3:] == ("ApiKeys", "BodyLimit", "InferFastPath")
    assert open_app.layers[-2:] == ("BodyLimit", "InferFastPath")


def test_the_infer_path_is_refused_by_the_door_as_the_routed_paths_are() -> None:
    """No key: 401 on the infer path (answered in the door) and on a model path (FastAPI's
    router), both before any body is read or any model is asked; an oversized declared body
    is 413 on both."""
    settings = Settings.model_validate(
        {"auth": {"api_keys": ["k" * 32]}, "limits": {"max_body_bytes": 1024}}
    )
    app = create_app(settings)

    async def calls() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            key = {"X-API-Key": "k" * 32}
            return [
                await client.post("/v2/models/m/infer", json={}),
                await client.post("/v2/repository/models/m/load", json={}),
                await client.post("/v2/models/m/infer", content=b"x" * 2048, headers=key),
                await client.post("/v2/repository/models/m/load", content=b"x" * 2048, headers=key),
            ]

    infer, routed, big_infer, big_routed = asyncio.run(calls())
    assert (infer.status_code, routed.status_code) == (401, 401)
    assert infer.json() == routed.json() and set(infer.json()) == {"error"}
    assert (big_infer.status_code, big_routed.status_code) == (413, 413)


def test_an_error_in_a_door_layer_is_a_json_500_and_a_bad_origin_a_403() -> None:
    """The door's layers are outside FastAPI's error middleware: an exception out of one before
    the answer began is still answered as the handlers answer it (a JSON 500, logged); a
    malformed ``Origin`` (which ``urlsplit`` cannot read) is a foreign origin, 403."""
    app = create_app(Settings())

    class Broken:
        def __init__(self, inner: ASGIApp) -> None:
            self.inner = inner

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            raise RuntimeError("a fault in a layer")

    async def call(path: str, headers: dict[str, str] | None = None) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
            return await client.post(path, json={}, headers=headers)

    for path in ("/v2/models/m/infer", "/v2/repository/models/m/load"):
        bad_origin = asyncio.run(call(path, {"Origin": "http://[x"}))
        assert bad_origin.status_code == 403 and set(bad_origin.json()) == {"error"}
    app.open_door(Broken)
    for path in ("/v2/models/m/infer", "/v2/repository/models/m/load"):
        broken = asyncio.run(call(path))
        assert broken.status_code == 500
        assert broken.json() == {"error": "internal server error"}
