"""What a binary V2 request's JSON comes to, kept: the next request with the same JSON takes
its tensors out of its own body at the same places, without parsing or checking it again.

A client sends the same JSON before every request of one shape: tritonclient, perf_analyzer
and the KServe clients write a request's header from its tensors' names, datatypes and
shapes, so a load of one shape repeats one header byte for byte. Decoding and checking that
header (``app.contract.decode_infer``: the JSON, each input's entry, its datatype and shape
against the model, the outputs, the rows) cost some 50 us of a front end's loop a request on
a 2-core EPYC, the largest single item of a batch-1 request's Python (BENCHMARKS.md). What
the header decides does not depend on the tensors' bytes when every input is a fixed-size
binary tensor read in place: the same header and the same binary length give the same
request, rows and outputs, and each input the same datatype, shape and offset in the body.

So a decode that passed is kept as a ``Plan`` when every input it made is a view of the
body's binary part (not JSON data, not BOOL or BYTES, which are converted element by element,
not a shared-memory region), keyed by the terms of the model (``Contract.serial``), the JSON's
bytes and the binary part's length. A header that names a datatype decoded element by element,
an escape or a shared-memory region is never planned (``contract.elementwise``), nor is one
over ``MAX_HEADER_BYTES``, nor a contract without a serial. ``DecodePlans`` holds at most
``limit`` plans, dropping the oldest: a client that sends a new ``id`` with every request
misses every time and costs a plan's making (a few microseconds) and a bounded dict.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from app.protocol import InferRequest, RequestedOutput

MAX_HEADER_BYTES = 4096
"""The longest JSON header a plan is kept for (a request of a few tensors takes 200-400)."""

PlanKey = tuple[int, int, bytes, int]
"""(the contract's serial, the JSON depth bound, the JSON's bytes, the binary part's length)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """A header's decoding apart from its tensors' bytes: the request without inputs, each
    input's (name, dtype, element count, shape, offset in the binary part), its rows and the
    outputs asked for."""

    request: InferRequest
    inputs: tuple[tuple[str, np.dtype[Any], int, tuple[int, ...], int], ...]
    rows: int
    wanted: tuple[RequestedOutput, ...]

    def decode(self, binary: memoryview) -> tuple[InferRequest, int, list[RequestedOutput]]:
        """The request of a body whose binary part is ``binary``, its rows and the outputs
        asked for (a ``Decoded``'s fields)."""
        request = self.request
        inputs = {
            name: np.frombuffer(binary, dtype, count, offset).reshape(shape)
            for name, dtype, count, shape, offset in self.inputs
        }
        made = InferRequest(
            request.id,
            inputs,
            request.outputs,
            request.binary_data_output,
            request.timeout_us,
            request.priority,
        )
        return made, self.rows, list(self.wanted)

    @classmethod
    def of(
        cls,
        request: InferRequest,
        rows: int,
        wanted: Sequence[RequestedOutput],
        binary: memoryview,
    ) -> Plan | None:
        """The plan of a decode (``request``, its ``rows`` and the outputs ``wanted``) of a
        body whose binary part is ``binary``; None unless every input is a contiguous view of
        ``binary`` in one piece."""
        if not len(binary):
            return None
        start = np.frombuffer(binary, np.uint8).ctypes.data
        end = start + len(binary)
        inputs = []
        for name, array in request.inputs.items():
            at = array.ctypes.data
            if (
                array.dtype.kind in "bOUS"  # converted element by element, or not of fixed size
                or not array.size
                or not array.flags.c_contiguous
                or array.flags.owndata
                or not start <= at <= end - array.nbytes
            ):
                return None
            inputs.append((name, array.dtype, int(array.size), tuple(array.shape), at - start))
        empty = InferRequest(
            request.id,
            {},
            request.outputs,
            request.binary_data_output,
            request.timeout_us,
            request.priority,
        )
        return cls(empty, tuple(inputs), rows, tuple(wanted))


class DecodePlans:
    """At most ``limit`` plans, the oldest dropped first; safe from several threads (a
    decode may run on a worker thread)."""

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self._plans: dict[PlanKey, Plan] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._plans)

    def get(self, key: PlanKey) -> Plan | None:
        return self._plans.get(key)

    def keep(self, key: PlanKey, plan: Plan) -> None:
        with self._lock:
            plans = self._plans
            plans[key] = plan
            while len(plans) > self.limit:
                del plans[next(iter(plans))]
