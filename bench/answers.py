"""``--check-answers``: every answer under load compared, row by row, with the answer the same
server gave the same request alone.

A load measures statuses; a server that answers 200 with another request's row (a batch split
wrongly, a row copied to the wrong place) passes it. With the check, each distinct request is
first sent alone, one at a time, and its answer kept as the payload's ``Expected``; under
load every 2xx answer is decoded and each row of each output compared with the kept one: a
row whose relative error passes ``tolerance`` (or an integer output that differs at all)
makes the answer ``wrong-answer``, an error in the step's statuses. The tolerance allows
what a batch's size may change in a float answer (another kernel, another padding: FP16
logits move by about 1e-3 of their norm), not another row's answer; ``reference`` says how
far apart the distinct rows' answers are, so a tolerance that could not tell them apart is
seen. V2 over HTTP (binary or JSON outputs) and gRPC (``raw_output_contents``, unary calls
and streams); not uploads or the in-process targets.
"""

from __future__ import annotations

import math
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import orjson

from bench.payloads import Payload
from engines.spec import numpy_dtype

Reference = Callable[
    [str, list[Payload], float, float], tuple[list[Payload], tuple[float, int] | None]
]
"""``reference`` or ``reference_grpc``: a target's address, the payloads, the tolerance and
the timeout to the payloads with their answers alone and the ``separation`` of those."""

WRONG = "wrong-answer"
"""The status of a 2xx answer that is not the request's."""
_told = False  # the first wrong answer of a client process says why, on stderr


def is_float(dtype: np.dtype[np.generic]) -> bool:
    """Whether an output is compared within the tolerance: floats, BF16 too (``ml_dtypes``'
    bfloat16 is not a numpy floating type). Integers, booleans and BYTES are compared exactly
    (an argmax or top-k output can flip on a near tie that a batch's size moves: check such a
    model's float output instead)."""
    return bool(np.issubdtype(dtype, np.floating)) or dtype.name == "bfloat16"


@dataclass(frozen=True)
class Expected:
    """A request's answer when it was sent alone, output by output (``of`` makes it)."""

    outputs: dict[str, np.ndarray]
    tolerance: float
    rows: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    """Each float output as FP32 rows and each row's bound on its squared error (made once:
    an answer is then checked in a few numpy calls, ~10 us, where the client shares the
    machine with the server)."""

    @classmethod
    def of(cls, outputs: dict[str, np.ndarray], tolerance: float) -> Expected:
        rows = {}
        for name, array in outputs.items():
            if is_float(array.dtype):
                flat = as_rows(array)
                scale = np.einsum("ij,ij->i", flat, flat, dtype=np.float64)
                scale[scale == 0] = 1.0  # a row of zeros: an absolute bound
                rows[name] = (flat, tolerance * tolerance * scale)
        return cls(outputs, tolerance, rows)


def as_rows(array: np.ndarray) -> np.ndarray:
    """``array`` as FP32 rows (its first axis; a scalar is one row of one)."""
    shape = (len(array), math.prod(array.shape[1:])) if array.ndim else (1, 1)
    return array.reshape(shape).astype(np.float32, copy=False)


