"""gRPC messages to and from what the HTTP routes hand the data plane.

A ``ModelInferRequest`` becomes a V2 request in Triton's binary form (a JSON header naming each
input with its datatype, shape and ``binary_data_size``, then the tensors' bytes in input
order, every output asked for as binary), so the data plane decodes, validates, batches and
encodes it exactly as an HTTP binary request; its answer, a JSON header and the outputs'
bytes, becomes a ``ModelInferResponse`` whose ``raw_output_contents`` are those bytes. The
other answers (metadata, config, statistics, index, shared memory) are the documents the HTTP
routes serialise, put into their messages. Pure functions: no gRPC server here.

Inference messages are read and written as protobuf's wire bytes where the tensors are: a
``raw_input_contents`` entry is a view of the message as it arrived (protobuf would copy it
twice, once to parse and once more to hand it to Python) and an answer's bytes go into the
response once. Every other field goes through the generated classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message

from app.contract import Answer, input_mismatch
from app.errors import BadRequest, EngineError
from app.frontend.grpc.contents import (
    LENGTH_DELIMITED,
    most_values,
    split_contents,
    typed_bytes,
    varint,
)
from app.frontend.grpc.contents import TYPED_CONTENTS as TYPED_CONTENTS  # bench's payloads
from app.frontend.grpc.generated import grpc_service_pb2 as pb
from app.frontend.grpc.generated import model_config_pb2 as config_pb
from app.protocol import HEADER_LENGTH
from app.tensor_data import quote
from engines.spec import ModelSpec

# grpc_service.proto's field numbers of what is read or written as wire bytes.
_INPUTS = 5  # ModelInferRequest.inputs
_RAW_INPUT_CONTENTS = 7  # ModelInferRequest.raw_input_contents
_RAW_OUTPUT_CONTENTS = 6  # ModelInferResponse.raw_output_contents
_INFER_RESPONSE = 2  # ModelStreamInferResponse.infer_response
_SHARED_MEMORY = "shared_memory_region"
_INT64_MAX = 2**63 - 1
# The most fields a request's top level may hold (a valid one holds a few per input and
# output): walked in Python, and protobuf makes an object of each.
MAX_FIELDS = 4096
# A failed stream answer echoes its request's id up to this many characters.
ECHOED_ID_CHARS = 1024

# Of a model configuration, what Triton's ModelConfig message holds (the HTTP document adds
# fields of Stoker's own, and versions named by precision that the message cannot hold).
_CONFIG_FIELDS = (
    "name",
    "platform",
    "backend",
    "max_batch_size",
    "input",
    "output",
    "dynamic_batching",
)
_INSTANCE_KINDS = frozenset(config_pb.ModelInstanceGroup.Kind.keys())


def parameter_value(parameter: pb.InferParameter) -> Any:
    """An InferParameter's value as the V2 JSON would carry it (None when none is set)."""
    choice = parameter.WhichOneof("parameter_choice")
    return None if choice is None else getattr(parameter, choice)


def set_parameter(parameter: pb.InferParameter, value: Any) -> None:
    if isinstance(value, bool):
        parameter.bool_param = value
    elif isinstance(value, int):
        if value > _INT64_MAX:
            parameter.uint64_param = value
        else:
            parameter.int64_param = value
    elif isinstance(value, float):
        parameter.double_param = value
    else:
        parameter.string_param = str(value)


def _parameters(entries: Mapping[str, pb.InferParameter]) -> dict[str, Any]:
    values = {key: parameter_value(entry) for key, entry in entries.items()}
    return {key: value for key, value in values.items() if value is not None}


@dataclass(frozen=True)
class InferCall:
    """A ModelInferRequest as it arrived: every field but ``raw_input_contents`` and the
    inputs' typed ``contents`` parsed into ``request``; those as ``raw`` and ``contents``
    (one entry per input, None where it has none), views of the received message."""

    request: pb.ModelInferRequest
    raw: list[memoryview]
    contents: list[memoryview | None]


