"""Comparing a variant's outputs with FP32's, and with labels, on hand-computed cases."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from engines.precision import accuracy
from tests.conftest import TINY_BIAS, TINY_WEIGHTS, tiny_onnx


def test_softmax_is_stable_and_normalised() -> None:
    probabilities = accuracy.softmax(np.array([[0.0, math.log(3.0)], [1000.0, 1000.0]]))
    np.testing.assert_allclose(probabilities, [[0.25, 0.75], [0.5, 0.5]])


def test_top1_agreement() -> None:
    reference = np.array([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    candidate = np.array([[0.0, 5.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 9.0], [2.0, 1.0, 0.0]])
    assert accuracy.top1_agreement(reference, candidate) == 0.5
    assert accuracy.top1_agreement(reference, reference) == 1.0
    with pytest.raises(ValueError, match="shape"):
        accuracy.top1_agreement(reference, candidate[:2])


def test_mean_kl_by_hand() -> None:
    # P = (1/4, 3/4), Q = (1/2, 1/2): KL = 1/4 ln(1/2) + 3/4 ln(3/2).
    reference = np.array([[0.0, math.log(3.0)], [5.0, 5.0]])
    candidate = np.array([[0.0, 0.0], [1.0, 1.0]])
    expected = (0.25 * math.log(0.5) + 0.75 * math.log(1.5)) / 2
    assert accuracy.mean_kl(reference, candidate) == pytest.approx(expected)
    assert accuracy.mean_kl(reference, reference) == 0.0


def test_mean_kl_stays_finite_when_the_candidate_underflows() -> None:
    reference = np.array([[0.0, 0.0]])
    candidate = np.array([[0.0, -5000.0]])
    kl = accuracy.mean_kl(reference, candidate)
    assert math.isfinite(kl) and kl == pytest.approx(0.5 * 5000 + 0.5 * 0 - math.log(2), rel=1e-3)


def test_topk_accuracy() -> None:
    logits = np.array([[0.1, 0.5, 0.4], [0.7, 0.2, 0.1], [0.1, 0.2, 0.7]])
    labels = np.array([2, 0, 0])
    assert accuracy.topk_accuracy(logits, labels, 1) == pytest.approx(1 / 3)
    assert accuracy.topk_accuracy(logits, labels, 2) == pytest.approx(2 / 3)
    assert accuracy.topk_accuracy(logits, labels, 3) == 1.0
    with pytest.raises(ValueError, match="k must"):
        accuracy.topk_accuracy(logits, labels, 4)


def test_imagenet_labels_from_file_names() -> None:
    assert accuracy.imagenet_label_of("n01443537_goldfish.JPEG") == 1
    assert accuracy.imagenet_label_of(Path("/photos/n01440764_tench.jpg")) == 0
    assert accuracy.imagenet_label_of("n15075141.JPEG") == 999
    assert accuracy.imagenet_label_of("coffee.jpg") is None
    assert accuracy.imagenet_label_of("n99999999_unknown.jpg") is None
    assert accuracy.imagenet_label_of("n014435370_too_long.jpg") is None


def test_imagenet_index_is_the_sorted_wnid_order() -> None:
    index = accuracy._imagenet_1k_index()
    assert len(index) == 1000
    assert [index[wnid] for wnid in sorted(index)] == list(range(1000))


def test_run_onnx_in_batches(tmp_path: Path) -> None:
    import onnx

    x = np.random.default_rng(0).standard_normal((7, 4)).astype(np.float32)
    expected = x @ TINY_WEIGHTS + TINY_BIAS
    np.testing.assert_allclose(accuracy.run_onnx(tiny_onnx(), x, "x", batch=3), expected, rtol=1e-5)
    path = tmp_path / "tiny.onnx"
    onnx.save(tiny_onnx(), str(path))
    np.testing.assert_allclose(accuracy.run_onnx(path, x, "x", threads=1), expected, rtol=1e-5)


def test_max_relative_error_is_relative_to_each_outputs_scale() -> None:
    big = np.array([[100.0, -200.0]])
    small = np.array([[0.001, 0.002]])
    # 1 off on a scale of 200, and 0.0001 off on a scale of 0.002: the worst is 5%.
    found = accuracy.max_relative_error([big, small], [big + 1.0, small + 0.0001])
    assert found == pytest.approx(0.05)
    assert accuracy.max_relative_error([big], [big]) == 0.0
    assert accuracy.max_relative_error([big], [np.array([[np.inf, 0.0]])]) == float("inf")
    with pytest.raises(ValueError, match="differ in shape"):
        accuracy.max_relative_error([big], [small.T])
