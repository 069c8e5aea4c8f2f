"""The rows a precision variant is calibrated and checked on, loaded only as far as they are used.

- An INT8 variant calibrates on ``int8.samples`` rows of the model's calibration source and is
  measured on ``evaluation_samples`` held-out rows after them (``VariantRows.split``).
- An FP16 variant needs no calibration: it is checked on ``evaluation_samples`` rows and
  nothing more is read (``VariantRows.check_rows``). For a model with preprocessing, photos
  of its calibration source; for a model without, the user's ``.npy``/``.npz`` rows where
  ``int8.calibration`` names them, else seeded random rows made from the ONNX inputs' spec
  (``spec_rows``).
- A model without preprocessing has no photos to calibrate on: its INT8 variant takes the
  user's rows, and without them it is refused (``NoCalibrationRows``) saying what to give.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engines.backends.onnxruntime import read_spec
from engines.precision import calibration_sets
from engines.precision.options import BUILTIN_CALIBRATION, Int8Options
from engines.preprocess import ImagePreprocess
from engines.spec import TensorSpec

log = logging.getLogger(__name__)


# Bumped when the builtin augmented set changes, so cached ranges are recalibrated.
BUILTIN_VERSION = "skimage-augmented-1"


# Rows per run along a dynamic first dimension, as the server's small batches.
CHUNK = 16


# The size a dynamic dimension other than the first gets in rows made from the spec: small,
# so that a check of a model with a dynamic sequence or image size stays fast.
DYNAMIC_SIZE = 8


class NoCalibrationRows(FileNotFoundError):
    """A variant asked for without the rows it needs (an INT8 variant of a model that takes
    no images and has no rows of the user's): like a missing model file, a refusal that says
    what to provide."""


@dataclass(frozen=True)
class CheckRows:
    """Rows for every input of a model, stacked along axis 0, and how many of them go in one
    run per input (``chunks``: the static first dimension, or ``CHUNK``)."""

    arrays: Mapping[str, np.ndarray]
    chunks: Mapping[str, int]

    @property
    def samples(self) -> int:
        """The rows of the first input (what a report counts)."""
        name = next(iter(self.arrays))
        return len(self.arrays[name])

    def runs(self) -> list[dict[str, np.ndarray]]:
        """The feeds, one per run: ``chunks[name]`` rows of each input at a time (the last
        run of a dynamic first dimension may be shorter)."""
        count = min(math.ceil(len(a) / self.chunks[n]) for n, a in self.arrays.items())
        return [
            {n: a[i * self.chunks[n] : (i + 1) * self.chunks[n]] for n, a in self.arrays.items()}
            for i in range(count)
        ]

    @classmethod
    def of(cls, spec: TensorSpec, rows: np.ndarray) -> CheckRows:
        """The rows of a model's one input; where its first dimension is static, only whole
        runs of it."""
        chunk = chunk_of(spec)
        if spec.shape[0] > 0:
            if len(rows) < chunk:
                raise ValueError(
                    f"input {spec.name!r} takes {chunk} rows at a time; {len(rows)} were given"
                )
            rows = rows[: len(rows) // chunk * chunk]
        return cls({spec.name: rows}, {spec.name: chunk})


def input_specs(source: Path) -> tuple[TensorSpec, ...]:
    """The ONNX file's inputs with their full shapes (the first dimension included; -1 where
    dynamic): what ONNX Runtime is fed when a variant is measured."""
    return read_spec(source, source.stem, 0).inputs


def chunk_of(spec: TensorSpec) -> int:
    """Rows of ``spec`` per run: its static first dimension, else ``CHUNK``."""
    if not spec.shape:
        raise ValueError(f"input {spec.name!r} is a scalar: a variant check feeds rows")
    return spec.shape[0] if spec.shape[0] > 0 else CHUNK


def spec_rows(inputs: tuple[TensorSpec, ...], samples: int, seed: int = 0) -> CheckRows:
    """Seeded random rows for every input, of its dtype and shape: ``samples`` rows (whole
    runs of a static first dimension), dynamic dimensions past the first ``DYNAMIC_SIZE``
    long. Floats are standard normal; integers and booleans 0 or 1, valid as indices, masks
    and flags."""
    if not inputs:
        raise ValueError("the model has no inputs to make rows for")
    rng = np.random.default_rng(seed)
    runs = math.ceil(samples / chunk_of(inputs[0]))
    arrays: dict[str, np.ndarray] = {}
    chunks: dict[str, int] = {}
    for spec in inputs:
        chunks[spec.name] = chunk_of(spec)
        count = runs * chunks[spec.name] if spec.shape[0] > 0 else samples
        shape = (count, *(d if d > 0 else DYNAMIC_SIZE for d in spec.shape[1:]))
        kind = spec.dtype.kind
        if kind == "f" or spec.datatype == "BF16":
            arrays[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
        elif kind in "biu":
            arrays[spec.name] = rng.integers(0, 2, shape).astype(spec.dtype)
        else:
            raise ValueError(
                f"input {spec.name!r} is {spec.datatype}: no rows can be made for it; give "
                "rows of your own (int8.calibration: a folder of .npy rows)"
            )
    return CheckRows(arrays, chunks)


def load_array_rows(source: Path, spec: TensorSpec, samples: int, seed: int = 0) -> np.ndarray:
    """``samples`` rows (a ``seed``-chosen subset where there are more) for input ``spec`` from
    a ``.npy``/``.npz`` file or a folder of them, in the input's dtype; each row is the input's
    shape without its first dimension. Raises ``NoCalibrationRows`` where there are none, and
    ``ValueError`` for rows of another shape."""
    if not source.exists():
        raise NoCalibrationRows(f"int8.calibration {source.name!r} does not exist")
    files = [source] if source.is_file() else sorted(p for p in source.iterdir() if p.is_file())
    arrays = [p for p in files if p.suffix.lower() in (".npy", ".npz")]
    row_shape = spec.shape[1:]
    rows: list[np.ndarray] = []
    for path in arrays:
        rows.extend(calibration_sets.array_rows(path, len(row_shape)))
    if not rows:
        raise NoCalibrationRows(
            f"int8.calibration {source.name!r} has no .npy/.npz rows; a model without a "
            f"preprocess: section takes its rows as arrays, each {list(row_shape)} "
            f"{spec.dtype.name} (or arrays of such rows)"
        )
    want = TensorSpec(spec.name, spec.datatype, row_shape)
    wrong = next((row.shape for row in rows if not want.matches(row.shape)), None)
    if wrong is not None:
        raise ValueError(
            f"int8.calibration {source.name!r}: a row is {list(wrong)}, input {spec.name!r} "
            f"takes rows of {list(row_shape)} (-1: any size)"
        )
    chosen = calibration_sets.sample_indices(len(rows), samples, seed)
    return np.stack([rows[i] for i in chosen]).astype(spec.dtype, copy=False)


class VariantRows:
    """The rows of one model's calibration source, loaded per build only as far as the
    variant built uses them: all of them for INT8 (``split``), the check's few for FP16
    (``check_rows``)."""

    def __init__(
        self,
        model: str,
        source: Path,
        folder: Path,
        preprocess: ImagePreprocess | None,
        int8: Int8Options,
        evaluation_samples: int,
    ) -> None:
        self._model = model
        self._source = source
        self._folder = folder
        self._preprocess = preprocess
        self._int8 = int8
        self._evaluation = evaluation_samples

    def source_path(self) -> Path | None:
        """The user's calibration rows (a folder or file); None: the builtin set."""
        configured = self._int8.calibration
        if configured == BUILTIN_CALIBRATION:
            return None
        path = Path(configured)
        return path if path.is_absolute() else self._folder / path

    @functools.cached_property
    def fingerprint(self) -> str:
        """Identifies the calibration data for cache keys without reading it all (the
        folder's names, sizes and times, listed once per build)."""
        path = self.source_path()
        if path is None:
            return BUILTIN_VERSION
        digest = hashlib.sha256()
        files = sorted(p for p in (path.rglob("*") if path.is_dir() else [path]) if p.is_file())
        for file in files:
            stat = file.stat()
            digest.update(
                f"{file.relative_to(path.parent)}:{stat.st_size}:{stat.st_mtime_ns}".encode()
            )
        return digest.hexdigest()[:20]

    @functools.cached_property
    def _inputs(self) -> tuple[TensorSpec, ...]:
        return input_specs(self._source)

    def _single_input(self, precision: str) -> TensorSpec:
        inputs = self._inputs
        if len(inputs) != 1:
            raise ValueError(
                f"{self._model} {precision}: rows of your own feed one input, and the model has "
                f"{len(inputs)} ({', '.join(i.name for i in inputs)})"
            )
        return inputs[0]

    def _load(self, samples: int, what: str, precision: str) -> np.ndarray:
        """``samples`` rows of the calibration source, as the model's one input takes them."""
        path = self.source_path()
        started = time.perf_counter()
        if self._preprocess is None:
            if path is None:
                spec = self._single_input(precision)
                raise NoCalibrationRows(
                    f"model {self._model!r} takes no images (its config has no preprocess: "
                    f"section), so the builtin photo set cannot calibrate its {precision} "
                    "variant: set int8.calibration to a .npy/.npz file or a folder of them in "
                    f"the model folder, rows of {list(spec.shape[1:])} {spec.dtype.name} for "
                    f"input {spec.name!r} ({self._int8.samples} calibration and "
                    f"{self._evaluation} evaluation rows are used)"
                )
            rows = load_array_rows(path, self._single_input(precision), samples, seed=0)
        elif path is None:
            rows = calibration_sets.augmented_builtin_set(self._preprocess, samples, seed=0)
        else:
            rows = calibration_sets.load_calibration_set(path, self._preprocess, samples, seed=0)
        log.info(
            "%s: %d %s rows from %s in %.1f s",
            self._model,
            len(rows),
            what,
            self._int8.calibration if path is not None else "the builtin photo set",
            time.perf_counter() - started,
        )
        return rows

    def split(self) -> tuple[np.ndarray, np.ndarray]:
        """INT8's (calibration rows, held-out evaluation rows), loaded once: the evaluation
        rows are never used for calibration."""
        return self._split

    @functools.cached_property
    def _split(self) -> tuple[np.ndarray, np.ndarray]:
        total = self._int8.samples + self._evaluation
        rows = self._load(total, "calibration and evaluation", "int8")
        held_out = min(self._evaluation, len(rows) // 2)
        return rows[: len(rows) - held_out], rows[len(rows) - held_out :]

    def held_out(self) -> CheckRows:
        """INT8's held-out rows, as a check feeds them."""
        return CheckRows.of(self._inputs[0], self.split()[1])

    def check_rows(self) -> CheckRows:
        """The ``evaluation_samples`` rows an FP16 check runs, and no more: photos of the
        source (a model with preprocessing), else the user's rows, else rows made from the
        inputs' spec."""
        if self._preprocess is None and self.source_path() is None:
            return spec_rows(self._inputs, self._evaluation, seed=0)
        spec = self._single_input("fp16")
        return CheckRows.of(spec, self._load(self._evaluation, "check", "fp16"))
