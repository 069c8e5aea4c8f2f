"""The KServe V2 / Open Inference Protocol codec, with Triton's binary tensor extension.

Pure functions from request bytes to numpy arrays and from arrays back to response bytes. No
web framework here: routes hand over the body and the ``Inference-Header-Content-Length``
header, and send back what ``encode_response`` returns.

Every malformed request becomes a ``BadRequest`` with a short message that names the field
but never echoes the payload. Checking an input against the model (names, datatypes, shapes)
is the data plane's job; only Triton's raw binary form needs the model spec to be read at all.

The request and response documents are read and written here (fields, parameters, shared
memory; a large document's numeric arrays are lifted out of it before orjson parses the rest,
``app.json_numbers``); each tensor's data, JSON or binary, is converted by
``app.tensor_data``, and the documents' JSON Schemas for the OpenAPI description are
``app.frontend.protocol_schema``.
Decoder and encoder are fuzzed together (``tests/unit/app/test_protocol_properties.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any, Protocol

import numpy as np
import orjson
from numpy.typing import NDArray

from app import json_numbers
from app.errors import BadRequest
from app.tensor_data import (
    binary_chunk,
    fixed_from_binary,
    from_binary,
    from_json,
    json_data,
    output_datatype,
    quote,
)
from engines.spec import V2_TO_NUMPY, ModelSpec

Array = NDArray[Any]

# numpy cannot hold more dimensions than this, and refusing longer shapes early keeps the
# element-count product cheap to compute.
HEADER_LENGTH = "Inference-Header-Content-Length"
"""Triton's binary extension: the bytes of JSON before a body's (or an answer's) tensors."""
MAX_DIMS = 64
_MAX_ELEMENTS = int(np.iinfo(np.intp).max)
# Nesting deeper than this in a tensor's JSON "data" is refused; a shape has at most MAX_DIMS
# dimensions, so data nested along its shape always fits. (orjson itself refuses documents
# nested past 1024 levels, before any of this runs.)
MAX_JSON_DEPTH = MAX_DIMS

_FAST_JSON_BYTES = 64 * 1024
_NUMBER_CHARACTERS = b"0123456789.eE-+,[] \n\r\t"
_KNOWN = ", ".join(V2_TO_NUMPY)
_SHARED_MEMORY = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")


@dataclass(frozen=True)
class RequestedOutput:
    """One entry of a request's ``outputs``.

    ``binary`` comes from the output's ``binary_data`` parameter, defaulting to the request's
    ``binary_data_output``. ``classification`` is 0 for the raw tensor, or k > 0 for Triton's
    classification extension (the caller applies ``classify``).
    """

    name: str
    binary: bool
    classification: int = 0
    shared: tuple[str, int, int] | None = None
    """Triton's system shared memory: (region, offset, byte size) the output is written to
    instead of the body."""


class Regions(Protocol):
    """Registered shared-memory regions (``app.engine.shared_memory.SharedRegions``)."""

    def view(self, name: str, offset: int, size: int, what: str) -> memoryview:
        """``size`` bytes of an input, read from region ``name`` at ``offset``."""
        ...

    def write(self, name: str, offset: int, data: bytes | memoryview, what: str) -> None:
        """An output's bytes, written into region ``name`` at ``offset``."""
        ...


@dataclass(frozen=True)
class InferRequest:
    """A decoded inference request.

    ``inputs`` keeps the request's order. Arrays have the shape the request gave and the dtype
    of their V2 datatype (``engines.spec.V2_TO_NUMPY``): BYTES is an object array of ``bytes``.
    Arrays decoded from binary data are read-only, zero-copy views of the request body; copy
    one before writing to it. An empty ``outputs`` means every model output, each binary or not
    as ``binary_data_output`` says.
    """

    id: str | None
    inputs: dict[str, Array]
    outputs: tuple[RequestedOutput, ...]
    binary_data_output: bool
    timeout_us: int | None
    priority: int


def decode_request(
    body: bytes | bytearray | memoryview,
    header_length: int | None,
    spec: ModelSpec,
    max_json_depth: int = MAX_JSON_DEPTH,
    regions: Regions | None = None,
) -> InferRequest:
    """Decode a V2 inference request.

    ``header_length`` is the ``Inference-Header-Content-Length`` header: None means the whole
    body is JSON; n > 0 means the first n bytes are JSON and the rest is binary tensor data in
    input order; 0 is Triton's raw binary request, where the whole body is the data of the
    model's single input. ``max_json_depth`` bounds the nesting of each tensor's JSON "data".
    With ``regions``, inputs and outputs may name a registered shared-memory region instead of
    carrying data (Triton's system shared-memory extension); without, that is refused.
    """
    if header_length is None:
        header, binary = body, memoryview(b"")
    elif header_length == 0:
        return _decode_raw(body, spec)
    elif header_length < 0:
        raise BadRequest(f"{HEADER_LENGTH} must not be negative")
    elif header_length > len(body):
        raise BadRequest(f"{HEADER_LENGTH} is larger than the body")
    else:
        header, binary = body[:header_length], memoryview(body)[header_length:]

    try:
        document, parsed = json_numbers.loads(header)
    except orjson.JSONDecodeError as exc:
        if "depth limit" in str(exc):
            raise BadRequest("request JSON nests deeper than 1024 levels") from None
        raise BadRequest("request body is not valid JSON") from None
    if type(document) is not dict:
        raise BadRequest("request body must be a JSON object")

    request_id = document.get("id")
    if request_id is not None and type(request_id) is not str:
        raise BadRequest('"id" must be a string')

    parameters = _parameters(document, "request", regions)
    binary_data_output = parameters.get("binary_data_output", False)
    if type(binary_data_output) is not bool:
        raise BadRequest('"binary_data_output" must be a boolean')
    timeout = parameters.get("timeout")
    if timeout is not None and not _is_count(timeout):
        raise BadRequest('"timeout" must be a non-negative integer (microseconds)')
    priority = parameters.get("priority", 0)
    if not _is_count(priority):
        raise BadRequest('"priority" must be a non-negative integer')

    # A large JSON text with no JSON boolean anywhere lets numeric data take the fast path
    # (``_numbers``): the one check numpy's own conversion cannot make is a boolean among
    # numbers, and the text says there is none. (Arrays ``json_numbers`` lifted out of the
    # text are not in it: simdjson read those, and refuses a boolean as a number.)
    plain = False
    if len(parsed) >= _FAST_JSON_BYTES:
        # What is left once the characters of numbers go: "true" and "false" lose their "e".
        rest = bytes(parsed).translate(None, _NUMBER_CHARACTERS)
        plain = b"tru" not in rest and b"fals" not in rest
    inputs = _decode_inputs(document.get("inputs"), binary, max_json_depth, regions, plain)
    outputs = _decode_outputs(document.get("outputs"), binary_data_output, regions)
    return InferRequest(
        id=request_id,
        inputs=inputs,
        outputs=outputs,
        binary_data_output=binary_data_output,
        timeout_us=timeout,
        priority=priority,
    )


def encode_response(
    model_name: str,
    model_version: str,
    request_id: str | None,
    outputs: Sequence[tuple[RequestedOutput, Array]],
    regions: Regions | None = None,
) -> tuple[bytes, dict[str, str]]:
    """Encode a V2 inference response; returns the body and the HTTP headers to send.

    Arrays are sent as given (apply ``classify`` first for classification outputs). Outputs
    asked for as binary go after the JSON header, in output order, and the headers then carry
    ``Inference-Header-Content-Length``.

    In JSON, BYTES elements become strings decoded as UTF-8 with invalid sequences replaced
    (U+FFFD): bytes that are not text should be requested as binary, as with Triton. BF16 and
    FP16 become JSON numbers; NaN and infinities, which JSON cannot hold, become null.
    """
    tensors: list[dict[str, Any]] = []
    chunks: list[bytes | memoryview] = []
    for requested, array in outputs:
        datatype = output_datatype(requested.name, array)
        tensor: dict[str, Any] = {
            "name": requested.name,
            "datatype": datatype,
            "shape": [int(d) for d in array.shape],
        }
        if requested.shared is not None and regions is not None:
            region, at, size = requested.shared
            chunk = binary_chunk(requested.name, array, datatype)
            if len(chunk) > size:
                raise BadRequest(
                    f"output {quote(requested.name)} takes {len(chunk)} bytes; its shared "
                    f"memory byte size is {size}"
                )
            regions.write(region, at, chunk, f"output {quote(requested.name)}")
            tensor["parameters"] = {
                "shared_memory_region": region,
                "shared_memory_byte_size": len(chunk),
                **({"shared_memory_offset": at} if at else {}),
            }
        elif requested.binary:
            chunk = binary_chunk(requested.name, array, datatype)
            tensor["parameters"] = {"binary_data_size": len(chunk)}
            chunks.append(chunk)
        else:
            tensor["data"] = json_data(requested.name, array, datatype)
        tensors.append(tensor)

    document: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request_id is not None:
        document["id"] = request_id
    document["outputs"] = tensors
    header = orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)
    if not chunks:
        return header, {"Content-Type": "application/json"}
    headers = {
        "Content-Type": "application/octet-stream",
        HEADER_LENGTH: str(len(header)),
    }
    return b"".join([header, *chunks]), headers


