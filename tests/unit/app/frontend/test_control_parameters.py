"""A model-control request's parameters, as HTTP's body and gRPC's message both give them:
Triton's and MLServer's form, a config override that is a JSON object, nothing else."""

from __future__ import annotations

import pytest

from app.errors import BadRequest
from app.frontend.control_parameters import LOAD_PARAMETERS, config_override, control_parameters


@pytest.mark.parametrize(
    ("body", "config", "problem"),
    [
        (b"", None, None),
        (b"{}", None, None),
        (b'{"parameters": {"config": "{\\"max_batch_size\\": 4}"}}', {"max_batch_size": 4}, None),
        (b'{"parameters": {"config": {"max_batch_size": 2}}}', {"max_batch_size": 2}, None),
        (b'{"parameters": {"config": "[1]"}}', None, "must be a JSON object"),
        (b'{"parameters": {"config": "{oops"}}', None, "parameters.config is not JSON"),
        (b'{"parameters": {"file:1/model.onnx": "AAAA"}}', None, "model files in the request"),
        (b'{"parameters": {"colour": "red"}}', None, "unknown parameter 'colour'"),
        (b'{"parameters": []}', None, "expected"),
        (b"not json", None, "not JSON"),
    ],
)
def test_a_load_body_is_tritons_and_its_config_a_json_object(
    body: bytes, config: dict[str, object] | None, problem: str | None
) -> None:
    if problem is None:
        assert config_override(control_parameters(body, LOAD_PARAMETERS)) == config
        return
    with pytest.raises(BadRequest, match=problem):
        config_override(control_parameters(body, LOAD_PARAMETERS))
