"""An input's typed ``contents`` as V2 binary data, counted against the model before they
are parsed, and the walks over protobuf's wire bytes that need.

Typed contents put every value in a field of its own (strings) or in packed runs
(numbers), and protobuf would make an object of each before anything could be checked:
33.5 M empty ``bytes_contents`` (64 MiB) cost 5.6 GB and most of a minute that way. Here
they stay wire bytes until counted: packed numbers at C speed, strings by a walk that stops
as soon as there are more than the input may hold (``most_values``: what the model takes
at its most rows, or what fits the tensor limit where a dimension is dynamic, and never
more than the declared shape).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from math import prod
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from app.errors import BadRequest, PayloadTooLarge
from app.frontend.grpc.generated import grpc_service_pb2 as pb
from app.tensor_data import quote
from engines.spec import ModelSpec

LENGTH_DELIMITED = 2
_CONTENTS = 5  # ModelInferRequest.InferInputTensor.contents
_BYTES_LENGTH = struct.Struct("<I")
# The most fields an input may hold (a valid one: its name, datatype, shape, a few
# parameters and its contents): walked in Python.
MAX_INPUT_FIELDS = 256

# The typed field of InferTensorContents each datatype is sent in, and the numpy type its
# bytes take. FP16 and BF16 have none: they travel in raw_input_contents only (as in Triton).
TYPED_CONTENTS: dict[str, tuple[str, type[np.generic]]] = {
    "BOOL": ("bool_contents", np.bool_),
    "INT8": ("int_contents", np.int8),
    "INT16": ("int_contents", np.int16),
    "INT32": ("int_contents", np.int32),
    "INT64": ("int64_contents", np.int64),
    "UINT8": ("uint_contents", np.uint8),
    "UINT16": ("uint_contents", np.uint16),
    "UINT32": ("uint_contents", np.uint32),
    "UINT64": ("uint64_contents", np.uint64),
    "FP32": ("fp32_contents", np.float32),
    "FP64": ("fp64_contents", np.float64),
}
# InferTensorContents' field numbers and how each packs its values on the wire: the bytes of
# a fixed-width value, 0 for varints, -1 for length-delimited strings (one field each).
_WIRE_FIELDS = {
    "bool_contents": (1, 0),
    "int_contents": (2, 0),
    "int64_contents": (3, 0),
    "uint_contents": (4, 0),
    "uint64_contents": (5, 0),
    "fp32_contents": (6, 4),
    "fp64_contents": (7, 8),
    "bytes_contents": (8, -1),
}
_WIRE_WIDTH = {0: 0, 1: 8, 5: 4}  # a scalar's wire type, its bytes (0: a varint)
_WIDE: dict[str, type[np.generic]] = {
    "b": np.bool_,
    "i": np.int64,
    "u": np.uint64,
    "f": np.float64,
}


def fields(data: memoryview, most: int) -> Iterator[tuple[int, int, int, int]]:
    """A message's fields as (field number, wire type, start of the field, start of its
    value), in order; the end of each is the next one's start (the last: the data's end).
    More than ``most`` are refused."""
    at, end, seen = 0, len(data), 0
    while at < end:
        if seen == most:
            raise BadRequest(f"an input holds over {most} fields")
        seen += 1
        start = at
        key, at = varint(data, at)
        yield key >> 3, key & 7, start, at
        at = skip(data, key & 7, at)


def skip(data: memoryview, kind: int, at: int) -> int:
    """Where the value of wire type ``kind`` at ``at`` ends."""
    if kind == 0:
        return varint(data, at)[1]
    if kind in _WIRE_WIDTH:
        at += _WIRE_WIDTH[kind]
    elif kind == LENGTH_DELIMITED:
        length, at = varint(data, at)
        at += length
    else:
        raise BadRequest("the request is not a ModelInferRequest")
    if at > len(data):
        raise BadRequest("the request is not a ModelInferRequest (it is cut short)")
    return at


def split_contents(tensor: memoryview) -> tuple[bytes | memoryview, memoryview | None]:
    """An InferInputTensor without its ``contents``, and those contents' bytes (None: it has
    none). Several ``contents`` fields merge, as protobuf merges them: their bytes joined."""
    parts = list(fields(tensor, MAX_INPUT_FIELDS))
    ends = [start for _, _, start, _ in parts[1:]] + [len(tensor)]
    kept: list[memoryview] = []
    found: list[memoryview] = []
    for (number, kind, start, value), stop in zip(parts, ends, strict=True):
        if number == _CONTENTS and kind == LENGTH_DELIMITED:
            found.append(tensor[varint(tensor, value)[1] : stop])
        else:
            kept.append(tensor[start:stop])
    if not found:
        return tensor, None
    typed = found[0] if len(found) == 1 else memoryview(b"".join(found))
    return b"".join(kept), typed


def varint(data: bytes | memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    while at < len(data) and shift < 64:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7
    raise BadRequest("the request is not a ModelInferRequest (a bad varint)")


def most_values(
    spec: ModelSpec, tensor: pb.ModelInferRequest.InferInputTensor, max_bytes: int
) -> int:
    """The most values an input's typed contents may hold: what the model takes of it at its
    most rows when its shape is fixed, else what fits in ``max_bytes`` as tensor data; and
    no more than its declared shape holds (an input the model lacks: none)."""
    model_tensor = spec.input(tensor.name)
    if model_tensor is None:
        return 0
    if model_tensor.is_static:
        rows = max(spec.max_batch_size, 1)
        most = rows * prod(model_tensor.shape)
    else:
        field = TYPED_CONTENTS.get(tensor.datatype)
        size = np.dtype(field[1]).itemsize if field else _BYTES_LENGTH.size
        most = max_bytes // size
    shape = list(tensor.shape)
    if all(d >= 0 for d in shape):
        most = min(most, prod(shape))
    return most


def typed_bytes(
    tensor: pb.ModelInferRequest.InferInputTensor, contents: memoryview, most: int
) -> bytes:
    """An input's typed ``contents`` (their wire bytes) as V2 binary data (little-endian;
    BYTES length-prefixed). Its values are counted before anything is parsed, and more than
    ``most`` are refused (413): packed numbers at C speed, strings (one field each) by a walk
    that stops past ``most``. Strings are then copied out of the walk, numbers parsed by
    protobuf and checked."""
    name, datatype = quote(tensor.name), tensor.datatype
    if datatype == "BYTES":
        field = "bytes_contents"
    elif datatype in TYPED_CONTENTS:
        field, dtype = TYPED_CONTENTS[datatype]
    else:
        raise BadRequest(
            f"input {name}: {datatype!r} has no typed contents field; send it in raw_input_contents"
        )
    number, width = _WIRE_FIELDS[field]
    if width < 0:
        count, strings = _strings(contents, number, most, name)
    else:
        count = 0
        for found, kind, _, at in fields(contents, most + 64):
            if found != number:
                continue
            if kind == LENGTH_DELIMITED:
                length, start = varint(contents, at)
                count += _packed_count(contents[start : start + length], width, name)
            elif _WIRE_WIDTH.get(kind) == width:
                count += 1
            else:
                raise BadRequest(f"input {name}: its {field} are not {datatype} values")
            if count > most:
                raise _too_many(name, most, datatype)
    shape = list(tensor.shape)
    if all(d >= 0 for d in shape) and count != prod(shape):
        raise BadRequest(
            f"input {name}: contents hold {count} {datatype} values, the shape {prod(shape)}"
        )
    if width < 0:
        return strings
    try:
        values: Any = getattr(pb.InferTensorContents.FromString(bytes(contents)), field)
    except DecodeError:
        raise BadRequest(f"input {name}: its contents do not parse") from None
    target = np.dtype(dtype)
    # The field's own type first (int32 for int_contents...), then the datatype's, checked.
    array = np.fromiter(values, dtype=_WIDE[target.kind], count=len(values))
    if array.size and target.kind in "iu":
        limits = np.iinfo(target)
        if array.min() < limits.min or array.max() > limits.max:
            raise BadRequest(f"input {name}: a value is out of range for {datatype}")
    with np.errstate(over="ignore"):
        return array.astype(target.newbyteorder("<")).tobytes()


def _too_many(name: str, most: int, datatype: str) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"input {name}: contents hold over {most} {datatype} values, more than its shape "
        "and the model take"
    )


def _strings(contents: memoryview, number: int, most: int, name: str) -> tuple[int, bytes]:
    """The strings of field ``number`` in ``contents`` as V2 binary BYTES data, and how
    many; more than ``most`` are refused as soon as they are seen. Every string is a field
    of its own (a tag, its length, its bytes), so they are walked one by one, in a loop kept
    tight: it runs for every string a dynamic BYTES input may hold."""
    data = bytes(contents)  # indexing bytes is faster than indexing a view
    tag = number << 3 | LENGTH_DELIMITED
    pack = _BYTES_LENGTH.pack
    out = bytearray()
    at, end, count, other = 0, len(data), 0, 0
    while at < end:
        if data[at] != tag:  # another field, skipped (a few at most)
            other += 1
            if other > 64:
                raise BadRequest(f"input {name}: its contents hold more than its strings")
            key, value = varint(data, at)
            at = skip(memoryview(data), key & 7, value)
            continue
        length = data[at + 1] if at + 1 < end else 0x80
        if length < 0x80:
            start = at + 2
        else:
            length, start = varint(data, at + 1)
        at = start + length
        if at > end:
            raise BadRequest(f"input {name}: its contents are cut short")
        count += 1
        if count > most:
            raise _too_many(name, most, "BYTES")
        out += pack(length)
        out += data[start:at]
    return count, bytes(out)


def _packed_count(values: memoryview, width: int, name: str) -> int:
    """How many numbers a packed field's bytes hold: fixed-width ones by their length,
    varints by their last bytes (those under 0x80), at C speed."""
    if width:
        if len(values) % width:
            raise BadRequest(f"input {name}: its contents are cut short")
        return len(values) // width
    return int(np.count_nonzero(np.frombuffer(values, np.uint8) < 0x80))
