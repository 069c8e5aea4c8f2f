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
seen. V2 over HTTP (binary or JSON outputs) only.
"""

from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass, field, replace

import numpy as np
import orjson

from bench.payloads import Payload
from engines.spec import numpy_dtype

WRONG = "wrong-answer"
"""The status of a 2xx answer that is not the request's."""


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
            if np.issubdtype(array.dtype, np.floating):
                flat = as_rows(array)
                scale = np.einsum("ij,ij->i", flat, flat, dtype=np.float64)
                scale[scale == 0] = 1.0  # a row of zeros: an absolute bound
                rows[name] = (flat, tolerance * tolerance * scale)
        return cls(outputs, tolerance, rows)


def as_rows(array: np.ndarray) -> np.ndarray:
    """``array`` as FP32 rows (its first axis; a scalar is one row of one)."""
    flat = array.reshape(len(array), -1) if array.ndim else array.reshape(1, 1)
    return flat.astype(np.float32, copy=False)


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
            array = np.frombuffer(body, dtype, count=math.prod(shape), offset=at)
            at += int(size)
        else:
            array = np.asarray(output["data"], dtype=dtype)
        outputs[output["name"]] = array.reshape(shape)
    return outputs


def mismatch(expected: Expected, got: dict[str, np.ndarray]) -> str | None:
    """Why ``got`` is not ``expected``'s answer (the first output and row that differs), or
    None when every row of every output is within the tolerance."""
    if got.keys() != expected.outputs.keys():
        return f"outputs {sorted(got)}, expected {sorted(expected.outputs)}"
    for name, want in expected.outputs.items():
        value = got[name]
        if value.shape != want.shape:
            return f"{name}: shape {value.shape}, expected {want.shape}"
        if value.tobytes() == want.tobytes():  # the same bytes: no arithmetic (most answers)
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


def separation(answers: list[dict[str, np.ndarray]]) -> float | None:
    """The smallest relative distance between two different requests' rows of the first float
    output (how far a row answered from another request's input would be off); None with
    fewer than two rows or no float output."""
    rows: list[np.ndarray] = []
    for outputs in answers:
        floats = [v for v in outputs.values() if np.issubdtype(v.dtype, np.floating) and v.ndim]
        if floats:
            rows.extend(floats[0].astype(np.float64).reshape(len(floats[0]), -1))
    if len(rows) < 2:
        return None
    matrix = np.stack(rows)
    norms = np.maximum(np.linalg.norm(matrix, axis=1), 1e-30)
    smallest = np.inf
    for i in range(len(matrix) - 1):
        distances = np.linalg.norm(matrix[i + 1 :] - matrix[i], axis=1) / norms[i]
        smallest = min(smallest, float(distances.min()))
    return smallest


def reference(
    url: str, payloads: list[Payload], tolerance: float, timeout_s: float
) -> tuple[list[Payload], float | None]:
    """Each payload with the answer ``url`` gives it alone (sent one at a time), and the
    separation of those answers' rows. Raises RuntimeError on an answer that is not 2xx."""
    checked, answers = [], []
    for payload in payloads:
        request = urllib.request.Request(url, payload.body, payload.headers, method="POST")
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            if not 200 <= response.status < 300:
                raise RuntimeError(f"{url} answered {response.status} to a request alone")
            length = response.headers.get("Inference-Header-Content-Length")
            outputs = decode(response.read(), None if length is None else int(length))
        answers.append(outputs)
        checked.append(replace(payload, expected=Expected.of(outputs, tolerance)))
    return checked, separation(answers)


def check(payload: Payload, status: int, body: bytes, header_length: int | None) -> int | str:
    """The status to record: ``status``, or ``WRONG`` for a 2xx answer that is not the
    payload's expected one (or cannot be read as one)."""
    expected = payload.expected
    if expected is None or not 200 <= status < 300:
        return status
    try:
        wrong = mismatch(expected, decode(body, header_length))
    except (ValueError, KeyError, TypeError):
        return WRONG
    return status if wrong is None else WRONG
