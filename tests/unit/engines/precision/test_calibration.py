"""Calibration: sets of rows, the three calibrators on known distributions, ranges of real
models, auto selection, and the raw material of the accuracy gate on EfficientNet-Lite0."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from PIL import Image

import zoo
from engines.devices import cpu
from engines.precision import accuracy, calibration, calibration_sets, int8
from engines.precision.calibration import Ranges, TensorStatistics
from engines.preprocess import ImagePreprocess
from tests.unit.engines.precision.small_models import small_conv_model, small_inputs

SMALL = ImagePreprocess(resize_shorter=40, crop=32)


def statistics_of(values: np.ndarray, chunks: int = 4, bins: int = 2048) -> TensorStatistics:
    entry = TensorStatistics(bins * 8)
    for chunk in np.array_split(values, chunks):
        entry.update(chunk)
    return entry


def ranges_of(values: np.ndarray, method: str, **kwargs: float) -> tuple[float, float]:
    stats = {"t": statistics_of(values)}
    return calibration.ranges_from_statistics(stats, method, **kwargs).tensors["t"]  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def outliers() -> np.ndarray:
    """A unit gaussian with five huge outliers, the largest first-to-last growing."""
    values = np.random.default_rng(0).standard_normal(200_000).astype(np.float32)
    values[[10, 50_000, 100_000, 150_000, 199_999]] = [30.0, -40.0, 60.0, -80.0, 100.0]
    return values


def test_minmax_catches_outliers_and_the_others_clip_them(outliers: np.ndarray) -> None:
    low, high = ranges_of(outliers, "minmax")
    assert (low, high) == (-80.0, 100.0)
    for method in ("percentile", "entropy"):
        low, high = ranges_of(outliers, method)
        assert low == -high, method
        assert 3.0 < high < 10.0, method


def test_percentile_of_a_known_distribution() -> None:
    values = np.random.default_rng(1).uniform(-10, 10, 400_000).astype(np.float32)
    _, high = ranges_of(values, "percentile", percentile=90.0)
    assert high == pytest.approx(9.0, abs=0.05)


def test_entropy_keeps_a_uniform_distribution_nearly_whole() -> None:
    values = np.random.default_rng(2).uniform(-4, 4, 400_000).astype(np.float32)
    low, high = ranges_of(values, "entropy")
    assert high > 0.95 * 4 and low == -high


def test_never_negative_tensors_get_a_range_from_zero() -> None:
    values = np.maximum(np.random.default_rng(3).standard_normal(100_000), 0).astype(np.float32)
    for method in ("percentile", "entropy"):
        low, high = ranges_of(values, method)
        assert low == 0.0 and high > 2.0


def test_histograms_grow_with_the_data_and_leave_zeros_out() -> None:
    """Growing the range merges bins exactly: the counts equal one histogram of it all."""
    rng = np.random.default_rng(4)
    chunks = [rng.uniform(-s, s, 10_000).astype(np.float32) for s in (0.5, 1.0, 3.0, 10.0)]
    chunks[0][:100] = 0.0
    entry = TensorStatistics(64)
    for chunk in chunks:
        entry.update(chunk)
    assert entry.histogram is not None
    assert entry.zeros == 100 and int(entry.histogram.sum()) == 40_000 - 100
    expected, _ = np.histogram(np.abs(np.concatenate(chunks)), bins=64, range=(0, entry.limit))
    expected[0] -= 100
    assert np.abs(entry.histogram - expected).max() <= 2  # bin edges rounded differently
    assert entry.magnitude_histogram(16).sum() == pytest.approx(40_000 - 100)


def naive_divergences(counts: np.ndarray, levels: int) -> list[float]:
    """TensorRT's search written out candidate by candidate, as the reference."""
    counts = counts.astype(np.float64)
    result = []
    for i in range(levels, counts.size + 1):
        p = counts[:i].copy()
        p[-1] += counts[i:].sum()
        nonempty = counts[:i] > 0
        level = np.arange(i) * levels // i
        mass = np.bincount(level, weights=counts[:i], minlength=levels)
        bins = np.bincount(level, weights=nonempty, minlength=levels)
        spread = np.divide(mass, bins, out=np.zeros(levels), where=bins > 0)
        q = np.where(nonempty, spread[level], 0.0)
        if q.sum() == 0:
            result.append(np.inf)
            continue
        q[(p > 0) & (q == 0)] = 1e-4  # smoothing: only the last bin can be such a bin
        p, q = p / p.sum(), q / q.sum()
        support = p > 0
        result.append(float(np.sum(p[support] * np.log(p[support] / q[support]))))
    return result


