"""One tensor's V2 data, JSON or binary, to and from a numpy array.

The element codec under ``app.protocol``: JSON ``data`` (nested lists, checked element by
element, or converted by numpy in one call where that is exact; a large array lifted out of
its document, ``app.json_numbers``, as the numbers simdjson read) and Triton's binary form
(little-endian, BYTES elements length-prefixed), each way, for every V2 datatype. The
protocol module reads and writes the documents around the tensors; how tensors cross between
processes (``app.frontend.arena``, ``app.engine.process``) is ``pack_tensor`` and
``unpack_tensor``. No knowledge of requests, models or shared memory here.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from itertools import chain
from math import prod
from typing import Any

import numpy as np
from numpy.typing import NDArray

from app.errors import BadRequest, EngineError
from app.json_numbers import CONVERTED, Numbers
from engines.spec import V2_TO_NUMPY, v2_datatype

Array = NDArray[Any]

_BYTES_LENGTH = struct.Struct("<I")
# The Python types orjson produces that each datatype accepts in JSON "data".
_INTEGERS = frozenset({"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"})
_FLOATS = frozenset({"FP16", "FP32", "FP64", "BF16"})


def _too_deep(name: str, max_depth: int) -> BadRequest:
    return BadRequest(f'input {quote(name)}: "data" nests deeper than {max_depth} levels')


def _wrong_count(name: str, got: int, count: int) -> BadRequest:
    return BadRequest(f"input {quote(name)}: data holds {got} elements, the shape {count}")


def _out_of_range(name: str, datatype: str) -> BadRequest:
    return BadRequest(f"input {quote(name)}: a value is out of range for {datatype}")


def pack_tensor(name: str, array: Array) -> tuple[str, bytes | memoryview]:
    """An array's V2 datatype and its bytes as V2 binary data (little-endian; BYTES elements
    length-prefixed): zero-copy for a contiguous little-endian array. ``unpack_tensor``
    reverses it. How tensors cross between processes (``app.engine.process``)."""
    datatype = output_datatype(name, array)
    return datatype, binary_chunk(name, array, datatype)


def unpack_tensor(name: str, datatype: str, shape: Sequence[int], chunk: memoryview) -> Array:
    """The array ``pack_tensor`` packed: a read-only view of ``chunk`` for fixed-size types."""
    if datatype not in V2_TO_NUMPY:
        raise BadRequest(f"tensor {quote(name)}: unknown datatype {datatype!r}")
    dims = tuple(int(d) for d in shape)
    return from_binary(name, chunk, datatype, prod(dims)).reshape(dims)


def from_json(
    name: str, data: Any, datatype: str, count: int, max_depth: int, plain: bool = False
) -> Array:
    if type(data) is Numbers:
        lifted = _lifted(name, data, datatype, count, max_depth)
        if lifted is not None:
            return lifted
        data, plain = data.json(), False
    if type(data) is not list:
        raise BadRequest(f'input {quote(name)}: "data" must be a list')
    if plain:
        fast = _numbers(data, datatype, count, max_depth)
        if fast is not None:
            return fast
    values = _flatten(name, data, max_depth)
    kinds = set(map(type, values))
    if len(values) != count:
        raise _wrong_count(name, len(values), count)
    if datatype == "BYTES":
        if not kinds <= {str}:
            raise BadRequest(f"input {quote(name)}: BYTES data must be strings")
        array = np.empty(count, dtype=np.object_)
        array[:] = [value.encode("utf-8") for value in values]
        return array
    if datatype == "BOOL":
        allowed: set[type] = {bool}
    elif datatype in _INTEGERS:
        allowed = {int}
    else:
        allowed = {int, float}
    if not kinds <= allowed:
        raise BadRequest(f"input {quote(name)}: data are not all {datatype} values")
    try:
        # A float too large for FP16 or BF16 rounds to infinity, as IEEE conversion does.
        with np.errstate(over="ignore"):
            try:
                return np.array(values, dtype=V2_TO_NUMPY[datatype])
            except TypeError:
                if datatype != "BF16":
                    raise
                # ml_dtypes takes no Python int beyond int64's range (JSON's up to 2**64 - 1
                # come as ints): such an integer as the float it is, as FP32 reads it.
                floats = [float(v) for v in values]
                return np.array(floats, dtype=V2_TO_NUMPY[datatype])
    except OverflowError:
        raise _out_of_range(name, datatype) from None


def _lifted(name: str, data: Numbers, datatype: str, count: int, max_depth: int) -> Array | None:
    """Numbers simdjson read (``app.json_numbers``) as an array of ``datatype``, checked in the
    element-wise path's order (depth, element count, range) with its messages; None where that
    path must read the data (``Numbers.values`` None, or a datatype without a buffer)."""
    values = data.values  # None for a datatype outside ``CONVERTED``
    if values is None:
        return None
    if data.depth > max_depth:
        raise _too_deep(name, max_depth)
    if values.size != count:
        raise _wrong_count(name, values.size, count)
    target = V2_TO_NUMPY[datatype]
    if values.dtype.kind != "f":
        limits = np.iinfo(target.type)  # type: ignore[type-var]
        if values.size and (values.min() < limits.min or values.max() > limits.max):
            raise _out_of_range(name, datatype)
    # A float too large for FP16 rounds to infinity, as IEEE conversion does.
    with np.errstate(over="ignore"):
        return values.astype(target)


def _numbers(data: list[Any], datatype: str, count: int, max_depth: int) -> Array | None:
    """Regular nested numeric ``data`` converted by numpy in one C call, or None for anything
    else (ragged, strings, nulls, too deep, out of range, floats for an integer type), which
    the element-wise path then decodes or refuses with its own message. Only for data known
    to hold no boolean (numpy would read ``true`` as 1). Three to four times faster on an
    image's 150,528 numbers; the property tests check it against the element-wise path."""
    if datatype not in CONVERTED:
        return None
    try:
        array = np.array(data)
    except (ValueError, OverflowError, RecursionError):
        return None
    if array.size != count or array.ndim > max_depth:
        return None
    target = V2_TO_NUMPY[datatype]
    if datatype in _FLOATS:
        if array.dtype.kind not in "if":
            return None
        with np.errstate(over="ignore"):
            # Integers through a double, as the element-wise path converts each Python int
            # (and simdjson each JSON integer): int64 straight to float32 rounds once, and
            # 2**60 + 2**36 + 1 would come out one float32 step apart.
            return array.astype(np.float64, copy=False).astype(target).reshape(-1)
    if array.dtype.kind != "i":
        return None
    limits = np.iinfo(target.type)  # type: ignore[type-var]
    if array.size and (array.min() < limits.min or array.max() > limits.max):
        return None
    return array.astype(target).reshape(-1)


