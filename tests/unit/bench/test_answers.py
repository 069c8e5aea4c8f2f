"""``bench.answers``: V2 answers decoded as the server writes them, and compared row by row.
The answers are made by the server's own encoder (``app.protocol.encode_response``), binary
and JSON."""

from __future__ import annotations

import numpy as np
import pytest

from app.protocol import RequestedOutput, encode_response
from bench.answers import WRONG, Expected, check, decode, mismatch, separation
from bench.payloads import Payload


def binary_answer(outputs: dict[str, np.ndarray]) -> tuple[bytes, int]:
    """The server's V2 binary answer of ``outputs`` and its JSON header's length."""
    requested = [(RequestedOutput(name, binary=True), a) for name, a in outputs.items()]
    body, headers = encode_response("m", "1", None, requested)
    return body, int(headers["Inference-Header-Content-Length"])


def test_binary_and_json_answers_decode_to_their_arrays() -> None:
    logits = np.random.default_rng(0).normal(size=(3, 5)).astype(np.float16)
    labels = np.array([[4], [0], [2]], dtype=np.int64)
    body, length = binary_answer({"logits": logits, "labels": labels})
    got = decode(body, length)
    np.testing.assert_array_equal(got["logits"], logits)
    np.testing.assert_array_equal(got["labels"], labels)
    x = np.array([[1.5, 2], [3, 4]], dtype=np.float32)
    body, headers = encode_response("m", "1", None, [(RequestedOutput("y", binary=False), x)])
    assert "Inference-Header-Content-Length" not in headers  # JSON data
    (y,) = decode(body, None).values()
    assert y.dtype == np.float32 and y.tolist() == [[1.5, 2.0], [3.0, 4.0]]


def test_a_row_from_another_request_is_found_and_noise_within_the_tolerance_is_not() -> None:
    rng = np.random.default_rng(1)
    want = rng.normal(size=(4, 100)).astype(np.float32)
    expected = Expected.of({"y": want}, tolerance=0.02)
    noisy = want * (1 + 1e-3 * rng.standard_normal(want.shape)).astype(np.float32)
    assert mismatch(expected, {"y": noisy}) is None
    swapped = want[[0, 2, 1, 3]]
    assert "row 1" in (mismatch(expected, {"y": swapped}) or "")
    nan = want.copy()
    nan[3, 7] = np.nan
    assert "row 3" in (mismatch(expected, {"y": nan}) or "")
    assert "shape" in (mismatch(expected, {"y": want[:3]}) or "")
    assert "outputs" in (mismatch(expected, {"z": want}) or "")
    ints = Expected.of({"k": np.array([[1], [2]])}, tolerance=0.5)
    assert mismatch(ints, {"k": np.array([[1], [3]])}) == "k: values differ"


@pytest.mark.parametrize("status", [200, 400, 503])
def test_check_marks_only_a_2xx_answer_that_is_not_the_requests(status: int) -> None:
    want = np.arange(6, dtype=np.float32).reshape(2, 3) + 1
    payload = Payload(2, expected=Expected.of({"y": want}, 0.01))
    right, length = binary_answer({"y": want})
    wrong, _ = binary_answer({"y": want[::-1].copy()})
    assert check(payload, status, right, length) == status
    assert check(payload, status, wrong, length) == (WRONG if status == 200 else status)
    assert check(payload, status, b"not json", None) == (WRONG if status == 200 else status)
    assert check(Payload(2), status, wrong, length) == status  # nothing expected


def test_separation_is_the_closest_two_rows_relative_distance() -> None:
    a = {"y": np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32)}
    b = {"y": np.array([[1.0, 0.1]], dtype=np.float32)}
    assert separation([a, b]) == pytest.approx(0.1)
    assert separation([b]) is None
    assert separation([{"k": np.array([[1]])}]) is None