@pytest.mark.parametrize("seed", range(3))
def test_entropy_search_matches_the_step_by_step_algorithm(seed: int) -> None:
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 4, 300) * (rng.random(300) < 0.8)
    np.testing.assert_allclose(
        calibration.entropy_divergences(counts, 32), naive_divergences(counts, 32), atol=1e-12
    )


def test_ranges_json_round_trip() -> None:
    ranges = Ranges("entropy", {"a": (-1.5, 1.5), "b": (0.0, 6.0)}, {"a": (0.25, -1.0)})
    assert Ranges.from_json(ranges.to_json()) == ranges
    with pytest.raises(ValueError, match="calibration cache"):
        Ranges.from_json('{"tensors": {}}')


def test_collect_ranges_of_a_small_model() -> None:
    model = small_conv_model()
    data = small_inputs(rows=20)
    calls: list[tuple[int, int]] = []
    ranges = calibration.collect_ranges(
        model, data, "input", "minmax", stride=3, progress=lambda d, t: calls.append((d, t))
    )
    assert calls[-1] == (20, 20) and len(calls) == 7
    assert {"input", "conv", "relu", "pool", "flat", "logits"} <= set(ranges.tensors)
    assert ranges.tensors["input"] == (float(data.min()), float(data.max()))
    assert ranges.tensors["relu"][0] == 0.0
    # Means per channel of the inputs of the weight nodes, for bias correction.
    np.testing.assert_allclose(ranges.channel_means["input"], data.mean(axis=(0, 2, 3)), rtol=1e-5)
    assert len(ranges.channel_means["flat"]) == 8
    # The stride changes memory, and the histograms' resolution a little, not the result.
    whole = calibration.collect_ranges(model, data, "input", "entropy", stride=20).tensors
    strided = calibration.collect_ranges(model, data, "input", "entropy", stride=7).tensors
    assert whole.keys() == strided.keys()
    for name, (low, high) in whole.items():
        assert strided[name][0] == pytest.approx(low, rel=0.03)
        assert strided[name][1] == pytest.approx(high, rel=0.03)
    with pytest.raises(ValueError, match="unknown calibrator"):
        calibration.collect_ranges(model, data, "input", "mse")


def test_calibrate_auto_scores_every_calibrator() -> None:
    model = small_conv_model()
    ranges, scores = int8.calibrate_auto(
        model, small_inputs(rows=30), "input", "u8s8", held_out_fraction=0.3
    )
    assert set(scores) == set(calibration.CALIBRATORS)
    assert all(np.isfinite(kl) and kl >= 0 for kl in scores.values())
    assert ranges.method == min(scores, key=lambda method: scores[method])


# Calibration sets -----------------------------------------------------------------------------


def write_images(folder: Path, count: int) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for index in range(count):
        pixels = rng.integers(0, 256, (48, 60, 3), dtype=np.uint8)
        path = folder / f"image_{index:02d}.{'png' if index % 2 else 'jpg'}"
        Image.fromarray(pixels).save(path)
        paths.append(path)
    return paths


def test_load_calibration_set_from_images(tmp_path: Path) -> None:
    write_images(tmp_path, 6)
    (tmp_path / "notes.txt").write_text("not an image")
    rows = calibration_sets.load_calibration_set(tmp_path, SMALL)
    assert rows.shape == (6, 3, 32, 32) and rows.dtype == np.float32
    from engines.preprocess import load_image, preprocess

    np.testing.assert_array_equal(rows[0], preprocess(load_image(tmp_path / "image_00.jpg"), SMALL))

    sampled = calibration_sets.load_calibration_set(tmp_path, SMALL, samples=3, seed=1)
    assert sampled.shape[0] == 3
    np.testing.assert_array_equal(
        sampled, calibration_sets.load_calibration_set(tmp_path, SMALL, samples=3, seed=1)
    )
    assert not np.array_equal(
        sampled, calibration_sets.load_calibration_set(tmp_path, SMALL, samples=3, seed=2)
    )