def _flatten(name: str, data: list[Any], max_depth: int) -> list[Any]:
    """Row-major elements of nested lists, in time linear in the number of JSON values
    whatever the nesting: levels made only of lists are joined at C speed, and lists mixed
    with values at one level (ragged data) are walked once. Re-scanning a long level once per
    level of a deep sibling would let a small body cost minutes of CPU."""
    depth = 1
    kinds = set(map(type, data))
    while kinds == {list}:
        depth += 1
        if depth > max_depth:
            raise _too_deep(name, max_depth)
        data = list(chain.from_iterable(data))
        kinds = set(map(type, data))
    if list not in kinds:
        return data
    values: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if type(item) is list:
                if depth + len(stack) > max_depth:
                    raise _too_deep(name, max_depth)
                stack.append(iter(item))
                break
            values.append(item)
        else:
            stack.pop()
    return values


def from_binary(name: str, chunk: memoryview, datatype: str, count: int) -> Array:
    if datatype == "BYTES":
        return _bytes_from_binary(name, chunk, count)
    expected = count * V2_TO_NUMPY[datatype].itemsize
    if len(chunk) != expected:
        raise BadRequest(
            f"input {quote(name)}: binary_data_size is {len(chunk)}, "
            f"the shape and datatype need {expected}"
        )
    return fixed_from_binary(chunk, datatype, count)


def fixed_from_binary(chunk: memoryview, datatype: str, count: int) -> Array:
    if datatype == "BOOL":
        # Any non-zero byte is true; normalise so that no bool holds a value other than 0 or 1.
        return np.frombuffer(chunk, dtype=np.uint8, count=count).astype(np.bool_)
    # V2 binary tensors are little-endian whatever the host.
    return np.frombuffer(chunk, dtype=V2_TO_NUMPY[datatype].newbyteorder("<"), count=count)


def _bytes_from_binary(name: str, chunk: memoryview, count: int) -> Array:
    # Each element takes at least its 4-byte length, which bounds the count before any loop.
    if count * _BYTES_LENGTH.size > len(chunk):
        raise BadRequest(f"input {quote(name)}: binary BYTES data is shorter than its shape")
    array = np.empty(count, dtype=np.object_)
    offset = 0
    for i in range(count):
        if offset + _BYTES_LENGTH.size > len(chunk):
            raise BadRequest(f"input {quote(name)}: binary BYTES data is shorter than its shape")
        (length,) = _BYTES_LENGTH.unpack_from(chunk, offset)
        offset += _BYTES_LENGTH.size
        if length > len(chunk) - offset:
            raise BadRequest(f"input {quote(name)}: a BYTES element runs past binary_data_size")
        array[i] = bytes(chunk[offset : offset + length])
        offset += length
    if offset != len(chunk):
        raise BadRequest(
            f"input {quote(name)}: binary BYTES data has {len(chunk) - offset} bytes "
            "beyond its elements"
        )
    return array


def output_datatype(name: str, array: Array) -> str:
    try:
        # The V2 maps hold native-order dtypes; the byte order is fixed when encoding.
        return v2_datatype(array.dtype.newbyteorder("="))
    except KeyError:
        raise EngineError(f"output {quote(name)} has unsupported dtype {array.dtype}") from None


def _byte_elements(name: str, array: Array) -> list[bytes]:
    elements: list[bytes] = []
    for element in array.reshape(-1).tolist():
        if isinstance(element, bytes):
            elements.append(element)
        elif isinstance(element, str):
            elements.append(element.encode("utf-8"))
        else:
            raise EngineError(f"output {quote(name)}: BYTES elements must be bytes or str")
    return elements


def binary_chunk(name: str, array: Array, datatype: str) -> bytes | memoryview:
    if datatype == "BYTES":
        return b"".join(
            _BYTES_LENGTH.pack(len(element)) + element for element in _byte_elements(name, array)
        )
    little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return little.reshape(-1).view(np.uint8).data


def json_data(name: str, array: Array, datatype: str) -> Any:
    if datatype == "BYTES":
        return [e.decode("utf-8", errors="replace") for e in _byte_elements(name, array)]
    # orjson serialises contiguous native-order arrays; it has no bfloat16, and float32 holds
    # every bfloat16 value exactly.
    dtype = np.dtype(np.float32) if datatype == "BF16" else array.dtype.newbyteorder("=")
    return np.ascontiguousarray(array, dtype=dtype).reshape(-1)


def quote(text: str) -> str:
    """A client-supplied name for an error message, cut short so a message stays small."""
    return repr(text) if len(text) <= 64 else repr(text[:64]) + "..."