def read_request(data: bytes) -> InferCall:
    """A serialized ModelInferRequest, its tensors' bytes left where they are. Its top-level
    fields and its inputs' fields are walked (a few, however large the tensors):
    ``raw_input_contents`` entries and typed ``contents`` are kept as views, the rest
    (names, shapes, parameters) parsed by protobuf. Typed contents are counted against the
    model before they are parsed (``contents.typed_bytes``): protobuf would turn 33.5 M
    empty strings (64 MiB) into a gigabyte of objects first."""
    view = memoryview(data)
    raw: list[memoryview] = []
    contents: list[memoryview | None] = []
    rest: list[bytes | memoryview] = []
    at = kept = fields = 0
    end = len(data)
    while at < end:
        fields += 1
        if fields > MAX_FIELDS:
            raise BadRequest(f"the request holds over {MAX_FIELDS} fields")
        start = at
        key, at = varint(data, at)
        kind = key & 7
        if kind == 0:
            _, at = varint(data, at)
        elif kind == 1:
            at += 8
        elif kind == 5:
            at += 4
        elif kind == LENGTH_DELIMITED:
            length, at = varint(data, at)
            if at + length <= end and key >> 3 == _RAW_INPUT_CONTENTS:
                rest.append(view[kept:start])
                raw.append(view[at : at + length])
                kept = at + length
            elif at + length <= end and key >> 3 == _INPUTS:
                tensor, typed = split_contents(view[at : at + length])
                contents.append(typed)
                if typed is not None:
                    rest += [view[kept:start], _length_prefix(_INPUTS, len(tensor)), tensor]
                    kept = at + length
            at += length
        else:
            raise BadRequest("the request is not a ModelInferRequest")
        if at > end:
            raise BadRequest("the request is not a ModelInferRequest (it is cut short)")
    rest.append(view[kept:end])
    try:
        request = pb.ModelInferRequest.FromString(b"".join(rest))
    except DecodeError:
        raise BadRequest("the request is not a ModelInferRequest") from None
    if len(contents) != len(request.inputs):  # never, for what protobuf parsed
        raise BadRequest("the request is not a ModelInferRequest")
    return InferCall(request, raw, contents)


def _length_prefix(field: int, length: int) -> bytes:
    """The key of a length-delimited ``field`` and the varint ``length`` that follows it."""
    out = bytearray([field << 3 | LENGTH_DELIMITED])
    while length >= 0x80:
        out.append(length & 0x7F | 0x80)
        length >>= 7
    out.append(length)
    return bytes(out)


def request_body(
    call: InferCall,
    spec: ModelSpec | None = None,
    max_bytes: int = _INT64_MAX,
    deadline_us: int | None = None,
) -> tuple[bytes, list[bytes | memoryview]]:
    """The V2 binary request for ``call``: its JSON header and the binary parts that follow
    it, in order. ``deadline_us``: what is left of the call's gRPC deadline, which bounds the
    request's ``timeout`` parameter (the engine then refuses work that cannot finish in
    time). Inputs take their data from ``raw_input_contents`` in order, or from their typed
    ``contents``, or from a registered shared-memory region, as Triton reads them. Typed
    contents are counted against ``spec`` (the model's; needed when any input has them) and
    ``max_bytes`` before they are parsed (``contents.typed_bytes``)."""
    request, raw = call.request, call.raw
    if spec is not None:  # refused before any contents are read, as the data plane would
        unexpected = [t.name for t in request.inputs if spec.input(t.name) is None]
        if unexpected:
            names = {t.name for t in request.inputs}
            missing = [t.name for t in spec.inputs if t.name not in names]
            raise BadRequest(input_mismatch(spec, missing, unexpected))
    used = 0
    inputs: list[dict[str, Any]] = []
    chunks: list[bytes | memoryview] = []
    for tensor, typed in zip(request.inputs, call.contents, strict=True):
        parameters = _parameters(tensor.parameters)
        parameters.pop("binary_data_size", None)
        entry: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
        }
        if _SHARED_MEMORY not in parameters:
            chunk: bytes | memoryview
            if typed is not None:
                if raw:
                    raise BadRequest(
                        f"input {quote(tensor.name)}: contents must not be set when "
                        "raw_input_contents are used"
                    )
                if spec is None:
                    raise ValueError("typed contents are counted against the model's spec")
                chunk = typed_bytes(tensor, typed, most_values(spec, tensor, max_bytes))
            elif used < len(raw):
                chunk = raw[used]
                used += 1
            else:
                raise BadRequest(
                    f"input {quote(tensor.name)} has no data: send it in raw_input_contents, "
                    "contents or shared memory"
                )
            parameters["binary_data_size"] = len(chunk)
            chunks.append(chunk)
        entry["parameters"] = parameters
        inputs.append(entry)
    if used != len(raw):
        raise BadRequest(
            f"{len(raw)} raw_input_contents for {used} input(s) that take their data from them"
        )

    parameters = _parameters(request.parameters)
    parameters["binary_data_output"] = True
    if deadline_us is not None:
        timeout = parameters.get("timeout")
        bounded = type(timeout) is int and 0 < timeout <= deadline_us
        parameters["timeout"] = timeout if bounded else max(1, deadline_us)
    document: dict[str, Any] = {"parameters": parameters, "inputs": inputs}
    if request.id:
        document["id"] = request.id
    if request.outputs:
        outputs = []
        for output in request.outputs:
            wanted = _parameters(output.parameters)
            if _SHARED_MEMORY not in wanted:
                wanted["binary_data"] = True
            outputs.append({"name": output.name, "parameters": wanted})
        document["outputs"] = outputs
    return orjson.dumps(document), chunks