def test_load_calibration_set_from_arrays(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    stacked = rng.standard_normal((4, 3, 32, 32))
    single = rng.standard_normal((3, 32, 32))
    np.save(tmp_path / "a.npy", stacked)
    np.save(tmp_path / "b.npy", single)
    np.savez(tmp_path / "c.npz", first=stacked[:2], second=single)
    rows = calibration_sets.load_calibration_set(tmp_path, SMALL)
    assert rows.shape == (4 + 1 + 2 + 1, 3, 32, 32) and rows.dtype == np.float32
    np.testing.assert_allclose(rows[4], single, rtol=1e-6)
    assert calibration_sets.load_calibration_set(tmp_path / "a.npy", SMALL, samples=2).shape[0] == 2


def test_load_calibration_set_refuses_what_it_cannot_use(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        calibration_sets.load_calibration_set(tmp_path / "missing", SMALL)
    (tmp_path / "readme.txt").write_text("no images here")
    with pytest.raises(ValueError, match="no images"):
        calibration_sets.load_calibration_set(tmp_path, SMALL)


def test_augmented_builtin_set() -> None:
    rows = calibration_sets.augmented_builtin_set(SMALL, samples=12, seed=0)
    assert rows.shape == (12, 3, 32, 32) and rows.dtype == np.float32
    assert len({row.tobytes() for row in rows}) == 12
    np.testing.assert_array_equal(rows, calibration_sets.augmented_builtin_set(SMALL, 12, seed=0))
    other = calibration_sets.augmented_builtin_set(SMALL, 12, seed=1)
    count = len(calibration_sets.BUILTIN_PHOTOS)
    # The photos as they are come first; the augmented rows depend on the seed.
    np.testing.assert_array_equal(rows[:count], other[:count])
    assert not np.array_equal(rows[count:], other[count:])


# The accuracy gate's raw material, on the default model ---------------------------------------


@pytest.fixture(scope="module")
def efficientnet(tmp_path_factory: pytest.TempPathFactory) -> onnx.ModelProto:
    folder = tmp_path_factory.mktemp("efficientnet_lite0")
    zoo.GENERATORS["efficientnet_lite0"](folder)
    return onnx.load(str(folder / "model.onnx"))


@pytest.fixture(scope="module")
def photos() -> np.ndarray:
    return calibration_sets.augmented_builtin_set(ImagePreprocess(), samples=40, seed=0)


@pytest.fixture(scope="module")
def calibrated(
    efficientnet: onnx.ModelProto, photos: np.ndarray
) -> tuple[Ranges, np.ndarray, np.ndarray]:
    """Ranges from the first 16 photos, FP32's logits of the other 24 and the 24 themselves:
    one calibration for every recipe (the recipes differ in what they make of the ranges)."""
    calibrate, evaluate = photos[:16], photos[16:]
    ranges = calibration.collect_ranges(efficientnet, calibrate, "input", "percentile")
    return ranges, accuracy.run_onnx(efficientnet, evaluate, "input"), evaluate


def int8_agreement(
    efficientnet: onnx.ModelProto,
    calibrated: tuple[Ranges, np.ndarray, np.ndarray],
    ranges: Ranges,
    reduce_range: bool,
    integer_kernels: bool,
) -> float:
    _, reference, evaluate = calibrated
    quantized = int8.to_int8(
        efficientnet,
        ranges,
        form="u8s8",
        reduce_range=reduce_range,
        keep_first_and_last=reduce_range,
    )
    got = accuracy.run_onnx(quantized, evaluate, "input", optimize=integer_kernels)
    return accuracy.top1_agreement(reference, got)


@pytest.mark.parametrize(
    "integer_kernels", [True, False], ids=["fused-integer-kernels", "qdq-in-float"]
)
@pytest.mark.parametrize("reduce_range", [False, True], ids=["8-bit", "7-bit+edges-in-float"])
def test_calibrated_int8_agrees_with_fp32(
    efficientnet: onnx.ModelProto,
    calibrated: tuple[Ranges, np.ndarray, np.ndarray],
    reduce_range: bool,
    integer_kernels: bool,
) -> None:
    """Both recipes, run as ONNX Runtime serves them (Q/DQ fused into this CPU's integer
    kernels) and as written (Q/DQ in float, what a GPU computes)."""
    if integer_kernels and not reduce_range and cpu.integer_kernels().saturates:
        pytest.skip(
            f"this CPU ({cpu.integer_kernels().name}) has no VNNI: its integer kernels saturate "
            "with 8-bit weights, which is why it is given 7-bit weights"
        )
    ranges = calibrated[0]
    assert int8_agreement(efficientnet, calibrated, ranges, reduce_range, integer_kernels) >= 0.9


def test_an_over_quantized_int8_does_not_agree(
    efficientnet: onnx.ModelProto, calibrated: tuple[Ranges, np.ndarray, np.ndarray]
) -> None:
    """The measure above can fail: ranges a hundredth of the calibrated ones clip nearly
    every activation, and the served recipe (7-bit weights, edges in float, Q/DQ in float so
    that the result is the same on every CPU) then agrees with FP32 on under half the rows."""
    ranges = calibrated[0].scaled(0.01)
    assert int8_agreement(efficientnet, calibrated, ranges, True, False) < 0.5
