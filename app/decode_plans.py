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
not a shared-memory region), keyed by the terms of the model (``Contract.serial``), the JSON
depth bound, the JSON's bytes and the binary part's length; it is made at a header's second
sighting, so a header sent once (a client that gives every request a new ``id``, a gRPC call
with a deadline) costs its key and a place among the ``limit`` keys seen once, not a plan
(some 8 us on the 2-core EPYC, against the 40 a plan saves), and pushes no kept plan out.
Never planned: a header that names a datatype decoded element by element, an escape or
shared memory (``contract.plannable``), one over ``MAX_HEADER_BYTES``, a contract without a
serial. ``DecodePlans`` holds at most ``limit`` plans, dropping the oldest.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
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
        start = np.frombuffer(binary, np.uint8).__array_interface__["data"][0]
        end = start + len(binary)
        inputs = []
        for name, array in request.inputs.items():
            at = array.__array_interface__["data"][0]
            if (
                array.dtype.kind in "bOUS"  # converted element by element, or not of fixed size
                or not array.size
                or not array.flags.c_contiguous
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
    """At most ``limit`` plans and ``limit`` keys seen once, the oldest dropped first; safe
    from several threads (a decode may run on a worker thread)."""

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        # OrderedDict: a dict's first key, after many deletions at its front, is found by a
        # scan over their dummy entries; ``popitem(last=False)`` is O(1).
        self._plans: OrderedDict[PlanKey, Plan] = OrderedDict()
        self._once: OrderedDict[PlanKey, None] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._plans)

    def __contains__(self, key: PlanKey) -> bool:
        return key in self._plans

    def get(self, key: PlanKey) -> Plan | None:
        return self._plans.get(key)

    def again(self, key: PlanKey) -> bool:
        """Whether ``key`` was seen before without a plan (then it is due one); notes it
        as seen once otherwise."""
        with self._lock:
            if self._once.pop(key, 0) is None:
                return True
            self._once[key] = None
            if len(self._once) > self.limit:
                self._once.popitem(last=False)
            return False

    def keep(self, key: PlanKey, plan: Plan) -> None:
        with self._lock:
            self._plans[key] = plan
            if len(self._plans) > self.limit:
                self._plans.popitem(last=False)
