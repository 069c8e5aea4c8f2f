"""INT8 calibration: the activation ranges that Q/DQ nodes quantize with, from real data.

A calibration set is a folder of images run through the model's own preprocessing (or
``.npy``/``.npz`` rows already preprocessed); with none at hand, ``augmented_builtin_set``
makes one from scikit-image's public-domain photos. ``collect_ranges`` runs a copy of the FP32
model that exposes every activation the Q/DQ quantizer needs, in one pass a stride of rows at a
time so memory stays bounded whatever the set's size, and reduces them with one calibrator:

- ``minmax``: the observed (min, max), outliers included;
- ``percentile``: the given percentile of ``|x|``;
- ``entropy``: TensorRT's KL-divergence threshold search over a 2048-bin histogram of ``|x|``.

Percentile and entropy ranges are symmetric, ``(-T, T)``, except for tensors that were never
negative in calibration (ReLU outputs), which get ``(0, T)``: the unsigned activations of the
CPU form then keep all 256 levels, and the symmetric form symmetrises them anyway.
Exact zeros are left out of the histograms: zero is quantized exactly whatever the threshold,
and the spike at zero that a ReLU leaves would otherwise dominate the KL search.

The same pass records the per-channel means of the Conv/Gemm inputs, with which ``to_int8``
corrects the bias that rounding the weights introduces. ``Ranges`` serialise to JSON so that a
rebuild does not recalibrate.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

from engines.precision.accuracy import session

logger = logging.getLogger(__name__)


CALIBRATORS = ("minmax", "percentile", "entropy")


Progress = Callable[[int, int], None]


# The op types ONNX Runtime's static quantizer handles by default: their float inputs and
# outputs are the tensors it needs a range for.
QUANTIZABLE_OPS = frozenset(QDQRegistry) | frozenset(QLinearOpsRegistry)


_FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)


# TensorRT's entropy calibrator: 128 quantized levels for the positive half of INT8.
_LEVELS = 128


# Counts given to an empty bin of the entropy search's Q where P has mass (MXNet's epsilon).
_SMOOTHING = 1e-4


# Histograms are collected this many times finer than the entropy calibrator's bins.
_REFINE = 8


@dataclass(frozen=True)
class Ranges:
    """Calibrated activation ranges: tensor name -> (low, high), and how they were found.

    ``channel_means`` holds the mean of each weight node's input per channel (axis 1), which
    ``to_int8`` uses to correct the bias shift that rounding the weights causes.
    """

    method: str
    tensors: dict[str, tuple[float, float]] = field(default_factory=dict)
    channel_means: dict[str, tuple[float, ...]] = field(default_factory=dict)

    def to_json(self) -> str:
        body = {
            "method": self.method,
            "tensors": {k: list(v) for k, v in self.tensors.items()},
            "channel_means": {k: list(v) for k, v in self.channel_means.items()},
        }
        return json.dumps(body, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Ranges:
        try:
            body = json.loads(text)
            method = str(body["method"])
            tensors = {str(k): (float(lo), float(hi)) for k, (lo, hi) in body["tensors"].items()}
            means = {
                str(k): tuple(float(m) for m in v) for k, v in body.get("channel_means", {}).items()
            }
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"not a calibration cache: {error!r}") from error
        return cls(method, tensors, means)

    def scaled(self, factor: float) -> Ranges:
        """Every range multiplied by ``factor``: a deliberately wrong calibration, for tests."""
        return Ranges(
            f"{self.method}*{factor:g}",
            {k: (lo * factor, hi * factor) for k, (lo, hi) in self.tensors.items()},
            self.channel_means,
        )


def calibration_tensors(model: onnx.ModelProto) -> list[str]:
    """The float activations the Q/DQ quantizer needs ranges for, in graph order.

    The inputs and outputs of every node of a quantizable op type, minus initializers.
    """
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    types = {
        value.name: value.type.tensor_type.elem_type
        for value in (*graph.value_info, *graph.input, *graph.output)
        if value.type.HasField("tensor_type")
    }
    constants = {init.name for init in graph.initializer}
    names: dict[str, None] = {}
    for node in graph.node:
        if node.op_type not in QUANTIZABLE_OPS:
            continue
        for name in (*node.input, *node.output):
            if name and name not in constants and types.get(name) in _FLOAT_TYPES:
                names[name] = None
    return list(names)


def weight_inputs(model: onnx.ModelProto) -> list[str]:
    """The activations that Conv and Gemm nodes multiply by constant weights (their input 0)."""
    constants = {init.name for init in model.graph.initializer}
    names: dict[str, None] = {}
    for node in model.graph.node:
        transposed = any(a.name == "transA" and a.i for a in node.attribute)
        if (
            node.op_type in ("Conv", "Gemm")
            and not transposed
            and len(node.input) > 1
            and node.input[1] in constants
            and node.input[0] not in constants
        ):
            names[node.input[0]] = None
    return list(names)


def _exposing(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """A copy of ``model`` whose graph outputs are ``names`` (typed by shape inference)."""
    augmented = onnx.shape_inference.infer_shapes(model)
    graph = augmented.graph
    values = {v.name: v for v in (*graph.value_info, *graph.input, *graph.output)}
    del graph.output[:]
    for name in names:
        value = onnx.ValueInfoProto()
        value.CopyFrom(values[name])
        graph.output.append(value)
    return augmented


def _batches(
    model: onnx.ModelProto,
    names: list[str],
    data: np.ndarray,
    input_name: str,
    stride: int,
    threads: int,
) -> Iterable[tuple[int, list[np.ndarray]]]:
    """(rows done, the activations of the next ``stride`` rows), through the exposing model."""
    if stride < 1:
        raise ValueError(f"stride must be positive, got {stride}")
    runner = session(_exposing(model, names), threads)
    for start in range(0, len(data), stride):
        batch = data[start : start + stride]
        yield start + len(batch), [np.asarray(v) for v in runner.run(names, {input_name: batch})]


class TensorStatistics:
    """What the calibrators need of one activation: its extremes and a histogram of |x|.

    The histogram covers [0, ``limit``] in fixed bins; data beyond the limit doubles it,
    merging bins pairwise (exact on the coarser grid), so one pass suffices however the
    magnitudes grow. Exact zeros are counted apart (``zeros``), out of the histogram.
    """

    def __init__(self, bins: int | None, channel_means: bool = False) -> None:
        self.low = math.inf
        self.high = -math.inf
        self.limit = 0.0
        self.zeros = 0
        self.histogram = None if bins is None else np.zeros(bins, dtype=np.int64)
        self.averaged = channel_means
        self.channel_sum: np.ndarray | None = None
        self.channel_count = 0

    @property
    def absmax(self) -> float:
        return max(abs(self.low), abs(self.high)) if math.isfinite(self.low) else 0.0

    def channel_means(self) -> tuple[float, ...] | None:
        if self.channel_sum is None or self.channel_count <= 0:
            return None
        return tuple(float(m) for m in self.channel_sum / self.channel_count)

    def update(self, value: np.ndarray) -> None:
        if value.size == 0:
            return
        self.low = min(self.low, float(value.min()))
        self.high = max(self.high, float(value.max()))
        if self.averaged and value.ndim >= 2:
            axes = tuple(a for a in range(value.ndim) if a != 1)
            sums = value.sum(axis=axes, dtype=np.float64)
            self.channel_sum = sums if self.channel_sum is None else self.channel_sum + sums
            self.channel_count += value.size // value.shape[1]
        if self.histogram is None or self.absmax == 0.0:
            return
        if self.limit == 0.0:
            self.limit = self.absmax
        while self.limit < self.absmax:
            # Doubling the range merges bin pairs: exact, at half the resolution.
            self.histogram = np.concatenate(
                [self.histogram.reshape(-1, 2).sum(axis=1), np.zeros_like(self.histogram[::2])]
            )
            self.limit *= 2.0
        bins = self.histogram.size
        magnitudes = np.abs(value.ravel(), dtype=np.float32)
        magnitudes *= bins / self.limit
        index = magnitudes.astype(np.intp)
        np.minimum(index, bins - 1, out=index)
        counts = np.bincount(index, minlength=bins)
        zeros = value.size - int(np.count_nonzero(value))
        counts[0] -= zeros
        self.zeros += zeros
        self.histogram += counts

    def magnitude_histogram(self, bins: int) -> np.ndarray:
        """The non-zero |x| counts in ``bins`` even bins over [0, absmax], as floats.

        Resampled from the finer histogram over [0, limit] by interpolating its cumulative
        counts; everything at or below ``absmax`` lands in range.
        """
        if self.histogram is None:
            raise ValueError("no histogram was collected")
        cumulative = np.concatenate([[0.0], np.cumsum(self.histogram, dtype=np.float64)])
        if self.absmax == 0.0 or cumulative[-1] == 0:
            return np.zeros(bins)
        edges = np.linspace(0.0, self.limit, self.histogram.size + 1)
        resampled = np.interp(np.linspace(0.0, self.absmax, bins + 1), edges, cumulative)
        resampled[-1] = cumulative[-1]
        return np.diff(resampled)


def collect_statistics(
    model: onnx.ModelProto,
    data: np.ndarray,
    input_name: str,
    *,
    histograms: bool,
    bins: int = 2048,
    stride: int = 16,
    threads: int = 0,
    progress: Progress | None = None,
) -> dict[str, TensorStatistics]:
    """Extremes and (with ``histograms``) |x| histograms of every activation to calibrate,
    and the per-channel means of the weight nodes' inputs.

    One pass over ``data``, ``stride`` rows at a time, so memory holds one stride of
    activations whatever the set's size. Histograms are ``_REFINE`` times finer than
    ``bins``, for percentiles far out in the tail and for resampling.
    """
    if len(data) == 0:
        raise ValueError("no calibration rows")
    names = calibration_tensors(model)
    averaged = weight_inputs(model)
    names += [name for name in averaged if name not in names]
    fine_bins = bins * _REFINE if histograms else None
    stats = {name: TensorStatistics(fine_bins, name in averaged) for name in names}
    for done, values in _batches(model, names, data, input_name, stride, threads):
        for name, value in zip(names, values, strict=True):
            stats[name].update(value)
        if progress is not None:
            progress(done, len(data))
    return stats


def percentile_threshold(entry: TensorStatistics, percentile: float) -> float:
    """The |x| below which ``percentile`` % of the non-zero magnitudes lie (a bin's upper edge)."""
    if entry.histogram is None:
        raise ValueError("the percentile calibrator needs histograms")
    total = int(entry.histogram.sum())
    if total == 0:
        return entry.absmax
    index = int(np.searchsorted(np.cumsum(entry.histogram), total * percentile / 100.0))
    return min(entry.absmax, (index + 1) * entry.limit / entry.histogram.size)


def _xlogx(x: np.ndarray) -> np.ndarray:
    return np.where(x > 0, x * np.log(np.where(x > 0, x, 1.0)), 0.0)


def entropy_divergences(histogram: np.ndarray, levels: int = _LEVELS) -> np.ndarray:
    """KL(P || Q) for every candidate threshold bin ``i`` in ``levels..bins`` (TensorRT's search).

    P is the first ``i`` bins with everything beyond folded into bin ``i - 1``; Q merges those
    ``i`` bins (without the fold) into ``levels`` levels, bin ``j`` into level
    ``j * levels // i``, and spreads each level's mass evenly over its non-empty bins. Both are
    normalised. Where the fold puts mass in a bin that Q leaves empty, Q gets ``_SMOOTHING``
    counts there (as MXNet's and ONNX Runtime's smoothing does) rather than an infinite
    divergence, so a few far outliers do not forbid every threshold below them. Computed for
    all candidates at once from cumulative sums: within a level Q is constant, so
    KL = sum_j p_j log p_j - sum_levels P_level log q_level.
    """
    counts = np.asarray(histogram, dtype=np.float64)
    bins = counts.size
    total = counts.sum()
    candidates = np.arange(levels, bins + 1)
    cum_mass = np.concatenate([[0.0], np.cumsum(counts)])
    cum_nonempty = np.concatenate([[0.0], np.cumsum(counts > 0)])
    cum_xlogx = np.concatenate([[0.0], np.cumsum(_xlogx(counts))])

    outliers = total - cum_mass[candidates]
    last = counts[candidates - 1]
    # sum p log p, with p = counts / total and the outliers folded into the last bin.
    p_log_p = (cum_xlogx[candidates - 1] + _xlogx(last + outliers)) / total - np.log(total)

    starts = (np.arange(levels + 1)[None, :] * candidates[:, None] + levels - 1) // levels
    mass = np.diff(cum_mass[starts], axis=1)
    nonempty = np.diff(cum_nonempty[starts], axis=1)
    # Outliers folded into an empty last bin meet Q's smoothing there, not its last level.
    smoothed = (last == 0) & (outliers > 0)
    q_total = cum_mass[candidates] + np.where(smoothed, _SMOOTHING, 0.0)
    p_level = mass / total
    p_level[:, -1] += np.where(smoothed, 0.0, outliers) / total
    with np.errstate(divide="ignore", invalid="ignore"):
        q_level = mass / (nonempty * q_total[:, None])
        p_log_q = np.where(mass > 0, p_level * np.log(q_level), 0.0).sum(axis=1)
        p_log_q += np.where(smoothed, outliers / total * np.log(_SMOOTHING / q_total), 0.0)
    divergence = p_log_p - p_log_q
    # Nothing at all in range: no candidate.
    return np.where(cum_mass[candidates] == 0, np.inf, np.maximum(divergence, 0.0))


def entropy_threshold(histogram: np.ndarray, absmax: float, levels: int = _LEVELS) -> float:
    """TensorRT's entropy calibration of a histogram of |x| over [0, absmax]: the threshold
    whose ``levels``-level quantization loses least information (``entropy_divergences``)."""
    bins = len(histogram)
    if bins <= levels or absmax <= 0.0 or float(np.sum(histogram)) == 0.0:
        return absmax
    divergences = entropy_divergences(histogram, levels)
    if not np.isfinite(divergences).any():
        return absmax
    return (levels + int(np.argmin(divergences))) * absmax / bins


def _threshold_range(entry: TensorStatistics, threshold: float) -> tuple[float, float]:
    threshold = min(threshold, entry.absmax)
    return (0.0 if entry.low >= 0.0 else -threshold, threshold)


def ranges_from_statistics(
    stats: Mapping[str, TensorStatistics],
    method: str,
    *,
    percentile: float = 99.99,
    bins: int = 2048,
) -> Ranges:
    """Reduce collected statistics with one calibrator."""
    if method not in CALIBRATORS:
        raise ValueError(f"unknown calibrator {method!r}; choose one of {', '.join(CALIBRATORS)}")
    tensors: dict[str, tuple[float, float]] = {}
    means: dict[str, tuple[float, ...]] = {}
    for name, entry in stats.items():
        channel_means = entry.channel_means()
        if channel_means is not None:
            means[name] = channel_means
        if not math.isfinite(entry.low):
            continue
        if method == "minmax":
            tensors[name] = (entry.low, entry.high)
        elif method == "percentile":
            tensors[name] = _threshold_range(entry, percentile_threshold(entry, percentile))
        else:
            threshold = entropy_threshold(entry.magnitude_histogram(bins), entry.absmax)
            tensors[name] = _threshold_range(entry, threshold)
    return Ranges(method, tensors, means)


def collect_ranges(
    model: onnx.ModelProto,
    data: np.ndarray,
    input_name: str,
    method: str,
    *,
    percentile: float = 99.99,
    stride: int = 16,
    bins: int = 2048,
    threads: int = 0,
    progress: Progress | None = None,
) -> Ranges:
    """Calibrate every activation the Q/DQ quantizer needs, with one calibrator.

    ``progress(rows done, rows)`` is called after each stride.
    """
    if method not in CALIBRATORS:
        raise ValueError(f"unknown calibrator {method!r}; choose one of {', '.join(CALIBRATORS)}")
    stats = collect_statistics(
        model,
        data,
        input_name,
        histograms=method != "minmax",
        bins=bins,
        stride=stride,
        threads=threads,
        progress=progress,
    )
    return ranges_from_statistics(stats, method, percentile=percentile, bins=bins)
