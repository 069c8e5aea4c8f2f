"""INT8 calibration sets: the rows calibration runs through the model.

A folder of images run through the model's own preprocessing (or ``.npy``/``.npz`` rows
already preprocessed); with none at hand, ``augmented_builtin_set`` makes one from
scikit-image's public-domain photos.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageEnhance, UnidentifiedImageError

from engines import preprocess as imaging
from engines.precision.calibration import Progress
from engines.preprocess import ImagePreprocess

logger = logging.getLogger(__name__)

_ARRAY_SUFFIXES = (".npy", ".npz")


# The bundled scikit-image photos that are photographs of scenes, in the public domain or CC0
# (the others are microscopy, synthetic or of unclear licence).
BUILTIN_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field")


def sample_indices(count: int, samples: int, seed: int) -> np.ndarray:
    """The indices to keep of ``count``: all, or ``samples`` chosen by ``seed``, in order."""
    if samples < 1:
        raise ValueError(f"samples must be positive, got {samples}")
    if count <= samples:
        return np.arange(count)
    return np.sort(np.random.default_rng(seed).choice(count, size=samples, replace=False))


def array_rows(path: Path, row_ndim: int) -> list[np.ndarray]:
    """The rows in a .npy file or in each array of a .npz file (a lone row is one row)."""
    if path.suffix == ".npz":
        with np.load(path) as archive:
            arrays = [archive[name] for name in archive.files]
    else:
        arrays = [np.load(path)]
    rows: list[np.ndarray] = []
    for array in arrays:
        rows.extend([array] if array.ndim == row_ndim else list(array))
    return rows


def load_calibration_set(
    source: Path,
    preprocess: ImagePreprocess,
    samples: int = 500,
    seed: int = 0,
    *,
    progress: Progress | None = None,
) -> np.ndarray:
    """Preprocessed rows ``[n, ...]`` from a folder of images or of ``.npy``/``.npz`` rows.

    Images (anything PIL reads; other files are skipped) are listed in sorted order and, when
    there are more than ``samples``, a ``seed``-determined subset is kept before any is decoded.
    Array files hold rows already preprocessed; the same sampling applies to their rows.
    ``source`` may also be a single ``.npy``/``.npz`` file.
    """
    source = Path(source)
    if not source.exists():
        raise FileNotFoundError(f"calibration set {source} does not exist")
    files = [source] if source.is_file() else sorted(p for p in source.iterdir() if p.is_file())
    files = [p for p in files if not p.name.startswith(".")]
    dtype = np.uint8 if preprocess.datatype == "UINT8" else np.float32
    row_shape = preprocess.row_shape()

    arrays = [p for p in files if p.suffix.lower() in _ARRAY_SUFFIXES]
    images = [p for p in files if p.suffix.lower() not in _ARRAY_SUFFIXES]
    rows: list[np.ndarray] = []
    for path in arrays:
        rows.extend(array_rows(path, len(row_shape)))
    if rows:
        rows = [rows[i] for i in sample_indices(len(rows), samples, seed)]

    chosen = [images[i] for i in sample_indices(len(images), samples, seed)] if images else []
    skipped = 0
    for done, path in enumerate(chosen, start=1):
        try:
            rows.append(imaging.preprocess(imaging.load_image(path), preprocess))
        except (UnidentifiedImageError, OSError):
            skipped += 1
        if progress is not None:
            progress(done, len(chosen))
        if done % 100 == 0 or done == len(chosen):
            logger.info("calibration set %s: %d/%d images", source, done, len(chosen))
    if skipped:
        logger.warning("calibration set %s: skipped %d files that are not images", source, skipped)
    if not rows:
        raise ValueError(f"calibration set {source} has no images or .npy/.npz rows")
    if rows[0].shape != row_shape:
        logger.warning(
            "calibration rows are %s, the preprocessing makes %s", rows[0].shape, row_shape
        )
    try:
        stacked = np.stack(rows)
    except ValueError as error:
        raise ValueError(f"calibration set {source}: rows differ in shape ({error})") from error
    return stacked[: max(samples, 0)].astype(dtype, copy=False)


def _augment(image: Image.Image, rng: np.random.Generator) -> Image.Image:
    """A random resized crop, flip, rotation and colour jitter of a photo."""
    width, height = image.size
    if rng.random() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    if rng.random() < 0.5:
        angle = float(rng.uniform(-20.0, 20.0))
        image = image.rotate(angle, resample=Image.Resampling.BILINEAR, expand=False)
    # Crop away what a rotation leaves black and a random share of the scene, as in training.
    area = width * height * float(rng.uniform(0.25, 0.85))
    aspect = math.exp(float(rng.uniform(math.log(3 / 4), math.log(4 / 3))))
    crop_w = min(width, round(math.sqrt(area * aspect)))
    crop_h = min(height, round(math.sqrt(area / aspect)))
    left = int(rng.integers(0, width - crop_w + 1))
    top = int(rng.integers(0, height - crop_h + 1))
    image = image.crop((left, top, left + crop_w, top + crop_h))
    for enhancer in (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color):
        image = enhancer(image).enhance(float(rng.uniform(0.7, 1.3)))
    return image


def augmented_builtin_set(
    preprocess: ImagePreprocess, samples: int = 500, seed: int = 0
) -> np.ndarray:
    """A calibration set that needs no download: scikit-image's bundled photos, augmented.

    The photos (``BUILTIN_PHOTOS``) come first as they are, then random crops, flips,
    rotations and colour jitter of them, up to ``samples`` rows. Good enough to calibrate a
    model trained on natural photos when no real data is at hand; real data is better.
    """
    try:
        from skimage import data as skimage_data
    except ImportError as error:
        raise RuntimeError(
            "the built-in calibration set needs scikit-image "
            "(pip install 'stoker[default-model]'), or give a folder of images"
        ) from error
    photos = [
        Image.fromarray(getattr(skimage_data, name)()).convert("RGB") for name in BUILTIN_PHOTOS
    ]
    rng = np.random.default_rng(seed)
    rows = [imaging.preprocess(photo, preprocess) for photo in photos[:samples]]
    while len(rows) < samples:
        photo = photos[int(rng.integers(len(photos)))]
        rows.append(imaging.preprocess(_augment(photo, rng), preprocess))
    return np.stack(rows)