def decode(body: bytes, header_length: int | None) -> dict[str, np.ndarray]:
    """A V2 infer response's outputs: JSON ``data`` or, with ``Inference-Header-Content-Length``
    (``header_length``), raw bytes after the JSON header in the outputs' order."""
    header = orjson.loads(body[:header_length] if header_length is not None else body)
    at = header_length or 0
    outputs: dict[str, np.ndarray] = {}
    for output in header["outputs"]:
        dtype = numpy_dtype(output["datatype"])
        shape = tuple(output["shape"])
        size = (output.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if dtype.hasobject:
                raise ValueError(f"output {output['name']}: binary BYTES answers are not read")
            array = np.frombuffer(body, dtype, count=math.prod(shape), offset=at)
            at += int(size)
        elif is_float(dtype):  # JSON's null (a NaN or infinity) read as NaN
            array = np.asarray(output["data"], dtype=np.float64).astype(dtype)
        else:
            array = np.asarray(output["data"], dtype=dtype)
        outputs[output["name"]] = array.reshape(shape)
    return outputs


def decode_grpc(answer: bytes, stream: bool = False) -> dict[str, np.ndarray]:
    """A serialized ModelInferResponse's outputs (of a ModelStreamInferResponse with
    ``stream``), from its ``raw_output_contents`` (what Stoker and Triton answer)."""
    from app.frontend.grpc.generated import grpc_service_pb2 as pb

    if stream:
        response = pb.ModelStreamInferResponse.FromString(answer).infer_response
    else:
        response = pb.ModelInferResponse.FromString(answer)
    if len(response.raw_output_contents) != len(response.outputs):
        raise ValueError("outputs not in raw_output_contents are not read")
    outputs: dict[str, np.ndarray] = {}
    for output, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        dtype = numpy_dtype(output.datatype)
        if dtype.hasobject:
            raise ValueError(f"output {output.name}: BYTES answers over gRPC are not read")
        outputs[output.name] = np.frombuffer(raw, dtype).reshape(tuple(output.shape))
    return outputs


def mismatch(expected: Expected, got: dict[str, np.ndarray]) -> str | None:
    """Why ``got`` is not ``expected``'s answer (the first output and row that differs), or
    None when every row of every output is within the tolerance."""
    if got.keys() != expected.outputs.keys():
        return f"outputs {sorted(got)}, expected {sorted(expected.outputs)}"
    for name, want in expected.outputs.items():
        value = got[name]
        if value.shape != want.shape or value.dtype != want.dtype:
            return f"{name}: {value.dtype} {value.shape}, expected {want.dtype} {want.shape}"
        same_bytes = not value.dtype.hasobject and value.tobytes() == want.tobytes()
        if same_bytes:  # no arithmetic (most answers)
            continue
        made = expected.rows.get(name)
        if made is None:
            if not np.array_equal(value, want):
                return f"{name}: values differ"
            continue
        rows, bound = made
        difference = as_rows(value) - rows
        squared = np.einsum("ij,ij->i", difference, difference, dtype=np.float64)
        if not (squared <= bound).all():  # NaN fails too
            row = int(np.argmin(squared <= bound))
            error = float(np.sqrt(squared[row] / bound[row])) * expected.tolerance
            return f"{name} row {row}: relative error {error:.3g} > {expected.tolerance:g}"
    return None


def separation(answers: list[dict[str, np.ndarray]]) -> tuple[float, int] | None:
    """How far a row answered from another request's input would be off: the smallest
    relative distance between two rows of different requests' first float output, pairs of
    equal rows left out (the same input sent twice), and how many such equal pairs there
    were; None with no two requests' float rows to compare."""
    blocks = []
    for outputs in answers:
        floats = [v for v in outputs.values() if is_float(v.dtype) and v.ndim]
        if floats:
            blocks.append(as_rows(floats[0]).astype(np.float64))
    if len(blocks) < 2:
        return None
    smallest, equal = np.inf, 0
    for i, rows in enumerate(blocks[:-1]):
        others = np.concatenate(blocks[i + 1 :])
        norms = np.maximum(np.linalg.norm(rows, axis=1), 1e-30)
        for row, norm in zip(rows, norms, strict=True):
            distances = np.linalg.norm(others - row, axis=1) / norm
            equal += int((distances == 0).sum())
            apart = distances[distances > 0]
            if len(apart):
                smallest = min(smallest, float(apart.min()))
    return smallest, equal


def reference(
    url: str, payloads: list[Payload], tolerance: float, timeout_s: float
) -> tuple[list[Payload], tuple[float, int] | None]:
    """Each payload with the answer ``url`` (V2 over HTTP) gives it alone (sent one at a time),
    and the ``separation`` of those answers. Raises RuntimeError when a request alone is
    refused or its answer cannot be read (a binary BYTES output)."""

    def alone(payload: Payload) -> dict[str, np.ndarray]:
        request = urllib.request.Request(url, payload.body, payload.headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                length = response.headers.get("Inference-Header-Content-Length")
                body = response.read()
        except urllib.error.HTTPError as error:
            detail = error.read()[:300].decode("utf-8", "replace")
            raise RuntimeError(
                f"{url} answered {error.code} to a request alone: {detail}"
            ) from None
        return decode(body, None if length is None else int(length))

    return answered(url, payloads, tolerance, alone)


def reference_grpc(
    address: str, payloads: list[Payload], tolerance: float, timeout_s: float
) -> tuple[list[Payload], tuple[float, int] | None]:
    """``reference`` over gRPC: each payload (a serialized ModelInferRequest) as a ModelInfer
    call of its own to ``address``."""
    import grpc

    from bench.grpc_client import GRPC_INFER

    with grpc.insecure_channel(
        address, options=[("grpc.max_receive_message_length", -1)]
    ) as channel:
        call: Any = channel.unary_unary(GRPC_INFER)  # bytes in, bytes out

        def alone(payload: Payload) -> dict[str, np.ndarray]:
            try:
                answer = call(payload.body, timeout=timeout_s)
            except grpc.RpcError as error:
                code = error.code().name
                why = error.details()
                raise RuntimeError(f"{address} answered {code} to a request alone: {why}") from None
            return decode_grpc(answer)

        return answered(address, payloads, tolerance, alone)


def answered(
    where: str,
    payloads: list[Payload],
    tolerance: float,
    alone: Callable[[Payload], dict[str, np.ndarray]],
) -> tuple[list[Payload], tuple[float, int] | None]:
    checked, answers = [], []
    for payload in payloads:
        try:
            outputs = alone(payload)
        except (ValueError, KeyError, TypeError) as error:
            raise RuntimeError(
                f"{where}'s answer to a request alone is not read: {error}"
            ) from None
        answers.append(outputs)
        checked.append(replace(payload, expected=Expected.of(outputs, tolerance)))
    return checked, separation(answers)


def check(payload: Payload, status: int, read: Callable[[], dict[str, np.ndarray]]) -> int | str:
    """The status to record: ``status``, or ``WRONG`` for a 2xx answer that is not the
    payload's expected one (or cannot be read as one: ``read`` decodes it); the first of a
    process says why."""
    global _told
    expected = payload.expected
    if expected is None or not 200 <= status < 300:
        return status
    try:
        wrong = mismatch(expected, read())
    except (ValueError, KeyError, TypeError) as error:
        wrong = f"not read: {error}"
    if wrong is None:
        return status
    if not _told:
        _told = True
        print(f"bench: a wrong answer ({wrong}); later ones are counted only", file=sys.stderr)
    return WRONG
