"""``bench.answers``: V2 answers decoded as the server writes them, and compared row by row.
The answers are made by the server's own encoder (``app.protocol.encode_response``), binary
and JSON."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from app.contract import Answer
from app.frontend.grpc import codec
from app.protocol import RequestedOutput, encode_response
from bench.answers import WRONG, Expected, check, decode, decode_grpc, mismatch, separation
from bench.payloads import Payload
from engines.spec import numpy_dtype


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
    assert "expected float32 (4, 100)" in (mismatch(expected, {"y": want[:3]}) or "")
    assert "outputs" in (mismatch(expected, {"z": want}) or "")
    ints = Expected.of({"k": np.array([[1], [2]])}, tolerance=0.5)
    assert mismatch(ints, {"k": np.array([[1], [3]])}) == "k: values differ"


@pytest.mark.parametrize("status", [200, 400, 503])
def test_check_marks_only_a_2xx_answer_that_is_not_the_requests(status: int) -> None:
    want = np.arange(6, dtype=np.float32).reshape(2, 3) + 1
    payload = Payload(2, expected=Expected.of({"y": want}, 0.01))
    right, length = binary_answer({"y": want})
    wrong, _ = binary_answer({"y": want[::-1].copy()})
    assert check(payload, status, partial(decode, right, length)) == status
    wrong_read = partial(decode, wrong, length)
    assert check(payload, status, wrong_read) == (WRONG if status == 200 else status)
    garbled = partial(decode, b"not json", None)
    assert check(payload, status, garbled) == (WRONG if status == 200 else status)
    assert check(Payload(2), status, wrong_read) == status  # nothing expected


def test_grpc_answers_decode_as_the_server_encodes_them() -> None:
    """The server's ModelInferResponse of a binary answer (``codec.infer_response``), and the
    same as a stream's message (``codec.stream_answer``), read back to the arrays."""
    logits = np.random.default_rng(3).normal(size=(2, 7)).astype(np.float16)
    body, headers = encode_response("m", "1", None, [(RequestedOutput("logits", True), logits)])
    response = codec.infer_response(Answer("m", "1", headers, body))
    np.testing.assert_array_equal(decode_grpc(response)["logits"], logits)
    streamed = codec.stream_answer(response)
    np.testing.assert_array_equal(decode_grpc(streamed, stream=True)["logits"], logits)


def test_separation_is_between_rows_of_different_requests() -> None:
    a = {"y": np.array([[1.0, 0.0], [1.0, 0.001]], dtype=np.float32)}  # 0.001 apart, one request
    b = {"y": np.array([[0.0, 1.0], [0.0, 2.0]], dtype=np.float32)}  # 1.0 apart, one request
    closest, equal = separation([a, b]) or (None, None)
    assert closest == pytest.approx(np.hypot(1, 0.999) / np.hypot(1, 0.001), rel=1e-4)
    assert equal == 0
    again = {"y": a["y"].copy()}  # the same input sent twice: its rows are left out
    closest, equal = separation([a, again]) or (None, None)
    assert closest == pytest.approx(0.001, rel=1e-2) and equal == 2
    assert separation([b]) is None
    assert separation([{"k": np.array([[1]])}, {"k": np.array([[2]])}]) is None


def test_bf16_rows_are_compared_within_the_tolerance_and_json_nulls_read_as_nan() -> None:
    bf16 = numpy_dtype("BF16")
    want = np.random.default_rng(2).normal(size=(2, 64)).astype(np.float32).astype(bf16)
    expected = Expected.of({"y": want}, tolerance=0.02)
    moved = (want.astype(np.float32) * 1.004).astype(bf16)  # a rounding or two apart
    assert not np.array_equal(moved.view(np.uint16), want.view(np.uint16))
    assert mismatch(expected, {"y": moved}) is None
    assert "row 0" in (mismatch(expected, {"y": want[::-1].copy()}) or "")
    assert "expected" in (mismatch(expected, {"y": want.astype(np.float32)}) or "")  # dtype
    x = np.array([[np.nan, 1.0]], dtype=np.float32)
    for datatype in ("FP32", "BF16"):
        array = x.astype(numpy_dtype(datatype))
        body, _ = encode_response("m", "1", None, [(RequestedOutput("y", binary=False), array)])
        assert b"null" in body
        (y,) = decode(body, None).values()
        assert y.dtype == array.dtype and np.isnan(y.astype(np.float32)[0, 0])


def test_a_binary_bytes_answer_is_not_read() -> None:
    words = np.array([[b"cat"], [b"dog"]], dtype=object)
    body, length = binary_answer({"labels": words})
    with pytest.raises(ValueError, match="BYTES"):
        decode(body, length)
    json_body, _ = encode_response("m", "1", None, [(RequestedOutput("labels", False), words)])
    (labels,) = decode(json_body, None).values()
    assert labels.tolist() == [["cat"], ["dog"]]
