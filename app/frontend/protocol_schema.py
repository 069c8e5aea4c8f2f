"""JSON Schemas of the V2 inference request and response documents.

What the OpenAPI description shows (``app.frontend.routes``), so that clients and
schema-driven fuzzers know the documents' shape. They describe; ``app.protocol`` decodes and
enforces, and changes to one are mirrored in the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.protocol import MAX_DIMS
from engines.spec import V2_TO_NUMPY


def _object(properties: dict[str, Any], required: Sequence[str] = ()) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    return schema


_PARAMETERS = {"type": "object"}
INFER_REQUEST_SCHEMA = _object(
    {
        "id": {"type": "string"},
        "parameters": _object(
            {
                "binary_data_output": {"type": "boolean"},
                "timeout": {"type": "integer", "minimum": 0, "description": "microseconds"},
                "priority": {"type": "integer", "minimum": 0},
            }
        ),
        "inputs": {
            "type": "array",
            "minItems": 1,
            "items": _object(
                {
                    "name": {"type": "string", "minLength": 1},
                    "datatype": {"enum": list(V2_TO_NUMPY)},
                    "shape": {
                        "type": "array",
                        "maxItems": MAX_DIMS,
                        "items": {"type": "integer", "minimum": 0},
                    },
                    "data": {"type": "array"},
                    "parameters": _object({"binary_data_size": {"type": "integer", "minimum": 0}}),
                },
                required=("name", "datatype", "shape"),
            ),
        },
        "outputs": {
            "type": "array",
            "items": _object(
                {
                    "name": {"type": "string", "minLength": 1},
                    "parameters": _object(
                        {
                            "binary_data": {"type": "boolean"},
                            "classification": {"type": "integer", "minimum": 1},
                        }
                    ),
                },
                required=("name",),
            ),
        },
    },
    required=("inputs",),
)
INFER_RESPONSE_SCHEMA = _object(
    {
        "model_name": {"type": "string"},
        "model_version": {"type": "string"},
        "id": {"type": "string"},
        "outputs": {
            "type": "array",
            "items": _object(
                {
                    "name": {"type": "string"},
                    "datatype": {"enum": list(V2_TO_NUMPY)},
                    "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                    "data": {"type": "array"},
                    "parameters": _PARAMETERS,
                },
                required=("name", "datatype", "shape"),
            ),
        },
    },
    required=("model_name", "model_version", "outputs"),
)
