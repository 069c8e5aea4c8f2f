"""The parameters of a model-control request (a load, an unload), read alike from an HTTP
body (``app.frontend.routes``) and from gRPC's ``parameters`` (``app.frontend.grpc``)."""

from __future__ import annotations

from typing import Any

import orjson

from app.errors import BadRequest, client_text


def json_object(text: bytes | str, what: str, not_an_object: str) -> dict[str, Any]:
    """``text`` parsed as a JSON object; ``BadRequest`` saying ``what`` is not JSON, or
    ``not_an_object`` where it is JSON of another kind."""
    try:
        document = orjson.loads(text)
    except orjson.JSONDecodeError as error:
        raise BadRequest(f"{what} is not JSON: {error}") from None
    if not isinstance(document, dict):
        raise BadRequest(not_an_object)
    return document


def control_parameters(body: bytes, accepted: frozenset[str]) -> dict[str, Any]:
    """The ``parameters`` of a load or unload body (Triton's and MLServer's; the body is
    optional), each named in ``accepted``."""
    if not body.strip():
        return {}
    expected = 'expected {"parameters": {...}}'
    document = json_object(body, "the body", expected)
    if not isinstance(document.get("parameters", {}), dict):
        raise BadRequest(expected)
    parameters: dict[str, Any] = document.get("parameters", {})
    check_parameters(parameters, accepted)
    return parameters


def check_parameters(parameters: dict[str, Any], accepted: frozenset[str]) -> None:
    for key in parameters:
        if key.startswith("file:"):
            raise BadRequest(
                "model files in the request are not supported: put them in the model's "
                "folder in the repository and load it"
            )
        if key not in accepted:
            raise BadRequest(
                f"unknown parameter '{client_text(key)}'; accepted: {', '.join(sorted(accepted))}"
            )


def config_override(parameters: dict[str, Any]) -> dict[str, Any] | None:
    """Triton's ``parameters.config``: the model's config as JSON text (or, here, a JSON
    object), in place of its config.yaml for this load; None: the folder's config.yaml."""
    config = parameters.get("config")
    if config is None:
        return None
    not_an_object = "parameters.config must be a JSON object (a config.yaml's fields)"
    if isinstance(config, str):
        return json_object(config, "parameters.config", not_an_object)
    if not isinstance(config, dict):
        raise BadRequest(not_an_object)
    return config


LOAD_PARAMETERS = frozenset({"config"})
UNLOAD_PARAMETERS = frozenset({"unload_dependents"})
