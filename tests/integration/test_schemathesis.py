"""Schemathesis against a real server's own OpenAPI description: every operation, with bodies
generated from the V2 request schema (and the upload forms), valid and invalid, must answer
without a server error and as documented: the status among those declared, the content type
and the body matching their schemas ({"error": ...} for every refusal).

Bounded for CI: ``EXAMPLES`` cases per operation (``STOKER_SCHEMATHESIS_EXAMPLES`` raises it
for a longer run by hand). Path parameters name the real models four times in five, so that
generated bodies reach the codec and the model checks instead of stopping at a 404.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from app.frontend.server import create_app
from app.settings import Settings
from tests.integration.conftest import Server, start_server, stop_server
from tests.integration.test_hardening_http import hardening_repository

EXAMPLES = int(os.environ.get("STOKER_SCHEMATHESIS_EXAMPLES", "40"))
MODELS = ["tiny", "triple", "tiny_image", "slow"]


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("schemathesis")
    server = start_server(
        hardening_repository(root),
        root / "server.log",
        {"STOKER_LIMITS__MAX_BODY_BYTES": str(1024 * 1024)},
    )
    yield server
    code = stop_server(server)
    log = server.log.read_text()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log and "unhandled" not in log, log[-3000:]


# The description the server serves (checked equal below), built without starting anything, so
# that the operations are known when the tests are collected.
schema = schemathesis.openapi.from_dict(create_app(Settings()).openapi())


TURNS = itertools.count()


def aim_at_real_models(case: Any) -> None:
    """Four cases in five name, in turn, a served model (and most an fp32 version), so that
    generated bodies reach the codec and the model checks; the fifth keeps its generated
    name and exercises the 404s. Done here rather than in a hook so that every phase's cases
    (examples, coverage, fuzzing) are aimed alike."""
    turn = next(TURNS)
    parameters = case.path_parameters
    if parameters and "name" in parameters and turn % 5:
        parameters["name"] = MODELS[turn % 5 - 1]
        if "version" in parameters and turn % 3:
            parameters["version"] = "fp32"


@schemathesis.check
def no_unexpected_server_error(ctx: Any, response: Any, case: Any) -> bool | None:
    """The one 5xx a well-formed request may earn here is 504 after its own ``timeout``, which
    the schema lets a client set to a microsecond. Anything else, 500 included, fails."""
    if response.status_code == 504 and "deadline" in response.text:
        return True
    return not_a_server_error(ctx, response, case)


CHECKS = [
    no_unexpected_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_every_operation_answers_as_documented(fuzzed: Server, case: Any) -> None:
    aim_at_real_models(case)
    case.call_and_validate(base_url=fuzzed.url, checks=CHECKS, timeout=30)


def test_the_infer_body_is_described(fuzzed: Server) -> None:
    """The V2 infer routes read raw bodies; their request schema is declared explicitly so
    that clients and fuzzers know the V2 document."""
    document = httpx.get(f"{fuzzed.url}/openapi.json").json()
    assert document == create_app(Settings()).openapi()
    infer = document["paths"]["/v2/models/{name}/infer"]["post"]
    content = infer["requestBody"]["content"]
    assert content["application/json"]["schema"]["required"] == ["inputs"]
    assert "application/octet-stream" in content
    assert "default" in infer["responses"]