def infer_response(answer: Answer) -> bytes:
    """The serialized ModelInferResponse of a V2 binary answer: one raw_output_contents entry
    per output, in output order (empty for an output written to shared memory), as Triton
    sends them; classification and BYTES outputs length-prefixed, as in HTTP's binary data.
    The outputs' bytes are copied once, from the answer into the response."""
    content = answer.content
    length = answer.headers.get(HEADER_LENGTH)
    start = len(content) if length is None else int(length)
    document = orjson.loads(content[:start])
    response = pb.ModelInferResponse(
        model_name=document["model_name"],
        model_version=document["model_version"],
        id=document.get("id", ""),
    )
    view = memoryview(content)
    offset = start
    raw: list[bytes | memoryview] = []
    for output in document["outputs"]:
        tensor = response.outputs.add(
            name=output["name"], datatype=output["datatype"], shape=output["shape"]
        )
        parameters = output.get("parameters", {})
        size = parameters.pop("binary_data_size", None)
        for key, value in parameters.items():
            set_parameter(tensor.parameters[key], value)
        if size is not None:
            chunk = view[offset : offset + size]
            offset += size
        elif "data" in output:  # every output is asked for as binary: never expected here
            raise EngineError(f"output {output['name']!r} came back as JSON")
        else:
            chunk = view[:0]
        raw += [_length_prefix(_RAW_OUTPUT_CONTENTS, len(chunk)), chunk]
    # Fields may come in any order on the wire: the tensors follow the rest.
    return b"".join([response.SerializeToString(), *raw])


def stream_answer(response: bytes) -> bytes:
    """A stream's answer to one request: the serialized ModelInferResponse, wrapped."""
    return _length_prefix(_INFER_RESPONSE, len(response)) + response


def stream_error(request: pb.ModelInferRequest, message: str) -> bytes:
    """A stream's answer to one request that failed: the error, and the request's id so a
    client with many in flight can tell which (its first ``ECHOED_ID_CHARS``, as the model's
    name and version: a failed answer never echoes a megabyte)."""
    failed = pb.ModelInferResponse(
        model_name=request.model_name[:ECHOED_ID_CHARS],
        model_version=request.model_version[:ECHOED_ID_CHARS],
        id=request.id[:ECHOED_ID_CHARS],
    )
    answer = pb.ModelStreamInferResponse(error_message=message, infer_response=failed)
    data: bytes = answer.SerializeToString()
    return data


# -- the other answers ----------------------------------------------------------------------


M = TypeVar("M", bound=Message)


def message(kind: type[M], document: dict[str, Any]) -> M:
    """The ``kind`` message of an answer's JSON document as HTTP serialises it (the metadata,
    statistics, index and shared-memory documents are Triton's JSON of its messages): the
    fields the message has, the rest (Stoker's own) left out."""
    return json_format.ParseDict(document, kind(), ignore_unknown_fields=True)


def model_config(document: Mapping[str, Any]) -> pb.ModelConfigResponse:
    """Triton's ModelConfig of the HTTP config document: the fields the message has (versions
    are named by precision, which its integer versions cannot hold; BYTES is TYPE_STRING)."""
    config: dict[str, Any] = {key: document[key] for key in _CONFIG_FIELDS if key in document}
    for key in ("input", "output"):
        config[key] = [
            {**t, "data_type": "TYPE_STRING" if t["data_type"] == "TYPE_BYTES" else t["data_type"]}
            for t in config.get(key, [])
        ]
    groups = []
    for group in document.get("instance_group", []):
        kind = group.get("kind")
        known = {"kind": kind} if kind in _INSTANCE_KINDS else {}
        groups.append({"count": group["count"], **known})
    config["instance_group"] = groups
    response = pb.ModelConfigResponse()
    json_format.ParseDict(config, response.config, ignore_unknown_fields=True)
    return response


def repository_parameters(
    parameters: Mapping[str, pb.ModelRepositoryParameter],
) -> dict[str, Any]:
    """A load or unload request's parameters as HTTP's body has them: each one's value
    (whichever of its fields is set)."""
    values: dict[str, Any] = {}
    for key, parameter in parameters.items():
        which = parameter.WhichOneof("parameter_choice")
        values[key] = getattr(parameter, which) if which else None
    return values