def classify(scores: Array, k: int, labels: Sequence[str] | None) -> Array:
    """Triton's classification extension: the top-k entries of each row of ``scores``.

    A 1-D ``scores`` is one unbatched row and gives shape [k]; otherwise axis 0 is the batch,
    the other axes are flattened into classes, and the result has shape [batch, k]. Each
    element is ``b"score:index:label"`` (score printed with ``%f``), without ``:label`` when
    ``labels`` is None or has no entry for that index. Order: score descending, ties to the
    lower index. A k above the number of classes is clamped to it, as Triton does.
    """
    if type(k) is not int or k < 1:
        raise BadRequest("classification count must be a positive integer")
    if scores.ndim == 0:
        raise BadRequest("classification needs an output with at least one dimension")
    rows_shape = (1, scores.size) if scores.ndim == 1 else (scores.shape[0], prod(scores.shape[1:]))
    rows = scores.reshape(rows_shape).astype(np.float64)
    k = min(k, rows.shape[1])
    top = np.argsort(-rows, axis=1, kind="stable")[:, :k]

    result = np.empty(top.shape, dtype=np.object_)
    for r, c in np.ndindex(top.shape):
        index = int(top[r, c])
        entry = b"%f:%d" % (rows[r, index], index)
        if labels is not None and index < len(labels) and labels[index]:
            entry += b":" + labels[index].encode("utf-8")
        result[r, c] = entry
    return result[0] if scores.ndim == 1 else result


