"""What a V2 body's JSON may cost, bounded before and while it is parsed.

A JSON value costs 8 to 80 bytes as a Python object, and the parser holds the GIL while it
builds them: ``check_json_size`` refuses (413) JSON that holds more values than any valid
request for the model can, by counting three characters at C speed, and ``LargeDecodes``
runs the large decodes that pass one at a time per process with the cyclic garbage
collector paused. ``app.contract`` calls both before and around ``decode_request``.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from app.errors import BadRequest, PayloadTooLarge
from app.protocol import HEADER_LENGTH
from engines.spec import ModelSpec

T = TypeVar("T")

# JSON smaller than this is parsed without being counted first: it cannot cost much.
COUNTED_JSON_BYTES = 64 * 1024
# Commas and objects a valid request has beside its tensors' elements: per input or output
# (its name, datatype, shape and parameters) and in all (an id, request parameters).
STRUCTURE_PER_TENSOR = 64
STRUCTURE = 1024


def json_part(body: bytes | bytearray | memoryview, header_length: int | None) -> memoryview:
    """The JSON of a V2 body: all of it, or its first ``header_length`` bytes (none for a
    raw binary body, ``header_length`` 0); 400 for a length past the body, before any size
    check counts what is there (that is no request's fault of size)."""
    view = memoryview(body)
    if header_length is None:
        return view
    if header_length > len(view):
        raise BadRequest(f"{HEADER_LENGTH} is larger than the body")
    return view[:header_length]


def count_byte(data: memoryview, byte: bytes) -> int:
    """How often ``byte`` occurs in ``data``: numpy's vector compare over the bytes in place
    (about 12 GB/s on the 2-core EPYC, where a copy and ``bytes.count`` made 1.3 GB/s),
    1 MiB at a time so that the comparison's mask stays small."""
    codes = np.frombuffer(data, np.uint8)
    code = byte[0]
    step = 1024 * 1024
    return sum(
        int(np.count_nonzero(codes[at : at + step] == code)) for at in range(0, len(codes), step)
    )


def check_json_size(spec: ModelSpec, document: memoryview) -> None:
    """Refuse (413), before parsing, JSON that holds more values than any valid request for
    this model can: a JSON value costs 8 to 80 bytes as a Python object, so a 64 MiB body of
    22 M ``{}`` would cost 1.7 GB and seconds of the GIL to be refused after parsing. Commas
    bound the values (every value but a container's first follows one), braces the objects,
    brackets the lists. A valid request has a few objects (the document, its inputs and
    outputs, their parameters); as many lists as data nested along its inputs' shapes has
    when only their last dimension may vary (``nested_lists``); when every input's shape is
    fixed, at most the model's rows times each input's elements. Strings may hold any of
    these characters: a model with a BYTES input is not counted."""
    if len(document) < COUNTED_JSON_BYTES:
        return
    if any(tensor.datatype == "BYTES" for tensor in spec.inputs):
        return
    tensors = len(spec.inputs) + len(spec.outputs)
    objects = count_byte(document, b"{")
    most_objects = 2 * tensors + STRUCTURE_PER_TENSOR
    if objects > most_objects:
        raise PayloadTooLarge(
            f"request JSON holds {objects} objects; a request for this model holds at most "
            f"{most_objects}: tensor data are numbers"
        )
    most_lists = nested_lists(spec)
    if most_lists is not None:
        lists = count_byte(document, b"[")
        most_lists += STRUCTURE_PER_TENSOR * tensors
        if lists > most_lists:
            raise PayloadTooLarge(
                f"request JSON holds {lists} lists; data nested along this model's shapes "
                f"hold at most {most_lists}"
            )
    if not all(tensor.is_static for tensor in spec.inputs):
        return  # any number of elements may be valid: max_body_bytes bounds them
    rows = max(spec.max_batch_size, 1)
    elements = sum(rows * int(np.prod(tensor.shape)) for tensor in spec.inputs)
    most_values = elements + STRUCTURE_PER_TENSOR * tensors + STRUCTURE
    values = count_byte(document, b",")
    if values > most_values:
        raise PayloadTooLarge(
            f"request JSON holds at least {values} values; this model takes at most "
            f"{elements} elements per request ({rows} rows)"
        )


def nested_lists(spec: ModelSpec) -> int | None:
    """The most lists the ``data`` of a valid request's inputs hold, nested along their
    shapes at the model's most rows: for a shape (d0, ..., dk), 1 + d0 + d0 d1 + ... +
    d0...d(k-1). None when a dimension before the last is dynamic: any number may be valid."""
    rows = max(spec.max_batch_size, 1)
    total = 0
    for tensor in spec.inputs:
        dims = (rows, *tensor.shape) if spec.batched else tensor.shape
        lists = running = 1
        for dim in dims[:-1]:
            if dim == -1:
                return None
            running *= dim
            lists += running
        total += lists
    return total


class LargeDecodes:
    """The JSON decodes too large for the event loop, per process: run on a worker thread,
    at most ``limit`` at once (the others wait their turn, event-driven), with the cyclic
    garbage collector paused while any runs. The parser builds a Python object per JSON
    value while holding the GIL, and with the collector on it scans the young objects again
    and again as they pile up: 22 M small lists took 6 to 8 s to parse, 1.0 to 1.2 s with it
    paused, a stall of the event loop either way (health probes included). The collector
    runs again as soon as the last one ends."""

    def __init__(self) -> None:
        self._gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()
        self._running = 0
        self._paused = False

    async def run(self, decode: Callable[[], T], limit: int) -> T:
        loop = asyncio.get_running_loop()
        gate = self._gates.get(loop)
        if gate is None:
            gate = self._gates[loop] = asyncio.Semaphore(limit)
        async with gate:
            return await asyncio.to_thread(self._paused_gc, decode)

    def _paused_gc(self, decode: Callable[[], T]) -> T:
        with self._lock:
            self._running += 1
            if self._running == 1 and gc.isenabled():
                gc.disable()
                self._paused = True
        try:
            return decode()
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0 and self._paused:
                    self._paused = False
                    gc.enable()


LARGE_DECODES = LargeDecodes()