def _decode_raw(body: bytes | bytearray | memoryview, spec: ModelSpec) -> InferRequest:
    """Triton's raw binary request: the body is the bytes of the model's only input."""
    if len(spec.inputs) != 1:
        raise BadRequest("a raw binary request needs a model with exactly one input")
    tensor = spec.inputs[0]
    if not tensor.is_static or tensor.datatype == "BYTES":
        raise BadRequest("a raw binary request needs an input of static shape and fixed size")
    row_bytes = tensor.row_bytes()
    if spec.batched:
        if not body or len(body) % row_bytes:
            raise BadRequest(
                f"raw binary body of {len(body)} bytes is not a whole number of "
                f"{row_bytes}-byte rows of input {quote(tensor.name)}"
            )
        shape = (len(body) // row_bytes, *tensor.shape)
    elif len(body) != row_bytes:
        raise BadRequest(
            f"raw binary body of {len(body)} bytes does not match the {row_bytes} bytes of "
            f"input {quote(tensor.name)}"
        )
    else:
        shape = tensor.shape
    array = fixed_from_binary(memoryview(body), tensor.datatype, prod(shape)).reshape(shape)
    return InferRequest(
        id=None,
        inputs={tensor.name: array},
        outputs=(),
        binary_data_output=True,
        timeout_us=None,
        priority=0,
    )


def _shared(parameters: dict[str, Any], where: str, data_too: bool) -> tuple[str, int, int] | None:
    """(region, offset, byte size) of an entry that names a shared-memory region, else None."""
    region = parameters.get("shared_memory_region")
    if region is None:
        if "shared_memory_byte_size" in parameters or "shared_memory_offset" in parameters:
            raise BadRequest(f'{where}: shared memory parameters without "shared_memory_region"')
        return None
    if type(region) is not str or not region:
        raise BadRequest(f'{where}: "shared_memory_region" must be a non-empty string')
    size: Any = parameters.get("shared_memory_byte_size")
    offset: Any = parameters.get("shared_memory_offset", 0)
    if not _is_count(size) or not _is_count(offset):
        raise BadRequest(
            f'{where}: "shared_memory_byte_size" and "shared_memory_offset" must be '
            "non-negative integers"
        )
    if data_too:
        raise BadRequest(f'{where}: has both shared memory and "data" or "binary_data_size"')
    return region, offset, size


def _decode_inputs(
    entries: Any,
    binary: memoryview,
    max_depth: int,
    regions: Regions | None = None,
    plain: bool = False,
) -> dict[str, Array]:
    if type(entries) is not list or not entries:
        raise BadRequest('"inputs" must be a non-empty list')
    inputs: dict[str, Array] = {}
    offset = 0
    for name, entry, parameters in _named(entries, "input", regions):
        datatype = entry.get("datatype")
        if type(datatype) is not str:
            raise BadRequest(f'input {quote(name)} needs a string "datatype"')
        if datatype not in V2_TO_NUMPY:
            raise BadRequest(f"input {quote(name)}: unknown datatype, expected one of {_KNOWN}")
        shape = _shape(name, entry.get("shape"))
        count = prod(shape)
        if count > _MAX_ELEMENTS:
            raise BadRequest(f"input {quote(name)} has a shape too large to hold")

        where = f"input {quote(name)}"
        size = parameters.get("binary_data_size")
        has_data = "data" in entry
        shared = _shared(parameters, where, has_data or size is not None)
        if shared is not None and regions is not None:
            region, at, length = shared
            chunk = regions.view(region, at, length, where)
            inputs[name] = from_binary(name, chunk, datatype, count).reshape(shape)
            continue
        if size is not None and has_data:
            raise BadRequest(f'input {quote(name)} has both "data" and "binary_data_size"')
        if size is None and not has_data:
            raise BadRequest(f'input {quote(name)} has neither "data" nor "binary_data_size"')
        if size is None:
            array = from_json(name, entry["data"], datatype, count, max_depth, plain)
        else:
            if not _is_count(size):
                raise BadRequest(
                    f'input {quote(name)}: "binary_data_size" must be a non-negative integer'
                )
            if size > len(binary) - offset:
                raise BadRequest(f"binary data of input {quote(name)} runs past the body")
            chunk = binary[offset : offset + size]
            offset += size
            array = from_binary(name, chunk, datatype, count)
        inputs[name] = array.reshape(shape)
    if offset != len(binary):
        raise BadRequest(f"{len(binary) - offset} bytes of binary data follow the last input")
    return inputs


def _decode_outputs(
    entries: Any, binary_default: bool, regions: Regions | None = None
) -> tuple[RequestedOutput, ...]:
    if entries is None:
        return ()
    if type(entries) is not list:
        raise BadRequest('"outputs" must be a list')
    outputs: dict[str, RequestedOutput] = {}
    for name, _, parameters in _named(entries, "output", regions):
        where = f"output {quote(name)}"
        shared = _shared(parameters, where, False)  # binary_data is moot with a region
        binary = parameters.get("binary_data", binary_default)
        if type(binary) is not bool:
            raise BadRequest(f'output {quote(name)}: "binary_data" must be a boolean')
        classification = parameters.get("classification", 0)
        if "classification" in parameters and (not _is_count(classification) or not classification):
            raise BadRequest(f'output {quote(name)}: "classification" must be a positive integer')
        outputs[name] = RequestedOutput(name, binary and shared is None, classification, shared)
    return tuple(outputs.values())


def _named(
    entries: list[Any], kind: str, regions: Regions | None
) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """Each entry of ``"inputs"`` or ``"outputs"`` (``kind``): its name (once), the entry
    and its ``parameters``."""
    seen: set[str] = set()
    for entry in entries:
        if type(entry) is not dict:
            raise BadRequest(f'each entry of "{kind}s" must be an object')
        name = entry.get("name")
        if type(name) is not str or not name:
            raise BadRequest(f'each {kind} needs a non-empty string "name"')
        if name in seen:
            raise BadRequest(f"{kind} {quote(name)} appears more than once")
        seen.add(name)
        yield name, entry, _parameters(entry, f"{kind} {quote(name)}", regions)


def _parameters(
    entry: dict[str, Any], where: str, regions: Regions | None = None
) -> dict[str, Any]:
    parameters = entry.get("parameters", {})
    if type(parameters) is not dict:
        raise BadRequest(f'{where}: "parameters" must be an object')
    if regions is None and any(key in parameters for key in _SHARED_MEMORY):
        raise BadRequest(f"{where}: shared memory is not supported; send the data in the body")
    return parameters


def _shape(name: str, shape: Any) -> tuple[int, ...]:
    if type(shape) is not list or not all(_is_count(d) for d in shape):
        raise BadRequest(f'input {quote(name)}: "shape" must be a list of non-negative integers')
    if len(shape) > MAX_DIMS:
        raise BadRequest(f"input {quote(name)}: more than {MAX_DIMS} dimensions")
    return tuple(shape)


def _is_count(value: Any) -> bool:
    """A non-negative JSON integer (JSON booleans are not integers)."""
    return type(value) is int and value >= 0
